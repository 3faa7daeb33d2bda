"""One night's problems cut into shards, one per machine of a hardware class.

A shard is a list of problems, each measured with every candidate on one machine in one
window (its labels stay relative to its rivals). `cut` balances the shards' estimated seconds
(longest first, each to the least loaded shard) and keeps each shard's problems in the night's
order, so that what the plan put first (labels to settle, sentinels) is measured first on
every machine. A shard travels as JSON: a Prefect flow run's parameters.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

# the speed a problem is costed at when nothing measured says better (a night of the config's
# lists): only the shards' balance depends on it, never what is measured
NOMINAL_TFLOPS = 0.05


@dataclass(frozen=True)
class Item:
    """One problem of a shard."""
    problem_set: str          # train / holdout
    values: dict              # the family's problem fields
    seconds: float            # its estimated measuring time

    def to_json(self) -> dict:
        return {"problem_set": self.problem_set, "values": dict(self.values),
                "seconds": float(self.seconds)}


@dataclass(frozen=True)
class Shard:
    """Problems of one family that one machine measures tonight."""
    family: str
    index: int                # 0 .. count - 1
    count: int                # the family's shards tonight
    items: tuple[Item, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return f"{self.family}-{self.index + 1}-of-{self.count}"

    @property
    def seconds(self) -> float:
        return float(sum(item.seconds for item in self.items))

    def pairs(self, family) -> list[tuple[str, object]]:
        """(problem_set, problem) pairs in order, as the benchmark stage takes them."""
        return [(item.problem_set, family.problem(item.values)) for item in self.items]

    def to_json(self) -> dict:
        return {"family": self.family, "index": self.index, "count": self.count,
                "items": [item.to_json() for item in self.items]}

    @classmethod
    def from_json(cls, data: Mapping) -> "Shard":
        try:
            items = tuple(Item(str(i["problem_set"]), dict(i["values"]), float(i["seconds"]))
                          for i in data["items"])
            shard = cls(str(data["family"]), int(data["index"]), int(data["count"]), items)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a shard: {err!r} in {str(dict(data))[:200]}") from None
        if not 0 <= shard.index < shard.count:
            raise ValueError(f"shard index {shard.index} is outside 0..{shard.count - 1}")
        bad = sorted({i.problem_set for i in items} - {"train", "holdout"})
        if bad:
            raise ValueError(f"shard {shard.name}: unknown problem set {bad[0]!r}")
        return shard


def cut(family: str, items: Sequence[Item], count: int) -> list[Shard]:
    """`items` (in the night's order) in `count` shards of about equal estimated seconds.
    Fewer problems than shards give fewer shards: no machine is sent nothing."""
    if count < 1:
        raise ValueError(f"shards must be at least 1, got {count}")
    count = max(1, min(count, len(items)))
    order = sorted(range(len(items)), key=lambda i: (-items[i].seconds, i))
    loads = [(0.0, s) for s in range(count)]
    heapq.heapify(loads)
    owner = np.empty(len(items), dtype=int)
    for i in order:
        load, s = heapq.heappop(loads)
        owner[i] = s
        heapq.heappush(loads, (load + items[i].seconds, s))
    return [Shard(family, s, count, tuple(items[i] for i in range(len(items)) if owner[i] == s))
            for s in range(count)]


def list_items(family, pairs: Sequence[tuple[str, object]], protocol, kernels: int
               ) -> list[Item]:
    """A night of the config's lists as items, each costed as its work at NOMINAL_TFLOPS on
    every kernel under the protocol (tilecast.store.plan.CostModel)."""
    from tilecast.store.plan import CostModel

    cost = CostModel.of(protocol)
    out = []
    for problem_set, problem in pairs:
        kernel_s = family.flops(problem) / (NOMINAL_TFLOPS * 1e12)
        out.append(Item(problem_set, {f: getattr(problem, f) for f in family.problem_fields},
                        cost.seconds(np.full(max(1, kernels), kernel_s))))
    return out


def plan_items(plan) -> list[Item]:
    """A budgeted night's plan (tilecast.store.plan.NightPlan) as items, in its order."""
    return [Item(c.problem_set, dict(c.values), float(c.seconds)) for c in plan.chosen]
