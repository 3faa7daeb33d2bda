"""A night that spends its time where it learns most: what a budgeted night measures.

With a store and `night.budget_minutes`, a night no longer measures the config's fixed
problem lists. It fills its measuring budget in this order (tilecast.config.NightSettings
holds the knobs):

1. **labels to settle**, at most `remeasure_share` of the budget: held-out problems with fewer
   than `settle_nights` nights (they judge tonight's model), then contested training labels
   (the runner-up within `contested_pct` of the best and fewer than `settle_nights` nights),
   fewest nights first, then the closest contest;
2. **drift sentinels**: the family's sentinel set's first `sentinels` problems, every night,
   so that change points (tilecast.store.drift) have a series to be found in;
3. **new shapes**: the workload file's shapes not yet measured (`workload_share` of the time
   left) and exploration shapes (the config's random training entries drawn again with the
   night's seed, `explore` of them), ranked by the members' regret (tilecast.store.members;
   policy `active`) or in a seeded random order (policy `random`); a shape within a factor
   sqrt(2) on every dimension of one already chosen tonight is passed over.

Held-out shapes never enter as training shapes, from the workload file or from exploration.

**Cost.** A problem's seconds = calibration x (samples x the sum over kernels of
max(min_sample, t_k) + kernels x warmup), t_k a kernel's time: its pooled label for a shape
already measured, the members' median prediction for a new one (without members, its work
over each kernel's median TFLOP/s in the store). The calibration is the median, over the store's last three nights of the class,
of a night's measuring span (first to last record) over that formula summed over its problems
with their measured times: races, validation, process starts and batching are in it.

`replay` (tilecast.workflows.replay) ranks new shapes with the same `rank_new_shapes`, so a
policy compared in replay is the policy a night runs.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from tilecast.core import dataset
from tilecast.core.atomic import atomic_write_json
from tilecast.config import ConfigError, NightSettings, expand_problems
from tilecast.store import labels
from tilecast.store.members import Members, predicted_seconds, regret

log = logging.getLogger("tilecast.store.plan")

CALIBRATION_NIGHTS = 3     # the last nights a night's cost model is calibrated on
NEAR_LOG2 = 0.5            # shapes closer than this on every log2 dimension are neighbours
REASONS = ("held-out", "contested", "sentinel", "workload", "explore")


@dataclass(frozen=True)
class Chosen:
    """One problem of a night's plan, and why."""
    dims_key: str
    problem_set: str          # train / holdout
    reason: str               # one of REASONS
    seconds: float            # its estimated measuring time
    values: dict              # the family's problem fields
    score: float | None = None   # new shapes: the members' regret (active) or None


@dataclass
class NightPlan:
    """What one family measures tonight, in order, within its budget."""
    family: str
    policy: str
    budget_s: float
    calibration: float
    chosen: list[Chosen] = field(default_factory=list)
    considered: dict = field(default_factory=dict)   # reason -> shapes it could have taken
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return float(sum(c.seconds for c in self.chosen))

    def counts(self) -> dict[str, int]:
        return {r: sum(c.reason == r for c in self.chosen) for r in REASONS}

    def problems(self, family) -> list[tuple[str, object]]:
        """(problem_set, problem) pairs in the plan's order, as bench measures them."""
        return [(c.problem_set, family.problem(c.values)) for c in self.chosen]

    def lines(self) -> list[str]:
        counts = self.counts()
        text = [f"{self.family}: {self.policy} night, {self.budget_s / 60:g} min budget: "
                f"{len(self.chosen)} problems, estimated {self.seconds / 60:.1f} min "
                f"(calibration x{self.calibration:.2f})",
                "  " + ", ".join(f"{counts[r]} {r}" + (f" of {self.considered[r]}"
                                                      if r in self.considered else "")
                                 for r in REASONS)]
        return text + [f"  {note}" for note in self.notes]

    def to_json(self) -> dict:
        return {"family": self.family, "policy": self.policy, "budget_s": self.budget_s,
                "calibration": self.calibration, "seconds": self.seconds,
                "counts": self.counts(), "considered": self.considered, "notes": self.notes,
                "chosen": [asdict(c) for c in self.chosen]}

    @classmethod
    def from_json(cls, data: Mapping) -> "NightPlan":
        return cls(family=data["family"], policy=data["policy"], budget_s=data["budget_s"],
                   calibration=data["calibration"], chosen=[Chosen(**c) for c in data["chosen"]],
                   considered=dict(data.get("considered", {})), notes=list(data.get("notes", [])))


# -- cost ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostModel:
    """A problem's measuring seconds from its kernels' times (see the module docstring)."""
    samples: int
    min_sample_s: float
    warmup_s: float
    calibration: float = 1.0

    @classmethod
    def of(cls, protocol, calibration: float = 1.0) -> "CostModel":
        return cls(samples=int(protocol.samples), min_sample_s=protocol.min_sample_ms / 1e3,
                   warmup_s=protocol.warmup_ms / 1e3, calibration=calibration)

    def raw(self, seconds: np.ndarray) -> float:
        seconds = np.asarray(seconds, dtype=float)
        return float(self.samples * np.maximum(seconds, self.min_sample_s).sum()
                     + len(seconds) * self.warmup_s)

    def seconds(self, kernel_seconds: np.ndarray) -> float:
        return self.calibration * self.raw(kernel_seconds)

    def calibrated(self, stored: pd.DataFrame,
                   machines: Callable[[str], int] | None = None) -> "CostModel":
        """This model with its calibration read from the store's last nights (unchanged when
        the store has none). `machines(night)`: the machines a night measured on at once
        (a fleet night, tilecast.workflows.fleet; 0 or 1 for one), whose span is that many
        machines' time."""
        rows = stored[(stored["role"] == "candidate") & (stored["phase"] == "screen")]
        rows = rows[rows["median_s"].notna()]
        if rows.empty:
            return self
        ratios = []
        for night in labels.nights_in_order(rows)[-CALIBRATION_NIGHTS:]:
            own = stored[stored["run_id"] == night]
            times = pd.to_datetime(own["time"], utc=True, format="ISO8601")
            span = (times.max() - times.min()).total_seconds()
            screened = rows[rows["run_id"] == night]
            raw = sum(self.raw(g["median_s"].to_numpy()) for _, g in screened.groupby("dims_key"))
            if span > 0 and raw > 0:
                ratios.append(span * max(1, machines(night) if machines else 1) / raw)
        if not ratios:
            return self
        return CostModel(self.samples, self.min_sample_s, self.warmup_s, float(np.median(ratios)))


# -- what to re-measure --------------------------------------------------------------------------

def label_status(final: pd.DataFrame) -> pd.DataFrame:
    """Per problem of a pooled final table: its nights (the fewest of its best two kernels'),
    the runner-up's gap to the best (percent; inf with one valid kernel) and every valid
    kernel's pooled time."""
    valid = dataset.valid(final)
    rows = []
    for dims_key, group in valid.groupby("dims_key", sort=True):
        group = group.sort_values("median_s", kind="stable")
        times = group["median_s"].to_numpy(dtype=float)
        gap = (times[1] / times[0] - 1) * 100 if len(times) > 1 else math.inf
        rows.append({"dims_key": dims_key, "nights": int(group["nights"].iloc[:2].min()),
                     "gap_pct": float(gap), "seconds": times})
    return pd.DataFrame(rows, columns=["dims_key", "nights", "gap_pct", "seconds"])


def to_settle(status: pd.DataFrame, holdout: set[str], settings: NightSettings) -> pd.DataFrame:
    """The problems whose labels a night re-measures, in order, with their reason."""
    young = status["nights"] < settings.settle_nights
    held = status["dims_key"].isin(holdout)
    contested = young & ~held & (status["gap_pct"] < settings.contested_pct)
    picked = pd.concat([status[young & held].assign(reason="held-out"),
                        status[contested].assign(reason="contested")])
    order = {"held-out": 0, "contested": 1}
    return picked.assign(rank=picked["reason"].map(order)).sort_values(
        ["rank", "nights", "gap_pct", "dims_key"], kind="stable").drop(columns="rank")


# -- new shapes ----------------------------------------------------------------------------------

def exploration(family, entries: Sequence[Mapping], count: int, seed: int) -> list[dict]:
    """About `count` shapes of the config's random training entries drawn with `seed` (their
    share of `count` each, by their counts); none when the config draws none."""
    drawn = [e for e in entries if "random" in e]
    total = sum(e["random"]["count"] for e in drawn)
    if not total:
        return []
    redrawn = []
    for index, entry in enumerate(drawn):
        body = dict(entry["random"])
        body["count"] = max(1, round(body["count"] * count / total))
        body["seed"] = (int(body.get("seed", 0)) * 1_000_003 + seed * 7919 + index) % (2**32)
        redrawn.append({**entry, "random": body})
    values = expand_problems("exploration", redrawn, family)
    shapes = []
    for item in values:
        try:
            shapes.append(family.problem_dict(family.problem(item)))
        except ValueError:      # FamilyError: a draw the family refuses (e.g. a bad group split)
            continue
    return shapes


def _position(values: Mapping) -> tuple[tuple, np.ndarray]:
    """(the non-numeric fields, log2 of the numeric ones) of a shape."""
    kinds = tuple(sorted((k, str(v)) for k, v in values.items()
                         if isinstance(v, (bool, str)) or v is None))
    numbers = np.array([math.log2(max(float(v), 1.0)) for k, v in sorted(values.items())
                        if isinstance(v, (int, float)) and not isinstance(v, bool)])
    return kinds, numbers


class Spread:
    """Shapes chosen so far; `near` tells whether a shape is a neighbour of one of them."""

    def __init__(self):
        self.seen: dict[tuple, list[np.ndarray]] = {}

    def near(self, values: Mapping) -> bool:
        kinds, numbers = _position(values)
        return any(np.max(np.abs(numbers - other)) < NEAR_LOG2 for other in self.seen.get(kinds, ()))

    def add(self, values: Mapping) -> None:
        kinds, numbers = _position(values)
        self.seen.setdefault(kinds, []).append(numbers)


def rank_new_shapes(family, shapes: Sequence[dict], members: Members | None, policy: str,
                    rng: np.random.Generator) -> list[tuple[dict, float | None, np.ndarray | None]]:
    """(shape, score, predicted kernel seconds) of every shape, best first: by the members'
    regret (policy `active`; a random order while there are no members) or in a random order
    (policy `random`)."""
    if policy not in ("active", "random"):
        raise ValueError(f"unknown night policy {policy!r}; valid: active, random")
    order = list(rng.permutation(len(shapes)))
    if members is None:
        return [(shapes[i], None, None) for i in order]
    problems = [family.problem(s) for s in shapes]
    predictions = members.predict(problems)
    seconds = [predicted_seconds(family, p, predicted) if len(k) else np.empty(0)
               for p, (k, predicted) in zip(problems, predictions)]
    if policy == "random":
        return [(shapes[i], None, seconds[i]) for i in order]
    scores = [regret(predicted) for _, predicted in predictions]
    order = sorted(range(len(shapes)), key=lambda i: -scores[i])
    return [(shapes[i], scores[i], seconds[i]) for i in order]


# -- the plan ------------------------------------------------------------------------------------

def plan_night(family, engine, fc, settings: NightSettings, protocol, stored: pd.DataFrame,
               kernels: Sequence[str], spec, seed: int, threads: int = 2,
               budget_minutes: float | None = None,
               machines: Callable[[str], int] | None = None) -> NightPlan:
    """Tonight's problems for family config `fc` from the class's stored records `stored`
    (tilecast.store.nights.read_frame), tonight's candidate `kernels`, the family's feature
    `engine` and model `spec`; `machines(night)`: see CostModel.calibrated."""
    budget_minutes = budget_minutes or settings.budget_minutes
    if not budget_minutes:
        raise ConfigError("a budgeted night needs night.budget_minutes (or --budget-minutes)")
    budget = float(budget_minutes) * 60
    kernels = list(kernels)
    cost = CostModel.of(protocol).calibrated(stored, machines)
    holdout = {family.dims_key(family.problem(v)): v for v in fc.problems["holdout"]}
    final = labels.pooled_final(stored[stored["kernel"].isin(kernels)])
    plan = NightPlan(family=family.name, policy=settings.policy, budget_s=budget,
                     calibration=cost.calibration)
    if cost.calibration == 1.0:
        plan.notes.append("no night of this class in the store yet: costs uncalibrated")
    taken: set[str] = set()
    spread = Spread()
    spent = 0.0

    def take(dims_key: str, problem_set: str, reason: str, seconds: float, values: Mapping,
             score: float | None = None, limit: float = budget) -> bool:
        nonlocal spent
        if dims_key in taken or spent + seconds > limit:
            return False
        plan.chosen.append(Chosen(dims_key, problem_set, reason, round(float(seconds), 2),
                                  dict(values), None if score is None else float(score)))
        taken.add(dims_key)
        spread.add(values)
        spent += seconds
        return True

    # 1. labels to settle
    status = label_status(final)
    measured = set(status["dims_key"])
    values_of = _values_by_key(family, final)
    values_of.update(holdout)
    settle = to_settle(status, set(holdout), settings)
    unmeasured_holdout = [k for k in holdout if k not in measured]
    plan.considered["held-out"] = len(unmeasured_holdout) + int((settle["reason"] == "held-out").sum())
    plan.considered["contested"] = int((settle["reason"] == "contested").sum())
    limit = budget * settings.remeasure_share
    speed = _typical_tflops(final, kernels)

    def unmeasured(values: Mapping) -> np.ndarray:
        """Kernel seconds of a shape no model predicts: its work at the typical speeds."""
        return family.flops(family.problem(values)) / speed / 1e12

    for key in unmeasured_holdout:
        take(key, "holdout", "held-out", cost.seconds(unmeasured(holdout[key])), holdout[key],
             limit=limit)
    for row in settle.itertuples():
        take(row.dims_key, "holdout" if row.dims_key in holdout else "train", row.reason,
             cost.seconds(row.seconds), values_of[row.dims_key], limit=limit)

    # 2. drift sentinels
    seconds_of = dict(zip(status["dims_key"], status["seconds"]))
    sentinels = [family.problem(v) for v in fc.sentinel[:settings.sentinels]]
    plan.considered["sentinel"] = len(sentinels)
    covered = sum(family.dims_key(p) in taken for p in sentinels)
    if covered:
        plan.notes.append(f"{covered} sentinel(s) measured tonight as labels to settle")
    for problem in sentinels:
        key = family.dims_key(problem)
        values = family.problem_dict(problem)
        take(key, "holdout" if key in holdout else "train", "sentinel",
             cost.seconds(seconds_of[key] if key in seconds_of else unmeasured(values)), values)

    # 3. new shapes: the workload's, then exploration's, ranked
    rng = np.random.default_rng(seed)
    fresh = _fresh(family, fc.workload, measured | set(holdout))
    dropped = [v for v in fc.workload if family.dims_key(family.problem(v)) in holdout]
    if dropped:
        plan.notes.append(f"{len(dropped)} workload shape(s) are held out and never trained on")
    explored = _fresh(family, exploration(family, fc.entries.get("train", []), settings.explore,
                                          seed), measured | set(holdout))
    plan.considered["workload"], plan.considered["explore"] = len(fresh), len(explored)
    members = None
    if settings.policy == "active":
        members = _members(family, engine, final, holdout, spec, settings, seed, threads, plan)
    pools = [("workload", rank_new_shapes(family, fresh, members, settings.policy, rng)),
             ("explore", rank_new_shapes(family, explored, members, settings.policy, rng))]
    left = budget - spent
    shares = {"workload": left * settings.workload_share if explored else left}
    for reason, ranked in pools:
        limit = spent + shares.get(reason, budget)
        for values, score, seconds in ranked:
            if spread.near(values):
                continue
            kernel_seconds = unmeasured(values) if seconds is None or not len(seconds) else seconds
            take(family.dims_key(family.problem(values)), "train", reason,
                 cost.seconds(kernel_seconds), values, score, limit=min(limit, budget))
            if spent >= budget:
                break
    return plan


def _typical_tflops(final: pd.DataFrame, kernels: Sequence[str]) -> np.ndarray:
    """Each kernel's median TFLOP/s over the shapes it was measured on: what a new shape
    costs when no model predicts it (the random policy, a store without training shapes)."""
    valid = dataset.valid(final)
    typical = valid.groupby("kernel")["tflops"].median()
    overall = float(valid["tflops"].median()) if len(valid) else 1e-3
    return np.array([float(typical.get(k, overall)) for k in kernels])


def _values_by_key(family, final: pd.DataFrame) -> dict[str, dict]:
    first = final.drop_duplicates("dims_key")
    return {row["dims_key"]: {f: _plain(row[f]) for f in family.problem_fields}
            for _, row in first.iterrows()}


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def _fresh(family, shapes: Sequence[Mapping], known: set[str]) -> list[dict]:
    """`shapes` not in `known`, each once."""
    out, seen = [], set(known)
    for values in shapes:
        key = family.dims_key(family.problem(values))
        if key not in seen:
            seen.add(key)
            out.append(dict(values))
    return out


def _members(family, engine, final, holdout, spec, settings, seed, threads,
             plan) -> Members | None:
    train = final[~final["dims_key"].isin(holdout)]
    if dataset.valid(train)["dims_key"].nunique() < 2:
        plan.notes.append("fewer than 2 measured training shapes: new shapes in random order")
        return None
    return Members.fit(family, engine, train, spec, settings.members, seed, threads)


def write(plan: NightPlan, path: Path) -> None:
    """The plan as JSON at `path` (its directory made), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, plan.to_json())


def read(path: Path) -> NightPlan:
    return NightPlan.from_json(json.loads(path.read_text()))
