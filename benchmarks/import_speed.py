"""How long `tilecast import` takes on six Kernel Tuner cache files of 5,000 configurations.

    python benchmarks/import_speed.py [--devices 6] [--configs 5000] [--keep DIR]

The files are written in Kernel Tuner's cache layout (device_name, problem_size,
tune_params_keys, one entry per configuration with `time`, seven `times` and the timing
fields, about 1 % failure markers), one per device of the shipped hardware table. THE TIMINGS
IN THEM ARE SYNTHETIC (a smooth function of the parameters plus noise): this measures the
importer, not any GPU, and the files must never be used as data. Prints the seconds of the
import (reading, device resolution, keys, checks, parquet written) and rows per second; the
target is <= 30 s for 6 x 5,000 on two cores. Figures, not a test.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.table.importing import import_files  # noqa: E402

# device_name as Kernel Tuner prints it (pycuda / cupy device names); all in devices.yaml
DEVICE_NAMES = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "Tesla T4",
                "Tesla V100-SXM2-32GB", "NVIDIA L4", "NVIDIA RTX A6000", "NVIDIA A10",
                "NVIDIA GeForce RTX 4090")
MARKERS = ("InvalidConfig", "CompilationFailedConfig", "RuntimeFailedConfig")
REPEATS = 7   # Kernel Tuner's default iterations


def tune_params(configs: int) -> dict[str, list[int]]:
    """Four tunable parameters whose product has at least `configs` values."""
    side = int(np.ceil(configs ** 0.25))
    return {"block_size_x": [16 * (i + 1) for i in range(side)],
            "block_size_y": [1 << i for i in range(side)],
            "tile_size_x": list(range(1, side + 1)),
            "tile_size_y": list(range(1, side + 1))}


def synthetic_cache(device: str, configs: int, rng: np.random.Generator) -> dict:
    """A cache file document with SYNTHETIC timings (see the module docstring)."""
    params = tune_params(configs)
    keys = list(params)
    cache = {}
    speed = rng.uniform(0.5, 2.0)
    for values in itertools.islice(itertools.product(*params.values()), configs):
        key = ",".join(map(str, values))
        entry = dict(zip(keys, values))
        if rng.random() < 0.01:
            entry["time"] = str(rng.choice(MARKERS))
        else:
            base = speed * (5.0 + sum(abs(np.log2(v) - 3) for v in values))
            times = (base * (1 + rng.normal(0, 0.01, REPEATS))).round(6).tolist()
            entry.update(time=float(np.mean(times)), times=times)
        entry.update(compile_time=700.0, verification_time=0, benchmark_time=120.0,
                     strategy_time=0, framework_time=2.0, timestamp="2024-03-01 10:00:00+00:00")
        cache[key] = entry
    return {"schema_version": "1.0.0", "device_name": device, "kernel_name": "matmul_kernel",
            "problem_size": [4096, 4096, 4096], "tune_params_keys": keys, "tune_params": params,
            "objective": "time", "cache": cache}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=6, choices=range(1, len(DEVICE_NAMES) + 1))
    parser.add_argument("--configs", type=int, default=5000)
    parser.add_argument("--keep", type=Path, help="write the files and dataset here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        paths = []
        for device in DEVICE_NAMES[:args.devices]:
            path = root / f"cache_{device.replace(' ', '_')}.json"
            path.write_text(json.dumps(synthetic_cache(device, args.configs, rng)))
            paths.append(path)
        written = time.perf_counter() - started
        megabytes = sum(p.stat().st_size for p in paths) / 1e6
        print(f"wrote {len(paths)} SYNTHETIC Kernel Tuner caches x {args.configs} configurations "
              f"({megabytes:.1f} MB) in {written:.1f} s")
        started = time.perf_counter()
        summary = import_files("kernel-tuner", paths, root / "dataset")
        seconds = time.perf_counter() - started
        print(summary.line())
        print(f"import: {seconds:.2f} s for {summary.rows} rows "
              f"({summary.rows / seconds:,.0f} rows/s); target <= 30 s for 6 x 5,000")
    return 0


if __name__ == "__main__":
    sys.exit(main())
