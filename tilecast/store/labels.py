"""Labels pooled over nights: what a model of one hardware class trains and is judged on.

A night measures a problem's kernels side by side, so within a night a kernel's time is
meaningful relative to its rivals'. A night on a shared machine also carries a state of its
own that no sample count inside it averages away (docs/journal/: ~1.2 % per label, for the
whole run); several nights do. So each problem's labels are pooled over the nights that
measured it:

- only records of a kernel's current binary and protocol count (its latest build key and
  protocol hash in the class): a new build key starts fresh;
- per problem, the kernels x nights matrix of log median times (its latest `window`
  nights) is split by Tukey's median polish into a kernel effect and a night effect: a
  night whose whole level moved (the machine slower that night) moves the night effect, not
  a label, and a kernel one night did not measure is still placed against its rivals;
- a kernel's pooled time is its effect (its time on a typical night), with the spread of its
  night-adjusted times (max - min, relative) and its night count.

`pooled_final` gives the result in the shape of tilecast.core.dataset.final_table (one row
per (dims_key, kernel), `median_s` the pooled time and `tflops` the problem's work over
it), so winners, training, evaluation and repeatability read pooled labels as they read
one run's.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from tilecast.core import dataset

DEFAULT_WINDOW = 8     # the most recent nights a label pools
MAX_SWEEPS = 10        # median polish: row and column sweeps (it settles in 2-4)
ORIGIN = ("protocol_hash", "build_key")
# statuses that, on any night, make a pair no choice (a timeout on one night does not)
UNTRUSTED = ("wrong_result", "crashed")


def current_origin(records: pd.DataFrame) -> pd.DataFrame:
    """The candidate records made by each kernel's latest binary and protocol (by time): a
    kernel rebuilt or re-measured under a new protocol starts its labels fresh."""
    rows = records[records["role"] == "candidate"]
    if rows.empty:
        return rows
    origin = rows[list(ORIGIN)].astype("string").fillna("").agg("|".join, axis=1)
    latest = (rows.assign(_origin=origin).sort_values("time", kind="stable")
              .drop_duplicates("kernel", keep="last").set_index("kernel")["_origin"])
    return rows[origin.to_numpy() == rows["kernel"].map(latest).to_numpy()]


def night_labels(records: pd.DataFrame) -> pd.DataFrame:
    """Every night's valid measurements of the current binaries: one row per (run_id,
    dims_key, kernel) with its `median_s` and `time` (what the polish reads)."""
    columns = ["run_id", "dims_key", "kernel", "median_s", "time"]
    frames = [dataset.valid(dataset.final_table(night)).assign(run_id=run_id)[columns]
              for run_id, night in current_origin(records).groupby("run_id", sort=True)]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def _latest_nights(labels: pd.DataFrame, window: int) -> pd.DataFrame:
    """Each problem's labels of the `window` latest nights that measured it."""
    first = labels.groupby(["dims_key", "run_id"])["time"].min().rename("_night_time")
    labels = labels.join(first, on=["dims_key", "run_id"])
    nights = labels.drop_duplicates(["dims_key", "run_id"]).sort_values(
        ["dims_key", "_night_time"], kind="stable")
    nights = nights[nights.groupby("dims_key").cumcount(ascending=False) < window]
    keep = set(zip(nights["dims_key"], nights["run_id"]))
    mask = [pair in keep for pair in zip(labels["dims_key"], labels["run_id"])]
    return labels[mask].drop(columns="_night_time")


def median_polish(log_times: np.ndarray, sweeps: int = MAX_SWEEPS) -> tuple[np.ndarray, np.ndarray]:
    """Tukey's median polish of a kernels x nights matrix of log times (NaN: not measured
    that night): (kernel effects, night effects) with `log t = kernel + night + residual`,
    night effects centred on 0 by their median, so a kernel effect is its log time on a
    typical night. Robust to a night whose level moved and to a kernel one night missed."""
    residual = np.array(log_times, dtype=float)
    kernel = np.zeros(residual.shape[0])
    night = np.zeros(residual.shape[1])
    for _ in range(sweeps):
        rows = np.nanmedian(residual, axis=1)
        kernel += rows
        residual -= rows[:, None]
        columns = np.nanmedian(residual, axis=0)
        night += columns
        residual -= columns[None, :]
        centre = np.median(night)
        night -= centre
        kernel += centre
        if np.nanmax(np.abs(rows), initial=0.0) < 1e-12 and np.abs(columns).max() < 1e-12:
            break
    return kernel, night


def polished(labels: pd.DataFrame, window: int = DEFAULT_WINDOW):
    """Per problem of night_labels(): (dims_key, kernel names, run ids, kernel effects,
    residuals): the median polish of its kernels x latest `window` nights log times, with
    NaN residuals where a night did not measure a kernel."""
    if window < 1:
        raise ValueError(f"window {window!r}: pool at least one night")
    if labels.empty:
        return
    for dims_key, problem in _latest_nights(labels, window).groupby("dims_key", sort=True):
        table = problem.pivot_table(index="kernel", columns="run_id", values="median_s",
                                    aggfunc="first")
        log_times = np.log(table.to_numpy(dtype=float))
        kernel, night = median_polish(log_times)
        residual = log_times - kernel[:, None] - night[None, :]
        yield dims_key, list(table.index), list(table.columns), kernel, residual


def pool(labels: pd.DataFrame, window: int = DEFAULT_WINDOW) -> pd.DataFrame:
    """One row per (dims_key, kernel) measured validly on one of the problem's latest `window`
    nights: its pooled `median_s` (median polish of the problem's kernels x nights log
    times: the kernel's time on a typical night), `rel` (the problem's fastest pooled time /
    this one), `spread` (max - min over its nights of its time relative to its pooled one,
    the night's level taken out) and `nights`."""
    rows = []
    for dims_key, kernels, _, kernel, residual in polished(labels, window):
        pooled_s = np.exp(kernel)
        for index, name in enumerate(kernels):
            ratio = np.exp(residual[index][np.isfinite(residual[index])])
            rows.append({"dims_key": dims_key, "kernel": name, "median_s": pooled_s[index],
                         "rel": pooled_s.min() / pooled_s[index],
                         "spread": float(ratio.max() - ratio.min()),
                         "nights": int(np.isfinite(residual[index]).sum())})
    return pd.DataFrame(rows, columns=["dims_key", "kernel", "median_s", "rel", "spread",
                                       "nights"])


def pooled_final(records: pd.DataFrame, window: int = DEFAULT_WINDOW) -> pd.DataFrame:
    """A final table (tilecast.core.dataset.final_table's columns) of pooled labels: a valid
    pair's `median_s` is its pooled time and its `tflops` the problem's work over that, with
    its `nights` and `spread`; a pair no night measured validly keeps its latest record (its
    failure), and a pair whose binary gave a wrong result or crashed on any night is that
    failure. The other columns come from the pair's latest record."""
    candidates = current_origin(records)
    if candidates.empty:
        return candidates.assign(nights=pd.Series(dtype=int), spread=pd.Series(dtype=float))
    latest = dataset.final_table(candidates.sort_values("time", kind="stable")
                                 .drop_duplicates(["dims_key", "kernel", "phase"], keep="last"))
    latest = latest.set_index(["dims_key", "kernel"])
    pooled = pool(night_labels(candidates), window).set_index(["dims_key", "kernel"])
    table = latest.join(pooled[["median_s", "spread", "nights"]].rename(
        columns={"median_s": "pooled_s"}), how="left")
    # a binary that gave a wrong result, or crashed, on any night is not a choice there
    broken = candidates[candidates["status"].isin(UNTRUSTED)].sort_values("time", kind="stable")
    broken = (broken.drop_duplicates(["dims_key", "kernel"], keep="last")
              .set_index(["dims_key", "kernel"]))
    if not broken.empty:
        keys = table.index.intersection(broken.index)
        table.loc[keys, "pooled_s"] = np.nan
        table.loc[keys, ["status", "reason"]] = broken.loc[keys, ["status", "reason"]].to_numpy()
        table.loc[keys, ["tflops", "median_s"]] = np.nan
    # TFLOP/s x seconds is the problem's work, the same for every valid record of it
    valid = dataset.valid(candidates)
    work = (valid["tflops"] * valid["median_s"]).groupby(valid["dims_key"]).median()
    labelled = table["pooled_s"].notna().to_numpy()
    pooled_s = table["pooled_s"].to_numpy(dtype=float)[labelled]
    problems = table.index.get_level_values("dims_key")[labelled]
    scale = table["median_s"].to_numpy(dtype=float)[labelled] / pooled_s
    table.loc[labelled, "status"] = "ok"
    table.loc[labelled, "median_s"] = pooled_s
    table.loc[labelled, "tflops"] = work.reindex(problems).to_numpy(dtype=float) / pooled_s
    table.loc[labelled, "gbps"] = table["gbps"].to_numpy(dtype=float)[labelled] * scale
    table["nights"] = table["nights"].fillna(0).astype(int)
    table["spread"] = table["spread"].astype(float)
    return table.drop(columns=["pooled_s"]).reset_index()


def series_labels(records: pd.DataFrame, nights: list[str],
                  window: int = DEFAULT_WINDOW) -> pd.DataFrame:
    """pooled_final over the records of the given nights only (a series' first K nights)."""
    return pooled_final(records[records["run_id"].isin(nights)], window)


def nights_in_order(records: pd.DataFrame) -> list[str]:
    """The run ids of `records`, first night first (by their first record's time)."""
    first = records.groupby("run_id")["time"].min().sort_values(kind="stable")
    return [str(r) for r in first.index]


def label_spread_summary(pooled: pd.DataFrame) -> dict:
    """How settled the labels are: pairs, median nights, and the median and P90 spread of
    the pairs measured on two or more nights (None while there are none)."""
    valid = dataset.valid(pooled)
    several = valid[valid["nights"] >= 2]["spread"].to_numpy(dtype=float)
    return {"pairs": int(len(valid)),
            "median_nights": float(np.median(valid["nights"])) if len(valid) else 0.0,
            "median_spread": float(np.median(several)) if len(several) else None,
            "p90_spread": float(np.percentile(several, 90)) if len(several) else None}
