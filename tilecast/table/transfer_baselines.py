"""What a user would do without a table model, scored like the model in `transfer`.

Each baseline sees only a fold's training rows (never the held-out device's or problems'
measurements) and answers one configuration per test problem, except `random`, whose
expected efficiency is computed exactly from the held-out measurements (it needs no
training: a uniformly random configuration among those that ran there, which is generous to
it, since a user cannot know which those are). Efficiencies here are best time / time.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from tilecast.table.dataset import TableSchema

#: A configuration within TIE_PCT percent of the best time is in the practical tie with it
#: (tune.tie_set's rule): efficiency at or above TIE_EFFICIENCY.
TIE_PCT = 1.0
TIE_EFFICIENCY = 1.0 / (1.0 + TIE_PCT / 100.0) - 1e-12


def efficiency_table(ok_rows: pd.DataFrame, index: Sequence[str] = ("dims_key",)) -> pd.DataFrame:
    """Efficiency of each configuration (columns) on each problem (rows, keyed by `index`):
    the problem's best ok time / the configuration's ok time; NaN where it has no ok time."""
    times = ok_rows.pivot_table(index=list(index), columns="kernel", values="median_s",
                                aggfunc="min")
    return times.rdiv(times.min(axis=1), axis=0)


def average_ranking(train_ok: pd.DataFrame, pool: Sequence[str]) -> list[str]:
    """The configurations of `pool` by mean efficiency over the training rows' (device,
    problem) pairs, best first, a pair where one has no ok time counting 0; ties go to the
    smaller key."""
    means = (efficiency_table(train_ok, ("device", "dims_key"))
             .reindex(columns=sorted(pool)).fillna(0.0).mean(axis=0))
    return sorted(means.index, key=lambda k: (-means[k], k))


def best_on_average(train_ok: pd.DataFrame, pool: Sequence[str]) -> str:
    """The first of average_ranking."""
    return str(average_ranking(train_ok, pool)[0])


def first_offered(ranking: Sequence[str], offered: set) -> str | None:
    """The first configuration of `ranking` among `offered` (None: none is)."""
    return next((k for k in ranking if k in offered), None)


def nearest_device(held_out: str, training: Sequence[str], devices) -> str:
    """The training device least unlike `held_out` (devices.distance; ties by name)."""
    return min(sorted(training), key=lambda name: devices.distance(held_out, name))


def most_similar_device_picks(train_ok: pd.DataFrame, nearest: str, problems: Sequence[str],
                              pool: Sequence[str],
                              offered: Mapping[str, set] | None = None) -> dict[str, str]:
    """Per test problem, the fastest ok configuration of `pool` measured on `nearest` for that
    problem among those the problem was offered (`offered`, by dims_key; None: all of
    `pool`); else `nearest`'s best on average among them."""
    rows = train_ok[(train_ok["device"] == nearest) & train_ok["kernel"].isin(list(pool))]
    by_speed = rows.sort_values(["median_s", "kernel"]).groupby("dims_key")["kernel"].agg(list)
    ranking = average_ranking(rows, pool)
    picks = {}
    for key in problems:
        allowed = set(pool) if offered is None else offered[key]
        picks[key] = str(first_offered(by_speed.get(key, []), allowed)
                         or first_offered(ranking, allowed))
    return picks


def random_expectations(efficiency: pd.DataFrame, ks: Sequence[int],
                        tie: float) -> pd.DataFrame:
    """Per problem (rows of `efficiency`): the expected efficiency of a uniformly random ok
    configuration (`random`), the chance it is within the practical tie (`random_top1`), and
    the expected best of k distinct random ok configurations (`random_best_of_<k>`, exact:
    the i-th smallest of n is the best of k with probability C(i-1, k-1) / C(n, k))."""
    records = []
    for key, row in efficiency.iterrows():
        values = np.sort(row.dropna().to_numpy(dtype=np.float64))
        count = len(values)
        record = {"dims_key": key, "random": float(values.mean()),
                  "random_top1": float(np.mean(values >= tie))}
        for k in ks:
            if k >= count:
                record[f"random_best_of_{k}"] = float(values[-1])
                continue
            ranks = np.arange(k, count + 1)           # 1-based ranks that can be the best
            log_weights = (np.array([math.lgamma(r) - math.lgamma(k) - math.lgamma(r - k + 1)
                                     for r in ranks])
                           - (math.lgamma(count + 1) - math.lgamma(k + 1)
                              - math.lgamma(count - k + 1)))
            record[f"random_best_of_{k}"] = float(np.dot(np.exp(log_weights), values[k - 1:]))
        records.append(record)
    return pd.DataFrame(records).set_index("dims_key")


#: Below this many training rows the plain baseline trains on one thread: more cost more than
#: they give, and on a busy machine OpenMP's waiting threads make it ten times slower.
SMALL_ROWS = 20_000


def _plain_columns(frame: pd.DataFrame, schema: TableSchema, categories: dict) -> pd.DataFrame:
    """Raw problem and configuration columns plus the device id, categorical where the
    schema says so (with the training categories: an unseen device is a missing value)."""
    def categorical(values: pd.Series, known: list[str]) -> pd.Categorical:
        text = values.astype(str)
        return pd.Categorical(text.where(text.isin(known)), categories=known)

    columns = {}
    for column in schema.problem + schema.config:
        values = frame[column.name]
        columns[column.name] = (categorical(values, categories[column.name])
                                if column.kind == "categorical" else values.astype(float))
    columns["device"] = categorical(frame["device"], categories["device"])
    return pd.DataFrame(columns, index=frame.index)


def plain_lightgbm_picks(train_ok: pd.DataFrame, schema: TableSchema, grid: pd.DataFrame, *,
                         rounds: int, threads: int | None, seed: int) -> dict[str, str]:
    """The reference a first attempt gives: LightGBM on the raw problem, configuration and
    device-id columns predicting log time (no device features, no per-problem relative
    target), trained on the training rows; per problem of `grid` (test problem x offered
    candidate rows with the held-out device), the configuration with the lowest predicted
    time."""
    import lightgbm

    categorical = [c.name for c in schema.problem + schema.config if c.kind == "categorical"]
    categories = {name: sorted(train_ok[name].astype(str).unique()) for name in categorical}
    categories["device"] = sorted(train_ok["device"].unique())
    features = _plain_columns(train_ok, schema, categories)
    params = {"objective": "regression", "learning_rate": 0.05, "num_leaves": 31,
              "min_data_in_leaf": 5, "verbose": -1, "seed": seed, "deterministic": True,
              "num_threads": threads or (1 if len(train_ok) < SMALL_ROWS else 0)}
    booster = lightgbm.train(params, lightgbm.Dataset(features, np.log(train_ok["median_s"]),
                                                      categorical_feature=categorical
                                                      + ["device"]),
                             num_boost_round=rounds)
    predicted = booster.predict(_plain_columns(grid, schema, categories))
    ranked = grid.assign(predicted=predicted).sort_values(["dims_key", "predicted", "kernel"])
    return ranked.drop_duplicates("dims_key").set_index("dims_key")["kernel"].to_dict()
