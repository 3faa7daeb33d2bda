"""Cross-hardware evaluation at a size: how long `tilecast transfer --dataset` takes and what it
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
import time

from synthetic_gemm import DEVICES, VENDOR, synthetic, with_vendor
from tilecast.table.dataset import read_dataset
from tilecast.table.devices import DeviceTable
from tilecast.table.transfer import run_transfer
from tilecast.table.transfer_report import overall_line


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
