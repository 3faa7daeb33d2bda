"""Overhead of the orchestration: `tilecast run` (the Prefect flow on its embedded server)
against the same stages called as plain library functions (`tilecast run --plain`), on the
same machine in the same run, each from a cold workdir (its own build cache) and then re-run
warm in that workdir.

    .venv/bin/python benchmarks/orchestration_overhead.py --config quick --rounds 1

Rounds alternate the order (plain first, then Prefect first) so a drift of the machine does
not favour one side; the figure is the median of the per-round ratios. Goal: <= 1.2x.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(mode: str, config: str, workdir: Path, build_cache: str | None = None) -> float:
    """Wall seconds of one `tilecast run` (mode "prefect" or "plain") in `workdir`."""
    command = [sys.executable, "-m", "tilecast.flows.cli", "run", "--config", config,
               "--workdir", str(workdir), "--registry", str(workdir / "registry")]
    if mode == "plain":
        command.append("--plain")
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "TILECAST_BUILD_CACHE": build_cache or str(workdir / "build-cache")}
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout)
    records = sum(s["bench"]["new_records"] for s in summary["stages"].values())
    bench_s = sum(s["bench"]["seconds"] for s in summary["stages"].values())
    retaken = sum(r.get("retaken") or 0 for raw in (workdir / "bench").glob("*.jsonl")
                  for r in map(json.loads, raw.read_text().splitlines()))
    print(f"  {mode:7s} {seconds:7.1f} s wall; benchmark stages {bench_s:6.1f} s, "
          f"{records} new records, {retaken} samples re-taken in the raw logs", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="quick")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the workdirs")
    parser.add_argument("--build-cache", default=None,
                        help="one build cache for every run (e.g. a warm one: leaves compiling out)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="tilecast-overhead-"))
    cold, warm = {"plain": [], "prefect": []}, {"plain": [], "prefect": []}
    try:
        for r in range(args.rounds):
            order = ["plain", "prefect"] if r % 2 == 0 else ["prefect", "plain"]
            print(f"round {r + 1}: cold runs ({' then '.join(order)})", flush=True)
            for mode in order:
                cold[mode].append(run(mode, args.config, root / f"{mode}{r}", args.build_cache))
            print(f"round {r + 1}: warm re-runs", flush=True)
            for mode in reversed(order):
                warm[mode].append(run(mode, args.config, root / f"{mode}{r}", args.build_cache))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    def ratio(table):
        return statistics.median(p / q for p, q in zip(table["prefect"], table["plain"]))

    print(f"\nconfig {args.config}, {args.rounds} round(s), medians:")
    print(f"  cold: prefect {statistics.median(cold['prefect']):.1f} s, plain "
          f"{statistics.median(cold['plain']):.1f} s, ratio {ratio(cold):.3f}x (goal <= 1.2x)")
    print(f"  warm: prefect {statistics.median(warm['prefect']):.1f} s, plain "
          f"{statistics.median(warm['plain']):.1f} s, ratio {ratio(warm):.3f}x")


if __name__ == "__main__":
    main()
