"""Which target a table model should learn, judged by leave-one-device-out on a GEMM-shaped
dataset: each device held out in turn, a model trained on the others picks a configuration
for every problem of the held-out device from that device's hardware features alone.

    python benchmarks/table_formulations.py                      # generated dataset, all kinds
    python benchmarks/table_formulations.py --dataset DIR        # an imported dataset
    python benchmarks/table_formulations.py --kinds log_efficiency lambdarank --rounds 300

Formulations: `log_efficiency` and `efficiency` (tilecast.table.model.FORMULATIONS: L2
regression on the log of efficiency with rows weighted towards each group's best, or on
efficiency itself), and `lambdarank` ((device, problem) query groups, graded relevance from
efficiency, RANK_EDGES). Beside them: `best_on_average` (the configuration with the best mean
efficiency over the training devices' groups), `random` (the expected efficiency of a random
ok configuration). Each line: mean / P10 efficiency of the picks (0 for a pick that failed
there) and top-1 (within 1 % of the best). Then the wall time of one full fit on every device
and of `train_table` (the final fit plus the out-of-fold calibration models).

The generated dataset (`generate`) is CLBlast's GEMM kernel space (Kernel Tuner's GEMM
example): MWG, NWG, KWG, MDIMC, NDIMC, KWI, VWM, VWN, SA, SB under CLBlast's divisibility
constraints, on six GPUs of the shipped hardware table, timed by a roofline-style
rule (occupancy from threads, registers and shared memory; padding and wave quantization;
vector width against the warp size; DRAM traffic with and without shared-memory caching),
with per-device quirks that no hardware feature explains and 2 % noise; configurations whose
shared memory does not fit a device are `invalid` there, and 1 % fail to compile at random.
Figures, not a test.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from tilecast.table.dataset import (Column, TableDataset, TableSchema, finish_frame,
                                    read_dataset, write_dataset)
from tilecast.table.devices import DeviceTable
from tilecast.table.features import TableFeatures
from tilecast.table.model import (FORMULATIONS, TableModel, efficiencies, lgb_params,
                                  training_rows)

DEVICES = ("A100-PCIE-40GB", "RTX A4000", "RTX A6000", "MI250X", "Radeon PRO W6600",
           "Radeon PRO W7800")
SIZES = [(4096, 4096, 4096), (1024, 1024, 1024), (2048, 512, 1024), (512, 4096, 256),
         (3000, 3000, 500), (768, 1536, 2048), (256, 256, 4096), (8192, 1024, 512)]
PARAMS = {"MWG": (16, 32, 64, 128), "NWG": (16, 32, 64, 128), "KWG": (16, 32),
          "MDIMC": (8, 16, 32), "NDIMC": (8, 16, 32), "KWI": (2,), "VWM": (1, 2, 4, 8),
          "VWN": (1, 2, 4, 8), "SA": (0, 1), "SB": (0, 1)}
# LambdaRank's grades: efficiency below 0.5 -> 0, then one grade per edge passed
RANK_EDGES = (0.5, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.985, 0.995)
TIE = 1.0 / 1.01


def valid(c: dict) -> bool:
    """CLBlast's xgemm constraints, with its MDIMA = MDIMC and NDIMB = NDIMC (the loading
    threads shaped like the computing ones), which keeps the space near 5,000."""
    return (c["KWG"] % c["KWI"] == 0 and c["MWG"] % (c["MDIMC"] * c["VWM"]) == 0
            and c["NWG"] % (c["NDIMC"] * c["VWN"]) == 0
            and c["KWG"] % c["NDIMC"] == 0 and c["KWG"] % c["MDIMC"] == 0)


def configurations() -> pd.DataFrame:
    names = list(PARAMS)
    rows = [dict(zip(names, values)) for values in itertools.product(*PARAMS.values())]
    return pd.DataFrame([c for c in rows if valid(c)])


def device_times(entry: dict, problem: tuple, c: pd.DataFrame, rng) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, status) of every configuration row of `c` on one device and problem."""
    m, n, k = problem
    threads = (c["MDIMC"] * c["NDIMC"]).to_numpy(float)
    warp = entry["warp_size"]
    warp_use = threads / (np.ceil(threads / warp) * warp)
    regs = (c["MWG"] * c["NWG"]).to_numpy(float) / threads + \
        (c["MWG"] / c["MDIMC"] + c["NWG"] / c["NDIMC"]).to_numpy(float) * 2 + 20
    smem = 4.0 * c["KWG"].to_numpy(float) * (c["SA"] * c["MWG"] + c["SB"] * c["NWG"]).to_numpy(float)
    smem_kib = entry["shared_memory_kib"]
    limit = min(64.0, smem_kib) * 1024
    registers = (entry.get("registers_kib") or 256) * 1024 / 4
    per_cu = np.minimum.reduce([np.where(smem > 0, np.floor(smem_kib * 1024 / np.maximum(smem, 1)), 32),
                                np.floor(2048 / threads), np.floor(registers / (regs * threads)),
                                np.full(len(c), 32.0)])
    occupancy = np.clip(per_cu * threads / 2048, 0, 1)
    hiding = np.minimum(1.0, 0.3 + occupancy)
    spill = np.where(regs > 255, np.exp(-(regs - 255) / 120), 1.0)
    work = (c["MWG"] * c["NWG"]).to_numpy(float) / threads
    ilp = np.minimum(1.0, work / 16) ** 0.5
    vector = (c["VWM"] * c["VWN"]).to_numpy(float)
    preferred = 8.0 if warp == 64 else 4.0
    vector_use = 1.0 - 0.08 * np.abs(np.log2(vector) - math.log2(preferred))
    kwi = np.where(c["KWI"] == 8, 1.03 if entry["vendor"] == "amd" else 0.98, 1.0)
    mwg, nwg = c["MWG"].to_numpy(float), c["NWG"].to_numpy(float)
    blocks = np.ceil(m / mwg) * np.ceil(n / nwg)
    units = entry["compute_units"]
    active = np.maximum(per_cu, 1) * units
    waves = blocks / (np.ceil(blocks / active) * active)
    padding = m * n / (np.ceil(m / mwg) * mwg * np.ceil(n / nwg) * nwg)
    rate = (entry["peak_tflops"]["fp32"] * 1e12 * warp_use * hiding * spill * ilp * vector_use
            * kwi * np.minimum(1.0, 0.25 + waves) * padding)
    compute = 2.0 * m * n * k / rate
    cached = np.where(c["SA"] + c["SB"] == 2, 1.0, np.where(c["SA"] + c["SB"] == 1, 1.6, 2.5))
    l2_relief = 1.0 / (1.0 + entry["l2_kib"] / 16384)
    traffic = 4.0 * k * (m * np.ceil(n / nwg) + n * np.ceil(m / mwg)) * (1 + (cached - 1) * l2_relief)
    memory = traffic / (entry["memory_bandwidth_gbs"] * 1e9)
    seconds = (np.maximum(compute, memory) + 4e-6)
    status = np.where(smem > limit, "unsupported", "ok").astype(object)
    return seconds, status


def generate(seed: int = 0, devices=DEVICES, sizes=SIZES) -> TableDataset:
    """The GEMM-shaped dataset described in the module docstring."""
    table = DeviceTable.load()
    rng = np.random.default_rng(seed)
    configs = configurations()
    schema = TableSchema(problem=tuple(Column(n, "numeric") for n in ("m", "n", "k")),
                         config=tuple(Column(n, "numeric") for n in PARAMS))
    # quirks: one per (device, MWG, NWG, VWM, VWN) (unexplained by any feature) and one per
    # (vendor, SA, SB, KWI) (shared by a vendor's devices)
    tile = configs[["MWG", "NWG", "VWM", "VWN"]].astype(str).agg("-".join, axis=1)
    style = configs[["SA", "SB", "KWI"]].astype(str).agg("-".join, axis=1)
    vendor_quirk = {v: dict(zip(sorted(set(style)), rng.lognormal(0, 0.08, style.nunique())))
                    for v in ("nvidia", "amd")}
    frames = []
    for device in devices:
        entry = table.entry(device)
        quirk = dict(zip(sorted(set(tile)), rng.lognormal(0, 0.10, tile.nunique())))
        factor = tile.map(quirk).to_numpy() * style.map(vendor_quirk[entry["vendor"]]).to_numpy()
        build_failed = rng.random(len(configs)) < 0.01
        for problem in sizes:
            seconds, status = device_times(entry, problem, configs, rng)
            seconds = seconds * factor * rng.lognormal(0, 0.02, len(configs))
            status = np.where(build_failed, "build_failed", status)
            frame = configs.assign(m=problem[0], n=problem[1], k=problem[2], device=device,
                                   status=status,
                                   time_s=np.where(status == "ok", seconds, np.nan))
            frames.append(frame)
    rows = pd.concat(frames, ignore_index=True).to_dict("records")
    return TableDataset(frame=finish_frame(rows, schema), schema=schema)


# -- the comparison -------------------------------------------------------------------------

def fit_rank(dataset: TableDataset, devices, exclude, rounds: int, threads, seed: int):
    """A LambdaRank booster on the same rows and features as TableModel.fit, and its features."""
    import lightgbm as lgb

    rows = training_rows(dataset, devices, exclude_devices=exclude, seed=seed)
    features = TableFeatures(dataset.schema, devices).fit(rows.ok)
    X = features.rows(rows.ok)
    grades = np.searchsorted(RANK_EDGES, rows.efficiency, side="right")
    groups = rows.ok.groupby(["device", "dims_key"], sort=False).size().to_numpy()
    params = {**lgb_params("lambdarank", len(X), threads, seed),
              "lambdarank_truncation_level": 20}
    booster = lgb.train(params, lgb.Dataset(X, grades, group=groups,
                                            categorical_feature=features.categorical_indices
                                            or "auto"), num_boost_round=rounds)
    return booster, features, rows.candidates


def variant_params(dataset: TableDataset, devices, variant: dict) -> dict:
    """LightGBM parameters of a variant: its key=value pairs, `device_penalty` turned into
    LightGBM's feature_penalty on the device features."""
    params = dict(variant or {})
    penalty = params.pop("device_penalty", None)
    if penalty is not None:
        names = TableFeatures(dataset.schema, devices).names
        params["feature_penalty"] = [float(penalty) if n.startswith("device:") else 1.0
                                     for n in names]
    return params


def held_out_picks(kind: str, dataset: TableDataset, devices, held: str, rounds: int,
                   threads, seed: int, variant: dict | None = None) -> pd.DataFrame:
    """Per problem of `held`: the efficiency of the pick of a model trained without it."""
    frame = dataset.frame
    test = frame[frame["device"] == held]
    ok = test[test["status"] == "ok"]
    eff = ok.assign(efficiency=efficiencies(ok)).set_index(["dims_key", "kernel"])["efficiency"]
    train = TableDataset(frame=frame[frame["device"] != held].reset_index(drop=True),
                         schema=dataset.schema)
    if kind == "lambdarank":
        booster, features, kernels = fit_rank(train, devices, (), rounds, threads, seed)
        predict = lambda grid: booster.predict(features.grid(*grid))  # noqa: E731
    elif kind in FORMULATIONS:
        model = TableModel.fit(train, devices, rounds=rounds, threads=threads, seed=seed,
                               formulation=kind, params=variant_params(dataset, devices, variant))
        kernels = model.candidates()
        # scores: the model's own features and the training devices' measurements
        predict = lambda grid: model.scores(grid[0].iloc[0].to_dict(), grid[2],  # noqa: E731
                                            kernels)
        configs = model.candidate_configs().reset_index(drop=True)
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    if kind == "lambdarank":
        from tilecast.table.dataset import parse_key
        configs = pd.DataFrame([parse_key(k, dataset.schema.config) for k in kernels])
    out = []
    for dims_key, rows in test.groupby("dims_key"):
        problem = rows.iloc[:1][list(dataset.schema.problem_names)].reset_index(drop=True)
        scores = predict((problem, configs, held))
        pick = kernels[int(np.argmax(scores))]
        out.append({"device": held, "dims_key": dims_key,
                    "efficiency": float(eff.get((dims_key, pick), 0.0))})
    return pd.DataFrame(out)


def baselines(dataset: TableDataset, held: str, rng) -> pd.DataFrame:
    frame = dataset.frame
    ok = frame[frame["status"] == "ok"]
    ok = ok.assign(efficiency=efficiencies(ok))
    train, test = ok[ok["device"] != held], ok[ok["device"] == held]
    groups = train.groupby(["device", "dims_key"]).ngroups
    average = train.groupby("kernel")["efficiency"].sum() / groups
    static = average.idxmax()
    all_test = frame[frame["device"] == held]
    out = []
    for dims_key, rows in test.groupby("dims_key"):
        known = dict(zip(rows["kernel"], rows["efficiency"]))
        tried = all_test[all_test["dims_key"] == dims_key]["kernel"]
        out.append({"device": held, "dims_key": dims_key,
                    "best_on_average": known.get(static, 0.0),
                    "random": float(np.mean([known.get(k, 0.0) for k in tried]))})
    return pd.DataFrame(out)


def line(name: str, values: np.ndarray) -> str:
    return (f"  {name:<16} mean {values.mean():.4f}  P10 {np.percentile(values, 10):.4f}  "
            f"top-1 {np.mean(values >= TIE - 1e-12):.3f}  (n={len(values)})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", help="an imported dataset (default: generate one)")
    parser.add_argument("--kinds", nargs="+",
                        default=["log_efficiency", "efficiency", "lambdarank"])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="a LightGBM parameter for the regression kinds (repeatable); "
                             "device_penalty=X scales the device features' split gains")
    args = parser.parse_args(argv)
    variant = {key: float(value) for key, value in (p.split("=", 1) for p in args.param)}
    variant = {k: int(v) if v.is_integer() and k not in ("device_penalty",) else v
               for k, v in variant.items()}
    devices = DeviceTable.load()
    started = time.monotonic()
    dataset = read_dataset(args.dataset) if args.dataset else generate(args.seed)
    frame = dataset.frame
    print(f"dataset: {len(frame)} rows, {frame['device'].nunique()} devices, "
          f"{frame['dims_key'].nunique()} problems, {frame['kernel'].nunique()} configurations, "
          f"statuses {frame['status'].value_counts().to_dict()} "
          f"({time.monotonic() - started:.1f} s)")
    results = {kind: [] for kind in args.kinds}
    base = []
    for held in dataset.devices:
        base.append(baselines(dataset, held, None))
        for kind in args.kinds:
            fold_started = time.monotonic()
            picks = held_out_picks(kind, dataset, devices, held, args.rounds, args.threads,
                                   args.seed, variant)
            results[kind].append(picks)
            print(f"  {held:<18} {kind:<15} mean {picks['efficiency'].mean():.4f} "
                  f"({time.monotonic() - fold_started:.1f} s)", flush=True)
    print(f"leave-one-device-out, {args.rounds} rounds:")
    for kind, parts in results.items():
        print(line(kind, pd.concat(parts)["efficiency"].to_numpy()))
    base = pd.concat(base)
    for name in ("best_on_average", "random"):
        print(line(name, base[name].to_numpy()))
    if args.no_timing:
        return 0
    fit_started = time.monotonic()
    TableModel.fit(dataset, devices, rounds=args.rounds, threads=args.threads, seed=args.seed)
    print(f"one fit on every device: {time.monotonic() - fit_started:.1f} s")
    from tilecast.table.train import train_table
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "dataset"
        write_dataset(path, frame, dataset.schema, [{"file": "generated"}])
        summary = train_table(path, Path(scratch) / "work", rounds=args.rounds,
                              threads=args.threads, seed=args.seed)
        print(summary.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
