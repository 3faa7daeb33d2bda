"""A generated GEMM-like space over the shipped device table, for benchmarks/transfer.py and
benchmarks/transfer_members.py: times follow a rule of the devices' figures (ideal block from
shared memory, unroll from the warp size, stages from bandwidth), with 3 % noise; and the
space with a near-best vendor configuration. Generated data: for tests and ablations, never
reported as a real figure."""
from __future__ import annotations

import math

import numpy as np

from tilecast.table.dataset import Column, TableDataset, TableSchema, finish_frame
from tilecast.table.devices import DeviceTable

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
                             "status": "build_failed" if failed else "ok",
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
