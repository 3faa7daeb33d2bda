"""Replay: compare how nights choose new shapes, over a store, without measuring anything.

A replay treats the training shapes a store holds for one hardware class as the shapes a
night could measure, and their labels pooled over the store's nights as what measuring them
would give (Kernel Tuner's simulation mode does this for search strategies). Every policy
starts from the same `start` shapes drawn at random; then, `steps` times, it picks `step`
more shapes from those it has not "measured", and a model is trained on what it has and
scored on the store's held-out shapes (the config's held-out set, pooled labels). Each
policy runs with several seeds; the figures are the medians over seeds. The policies:

- `active`, what a budgeted night does (tilecast.store.plan): `workload_share` of each step
  from the stored shapes that are in the family's workload file, the rest from the others,
  each part ranked by the members' regret (tilecast.store.plan.rank_new_shapes);
- `regret`, the members' regret over every stored shape, the workload file ignored;
- `random`, a random order over every stored shape: a night of random shapes.

Neighbours of a shape picked in the same step are passed over (tilecast.store.plan.Spread).

The model a replay trains is the config's model spec fitted at a fixed `rounds` (no
cross-validation, to keep a replay to minutes); the same for every policy.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from tilecast.core import dataset
from tilecast.stages.evaluate import evaluate
from tilecast.stages.train import (ModelSpec, Predictor, featurize, row_weights,
                                   target_transform)
from tilecast.store import labels
from tilecast.store.members import Members
from tilecast.store.plan import Spread, rank_new_shapes

log = logging.getLogger("tilecast.workflows.replay")

POLICIES = ("active", "regret", "random")
FIGURES = ("mean_efficiency", "p10_efficiency", "top1", "top5")


@dataclass(frozen=True)
class Point:
    """One policy's model after one step of one seed's replay."""
    policy: str
    seed: int
    step: int
    problems: int
    measurements: int
    mean_efficiency: float
    p10_efficiency: float
    top1: float
    top5: float


def fit_predictor(family, engine, train: pd.DataFrame, spec: ModelSpec, rounds: int,
                  threads: int) -> Predictor:
    """The config's model spec fitted on the valid rows of `train` at `rounds` trees."""
    import lightgbm as lgb   # slow to import; only fitting needs it

    rows = dataset.valid(train).reset_index(drop=True)
    features = featurize(family, engine, rows)
    forward, _ = target_transform(spec.target)
    data = lgb.Dataset(features.X, forward(features.y_tflops),
                       weight=row_weights(features.y_tflops, features.groups, spec.top_weight),
                       feature_name=engine.feature_names())
    booster = lgb.train(spec.lgb_params(threads), data, num_boost_round=rounds)
    return Predictor(booster, {"feature_names": engine.feature_names(),
                               "target_transform": spec.target})


def shape_values(family, final: pd.DataFrame) -> dict[str, dict]:
    """dims_key -> the problem's field values, for every problem of a final table."""
    first = final.drop_duplicates("dims_key")
    return {row["dims_key"]: {f: (row[f].item() if isinstance(row[f], np.generic) else row[f])
                              for f in family.problem_fields}
            for _, row in first.iterrows()}


def replay(family, engine, stored: pd.DataFrame, holdout: set[str], spec: ModelSpec, *,
           tie_threshold_pct: float, kernels: Sequence[str] | None = None,
           workload: set[str] = frozenset(), workload_share: float = 0.5,
           policies: Sequence[str] = POLICIES, start: int = 40, step: int = 20, steps: int = 8,
           seeds: Sequence[int] = (0, 1, 2), members: int = 5, rounds: int = 500,
           threads: int = 2, progress=None) -> list[Point]:
    """Every policy's points over `seeds` (see the module docstring). `stored`: one class's
    records of the family (tilecast.store.nights.read_frame); `holdout`: the dims_keys it
    is judged on; `kernels`: the candidates (default: every kernel the store measured);
    `workload`: the dims_keys of the family's workload file."""
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown replay policy {unknown[0]!r}; valid: {', '.join(POLICIES)}")
    final = labels.pooled_final(stored if kernels is None
                                else stored[stored["kernel"].isin(list(kernels))])
    valid = dataset.valid(final)
    candidates = sorted(set(valid["kernel"]))
    held = final[final["dims_key"].isin(holdout)]
    pool = sorted(set(valid["dims_key"]) - set(holdout))
    if held.empty:
        raise ValueError("the store holds none of the held-out shapes; nothing to score on")
    need = start + step * steps
    if len(pool) < need:
        raise ValueError(f"the store holds {len(pool)} training shapes; start {start} + "
                         f"{steps} steps of {step} need {need}")
    values = shape_values(family, final)
    by_key = {key: group for key, group in final.groupby("dims_key")}
    points = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        first = list(rng.choice(pool, size=start, replace=False))
        for policy in policies:
            chosen = list(first)
            policy_rng = np.random.default_rng(seed + 1)
            for number in range(steps + 1):
                train = pd.concat([by_key[k] for k in chosen])
                predictor = fit_predictor(family, engine, train, spec, rounds, threads)
                metrics = evaluate(family, engine, predictor, held, train, candidates,
                                   tie_threshold_pct).metrics
                point = Point(policy=policy, seed=int(seed), step=number, problems=len(chosen),
                              measurements=int(len(dataset.valid(train))),
                              **{k: float(metrics[k]) for k in FIGURES})
                points.append(point)
                if progress:
                    progress(point)
                if number == steps:
                    break
                taken = set(chosen)
                model = (Members.fit(family, engine, train, spec, members, seed + number,
                                     threads) if policy != "random" else None)
                order = "random" if policy == "random" else "active"

                def ranked(keys: Sequence[str]) -> list[dict]:
                    return [shape for shape, _, _ in
                            rank_new_shapes(family, [values[k] for k in keys], model, order,
                                            policy_rng)]

                left = [k for k in pool if k not in taken]
                if policy == "active":
                    mine = [k for k in left if k in workload]
                    spread, count = Spread(), min(len(mine), round(step * workload_share))
                    chosen += pick(family, ranked(mine), count, spread)
                    taken = set(chosen)
                    chosen += pick(family, ranked([k for k in left if k not in taken]),
                                   step - count, spread)
                else:
                    chosen += pick(family, ranked(left), step)
    return points


def pick(family, ranked: Sequence[dict], count: int, spread: Spread | None = None) -> list[str]:
    """The dims_keys of the first `count` shapes of `ranked` that are no neighbour of one
    picked before them (tilecast.store.plan.Spread; `spread`: the shapes picked before this
    call), then, when those run out, of the next best-ranked."""
    keys, spread = [], Spread() if spread is None else spread
    if count <= 0:
        return keys
    for shape in ranked:
        if len(keys) == count:
            return keys
        if not spread.near(shape):
            spread.add(shape)
            keys.append(family.dims_key(family.problem(shape)))
    for shape in ranked:
        key = family.dims_key(family.problem(shape))
        if len(keys) == count:
            break
        if key not in keys:
            keys.append(key)
    return keys


def curves(points: Sequence[Point]) -> pd.DataFrame:
    """Median over seeds of each figure, per policy and step."""
    frame = pd.DataFrame([asdict(p) for p in points])
    return (frame.groupby(["policy", "step"], sort=True)
            [["problems", "measurements", *FIGURES]].median().reset_index())


def reached(table: pd.DataFrame, policy: str = "active", baseline: str = "random",
            figure: str = "mean_efficiency") -> dict:
    """Where `policy` first reaches `baseline`'s final `figure`: {target, problems,
    share} (share of the baseline's measurements; None when it never does)."""
    base = table[table["policy"] == baseline].sort_values("step")
    mine = table[table["policy"] == policy].sort_values("step")
    target = float(base[figure].iloc[-1])
    total = float(base["measurements"].iloc[-1])
    hit = mine[mine[figure] >= target]
    if hit.empty:
        return {"target": target, "problems": None, "measurements": None, "share": None}
    row = hit.iloc[0]
    return {"target": target, "problems": int(row["problems"]),
            "measurements": int(row["measurements"]), "share": float(row["measurements"]) / total}


def report_lines(table: pd.DataFrame, policies: Sequence[str]) -> list[str]:
    """The curves side by side, and where each other policy reaches random's final mean."""
    lines = ["problems | " + " | ".join(f"{p}: mean / P10 / top-1 / top-5" for p in policies)]
    for step in sorted(set(table["step"])):
        cells, count = [], None
        for policy in policies:
            row = table[(table["policy"] == policy) & (table["step"] == step)]
            if row.empty:
                cells.append("-")
                continue
            row = row.iloc[0]
            count = int(row["problems"])
            cells.append(" / ".join(f"{row[f]:.4f}" if f.endswith("efficiency") else f"{row[f]:.3f}"
                                    for f in FIGURES))
        lines.append(f"{count} | " + " | ".join(cells))
    if "random" in policies:
        for policy in policies:
            if policy == "random":
                continue
            hit = reached(table, policy)
            share = ("never, within the replay" if hit["share"] is None else
                     f"at {hit['problems']} problems, {hit['share']:.0%} of random's "
                     "measurements")
            lines.append(f"{policy} reaches random's final mean {hit['target']:.4f}: {share}")
    return lines


def store_replay(location: str, config: str, family_name: str, *, policies: Sequence[str],
                 hardware_class: str | None, start: int, step: int, steps: int,
                 seeds: Sequence[int], rounds: int, out: str | None = None) -> list[str]:
    """`tilecast replay`: the replay of a store's class (the one named, or the only one it
    holds) under a config's candidates, model spec and held-out set, as printed lines."""
    from tilecast.core import hardware
    from tilecast.core.atomic import atomic_write_json
    from tilecast.config import ConfigError, load_config
    from tilecast.families import get_family
    from tilecast.store import nights
    from tilecast.store.store import Store
    from tilecast.workflows.repeatability import common_class

    cfg = load_config(config)
    if family_name not in cfg.families:
        raise ConfigError(f"family {family_name!r} is not in config {cfg.path}; it has: "
                          f"{', '.join(cfg.families)}")
    family, fc = get_family(family_name), cfg.families[family_name]
    store = Store(location).require()
    chosen = common_class([store], hardware_class, family_name)
    stored = nights.read_frame(store, chosen, family_name)
    holdout = {family.dims_key(family.problem(v)) for v in fc.problems["holdout"]}
    spec = ModelSpec.from_mapping({"seed": fc.seed, **fc.model})
    profile = hardware.profile(cfg.protocol.threads)
    engine = family.feature_engine(profile)
    count = len(labels.nights_in_order(stored))

    def progress(point: Point) -> None:
        log.info("replay %s seed %d: %d problems, mean %.4f, P10 %.4f, top-1 %.3f, top-5 %.3f",
                 point.policy, point.seed, point.problems, point.mean_efficiency,
                 point.p10_efficiency, point.top1, point.top5)

    workload = {family.dims_key(family.problem(v)) for v in fc.workload}
    points = replay(family, engine, stored, holdout, spec,
                    tie_threshold_pct=cfg.tie_threshold_pct, workload=workload,
                    workload_share=cfg.night.workload_share, policies=policies, start=start,
                    step=step, steps=steps, seeds=seeds, members=cfg.night.members,
                    rounds=rounds, threads=int(profile.get("threads") or 2), progress=progress)
    table = curves(points)
    if out:
        atomic_write_json(out, {"store": str(location), "hardware_class": chosen,
                                "config": str(cfg.path), "family": family_name,
                                "points": [asdict(p) for p in points]})
    held = len(holdout & set(stored["dims_key"]))
    return ([f"replay of store {location}, class {chosen}, {family_name}: {count} nights, "
             f"{stored['dims_key'].nunique() - held} training shapes, {held} held-out; "
             f"{len(seeds)} seeds, medians; {start} shapes to start, {steps} steps of {step}"]
            + report_lines(table, list(policies)))
