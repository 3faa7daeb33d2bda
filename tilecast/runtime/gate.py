"""The publish stage's promotion gate: the new model against production on the same holdout.

Stored metrics of two versions come from different holdouts and different measurements, so
they cannot be compared fairly. Here the production version is loaded as a Dispatcher and
asked to choose a kernel for every problem of *this* run's holdout; its choices are scored on
this run's measurements, exactly like the new model's. The new model is promoted only if

    mean and median efficiency  >= production's - MEAN_TOLERANCE (0.5 %),
    P10 efficiency              >= production's - P10_TOLERANCE (2 %),
    no holdout problem          loses more than MAX_PROBLEM_LOSS (10 %) of production's efficiency.

When production cannot be scored (no production yet, or its files no longer load), the
registry's default gate on stored metrics decides, and the reason says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from tilecast.core import dataset, stats
from tilecast.registry import api as registry
from tilecast.registry.base import (FLOAT_SLACK, MAX_PROBLEM_LOSS, MEAN_TOLERANCE,
                                    MEDIAN_TOLERANCE, P10_TOLERANCE)
from tilecast.runtime.dispatch import Dispatcher


@dataclass(frozen=True)
class Baseline:
    """Production's choices scored on this run's holdout (None fields: not scoreable, why)."""
    version: int | None
    per_problem: pd.DataFrame | None  # dims_key, chosen_kernel, efficiency
    why_not: str = ""
    notes: list = field(default_factory=list)


def choice_efficiency(family, holdout_final: pd.DataFrame, choose, tie_threshold_pct: float
                      ) -> pd.DataFrame:
    """Per holdout problem with a measured winner: the kernel `choose(problem)` returns and its
    measured efficiency (0.0 when that kernel has no valid measurement here)."""
    rows = []
    for dims_key, problem, winner, tflops_of in dataset.measured_problems(family, holdout_final,
                                                                           tie_threshold_pct):
        kernel = choose(problem)
        rows.append({"dims_key": dims_key, "chosen_kernel": kernel,
                     "efficiency": tflops_of(kernel) / winner.best_tflops})
    return pd.DataFrame(rows, columns=["dims_key", "chosen_kernel", "efficiency"])


def production_baseline(root, model: str, family, holdout_final: pd.DataFrame,
                        tie_threshold_pct: float) -> Baseline:
    """Score the production version of `model` on this holdout; a Baseline with why_not set
    when there is no production version or it cannot be loaded."""
    try:
        version = registry.read_alias(root, model, registry.PRODUCTION)
    except registry.RegistryError as err:
        return Baseline(None, None, f"no usable production version ({err})")
    try:
        dispatcher = Dispatcher.from_registry(root, model, version)
    except (registry.RegistryError, ValueError, OSError) as err:
        return Baseline(version, None, f"production version {version} does not load ({err})")
    table = choice_efficiency(family, holdout_final, dispatcher.select, tie_threshold_pct)
    unmeasured = int((table["efficiency"] == 0).sum())
    notes = [f"production's pick has no measurement in this run on {unmeasured} problem(s) "
             "(scored 0)"] if unmeasured else []
    return Baseline(version, table, notes=notes)


def summary(efficiency: np.ndarray) -> dict:
    """mean / median / P10 of per-problem efficiencies."""
    return {"mean_efficiency": float(np.mean(efficiency)),
            "median_efficiency": float(stats.median(efficiency)),
            "p10_efficiency": float(np.percentile(efficiency, 10))}


def compare(production: pd.DataFrame, candidate: pd.DataFrame) -> tuple[bool, str, dict]:
    """(promote?, reason with the figures, details) for two per-problem efficiency tables
    over the same holdout (matched on dims_key)."""
    both = production.merge(candidate, on="dims_key", suffixes=("_production", "_candidate"))
    if both.empty:
        raise ValueError("production and candidate share no holdout problem; cannot compare")
    prod = both["efficiency_production"].to_numpy(dtype=np.float64)
    new = both["efficiency_candidate"].to_numpy(dtype=np.float64)
    prod_figures, new_figures = summary(prod), summary(new)
    checks = []
    for key, tolerance in (("mean_efficiency", MEAN_TOLERANCE),
                           ("median_efficiency", MEDIAN_TOLERANCE),
                           ("p10_efficiency", P10_TOLERANCE)):
        floor = prod_figures[key] - tolerance
        ok = new_figures[key] >= floor - FLOAT_SLACK
        checks.append((ok, f"{key} {new_figures[key]:.4f} {'>=' if ok else '<'} production "
                           f"{prod_figures[key]:.4f} - {tolerance} = {floor:.4f}"))
    losses = both[new < (1 - MAX_PROBLEM_LOSS) * prod - FLOAT_SLACK]
    worst = ", ".join(f"{r.dims_key}: {r.efficiency_candidate:.3f} vs {r.efficiency_production:.3f}"
                      for r in losses.head(3).itertuples())
    checks.append((losses.empty, f"{len(losses)} problem(s) lose more than "
                                 f"{MAX_PROBLEM_LOSS:.0%} against production"
                                 + (f" ({worst})" if worst else "")))
    promote = all(ok for ok, _ in checks)
    # a promotion states every check it passed; a refusal only the ones that failed
    shown = [text for ok, text in checks if promote or not ok]
    reason = ("promoted: " if promote else "not promoted: ") + "; ".join(shown) + \
        f" (same holdout, {len(both)} problems)"
    details = {"n_problems": int(len(both)), "production": prod_figures,
               "candidate": new_figures, "problems_losing": int(len(losses))}
    return promote, reason, details


def make_gate(baseline: Baseline, candidate: pd.DataFrame):
    """A registry gate: the same-holdout comparison when production could be scored, else
    the default gate on stored metrics with the reason saying why."""
    def gate(production_metrics, new_metrics):
        if baseline.per_problem is None:
            promote, reason = registry.default_gate(production_metrics, new_metrics)
            if baseline.version is not None:
                reason += f" [stored metrics: {baseline.why_not}]"
            return promote, reason
        promote, reason, _ = compare(baseline.per_problem, candidate)
        notes = "; ".join(baseline.notes)
        return promote, reason + (f" [{notes}]" if notes else "") + \
            f" [production version {baseline.version}]"
    return gate


def read_candidate_table(per_problem_path: str | Path) -> pd.DataFrame:
    """The new model's per-problem efficiencies from the evaluate stage's per_problem.parquet."""
    table = pd.read_parquet(per_problem_path)
    return table[["dims_key", "chosen_kernel", "efficiency"]]
