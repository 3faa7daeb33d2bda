"""The cross-device model's parts, each alone and together: leave-one-device-out picks of the
ensemble's members (tilecast.table.model.MEMBERS), of its prior (the other devices'
similarity-weighted efficiency) and of the ensemble, from one fit per held-out device, on
three generated spaces or an imported dataset.

    python benchmarks/transfer_members.py                 # all three generated spaces
    python benchmarks/transfer_members.py --space conv --seed 2 --filters 15
    python benchmarks/transfer_members.py --dataset DIR   # an imported dataset

Spaces (THEIR TIMES ARE GENERATED, rules of the shipped devices' figures plus noise: they say
how the parts compare when the best configuration follows hardware figures in different ways,
not how they do on real devices):
- `gemm`: benchmarks/transfer.py's 8 GPUs x 24 problems x 120 configurations (ideal block,
  unroll and stages follow shared memory, warp size and bandwidth);
- `clblast`: benchmarks/table_formulations.py's CLBlast GEMM space, 6 GPUs x 8 problems x
  5,480 configurations (occupancy, padding, vector width, per-device quirks);
- `conv`: a 2D convolution's space like Kernel Tuner's example (block 16-256 x 1-32 threads,
  tiles 1-8 x 1-8, padding, read-only cache), 6 GPUs, one problem per filter size, times
  from occupancy (threads, shared memory, registers), wave tail, tile reuse, bank conflicts
  and coalescing against the warp size.
Prints, per part, the mean efficiency of its picks over the held-out (device, problem) pairs
and per device, beside the best-on-average configuration. Figures, not a test.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.table.dataset import (Column, TableDataset, TableSchema,  # noqa: E402
                                    finish_frame, read_dataset)
from tilecast.table.devices import DeviceTable  # noqa: E402
from tilecast.table.model import MEMBERS, PRIOR, TableModel, efficiencies  # noqa: E402
from tilecast.table.reference import NAMES  # noqa: E402

CONV_DEVICES = ("A100-PCIE-40GB", "RTX A4000", "RTX A6000", "MI250X", "Radeon PRO W6600",
                "Radeon PRO W7800")
CONV_PARAMS = ("block_size_x", "block_size_y", "tile_size_x", "tile_size_y", "use_padding",
               "read_only_cache")
IMAGE = 4096


def conv_time(entry: dict, config: tuple, filter_size: int, noise: float) -> tuple[str, float]:
    """(status, seconds) of one convolution configuration on a device (module docstring)."""
    bx, by, tx, ty, pad, read_only = config
    amd = entry["vendor"] == "amd"
    threads, warp = bx * by, entry["warp_size"]
    shared = (bx * tx + filter_size - 1 + pad) * (by * ty + filter_size - 1) * 4
    shared_limit = entry["shared_memory_kib"] * 1024
    if threads > 1024 or threads < warp or shared > min(shared_limit, 64 * 1024 + amd * 1e9):
        return "unsupported", math.nan
    registers = 20 + 3 * tx * ty
    if registers > 255:
        return "build_failed", math.nan
    max_threads = 2560 if amd else 2048
    register_file = (entry.get("registers_kib") or 256) * 256
    resident = min(max_threads // threads, int(shared_limit // shared),
                   int(register_file // (registers * threads)), 32)
    if resident < 1:
        return "crashed", math.nan
    occupancy = resident * threads / max_threads
    blocks = math.ceil(IMAGE / (bx * tx)) * math.ceil(IMAGE / (by * ty))
    waves = blocks / (resident * entry["compute_units"])
    tail = math.ceil(waves) / waves
    reuse = (bx * tx * by * ty) / ((bx * tx + filter_size - 1) * (by * ty + filter_size - 1))
    ilp = min(1.0, 0.35 + 0.12 * tx * ty) * (0.85 if tx * ty > (24 if amd else 32) else 1.0)
    bank = 1.0 if (pad or (bx * tx) % 32) else (1.1 if amd else 1.25)
    coalescing = 1.0 if bx % warp == 0 else 1.0 + 0.4 * (warp - bx % warp) / warp
    peak = entry["peak_tflops"]["fp32"] * 1e12
    compute = 2.0 * IMAGE * IMAGE * filter_size ** 2 / (peak * min(1.0, 0.25 + occupancy) * ilp)
    memory = ((IMAGE + filter_size) ** 2 * 8 / reuse / (entry["memory_bandwidth_gbs"] * 1e9)
              * coalescing * (0.9 if read_only and not amd else 1.0))
    return "ok", max(compute * bank, memory) * tail * math.exp(noise)


def conv_dataset(seed: int, filters: tuple[int, ...]) -> TableDataset:
    """The `conv` space (module docstring) on CONV_DEVICES."""
    table, rng = DeviceTable.load(), np.random.default_rng(seed)
    problem = (Column("filter_size", "numeric"),) if len(filters) > 1 else ()
    schema = TableSchema(problem=problem, config=tuple(Column(n, "numeric") for n in CONV_PARAMS))
    space = list(itertools.product((16, 32, 48, 64, 80, 96, 112, 128, 256),
                                   (1, 2, 4, 8, 16, 32), range(1, 9), range(1, 9), (0, 1),
                                   (0, 1)))
    rows = []
    for device, filter_size in itertools.product(CONV_DEVICES, filters):
        entry = table.entry(device)
        for config in space:
            status, seconds = conv_time(entry, config, filter_size, rng.normal(0.0, 0.02))
            rows.append({**({"filter_size": filter_size} if problem else {}),
                         **dict(zip(CONV_PARAMS, config)), "device": device,
                         "status": status, "time_s": seconds})
    return TableDataset(frame=finish_frame(rows, schema), schema=schema)


def dataset_of(space: str, seed: int, filters: tuple[int, ...]) -> TableDataset:
    if space == "gemm":
        from synthetic_gemm import synthetic
        return synthetic(8, 24, seed=seed)
    if space == "clblast":
        from table_formulations import generate
        return generate(seed)
    return conv_dataset(seed, filters)


def parts_picks(dataset: TableDataset, devices, rounds: int, threads: int) -> pd.DataFrame:
    """Per held-out (device, problem): the efficiency of each part's pick."""
    frame, schema, out = dataset.frame, dataset.schema, []
    for held in sorted(frame["device"].unique()):
        train = TableDataset(frame=frame[frame["device"] != held].reset_index(drop=True),
                             schema=schema)
        model = TableModel.fit(train, devices, rounds=rounds, threads=threads)
        train_ok = train.frame[train.frame["status"] == "ok"]
        average = (train_ok.assign(efficiency=efficiencies(train_ok))
                   .groupby("kernel")["efficiency"].sum()
                   / train_ok.groupby(["device", "dims_key"]).ngroups)
        test = frame[frame["device"] == held]
        ok = test[test["status"] == "ok"]
        prior_column = len(model.features.names) + NAMES.index(PRIOR)
        for dims_key, group in ok.groupby("dims_key"):
            known = set(test.loc[test["dims_key"] == dims_key, "kernel"])
            kernels = [k for k in model.allowed(held) if k in known]
            efficiency = dict(zip(group["kernel"], group["time_s"].min() / group["time_s"]))
            problem = group.iloc[0][list(schema.problem_names)].to_dict()
            problems = pd.DataFrame([problem], columns=list(schema.problem_names))
            X = np.hstack([model.features.grid(problems, model.candidate_configs().loc[kernels],
                                               held),
                           model.reference.grid(held, devices.features(held), problems,
                                                kernels, schema)[0]])
            scores = {member: booster.predict(X, num_threads=threads)
                      for member, booster in model.boosters.items()}
            scores["prior"] = np.nan_to_num(X[:, prior_column].astype(np.float64), nan=-1.0)
            scores["ensemble"] = model._predict(X)
            row = {"device": held, "dims_key": dims_key,
                   "best_on_average": efficiency.get(average.reindex(kernels).idxmax(), 0.0)}
            for part, values in scores.items():
                row[part] = efficiency.get(kernels[int(np.argmax(values))], 0.0)
            out.append(row)
    return pd.DataFrame(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--space", choices=("gemm", "clblast", "conv"), action="append")
    parser.add_argument("--dataset", help="an imported dataset instead of generated spaces")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--filters", default="15", help="conv: filter sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    devices = DeviceTable.load()
    filters = tuple(int(f) for f in args.filters.split(","))
    runs = ([("dataset", read_dataset(args.dataset))] if args.dataset else
            [(space, dataset_of(space, args.seed, filters))
             for space in (args.space or ["gemm", "clblast", "conv"])])
    parts = [*MEMBERS, "prior", "ensemble", "best_on_average"]
    for name, dataset in runs:
        started = time.monotonic()
        picks = parts_picks(dataset, devices, args.rounds, args.threads)
        print(f"{name} (seed {args.seed}): {len(picks)} held-out (device, problem) pairs, "
              f"{time.monotonic() - started:.0f} s")
        for part in parts:
            per_device = picks.groupby("device")[part].mean()
            print(f"  {part:16s} mean {picks[part].mean():.3f} | " + " ".join(
                f"{device[:10]} {value:.3f}" for device, value in per_device.items()))


if __name__ == "__main__":
    main()
