"""The figures of a cross-hardware evaluation, from its per-(device, problem) table.

Every block (`overall`, and each of `devices`) has the same keys: n_problems,
mean/median/p10/min_efficiency, top1, top5, shortlist {k: mean best efficiency among the k
highest predictions}, shortlist_random {k: expected best of k random ok configurations},
unsure {coverage, precision, confident_wrong}, unmeasured_picks, failed_picks, and baselines
{most_similar_device, best_on_average, random, plain_lightgbm[, default]: mean/p10/min
efficiency and top1}, and incumbent {share: of picks the guard answered with the model's
incumbent, model_alone: the mean efficiency of the top predictions unguarded}; with a default
configuration also beats_default. A device's block adds
its folds (what it was trained on, the calibration's threshold and note, seconds).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from tilecast.table.transfer_baselines import TIE_EFFICIENCY

#: Columns of the per-problem table that are efficiencies of a baseline's picks.
PICKING_BASELINES = ("most_similar_device", "best_on_average", "plain_lightgbm", "default")
FOLD_KEYS = ("fold", "method", "trained_on", "threshold", "n_problems", "note", "margin",
             "margin_note", "incumbent", "seconds")


def _figures(efficiency: np.ndarray, in_tie: np.ndarray) -> dict:
    return {"mean_efficiency": float(np.mean(efficiency)),
            "p10_efficiency": float(np.percentile(efficiency, 10)),
            "min_efficiency": float(np.min(efficiency)), "top1": float(np.mean(in_tie))}


def _baselines(rows: pd.DataFrame) -> dict:
    result = {}
    for name in PICKING_BASELINES:
        if name in rows.columns:
            values = rows[name].to_numpy(dtype=np.float64)
            result[name] = _figures(values, values >= TIE_EFFICIENCY)
    result["random"] = _figures(rows["random"].to_numpy(dtype=np.float64),
                                rows["random_top1"].to_numpy(dtype=np.float64))
    nearest = sorted(rows["nearest_device"].unique())
    result["most_similar_device"]["devices"] = nearest
    result["best_on_average"]["kernels"] = sorted(rows["best_on_average_kernel"].unique())
    return result


def block(rows: pd.DataFrame, ks: Sequence[int], target: float, default: str | None) -> dict:
    """The figures of one set of (device, problem) rows (module docstring)."""
    efficiency = rows["efficiency"].to_numpy(dtype=np.float64)
    sure = rows["sure"].to_numpy(dtype=bool)
    reached = efficiency >= target
    figures = {"n_problems": int(len(rows)), **_figures(efficiency, rows["top1"].to_numpy()),
               "median_efficiency": float(np.median(efficiency)),
               "top5": float(rows["top5"].mean()),
               "shortlist": {str(k): float(rows[f"shortlist_{k}"].mean()) for k in ks},
               "shortlist_random": {str(k): float(rows[f"random_best_of_{k}"].mean())
                                    for k in ks},
               "unsure": {"coverage": float(sure.mean()),
                          "precision": float(reached[sure].mean()) if sure.any() else None,
                          "confident_wrong": float((sure & ~reached).mean())},
               "unmeasured_picks": int((~rows["pick_measured"]).sum()),
               "failed_picks": int(rows["pick_failed"].sum()),
               "incumbent": {"share": float(rows["guarded"].mean()),
                             "model_alone": float(rows["model_efficiency"].mean())},
               "baselines": _baselines(rows)}
    if default is not None:
        figures["baselines"]["default"]["kernel"] = default
        figures["beats_default"] = bool(figures["mean_efficiency"]
                                        > figures["baselines"]["default"]["mean_efficiency"])
    return figures


def summarize(per_problem: pd.DataFrame, folds: dict[str, list[dict]], *, ks: Sequence[int],
              target: float, default: str | None) -> dict:
    """{"overall": block of every row, "devices": {device: block of its rows + its folds}}."""
    devices = {}
    for device, rows in per_problem.groupby("device", sort=True):
        devices[str(device)] = {
            **block(rows, ks, target, default),
            "folds": [{k: fold[k] for k in FOLD_KEYS} for fold in folds.get(device, [])],
            "seconds": round(sum(f["seconds"] for f in folds.get(device, [])), 2)}
    overall = block(per_problem, ks, target, default)
    if default is not None:
        overall["devices_beating_default"] = sum(d["beats_default"] for d in devices.values())
    return {"overall": overall, "devices": devices}
