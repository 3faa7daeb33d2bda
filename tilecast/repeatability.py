"""Repeatability: how well one run's measurements agree with another's run of the same config.

Every model figure is capped by its labels: a model cannot be judged better than one run's
own winners score on another run. For two converted datasets A and B (same family, same
problems, e.g. two nights on one machine), each taken in turn as the truth, the other's
winners (tuning policy: practical ties broken by binary size) are scored with the
evaluation's definitions: efficiency = truth's best TFLOP/s / truth's TFLOP/s of the pick;
winner agreement = the pick is in the truth's practical-tie set; "within 2 %" = the pick runs
within 2 % of the truth's best. Figures per problem set and per runtime bin of the truth's
best kernel, since microsecond problems are where timings agree least.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from . import dataset

# runtime bins of the truth's best kernel (microseconds): [low, high)
RUNTIME_BINS_US = ((0.0, 20.0, "< 20 us"), (20.0, 1000.0, "20 us - 1 ms"),
                   (1000.0, float("inf"), "> 1 ms"))
WITHIN_PCT = 2.0


@dataclass(frozen=True)
class Agreement:
    """One direction's figures over some problems."""
    n_problems: int
    mean: float
    p10: float
    min: float
    winner_in_tie: float     # share of problems whose pick is in the truth's tie set
    within_2pct: float       # share whose pick runs within 2 % of the truth's best

    def line(self) -> str:
        if not self.n_problems:
            return "   0 problems"
        return (f"{self.n_problems:4d} problems  mean {self.mean:.4f}  P10 {self.p10:.4f}  "
                f"min {self.min:.4f}  winner in tie {self.winner_in_tie:.3f}  "
                f"within {WITHIN_PCT:g} % {self.within_2pct:.3f}")


def per_problem(pick_run: pd.DataFrame, truth_run: pd.DataFrame,
                tie_threshold_pct: float = 1.0) -> pd.DataFrame:
    """Per problem both runs measured: the pick run's winner scored on the truth run."""
    picks = dataset.winners(pick_run, tie_threshold_pct)
    truths = dataset.winners(truth_run, tie_threshold_pct)
    speed = dataset.valid(truth_run).set_index(["dims_key", "kernel"])["tflops"]
    problem_set = truth_run.drop_duplicates("dims_key").set_index("dims_key")["problem_set"]
    rows = []
    for key in sorted(set(picks) & set(truths)):
        truth = truths[key]
        pick = picks[key].kernel
        measured = speed.get((key, pick))
        efficiency = 0.0 if measured is None or not np.isfinite(measured) else measured / truth.best_tflops
        rows.append({"dims_key": key, "problem_set": problem_set.get(key, ""),
                     "pick": pick, "truth_winner": truth.kernel, "efficiency": efficiency,
                     "in_tie": pick in truth.tie_set,
                     "within": efficiency >= 1 - WITHIN_PCT / 100,
                     "best_us": truth.median_s * 1e6})
    return pd.DataFrame(rows, columns=["dims_key", "problem_set", "pick", "truth_winner",
                                       "efficiency", "in_tie", "within", "best_us"])


def summarize(table: pd.DataFrame) -> Agreement:
    """The figures of a per_problem table (or a slice of it)."""
    if table.empty:
        return Agreement(0, float("nan"), float("nan"), float("nan"), float("nan"), float("nan"))
    eff = table["efficiency"].to_numpy(dtype=float)
    return Agreement(len(table), float(eff.mean()), float(np.percentile(eff, 10)),
                     float(eff.min()), float(table["in_tie"].mean()), float(table["within"].mean()))


def final_rows(path: str | Path) -> pd.DataFrame:
    """A run's final table (finalists pooled) from its parquet file or its workdir + family."""
    return dataset.final_table(dataset.load(path))


def dataset_path(run: str | Path, family: str) -> Path:
    """`run` itself if it is a file, else the workdir's converted dataset of `family`."""
    run = Path(run)
    return run if run.is_file() else run / "data" / f"{family}.parquet"


def report(run_a: str | Path, run_b: str | Path, family: str = "gemm",
           tie_threshold_pct: float = 1.0) -> str:
    """The text `tilecast repeatability` prints: both directions, per problem set and bin."""
    paths = dataset_path(run_a, family), dataset_path(run_b, family)
    finals = [final_rows(p) for p in paths]
    lines = [f"repeatability of {family}: A = {paths[0]}, B = {paths[1]}"]
    for (pick, truth), label in (((0, 1), "A's winners scored on B"),
                                 ((1, 0), "B's winners scored on A")):
        table = per_problem(finals[pick], finals[truth], tie_threshold_pct)
        lines.append(f"\n{label}")
        if table.empty:
            lines.append("  no problem has a valid measurement in both runs")
            continue
        for problem_set in ["all", *sorted(set(table["problem_set"]))]:
            rows = table if problem_set == "all" else table[table["problem_set"] == problem_set]
            lines.append(f"  {problem_set:8s} {summarize(rows).line()}")
            for low, high, name in RUNTIME_BINS_US:
                binned = rows[(rows["best_us"] >= low) & (rows["best_us"] < high)]
                if len(binned):
                    lines.append(f"    {name:12s} {summarize(binned).line()}")
    return "\n".join(lines)
