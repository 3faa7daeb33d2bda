"""Evaluate a model on held-out problems against the measured oracle (DESIGN.md, Definitions).

Per holdout problem the model scores every candidate kernel applicable to it and picks the
highest predicted TFLOP/s. Efficiency = measured TFLOP/s of the pick / best measured TFLOP/s
among the problem's valid kernels; a pick with no valid measurement scores 0.0, never skipped.
The measured best is the tuning policy's winner (dataset.winners, practical ties). The static
best is the one kernel with the best mean efficiency on the training problems.

Also here: `peer_ratios`, how the best candidate compares with the peer library.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from tilecast.core import dataset, stats

TOP_K = (1, 5)


@dataclass(frozen=True)
class Evaluation:
    """Summary metrics (keys fixed, see `evaluate`) and the per-problem table."""
    metrics: dict
    per_problem: pd.DataFrame


def _measured_table(final: pd.DataFrame) -> pd.DataFrame:
    """Valid TFLOP/s as a (dims_key x kernel) table; NaN = no valid measurement."""
    return dataset.valid(final).pivot_table(index="dims_key", columns="kernel",
                                            values="tflops", aggfunc="max")


def static_best(train_final: pd.DataFrame, candidates: list[str]) -> tuple[str, float]:
    """(kernel, mean efficiency) of the candidate with the best mean efficiency over the
    training problems; a missing measurement counts as 0. Ties go to the smaller name."""
    measured = _measured_table(train_final)
    if measured.empty:
        raise ValueError("no valid training measurements: cannot pick a static best kernel")
    efficiency = measured.div(measured.max(axis=1), axis=0)
    means = efficiency.reindex(columns=sorted(set(candidates))).fillna(0.0).mean(axis=0)
    best = max(means.index, key=means.get)  # max keeps the first, i.e. smallest, name
    return str(best), float(means[best])


def evaluate(family, engine, predictor, holdout_final: pd.DataFrame, train_final: pd.DataFrame,
             candidates: list[str], tie_threshold_pct: float) -> Evaluation:
    """Model vs oracle and static best on the holdout problems (see the module docstring).

    Holdout problems without any valid measurement have no best and are left out. Metrics:
    n_problems, mean/median/p10/min_efficiency, top1, top5 (fractions of problems whose
    winner is among the k highest predictions), top1_tie (pick in the winner's tie set),
    static_best {kernel, mean_efficiency (holdout)}, margin_over_static_best (model mean
    efficiency minus the static best's, in efficiency units).
    """
    overlap = sorted(set(holdout_final["dims_key"]) & set(train_final["dims_key"]))
    if overlap:
        raise ValueError(f"holdout problem {overlap[0]!r} (and {len(overlap) - 1} more) also "
                         "appears in the training data; holdouts must be disjoint by dims_key")
    if not candidates:
        raise ValueError("no candidate kernels to evaluate; pass the family's candidate names")
    configs = {name: family.parse_name(name) for name in sorted(set(candidates))}
    kernel_matrix = engine.kernel_features(list(configs.values()))
    static_kernel, _ = static_best(train_final, list(configs))

    winners = dataset.winners(holdout_final, tie_threshold_pct)
    if not winners:
        raise ValueError("no holdout problem has a valid measurement; nothing to evaluate")
    measured = _measured_table(holdout_final)
    first_rows = holdout_final.drop_duplicates("dims_key").set_index("dims_key")
    rows = []
    for dims_key, winner in winners.items():
        fields = {f: first_rows.at[dims_key, f] for f in family.problem_fields}
        problem = family.problem(fields)
        ranking = _ranking(family, engine, predictor, problem, dims_key, configs, kernel_matrix)
        problem_tflops = measured.loc[dims_key]
        chosen = ranking[0]
        chosen_tflops = _tflops(problem_tflops, chosen)
        rank = ranking.index(winner.kernel) + 1 if winner.kernel in ranking else pd.NA
        rows.append({
            "dims_key": dims_key, **fields, "chosen_kernel": chosen,
            "chosen_tflops": chosen_tflops,
            "best_kernel": winner.kernel, "best_tflops": winner.best_tflops,
            "efficiency": chosen_tflops / winner.best_tflops,
            "static_best_efficiency": _tflops(problem_tflops, static_kernel) / winner.best_tflops,
            "winner_rank": rank, "_top1_tie": chosen in winner.tie_set})
    table = pd.DataFrame(rows)
    table["winner_rank"] = table["winner_rank"].astype("Int64")
    metrics = _metrics(table, static_kernel)
    return Evaluation(metrics=metrics, per_problem=table.drop(columns="_top1_tie"))


def _ranking(family, engine, predictor, problem, dims_key: str, configs: dict,
             kernel_matrix: np.ndarray) -> list[str]:
    """Applicable candidate names, highest predicted TFLOP/s first (equal predictions in
    name order, so results are stable)."""
    mask = np.array([family.applicable(cfg, problem) for cfg in configs.values()])
    if not mask.any():
        raise ValueError(f"no candidate kernel is applicable to holdout problem {dims_key!r}; "
                         "check the candidate list matches the problem set")
    kernels = [name for name, keep in zip(configs, mask) if keep]
    X = engine.combine(problem, engine.problem_features(problem), kernel_matrix[mask],
                       [configs[name] for name in kernels])
    predicted = np.asarray(predictor.predict_tflops(X), dtype=np.float64)
    if predicted.shape != (len(kernels),) or not np.all(np.isfinite(predicted)):
        raise ValueError(f"predictor returned {predicted!r} for {len(kernels)} kernels on "
                         f"{dims_key!r}; expected one finite prediction per kernel")
    order = sorted(range(len(kernels)), key=lambda i: (-predicted[i], kernels[i]))
    return [kernels[i] for i in order]


def _tflops(problem_tflops: pd.Series, kernel: str) -> float:
    """Measured TFLOP/s of `kernel` on one problem; 0.0 when it has no valid measurement."""
    value = problem_tflops.get(kernel, np.nan)
    return 0.0 if pd.isna(value) else float(value)


def _metrics(table: pd.DataFrame, static_kernel: str) -> dict:
    eff = table["efficiency"].to_numpy(dtype=np.float64)
    ranks = table["winner_rank"]
    top = {f"top{k}": float(((ranks <= k).fillna(False)).mean()) for k in TOP_K}
    static_mean = float(table["static_best_efficiency"].mean())
    mean = float(eff.mean())
    return {"n_problems": int(len(table)), "mean_efficiency": mean,
            "median_efficiency": float(stats.median(eff)),
            "p10_efficiency": float(np.percentile(eff, 10)), "min_efficiency": float(eff.min()),
            **top, "top1_tie": float(table["_top1_tie"].mean()),
            "static_best": {"kernel": static_kernel, "mean_efficiency": static_mean},
            "margin_over_static_best": mean - static_mean}


def slice_metrics(family, per_problem: pd.DataFrame) -> dict:
    """Per report slice (family.slices of each problem): n_problems, mean and P10 efficiency,
    top-1, and the static best's mean efficiency on the same problems."""
    tags = [family.slices(family.problem({f: row[f] for f in family.problem_fields}))
            for _, row in per_problem.iterrows()]
    result = {}
    for name in sorted({t for problem_tags in tags for t in problem_tags}):
        rows = per_problem[[name in problem_tags for problem_tags in tags]]
        eff = rows["efficiency"].to_numpy(dtype=np.float64)
        result[name] = {"n_problems": int(len(rows)), "mean_efficiency": float(eff.mean()),
                        "p10_efficiency": float(np.percentile(eff, 10)),
                        "top1": float((rows["winner_rank"] == 1).fillna(False).mean()),
                        "static_best_mean_efficiency": float(rows["static_best_efficiency"].mean())}
    return result


def peer_ratios(records: pd.DataFrame, family) -> dict:
    """Best candidate TFLOP/s over peer TFLOP/s, per problem and per problem_set.

    Peer rows: role == "peer", status ok, phase screen, positive TFLOP/s (the latest per
    problem). Candidates go through dataset.final_table/valid. Returns {} without peer rows,
    else {"problem_sets": {set: {"n_problems", "geomean_ratio", "min_ratio", "max_ratio"}},
    "per_problem": DataFrame}. Problems lacking either side are left out.
    """
    peer = records[(records["role"] == "peer") & (records["status"] == "ok")
                   & (records["phase"] == "screen")]
    peer = peer[np.isfinite(peer["tflops"].astype(float)) & (peer["tflops"] > 0)]
    if peer.empty:
        return {}
    peer = (peer.sort_values("time", ascending=False).drop_duplicates("dims_key")
            [["dims_key", "kernel", "tflops"]]
            .rename(columns={"kernel": "peer", "tflops": "peer_tflops"}))
    valid = dataset.valid(dataset.final_table(records))
    best = valid.loc[valid.groupby("dims_key")["tflops"].idxmax(),
                     ["dims_key", "problem_set", *family.problem_fields, "kernel", "tflops"]]
    best = best.rename(columns={"kernel": "best_kernel", "tflops": "best_tflops"})
    table = best.merge(peer, on="dims_key", how="inner").sort_values(["problem_set", "dims_key"])
    table["ratio"] = table["best_tflops"] / table["peer_tflops"]
    table = table.reset_index(drop=True)
    summary = {}
    for problem_set, group in table.groupby("problem_set", sort=True):
        summary[str(problem_set)] = {
            "n_problems": int(len(group)), "geomean_ratio": stats.geometric_mean(group["ratio"]),
            "min_ratio": float(group["ratio"].min()), "max_ratio": float(group["ratio"].max())}
    return {"problem_sets": summary, "per_problem": table}


def shortlist_metrics(family, dispatchers: dict, per_problem: pd.DataFrame,
                      holdout_final: pd.DataFrame) -> dict:
    """What choosing through a shortlist costs on the held-out measurements: per shortlist
    size (`dispatchers`: size -> a Dispatcher with that shortlist), the mean, P10 and min
    efficiency of its picks, the share of problems it picks what the whole forest picks
    (`per_problem`'s chosen_kernel), and the forest's own mean for comparison."""
    measured = _measured_table(holdout_final)
    forest = per_problem["efficiency"].to_numpy(dtype=np.float64)
    result = {}
    for size, dispatcher in sorted(dispatchers.items()):
        efficiency, same = [], []
        for _, row in per_problem.iterrows():
            problem = family.problem({f: row[f] for f in family.problem_fields})
            chosen = dispatcher.select(problem)
            efficiency.append(_tflops(measured.loc[row["dims_key"]], chosen) / row["best_tflops"])
            same.append(chosen == row["chosen_kernel"])
        eff = np.array(efficiency)
        result[str(size)] = {"mean_efficiency": float(eff.mean()),
                             "p10_efficiency": float(np.percentile(eff, 10)),
                             "min_efficiency": float(eff.min()),
                             "same_as_forest": float(np.mean(same))}
    return {"forest_mean_efficiency": float(forest.mean()), "sizes": result}
