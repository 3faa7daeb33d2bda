"""How well one night's measurements predict another's: the ceiling any model is judged under.

    python benchmarks/measurement_repeatability.py W1/data/gemm.parquet W2/data/gemm.parquet [W3/...]

Each dataset is one run of the same config (same problems, same candidate pool) on the same
machine. For every dataset B taken as the truth, the ranking of the other runs (mean of their
log TFLOP/s per kernel; one run alone when two are given) plays the model's part and is
scored with the evaluation's own definitions: efficiency of its pick against B's best
measured, top-1 / top-5 against B's tuning winner (practical ties, dataset.winners). A
perfect model of the machine cannot be judged better than this on average: the truth side
carries its own noise. Also printed: the same figures per runtime bin of the best kernel,
since tiny problems (microseconds) are where timings agree least. Figures, not a test.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.core import dataset  # noqa: E402

RUNTIME_BINS_US = (0, 20, 100, 500, float("inf"))


def _tables(path: str, tie_threshold_pct: float) -> dict:
    final = dataset.valid(dataset.final_table(dataset.load(path)))
    result = {}
    for problem_set, rows in final.groupby("problem_set"):
        result[problem_set] = {
            "tflops": rows.pivot_table(index="dims_key", columns="kernel", values="tflops"),
            "best_s": rows.groupby("dims_key")["median_s"].min(),
            "winners": dataset.winners(rows, tie_threshold_pct)}
    return result


def score(ranking_log_tflops: pd.DataFrame, truth: dict) -> pd.DataFrame:
    """Per problem: efficiency of the ranking's pick on the truth, and the truth winner's
    rank among the ranking's kernels (kernels measured in both only)."""
    rows = []
    for dims_key, predicted in ranking_log_tflops.iterrows():
        measured = truth["tflops"].loc[dims_key].dropna()
        order = predicted.reindex(measured.index).dropna().sort_values(ascending=False)
        if order.empty or dims_key not in truth["winners"]:
            continue
        winner = truth["winners"][dims_key].kernel
        ranked = list(order.index)
        rows.append({"dims_key": dims_key, "efficiency": measured[ranked[0]] / measured.max(),
                     "winner_rank": ranked.index(winner) + 1 if winner in ranked else np.inf,
                     "best_us": truth["best_s"][dims_key] * 1e6})
    return pd.DataFrame(rows)


def summary(table: pd.DataFrame) -> str:
    eff = table["efficiency"].to_numpy()
    return (f"{len(table):4d} problems  mean {eff.mean():.4f}  P10 {np.percentile(eff, 10):.4f}  "
            f"top-1 {(table['winner_rank'] <= 1).mean():.3f}  "
            f"top-5 {(table['winner_rank'] <= 5).mean():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("datasets", nargs="+", help="converted parquet files of repeated runs")
    parser.add_argument("--tie-threshold-pct", type=float, default=1.0)
    args = parser.parse_args()
    if len(args.datasets) < 2:
        parser.error("give at least two datasets of the same config")
    runs = [_tables(path, args.tie_threshold_pct) for path in args.datasets]
    sets = sorted(set.intersection(*(set(run) for run in runs)))
    for problem_set in sets:
        keys = sorted(set.intersection(*(set(run[problem_set]["tflops"].index) for run in runs)))
        print(f"\n## problem set {problem_set!r}: {len(keys)} problems in every run")
        for truth_index, truth_path in enumerate(args.datasets):
            others = [np.log(run[problem_set]["tflops"].loc[keys])
                      for i, run in enumerate(runs) if i != truth_index]
            ranking = sum(others) / len(others)
            table = score(ranking, runs[truth_index][problem_set])
            print(f"truth {truth_path} ranked by the mean of {len(others)} other run(s): "
                  f"{summary(table)}")
            bins = pd.cut(table["best_us"], RUNTIME_BINS_US)
            for interval, rows in table.groupby(bins, observed=True):
                print(f"    best kernel {interval} us: {summary(rows)}")


if __name__ == "__main__":
    main()
