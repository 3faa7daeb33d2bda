"""Cross-hardware evaluation at a size: how long `tilecast evaluate --dataset` takes and what it
reports, on an imported dataset or on a synthetic one whose times follow a rule of the devices'
real figures (shipped hardware table).

    python benchmarks/transfer.py          # synthetic: 6 devices, 48 problems, 120 configurations
    python benchmarks/transfer.py DATASET_DIR --rounds 300 --default 'block=64,unroll=1,layout=row'
    python benchmarks/transfer.py --devices 4 --problems 24 --rounds 100
    python benchmarks/transfer.py --vendor --devices 8 --problems 24 --rounds 100
    python benchmarks/transfer.py --space conv --seed 2 --rounds 100   # transfer_members' spaces

`--vendor` adds one configuration (layout "vendor", the other parameters 0) that is near-best
on every device and problem, as a vendor library's GEMM is among autotuning choices: its time
is the problem's best times exp(N(0.03, 0.02)) (about 0.97 of the best, sometimes the best),
and the report scores it as the default. `--space clblast|conv` evaluates
benchmarks/transfer_members.py's other generated spaces (clblast: 6 GPUs x 8 problems x 5,480
configurations; conv: 6 GPUs x one problem x 13,824, where one configuration is near-best
everywhere).

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


VENDOR = "block=0,unroll=0,stages=0,layout=vendor"


def with_vendor(dataset: TableDataset, seed: int = 0) -> TableDataset:
    """`dataset` (the synthetic space) with the near-best vendor configuration (module
    docstring) on every (device, problem)."""
    rng = np.random.default_rng(seed + 1)
    ok = dataset.frame[dataset.frame["status"] == "ok"]
    best = ok.groupby(["device", "dims_key"], sort=True).agg(
        time_s=("time_s", "min"), m=("m", "first"), n=("n", "first"), k=("k", "first"))
    rows = [{"device": device, "m": r.m, "n": r.n, "k": r.k, "block": 0, "unroll": 0,
             "stages": 0, "layout": "vendor", "status": "ok",
             "time_s": r.time_s * math.exp(rng.normal(0.03, 0.02))}
            for (device, _), r in best.iterrows()]
    frame = dataset.frame[["device", *SCHEMA.problem_names, *SCHEMA.config_names, "status",
                           "time_s"]].to_dict("records")
    return TableDataset(frame=finish_frame(frame + rows, SCHEMA), schema=SCHEMA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", nargs="?", help="an imported dataset (default: synthetic)")
    parser.add_argument("--devices", type=int, default=6, help="synthetic devices (<= 8)")
    parser.add_argument("--problems", type=int, default=48, help="synthetic problems")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--default", default=None)
    parser.add_argument("--vendor", action="store_true",
                        help="add a near-best vendor configuration, scored as the default")
    parser.add_argument("--space", choices=("gemm", "clblast", "conv"), default="gemm",
                        help="the generated space (gemm: this module's synthetic one)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a clblast or conv space")
    parser.add_argument("--filters", default="15", help="conv: filter sizes, comma-separated")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.dataset:
        dataset = read_dataset(args.dataset)
    elif args.space != "gemm":
        from transfer_members import dataset_of
        dataset = dataset_of(args.space, args.seed,
                             tuple(int(f) for f in args.filters.split(",")))
    else:
        dataset = synthetic(min(args.devices, len(DEVICES)), args.problems)
    if args.vendor:
        if args.dataset or args.space != "gemm":
            parser.error("--vendor applies to the synthetic gemm space")
        dataset, args.default = with_vendor(dataset), VENDOR
    started = time.monotonic()
    report = run_transfer(dataset, DeviceTable.load(), rounds=args.rounds,
                          threads=args.threads, default=args.default).report
    print(overall_line(report))
    overall = report["overall"]
    guard = overall["incumbent"]
    print(f"  incumbent guard: the incumbent on {guard['share']:.0%} of the pairs; the top "
          f"predictions alone {guard['model_alone']:.3f}"
          + (f"; beats the default on {overall['devices_beating_default']} of "
             f"{len(report['devices'])} devices" if args.default else ""))
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
              f"{block['unsure']['coverage']:.0%} | guard {block['incumbent']['share']:.0%}"
              f" (alone {block['incumbent']['model_alone']:.3f})"
              + (f" default {baselines['default']['mean_efficiency']:.3f}"
                 if args.default else "") + f" | {block['seconds']:.1f} s")
    print(f"{len(dataset.frame)} rows, {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
