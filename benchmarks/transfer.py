"""Cross-hardware evaluation at a size: how long `tilecast evaluate --dataset` takes and what it
reports, on an imported dataset or on a synthetic one whose times follow a rule of the devices'
real figures (shipped hardware table).

    python benchmarks/transfer.py          # synthetic: 6 devices, 48 problems, 120 configurations
    python benchmarks/transfer.py DATASET_DIR --rounds 300 --default 'block=64,unroll=1,layout=row'
    python benchmarks/transfer.py --devices 4 --problems 24 --rounds 100

Prints the overall line, the per-device figures and the seconds. The synthetic rule (ideal
block from the device's shared memory, ideal unroll from its warp size, a layout penalty, the
padding of m to whole blocks, 3 % noise, a compile failure on small shared memory) is a
stand-in for real measurements: its figures say the pipeline works and how fast, not how well
a model transfers on real kernels. Figures, not a test.
"""
from __future__ import annotations

import argparse
import logging
import math
import time

import numpy as np

from tilecast.table.dataset import Column, TableDataset, TableSchema, finish_frame, read_dataset
from tilecast.table.devices import DeviceTable
from tilecast.table.transfer import run_transfer
from tilecast.table.transfer_report import overall_line

DEVICES = ("V100-SXM2", "A100-SXM4-80GB", "H100-SXM5-80GB", "MI250X", "T4", "RTX 4090",
           "MI300X", "L40S")
SCHEMA = TableSchema(problem=(Column("m", "numeric"), Column("n", "numeric"),
                              Column("k", "numeric")),
                     config=(Column("block", "numeric"), Column("unroll", "numeric"),
                             Column("stages", "numeric"), Column("layout", "categorical")))
CONFIGS = [(b, u, s, layout) for b in (16, 32, 64, 128, 256) for u in (1, 2, 4)
           for s in (1, 2, 3, 4) for layout in ("row", "col")]


def synthetic(devices: int, problems: int, seed: int = 0) -> TableDataset:
    """A dataset of `devices` shipped devices x `problems` random problems x 120 configs."""
    table, rng, rows = DeviceTable.load(), np.random.default_rng(seed), []
    sizes = [64, 128, 256, 512, 1024, 2048, 4096]
    every = [(m, n, k) for m in sizes for n in sizes for k in sizes]
    shapes = [every[i] for i in rng.choice(len(every), size=min(problems, len(every)),
                                           replace=False)]
    for device in DEVICES[:devices]:
        entry = table.entry(device)
        ideal_block = math.log2(entry["shared_memory_kib"]) - 1.0
        ideal_unroll = 1.0 if entry["warp_size"] == 32 else 2.0
        ideal_stages = 1.0 + math.log2(entry["memory_bandwidth_gbs"] / 500.0)
        for m, n, k in shapes:
            work = 2.0 * m * n * k / (entry["peak_tflops"]["fp32"] * 1e12)
            for block, unroll, stages, layout in CONFIGS:
                penalty = (math.exp(0.35 * (math.log2(block) - ideal_block) ** 2)
                           * (1.0 + 0.12 * abs(math.log2(unroll) - ideal_unroll))
                           * (1.0 + 0.05 * (stages - ideal_stages) ** 2)
                           * (1.0 if (layout == "row") == (m >= n) else 1.2))
                time_s = (work * math.ceil(m / block) * block / m * penalty
                          * math.exp(rng.normal(0.0, 0.03)))
                failed = block == 256 and stages == 4 and entry["shared_memory_kib"] < 100
                rows.append({"device": device, "m": m, "n": n, "k": k, "block": block,
                             "unroll": unroll, "stages": stages, "layout": layout,
                             "status": "compile_failed" if failed else "ok",
                             "time_s": math.nan if failed else time_s})
    return TableDataset(frame=finish_frame(rows, SCHEMA), schema=SCHEMA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", nargs="?", help="an imported dataset (default: synthetic)")
    parser.add_argument("--devices", type=int, default=6, help="synthetic devices (<= 8)")
    parser.add_argument("--problems", type=int, default=48, help="synthetic problems")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--default", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    dataset = (read_dataset(args.dataset) if args.dataset
               else synthetic(min(args.devices, len(DEVICES)), args.problems))
    started = time.monotonic()
    report = run_transfer(dataset, DeviceTable.load(), rounds=args.rounds,
                          threads=args.threads, default=args.default).report
    print(overall_line(report))
    overall = report["overall"]
    print("  measured shortlist, best of k: " + ", ".join(
        f"k={k} {v:.3f} (random {overall['shortlist_random'][k]:.3f})"
        for k, v in overall["shortlist"].items()))
    for name, block in report["devices"].items():
        baselines = block["baselines"]
        print(f"  {name:16s} mean {block['mean_efficiency']:.3f} P10 {block['p10_efficiency']:.3f}"
              f" top-1 {block['top1']:.2f} best-of-5 {block['shortlist']['5']:.3f} | similar "
              f"{baselines['most_similar_device']['mean_efficiency']:.3f} average "
              f"{baselines['best_on_average']['mean_efficiency']:.3f} plain "
              f"{baselines['plain_lightgbm']['mean_efficiency']:.3f} random "
              f"{baselines['random']['mean_efficiency']:.3f} | sure "
              f"{block['unsure']['coverage']:.0%} | {block['seconds']:.1f} s")
    print(f"{len(dataset.frame)} rows, {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
