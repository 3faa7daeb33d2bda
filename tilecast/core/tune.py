"""Tuning policy: robust scores, practical ties, Pareto fronts, reproducible subsets.

Implements ``seeds/TUNE_DESIGN.md``. The policy takes scores and never builds,
runs or validates a candidate; the application does that (through the same
measurement protocol as every other benchmark) and hands the results in, so
every function here is testable with made-up numbers.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tilecast.core import stats

__all__ = [
    "BUILD_STATUSES",
    "BuildEvent",
    "BuiltCandidate",
    "CandidateError",
    "CandidateSpace",
    "HoldoutPlan",
    "Score",
    "TuningBudget",
    "TuningObjective",
    "confirmation_count",
    "exhaustive_scores",
    "fnv1a64",
    "global_policy",
    "pareto_frontier",
    "score_samples",
    "seeded_order",
    "select_best",
    "tie_set",
]

BUILD_STATUSES = ("ok", "failed", "rejected")

# (relative uncertainty upper bound, multiplier of the base confirmation count);
# anything above the last bound, inf and nan included, gets _MAX_CONFIRMATION_MULTIPLIER.
CONFIRMATION_MULTIPLIERS = ((0.05, 1), (0.20, 2))
_MAX_CONFIRMATION_MULTIPLIER = 3

_FNV_OFFSET_BASIS = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


class CandidateError(Exception):
    """A candidate failed to build or run; exhaustive_scores records it as ``failed``."""


def _require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _require_threshold(threshold_pct: Any) -> None:
    if not (isinstance(threshold_pct, (int, float)) and math.isfinite(threshold_pct)
            and threshold_pct >= 0):
        raise ValueError(f"threshold_pct must be a finite number >= 0, got {threshold_pct!r}")


def _item_id(item: Any) -> str:
    """The id of a string or of an object with a string ``.id``."""
    item_id = item if isinstance(item, str) else getattr(item, "id", None)
    if not isinstance(item_id, str):
        raise TypeError(f"expected a str id or an object with a str .id, got {item!r}")
    return item_id


# --- value objects -----------------------------------------------------------


@dataclass(frozen=True)
class TuningBudget:
    """How much measuring a tuning run may spend; data only, nothing enforces it."""

    max_candidates: int
    samples: int = 5
    confirmation_samples: int = 3
    finalists: int = 3
    tie_threshold_pct: float = 1.0

    def __post_init__(self) -> None:
        _require_int("max_candidates", self.max_candidates, 1)
        _require_int("samples", self.samples, 1)
        _require_int("confirmation_samples", self.confirmation_samples, 0)
        _require_int("finalists", self.finalists, 1)
        _require_threshold(self.tie_threshold_pct)


@dataclass(frozen=True)
class TuningObjective:
    """Names of the primary (e.g. median seconds) and tie-breaking secondary metrics."""

    primary: str = "median_s"
    secondary: str = "binary_bytes"
    minimize: bool = True

    def __post_init__(self) -> None:
        for name in ("primary", "secondary"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty metric name, got {value!r}")
        if not isinstance(self.minimize, bool):
            raise ValueError(f"minimize must be a bool, got {self.minimize!r}")


@dataclass(frozen=True)
class HoldoutPlan:
    """Ids (problems, shapes) a winner is evaluated on but never selected on."""

    holdout_ids: tuple[str, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        holdout_ids = tuple(self.holdout_ids)
        for holdout_id in holdout_ids:
            if not isinstance(holdout_id, str):
                raise ValueError(f"holdout id {holdout_id!r} is not a str")
        duplicates = sorted({i for i in holdout_ids if holdout_ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate holdout ids {duplicates}")
        object.__setattr__(self, "holdout_ids", holdout_ids)

    @classmethod
    def from_fraction(cls, ids: Iterable[str], fraction: float, seed: int = 0) -> HoldoutPlan:
        """Hold out ``round(fraction * n)`` ids (at least 1, at most n - 1) in seeded order."""
        ids = list(ids)
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
        if len(ids) < 2:
            raise ValueError(f"need at least 2 ids to hold some out, got {ids!r}")
        count = min(max(math.floor(fraction * len(ids) + 0.5), 1), len(ids) - 1)
        return cls(tuple(seeded_order(ids, seed)[:count]), seed)

    def split(self, ids: Iterable[str]) -> tuple[list[str], list[str]]:
        """Return ``(train, holdout)``, each in the order of ``ids``.

        Raises ValueError when a holdout id is missing from ``ids`` (the holdout
        would silently shrink) or ``ids`` has duplicates.
        """
        ids = list(ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate ids in {ids!r}")
        known = set(ids)
        missing = [i for i in self.holdout_ids if i not in known]
        if missing:
            raise ValueError(f"holdout ids {missing} are not among the ids to split")
        held = set(self.holdout_ids)
        return [i for i in ids if i not in held], [i for i in ids if i in held]


@dataclass(frozen=True)
class CandidateSpace:
    """A cartesian product of parameter values, optionally filtered by a constraint.

    ``params`` maps each parameter name to its ordered list of values; the
    declared order of names and values fixes the enumeration order and what
    "one step" means for ``neighbors``.
    """

    params: Mapping[str, Sequence]
    constraint: Callable[[dict], bool] | None = None

    def __post_init__(self) -> None:
        params = {}
        for name, values in dict(self.params).items():
            values = tuple(values)
            if not values:
                raise ValueError(f"parameter {name!r} has no values")
            for value in values:
                if values.count(value) > 1:
                    raise ValueError(f"parameter {name!r} lists value {value!r} twice")
            params[name] = values
        if self.constraint is not None and not callable(self.constraint):
            raise ValueError(f"constraint must be callable or None, got {self.constraint!r}")
        object.__setattr__(self, "params", params)

    def _allowed(self, config: dict) -> bool:
        return self.constraint is None or bool(self.constraint(config))

    def enumerate(self) -> Iterator[dict]:
        """Yield every valid config as a dict, in declared (row-major) order."""
        names = list(self.params)
        for values in itertools.product(*self.params.values()):
            config = dict(zip(names, values))
            if self._allowed(config):
                yield config

    def __len__(self) -> int:
        return sum(1 for _ in self.enumerate())

    def contains(self, config: Mapping) -> bool:
        """True when ``config`` names exactly the parameters, with listed values, and is valid."""
        if set(config) != set(self.params):
            return False
        if any(config[name] not in values for name, values in self.params.items()):
            return False
        return self._allowed(dict(config))

    def neighbors(self, config: Mapping) -> list[dict]:
        """Valid configs that differ from ``config`` in one parameter by one list step.

        Ordered by declared parameter, the lower step before the upper one.
        Raises ValueError when ``config`` does not name exactly the parameters
        or uses a value that is not listed.
        """
        if set(config) != set(self.params):
            raise ValueError(
                f"config keys {sorted(config)} differ from parameters {sorted(self.params)}"
            )
        found = []
        for name, values in self.params.items():
            if config[name] not in values:
                raise ValueError(
                    f"value {config[name]!r} of parameter {name!r} is not one of {list(values)}"
                )
            position = values.index(config[name])
            for step in (-1, 1):
                if 0 <= position + step < len(values):
                    neighbor = {**config, name: values[position + step]}
                    if self._allowed(neighbor):
                        found.append(neighbor)
        return found


@dataclass(frozen=True)
class BuiltCandidate:
    """A built variant: its id, config, the runner's implementation and a secondary cost."""

    id: str
    config: Mapping
    implementation: Any = None
    secondary: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"candidate id must be a non-empty str, got {self.id!r}")


@dataclass(frozen=True)
class Score:
    """A candidate's primary score (lower is better) and tie-breaking secondary cost.

    A value that is NaN, infinite or negative marks the candidate invalid.
    """

    id: str
    value: float
    secondary: float = 0.0
    samples: tuple = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"score id must be a non-empty str, got {self.id!r}")
        object.__setattr__(self, "value", float(self.value))
        secondary = float(self.secondary)
        if math.isnan(secondary):
            raise ValueError(f"secondary of score {self.id!r} is nan; it must be ordered")
        object.__setattr__(self, "secondary", secondary)
        object.__setattr__(self, "samples", tuple(float(s) for s in self.samples))

    @property
    def usable(self) -> bool:
        """True when the value is finite and non-negative."""
        return math.isfinite(self.value) and self.value >= 0.0


@dataclass(frozen=True)
class BuildEvent:
    """What happened to one examined candidate: ok, failed or rejected, and why."""

    candidate_id: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    binary_bytes: int = 0

    def __post_init__(self) -> None:
        if self.status not in BUILD_STATUSES:
            raise ValueError(
                f"unknown build status {self.status!r} for candidate {self.candidate_id!r}; "
                f"valid: {', '.join(BUILD_STATUSES)}"
            )
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {self.seconds!r}")
        _require_int("binary_bytes", self.binary_bytes, 0)


# --- scores and selection ----------------------------------------------------


def score_samples(candidate_id: str, samples: Iterable, secondary: float = 0.0) -> Score:
    """Score a candidate by the median of its usable samples.

    With no usable sample the value is ``inf`` (``Score.usable`` is False), so a
    broken measurement that returned 0 or NaN can never win.
    """
    samples = tuple(samples)
    good = stats.usable(samples)
    value = stats.median(good) if good else math.inf
    return Score(candidate_id, value, secondary, samples)


def _usable_unique(scores: Iterable[Score]) -> list[Score]:
    scores = list(scores)
    seen: set[str] = set()
    for score in scores:
        if score.id in seen:
            raise ValueError(f"duplicate score id {score.id!r}; ids must be unique")
        seen.add(score.id)
    return [s for s in scores if s.usable]


def tie_set(scores: Iterable[Score], threshold_pct: float) -> list[Score]:
    """Usable scores within ``threshold_pct`` percent of the fastest, sorted by (value, secondary, id).

    A score ``c`` is in the set when ``(c - min) / min * 100 <= threshold_pct``;
    when the minimum is 0 only zero scores are. Raises ValueError on duplicate ids.
    """
    _require_threshold(threshold_pct)
    candidates = _usable_unique(scores)
    if not candidates:
        return []
    fastest = min(s.value for s in candidates)
    if fastest == 0.0:
        tied = [s for s in candidates if s.value == 0.0]
    else:
        tied = [s for s in candidates if (s.value - fastest) / fastest * 100 <= threshold_pct]
    return sorted(tied, key=lambda s: (s.value, s.secondary, s.id))


def select_best(scores: Iterable[Score], threshold_pct: float = 0.0) -> Score | None:
    """The tie-set member with the smallest secondary, then smallest id; None if none usable.

    The result does not depend on the order of ``scores``.
    """
    tied = tie_set(scores, threshold_pct)
    return min(tied, key=lambda s: (s.secondary, s.id)) if tied else None


def pareto_frontier(scores: Iterable[Score]) -> list[Score]:
    """Usable scores not dominated in (value, secondary), sorted by value, secondary, id.

    ``o`` dominates ``c`` when it is no worse in both and differs in at least
    one; scores at the same point therefore all stay on the frontier.
    """
    ordered = sorted(_usable_unique(scores), key=lambda s: (s.value, s.secondary, s.id))
    frontier = []
    best_secondary_before = math.inf  # over all points strictly before this group
    for _, group in itertools.groupby(ordered, key=lambda s: (s.value, s.secondary)):
        group = list(group)
        if group[0].secondary < best_secondary_before:
            frontier.extend(group)
            best_secondary_before = group[0].secondary
    return frontier


# --- reproducible orders -----------------------------------------------------


def fnv1a64(data: bytes, seed: int = 0) -> int:
    """64-bit FNV-1a of the 8-byte little-endian ``seed`` followed by ``data``.

    The seed is always hashed first, so ``fnv1a64(b"", 0)`` is FNV-1a of eight
    zero bytes, not the bare offset basis. ``seed`` must be in [0, 2**64).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MASK64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    digest = _FNV_OFFSET_BASIS
    for byte in seed.to_bytes(8, "little") + bytes(data):
        digest = ((digest ^ byte) * _FNV_PRIME) & _MASK64
    return digest


def seeded_order(ids_or_candidates: Iterable, seed: int) -> list:
    """The items sorted by ``fnv1a64(id.encode("utf-8"), seed)``, ties by id.

    Items are id strings or objects with a str ``.id``. The result is a
    pseudo-random permutation that depends only on the ids and the seed; its
    first B items are a reproducible random subset.
    """
    items = list(ids_or_candidates)
    keyed = [(fnv1a64(_item_id(item).encode("utf-8"), seed), _item_id(item), item)
             for item in items]
    keyed.sort(key=lambda entry: (entry[0], entry[1]))
    return [entry[2] for entry in keyed]


# --- search and confirmation -------------------------------------------------


def exhaustive_scores(
    candidates: Iterable,
    score_fn: Callable[[Any], Score],
    budget: int,
    is_valid: Callable[[Any], bool | str] | None = None,
    *,
    errors: tuple[type[Exception], ...] = (CandidateError,),
) -> tuple[list[Score], list[BuildEvent]]:
    """Score the first ``budget`` candidates in the given order.

    Each examined candidate (a str id or an object with ``.id``) gets one
    BuildEvent. ``is_valid`` returning a falsy value or a reason string rejects
    it without calling ``score_fn``. A valid one is scored by ``score_fn``; if
    that raises one of ``errors`` the candidate is ``failed`` with an ``inf``
    score; other exceptions propagate. Rejected candidates have no Score.
    """
    _require_int("budget", budget, 0)
    scores: list[Score] = []
    events: list[BuildEvent] = []
    for candidate in itertools.islice(candidates, budget):
        candidate_id = _item_id(candidate)
        if is_valid is not None:
            verdict = is_valid(candidate)
            if isinstance(verdict, str):
                if not verdict:
                    raise ValueError(f"is_valid returned an empty reason for {candidate_id!r}")
                events.append(BuildEvent(candidate_id, "rejected", verdict))
                continue
            if not verdict:
                events.append(
                    BuildEvent(candidate_id, "rejected", f"is_valid returned {verdict!r}")
                )
                continue
        started = time.perf_counter()
        try:
            score = score_fn(candidate)
        except errors as error:
            seconds = time.perf_counter() - started
            events.append(
                BuildEvent(candidate_id, "failed", f"{type(error).__name__}: {error}", seconds)
            )
            secondary = getattr(candidate, "secondary", 0.0)
            scores.append(Score(candidate_id, math.inf, secondary))
            continue
        seconds = time.perf_counter() - started
        if not isinstance(score, Score) or score.id != candidate_id:
            raise ValueError(
                f"score_fn must return a Score with id {candidate_id!r}, got {score!r}"
            )
        events.append(BuildEvent(candidate_id, "ok", "", seconds))
        scores.append(score)
    return scores, events


def confirmation_count(base: int, relative_uncertainty: float, budget: int) -> int:
    """Confirmation samples for a finalist: ``base`` times 1, 2 or 3, clamped to ``budget``.

    The multiplier is 1 up to 5 % relative uncertainty, 2 up to 20 %, and 3
    above that or when the uncertainty is inf or nan.
    """
    _require_int("base", base, 0)
    _require_int("budget", budget, 0)
    if relative_uncertainty < 0:
        raise ValueError(f"relative_uncertainty must be >= 0, got {relative_uncertainty!r}")
    multiplier = next(
        (factor for bound, factor in CONFIRMATION_MULTIPLIERS if relative_uncertainty <= bound),
        _MAX_CONFIRMATION_MULTIPLIER,
    )
    return min(base * multiplier, budget)


def global_policy(scores: Iterable[Score], threshold_pct: float) -> str:
    """The policy string ``global:<id>`` naming the select_best winner.

    Raises ValueError when no score is usable.
    """
    scores = list(scores)
    best = select_best(scores, threshold_pct)
    if best is None:
        raise ValueError(
            f"no usable score among {len(scores)} candidates; cannot choose a global winner"
        )
    return f"global:{best.id}"
