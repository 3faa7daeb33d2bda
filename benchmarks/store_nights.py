"""Fill a measurement store with nights of new shapes, as a fixed-list nightly would measure them.

Night i measures the nightly config's GEMM kernels and protocol on `--count` training shapes
drawn from the config's own random entries with their seeds moved by 1000 * i (so every night
adds shapes no other night drew; the fixed grids only on night 0), plus, on the first
`--holdout-nights` nights, the config's held-out shapes (its sentinel shapes on the others).
Each night is build + benchmark + convert in a fresh workdir under DIR (a night already there
resumes), appended to the store. The store this makes is what
`tilecast replay` compares its policies over (a pool of measured shapes) and what a budgeted
night starts from.

    .venv/bin/python benchmarks/store_nights.py DIR --nights 3 --count 100 --holdout-nights 2
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import yaml

from tilecast.config import resolve_path
from tilecast.store.store import Store
from tilecast.workflows import pipeline


def night_config(base: dict, family: str, night: int, count: int, with_holdout: bool) -> dict:
    """`base` with its family's training entries redrawn for night `night`."""
    cfg = copy.deepcopy(base)
    cfg.pop("night", None)          # a night of fixed lists, not a planned one
    fc = cfg["families"][family]
    fc.pop("workload", None)
    cfg["families"] = {family: fc}
    draws = [e for e in fc["problems"]["train"] if "random" in e]
    total = sum(e["random"]["count"] for e in draws)
    train = []
    for entry in fc["problems"]["train"]:
        if "random" in entry:
            entry = copy.deepcopy(entry)
            entry["random"]["seed"] = entry["random"].get("seed", 0) + 1000 * night
            entry["random"]["count"] = max(1, round(entry["random"]["count"] * count / total))
            train.append(entry)
        elif night == 0:
            train.append(entry)
    # the other nights re-measure only the config's sentinels (a subset of its held-out
    # shapes): a night must hold something out, and they are what drift is watched on
    holdout = fc["problems"]["holdout"] if with_holdout else fc["sentinel"]
    fc["problems"] = {"train": train, "holdout": holdout}
    cfg["name"] = f"{base['name']}-night{night}"
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="where the store (DIR/store) and the nights' workdirs go")
    ap.add_argument("--config", default="nightly")
    ap.add_argument("--family", default="gemm")
    ap.add_argument("--nights", type=int, default=3)
    ap.add_argument("--first", type=int, default=0, help="index of the first night")
    ap.add_argument("--count", type=int, default=100, help="new training shapes a night")
    ap.add_argument("--holdout-nights", type=int, default=2)
    args = ap.parse_args(argv)
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    Store(root / "store").create()
    base = yaml.safe_load(resolve_path(args.config).read_text())
    for night in range(args.first, args.first + args.nights):
        path = root / f"night{night}.yaml"
        path.write_text(yaml.safe_dump(night_config(base, args.family, night, args.count,
                                                    night < args.holdout_nights)))
        started = time.time()
        ctx = pipeline.RunContext.create(path, root / f"night{night}", root / "registry",
                                         store=str(root / "store"))
        pipeline.build_stage(ctx, args.family)
        bench = pipeline.bench_stage(ctx, args.family)
        convert = pipeline.convert_stage(ctx, args.family)
        print(f"night {night} ({ctx.run_id}): {convert['problems']} problems, "
              f"{bench['new_records']} records, bench {bench['seconds']} s, "
              f"{time.time() - started:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
