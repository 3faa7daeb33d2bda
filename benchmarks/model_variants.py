"""Retrain a run's model in several variants on its own measurements and score each on its
held-out problems: which target, weighting and tree size a machine's labels reward.

    python benchmarks/model_variants.py W                         # the default variants
    python benchmarks/model_variants.py W log:760 rel:760 rank:800 log:760:top_weight=4
    python benchmarks/model_variants.py W --family gemm --learning-rate 0.02

W is a run's workdir (its data/<family>.parquet). A variant is KIND:ROUNDS[:key=value...]:
KIND is `log` (log TFLOP/s, rows weighted by (t / best) ** top_weight, the shipped model's
target), `rel` (log of t / the problem's best: a per-problem relative target) or `rank`
(LambdaRank with problems as query groups, graded relevance from efficiency); the key=value
pairs are LightGBM parameters (num_leaves=63, min_data_in_leaf=20, ...) or top_weight. Each
line prints the held-out mean / P10 selection efficiency and top-1 / top-5 (the measured best
among the model's first 1 or 5). On tens of held-out problems one problem moves the mean by
several thousandths: read differences below that as noise. Figures, not a test.
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import lightgbm
import numpy as np
import pandas as pd

from tilecast.core import dataset, hardware
from tilecast.families import get_family
from tilecast.stages.train import ModelSpec, featurize, row_weights

DEFAULT_VARIANTS = ("log:760", "rel:760", "log:1500", "log:760:top_weight=4",
                    "log:760:num_leaves=63", "rank:800")
# LambdaRank's grades: efficiency 0.5 -> 0, each 2.5 % above it one grade more, 20 at the best
RANK_GRADES = 20


def _parse(variant: str) -> tuple[str, int, dict]:
    kind, rounds, *pairs = variant.split(":")
    if kind not in ("log", "rel", "rank") or not rounds.isdigit():
        raise SystemExit(f"variant {variant!r}: expected KIND:ROUNDS[:key=value...] with KIND "
                         "log, rel or rank")
    params = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        params[key] = float(value) if "." in value else int(value)
    return kind, int(rounds), params


def _fit(kind: str, rounds: int, params: dict, features, spec: ModelSpec, threads: int):
    tflops, groups = features.y_tflops, features.groups
    best = pd.Series(tflops).groupby(groups).transform("max").to_numpy()
    top_weight = params.pop("top_weight", spec.top_weight)
    lgb_params = {**spec.lgb_params(threads), **params}
    if kind in ("log", "rel"):
        target = np.log(tflops) if kind == "log" else np.log(tflops / best)
        data = lightgbm.Dataset(features.X, target,
                                weight=row_weights(tflops, groups, top_weight))
        return lightgbm.train(lgb_params, data, num_boost_round=rounds)
    grades = np.clip(np.floor((tflops / best - 0.5) * 2 * RANK_GRADES), 0, RANK_GRADES)
    order = np.argsort(groups, kind="stable")
    _, sizes = np.unique(groups[order], return_counts=True)
    lgb_params.update(objective="lambdarank", lambdarank_truncation_level=10,
                      label_gain=[2 ** (g / 4) - 1 for g in range(RANK_GRADES + 1)])
    data = lightgbm.Dataset(features.X[order], grades[order].astype(int), group=sizes)
    return lightgbm.train(lgb_params, data, num_boost_round=rounds)


def _score(pred: np.ndarray, features) -> str:
    frame = pd.DataFrame({"pred": pred, "tflops": features.y_tflops, "group": features.groups})
    effs, top1, top5 = [], [], []
    for _, rows in frame.groupby("group"):
        order = np.argsort(-rows["pred"].to_numpy())
        tflops = rows["tflops"].to_numpy()
        best = int(tflops.argmax())
        effs.append(tflops[order[0]] / tflops[best])
        top1.append(order[0] == best)
        top5.append(best in order[:5])
    effs = np.array(effs)
    return (f"mean {effs.mean():.4f}  P10 {np.percentile(effs, 10):.4f}  "
            f"top-1 {np.mean(top1):.2f}  top-5 {np.mean(top5):.2f}  ({len(effs)} problems)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("variants", nargs="*", default=DEFAULT_VARIANTS)
    parser.add_argument("--family", default="gemm")
    parser.add_argument("--learning-rate", type=float, default=0.02)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    family = get_family(args.family)
    engine = family.feature_engine(hardware.profile(threads=args.threads))
    table = dataset.valid(dataset.final_table(
        dataset.load(args.workdir / "data" / f"{args.family}.parquet")))
    train = featurize(family, engine, table[table.problem_set == "train"])
    holdout = featurize(family, engine, table[table.problem_set == "holdout"])
    spec = replace(ModelSpec(), learning_rate=args.learning_rate, top_weight=2.0)
    print(f"{args.workdir}: {len(np.unique(train.groups))} training and "
          f"{len(np.unique(holdout.groups))} held-out problems")
    for variant in args.variants:
        kind, rounds, params = _parse(variant)
        booster = _fit(kind, rounds, params, train, spec, args.threads)
        print(f"{variant:32s} held-out {_score(booster.predict(holdout.X), holdout)}", flush=True)


if __name__ == "__main__":
    main()
