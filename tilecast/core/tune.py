"""Choosing among measured candidates: robust scores, practical ties, a seeded order.

``score_samples`` scores a candidate by the median of its usable timings, ``tie_set`` and
``select_best`` find the candidates within a threshold of the fastest and the one that wins
among them (smaller secondary cost, then id), ``confirmation_count`` sizes a finalist's fresh
samples by how noisy its first ones were, ``seeded_order`` is the reproducible order a
candidate budget takes its prefix of (``stratified_order`` the same, dealt round-robin
across strata such as a kernel's pipeline, so a budget holds every kind), and
``BuildEvent`` records what happened to each candidate the build examined. Nothing here builds, runs or times a kernel: the stages hand
in the numbers, so every function is testable with made-up ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tilecast.core import stats
from tilecast.core.status import BUILD_STATUSES   # the one table of status codes

__all__ = [
    "BUILD_STATUSES",
    "BuildEvent",
    "Score",
    "confirmation_count",
    "fnv1a64",
    "score_samples",
    "seeded_order",
    "select_best",
    "stratified_order",
    "tie_set",
]

# (relative uncertainty upper bound, multiplier of the base confirmation count);
# anything above the last bound, inf and nan included, gets _MAX_CONFIRMATION_MULTIPLIER.
CONFIRMATION_MULTIPLIERS = ((0.05, 1), (0.20, 2))
_MAX_CONFIRMATION_MULTIPLIER = 3

_FNV_OFFSET_BASIS = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


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


def stratified_order(items: Iterable, seed: int, stratum) -> list:
    """``seeded_order`` dealt round-robin across strata: the first item of each stratum (in
    the order the strata first appear in the seeded order), then the second of each, and so
    on; a stratum that runs out drops out. `stratum(item)` names an item's stratum. Any prefix
    of the result holds the strata as evenly as their sizes allow."""
    piles: dict = {}
    for item in seeded_order(items, seed):
        piles.setdefault(stratum(item), []).append(item)
    dealt, depth = [], 0
    while len(dealt) < sum(map(len, piles.values())):
        dealt.extend(pile[depth] for pile in piles.values() if depth < len(pile))
        depth += 1
    return dealt


# --- confirmation ------------------------------------------------------------


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
