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


def run(mode: str, config: str, workdir: Path) -> float:
    """Wall seconds of one `tilecast run` (mode "prefect" or "plain") in `workdir`."""
    command = [sys.executable, "-m", "flows.cli", "run", "--config", config,
               "--workdir", str(workdir), "--registry", str(workdir / "registry")]
    if mode == "plain":
        command.append("--plain")
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "TILECAST_BUILD_CACHE": str(workdir / "build-cache")}
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout)
    bench = {f: s["bench"]["new_records"] for f, s in summary["stages"].items()}
    print(f"  {mode:7s} {seconds:7.1f} s   new benchmark records {bench}", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="quick")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the workdirs")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="tilecast-overhead-"))
    cold, warm = {"plain": [], "prefect": []}, {"plain": [], "prefect": []}
    try:
        for r in range(args.rounds):
            order = ["plain", "prefect"] if r % 2 == 0 else ["prefect", "plain"]
            print(f"round {r + 1}: cold runs ({' then '.join(order)})", flush=True)
            for mode in order:
                cold[mode].append(run(mode, args.config, root / f"{mode}{r}"))
            print(f"round {r + 1}: warm re-runs", flush=True)
            for mode in reversed(order):
                warm[mode].append(run(mode, args.config, root / f"{mode}{r}"))
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
