"""How sure a model is of a problem it never measured: models fitted on resampled problems.

A budgeted night (tilecast.store.plan) measures new shapes where the model is least sure.
`Members.fit` fits `count` small boosted models of the family's model spec, each on a
bootstrap sample of the training problems (a problem's kernels stay together). On a shape
none of them saw, each member picks the kernel it predicts fastest; `regret` scores a shape by
how much the members' picks lose when another member judges them: the mean over ordered
pairs (a, b) of 1 - b's predicted speed of a's pick / b's best predicted speed. Members that
agree on the winner, or disagree only among kernels they all predict as fast, score near 0;
a shape where following one member's choice costs much by another's lies where the
measurements do not yet decide.

The members also predict every kernel's time on a shape (their median), which the night's
cost model reads (tilecast.store.plan).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from tilecast.core import dataset
from tilecast.stages.train import ModelSpec, featurize, row_weights, target_transform

MEMBER_ROUNDS = 300          # trees a member; enough to rank kernels, a few seconds each
MEMBER_LEARNING_RATE = 0.05


@dataclass
class Members:
    """Boosted models fitted on resampled problems, over one candidate set."""
    family: object
    engine: object
    kernels: list[str]
    boosters: list
    inverse: object

    @classmethod
    def fit(cls, family, engine, train: pd.DataFrame, spec: ModelSpec, count: int, seed: int,
            threads: int = 2, rounds: int = MEMBER_ROUNDS) -> "Members":
        """`count` members on the valid rows of `train` (a final table), each on a bootstrap
        sample of its problems."""
        import lightgbm as lgb   # slow to import; only fitting needs it

        rows = dataset.valid(train).reset_index(drop=True)
        problems = rows["dims_key"].unique()
        if len(problems) < 2:
            raise ValueError(f"members need at least 2 measured problems, got {len(problems)}")
        features = featurize(family, engine, rows)
        forward, inverse = target_transform(spec.target)
        y = forward(features.y_tflops)
        weights = row_weights(features.y_tflops, features.groups, spec.top_weight)
        params = {**spec.lgb_params(threads), "learning_rate": MEMBER_LEARNING_RATE}
        by_problem = pd.Series(np.arange(len(rows))).groupby(features.groups).apply(np.asarray)
        rng = np.random.default_rng(seed)
        boosters = []
        for member in range(count):
            drawn = rng.choice(problems, size=len(problems), replace=True)
            index = np.concatenate([by_problem[key] for key in drawn])
            data = lgb.Dataset(features.X[index], y[index], weight=weights[index],
                               feature_name=engine.feature_names())
            boosters.append(lgb.train({**params, "seed": seed + member}, data,
                                      num_boost_round=rounds))
        return cls(family=family, engine=engine, kernels=sorted(set(rows["kernel"])),
                   boosters=boosters, inverse=inverse)

    def predict(self, problems: Sequence) -> list[tuple[list[str], np.ndarray]]:
        """For each problem: (its applicable kernels, members x kernels predicted TFLOP/s)."""
        configs = {name: self.family.parse_name(name) for name in self.kernels}
        kernel_matrix = self.engine.kernel_features(list(configs.values()))
        blocks, names, sizes = [], [], []
        for problem in problems:
            mask = np.array([self.family.applicable(c, problem) for c in configs.values()])
            kernels = [n for n, keep in zip(configs, mask) if keep]
            names.append(kernels)
            sizes.append(len(kernels))
            if kernels:
                blocks.append(self.engine.combine(problem, self.engine.problem_features(problem),
                                                  kernel_matrix[mask],
                                                  [configs[n] for n in kernels]))
        X = np.vstack(blocks) if blocks else np.empty((0, len(self.engine.feature_names())))
        predicted = np.vstack([self.inverse(b.predict(X)) for b in self.boosters])
        result, start = [], 0
        for kernels, size in zip(names, sizes):
            result.append((kernels, predicted[:, start:start + size]))
            start += size
        return result


def regret(predicted: np.ndarray) -> float:
    """Mean over ordered member pairs (a, b), a != b, of 1 - b's predicted speed of a's pick /
    b's best predicted speed (members x kernels of predicted TFLOP/s); 0 for no kernels."""
    if predicted.size == 0:
        return 0.0
    count = predicted.shape[0]
    picks = predicted.argmax(axis=1)
    best = predicted.max(axis=1)
    # judged[b, a]: b's predicted speed of a's pick
    judged = predicted[:, picks]
    loss = 1.0 - judged / best[:, None]
    return float((loss.sum() - np.trace(loss)) / (count * (count - 1)))


def predicted_seconds(family, problem, predicted: np.ndarray) -> np.ndarray:
    """Each kernel's predicted time on `problem`: its work over the members' median speed."""
    tflops = np.median(predicted, axis=0)
    return family.flops(problem) / np.maximum(tflops, 1e-9) / 1e12
