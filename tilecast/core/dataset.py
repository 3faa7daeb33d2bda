"""The benchmark dataset: record schema, status codes and the derived tables every stage reads.

The status codes are tilecast's one vocabulary, in tilecast.core.status (re-exported here).

One row per benchmark record (a kernel measured on a problem in one phase). Stages after
`convert` read the parquet file through `load` and derive what they need here, so the
rules (which phase counts, what is valid, who won) live in one place.

A raw file can hold records of two protocols (a run resumed after its protocol changed
measures every pair again, and the old records stay in the append-only log): the latest
protocol wins, pair by pair (`latest_origin`); the older records are kept in the dataset,
never scored.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from tilecast.core import stats, tune
from tilecast.core.columns import MEASUREMENT_NAMES
from tilecast.core.status import (  # noqa: F401  (the record's vocabulary, read from here too)
    BUILD_STATUSES, LEGACY_STATUSES, STATUS_TABLE, STATUSES, TABLE_STATUSES, USAGE_ERROR, Status,
    current_statuses, is_usage_error)

# 2: records say how their samples were timed (`timing`, one of TIMINGS); version 1 records
# convert with a warning, as `isolated` (the only protocol there was)
# 3: records say what made them: `protocol_hash` (measure.protocol_hash of the protocol) and
# `build_key` (the build cache key of the candidate's binary; None for peers and imports).
# Older records convert with a warning, both None; a resumed benchmark never reuses them.
SCHEMA_VERSION = 3


# Phases: `screen` measures every candidate; `confirm` re-measures finalists with fresh samples.
PHASES = ("screen", "confirm")

# Roles: `candidate` rows are kernels of the family; `peer` rows are the reference library
# (torch) measured with the same protocol, kept for ratios and never trained on.
ROLES = ("candidate", "peer")

# How a record's samples were taken: `isolated` (the candidate's own process, rounds over
# the batch), `interleaved` (the batch's candidates side by side in one process:
# tilecast.measurement.interleave), `imported` (someone else's measurement: convert_ck).
TIMINGS = ("isolated", "interleaved", "imported")

# Columns common to every family (problem fields and kernel config fields come from the family):
# the measurement columns every measurement row shares (core.columns: dims_key, kernel,
# status, reason, samples_s, median_s, mad_s), the machine's `hardware` fingerprint, and the
# record's own.
RECORD_COLUMNS = (
    ("schema_version", "run_id", "time", "git_sha", "hardware", "family", "problem_set")
    + MEASUREMENT_NAMES
    + ("role", "phase", "reps_per_sample", "tflops", "gbps", "max_error", "threads", "timing",
       "protocol_hash", "build_key")
)

# What makes two records of one (dims_key, kernel) comparable: the same protocol and binary.
ORIGIN_COLUMNS = ("protocol_hash", "build_key")


class DatasetError(ValueError):
    """A dataset file is missing, empty, truncated or has the wrong schema."""


def load(path: str | Path) -> pd.DataFrame:
    """Read a converted parquet dataset, checking its schema version and required columns."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist; run the convert stage first")
    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError) as err:   # pyarrow's ArrowInvalid is a ValueError
        raise DatasetError(f"dataset {path} is not a readable parquet file: "
                           f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
                           ) from None
    # an older dataset lacks this version's columns: the version says why, and what to do
    versions = set(frame["schema_version"].unique()) if "schema_version" in frame else set()
    if versions - {SCHEMA_VERSION}:
        raise DatasetError(f"dataset {path} has schema versions {sorted(versions)}; "
                           f"this tilecast reads version {SCHEMA_VERSION}: re-run convert on "
                           "its raw records (older raw records convert)")
    missing = [c for c in RECORD_COLUMNS if c not in frame.columns]
    if missing:
        raise DatasetError(f"dataset {path} lacks columns {missing}")
    return frame


def collapse_repeats(measurements: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """One row per distinct `keys` of `measurements` (one row per measurement, with `time_s`
    and `status`), in the order each first appears: a source that appends every run (a tile
    engine's CSV, an AutoHeuristic log) measures one slot several times. Columns: the keys,
    `first` (the position of its first row), `rows` and `failed` (the positions of its rows,
    and of those whose status is not ok), `samples_s` (every usable time: positive and
    finite, in row order), and `median_s`, `mad_s` and `spread` (max/min) of the samples, NaN
    when a row failed (a configuration that failed once is not safe to choose) or there is
    no usable time. The one place repeated measurements of one slot become one."""
    keys = list(keys)
    times = pd.to_numeric(measurements["time_s"], errors="coerce").to_numpy(dtype=float)
    usable = np.isfinite(times) & (times > 0)
    failed = (measurements["status"] != "ok").to_numpy()
    slot = measurements.groupby(keys, sort=False, dropna=False).ngroup().to_numpy()
    positions = pd.Series(np.arange(len(measurements)))
    by_slot = positions.groupby(slot)
    usable_times = pd.Series(np.where(usable, times, np.nan))
    median = usable_times.groupby(slot).median()
    deviation = (usable_times - median.reindex(slot).to_numpy()).abs()
    out = pd.DataFrame({
        "first": by_slot.min(),
        "rows": by_slot.agg(list),
        "failed": positions[failed].groupby(slot[failed]).agg(list),
        "samples_s": pd.Series(times[usable]).groupby(slot[usable]).agg(list),
        "median_s": median,
        "mad_s": deviation.groupby(slot).median(),
        "spread": usable_times.groupby(slot).max() / usable_times.groupby(slot).min(),
    })
    out["failed"] = [value if isinstance(value, list) else [] for value in out["failed"]]
    out["samples_s"] = [value if isinstance(value, list) else [] for value in out["samples_s"]]
    no_time = np.array([bool(f) for f in out["failed"]]) | out["median_s"].isna().to_numpy()
    out.loc[no_time, ["median_s", "mad_s", "spread"]] = np.nan
    out = out.sort_values("first", kind="stable")
    first_rows = measurements.iloc[out["first"].to_numpy()][keys].reset_index(drop=True)
    return pd.concat([first_rows, out.reset_index(drop=True)], axis=1)


def final_table(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (dims_key, kernel) among candidates.

    A finalist, measured in the screen and the confirm phase, is scored on all its samples
    pooled (median_s, mad_s, tflops and gbps recomputed; the row is the confirm record): the
    confirmation adds fresh samples, and a slow spell of the machine lasting through one
    phase (seen on this VM: 3x slower for ~5 s, invisible to the contention guard) cannot
    decide the score alone. When either phase failed (or a table carries no samples), the
    latest record stands. Only records of the latest origin (protocol and binary) of a
    (dims_key, kernel) count: a run resumed after a protocol change measured it again, and
    the earlier protocol's records left in its raw file are never pooled with the new ones.
    A record the harness refused to run (a usage error) counts only while there is no other."""
    frame = _measured(latest_origin(records[records["role"] == "candidate"])).copy()
    frame["_phase_rank"] = frame["phase"].map({"confirm": 0, "screen": 1})
    frame = frame.sort_values(["dims_key", "kernel", "_phase_rank", "time"],
                              ascending=[True, True, True, False])
    repeated = frame.duplicated(["dims_key", "kernel"], keep=False)
    final = frame.drop_duplicates(["dims_key", "kernel"], keep="first")
    if repeated.any() and "samples_s" in frame.columns:
        final = final.set_index(["dims_key", "kernel"])
        for key, group in frame[repeated].groupby(["dims_key", "kernel"], sort=False):
            if not (group["status"] == "ok").all():
                continue
            pooled = stats.usable([x for samples in group["samples_s"] for x in samples])
            if not pooled:
                continue
            median = stats.median(pooled)
            scale = final.at[key, "median_s"] / median
            final.at[key, "median_s"] = median
            final.at[key, "mad_s"] = stats.mad(pooled)
            final.at[key, "tflops"] = final.at[key, "tflops"] * scale
            final.at[key, "gbps"] = final.at[key, "gbps"] * scale
        final = final.reset_index()
    return final.drop(columns="_phase_rank").reset_index(drop=True)


def latest_origin(records: pd.DataFrame) -> pd.DataFrame:
    """The rows of `records` made by the same protocol and binary (ORIGIN_COLUMNS) as the
    latest row of their (dims_key, kernel, role); all rows where the columns are absent."""
    present = [c for c in ORIGIN_COLUMNS if c in records.columns]
    if not present or records.empty:
        return records
    origin = records[present].astype("string").fillna("").agg("|".join, axis=1)
    order = records["time"].astype(str).argsort(kind="stable").to_numpy()
    slots = ["dims_key", "kernel", "role"]
    latest = (records.iloc[order][slots].assign(_origin=origin.iloc[order].to_numpy())
              .drop_duplicates(slots, keep="last"))
    keyed = records[slots].merge(latest, on=slots, how="left")["_origin"].to_numpy()
    return records[origin.to_numpy() == keyed]


def _measured(records: pd.DataFrame) -> pd.DataFrame:
    """`records` less its usage-error rows (nothing was measured: measure.is_usage_error)
    whose (dims_key, kernel) has another row, which then stands for it."""
    if records.empty or "reason" not in records.columns:
        return records
    pairs = list(zip(records["dims_key"], records["kernel"]))
    refused = [is_usage_error(reason) for reason in records["reason"]]
    measured = {pair for pair, no in zip(pairs, refused) if not no}
    return records[[not (no and pair in measured) for pair, no in zip(pairs, refused)]]


def valid(final: pd.DataFrame) -> pd.DataFrame:
    """Rows whose time counts: status ok with a positive, finite TFLOP/s."""
    ok = (final["status"] == "ok") & (final["tflops"] > 0) & final["tflops"].notna()
    return final[ok]


@dataclass(frozen=True)
class Winner:
    """The measured best kernel of one problem, chosen by the tuning policy."""
    dims_key: str
    kernel: str
    median_s: float
    best_tflops: float
    tie_set: tuple[str, ...]


def winners(final: pd.DataFrame, tie_threshold_pct: float,
            secondary: dict[str, float] | None = None) -> dict[str, Winner]:
    """Per problem, the tune.select_best winner among valid kernels (practical ties broken by
    the secondary metric, then by name), with the best TFLOP/s measured. The secondary metric
    defaults to the records' `binary_bytes` (the smaller binary wins a practical tie)."""
    if secondary is None and "binary_bytes" in final.columns:
        sizes = final.dropna(subset=["binary_bytes"]).drop_duplicates("kernel")
        secondary = dict(zip(sizes["kernel"], sizes["binary_bytes"].astype(float)))

    secondary = secondary or {}
    result: dict[str, Winner] = {}
    for dims_key, group in valid(final).groupby("dims_key", sort=True):
        scores = [tune.Score(id=row.kernel, value=float(row.median_s),
                             secondary=float(secondary.get(row.kernel, 0.0)))
                  for row in group.itertuples()]
        best = tune.select_best(scores, tie_threshold_pct)
        if best is None:
            continue
        ties = tune.tie_set(scores, tie_threshold_pct)
        result[dims_key] = Winner(dims_key=dims_key, kernel=best.id, median_s=best.value,
                                  best_tflops=float(group["tflops"].max()),
                                  tie_set=tuple(s.id for s in ties))
    return result


def measured_problems(family, final: pd.DataFrame, tie_threshold_pct: float):
    """Per problem with a measured winner: (dims_key, the family's problem, its Winner,
    tflops_of(kernel) -> the kernel's best valid TFLOP/s there, 0.0 when it has none): what a
    scorer of choices (the promotion gate, a user's evaluation) walks over."""
    measured = valid(final).pivot_table(index="dims_key", columns="kernel", values="tflops",
                                        aggfunc="max")
    first = final.drop_duplicates("dims_key").set_index("dims_key")
    for dims_key, winner in winners(final, tie_threshold_pct).items():
        problem = family.problem({f: first.at[dims_key, f] for f in family.problem_fields})
        row = measured.loc[dims_key]

        def tflops_of(kernel: str, row=row) -> float:
            value = row.get(kernel)
            return 0.0 if value is None or pd.isna(value) else float(value)

        yield dims_key, problem, winner, tflops_of
