"""A model's shortlist: one small decision tree over the problem's own features whose leaves
name the few candidates worth scoring, learned from the model's own predictions.

Scoring a problem walks every tree of the forest once per candidate, so a query costs trees
x candidates (1,286 trees x 64 candidates in the nightly). A shortlist of size K answers
first which K candidates can win in the problem's region of the problem space; the forest
then ranks only those of them that apply (all applicable candidates when none of them does),
so a query costs trees x K whatever the number of candidates, and K = 1 needs no forest.

It is learned at training time (tilecast.workflows.pipeline.train_stage), from the model's
predictions on the training problems and on problems drawn around them (sample_problems):
the tree splits where one best kernel per side keeps the most predicted efficiency (a
problem's predicted TFLOP/s of a kernel over its best predicted), each leaf keeps the K
candidates that, added greedily, keep the most of it. Its `summary` says how much of the
forest's choice a share of drawn problems it was not fitted on keeps; the evaluate stage
measures what it costs on the held-out measurements.

Decisions are LightGBM's numerical ones (missing type None): NaN reads as 0, |x| <= 1e-35
as 0, left when x <= threshold, so an exported selector walks the tree with the forest's
own node code (tilecast.runtime.export).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from tilecast.core.artifact import SHORTLIST_FILE as FILE
from tilecast.runtime.query import NoKernelError

FORMAT = "tilecast-shortlist"
FORMAT_VERSION = 1
#: how a shortlist is learned unless the caller says otherwise
DRAWN_PROBLEMS = 6000     # problems scored (the training problems, then drawn ones)
DEPTH = 12                # internal nodes on the longest path
MIN_LEAF = 4              # drawn problems a leaf holds at least
FIT_SHARE = 0.8           # of the drawn problems fitted on; the rest measure `summary`
SPREAD = 0.6              # a drawn problem's integer fields: the base's times e^N(0, SPREAD)
ZERO_THRESHOLD = float(np.float32(1e-35))   # LightGBM's kZeroThreshold


class ShortlistError(ValueError):
    """A shortlist document that cannot be read, or one that does not fit its model."""


@dataclass(frozen=True)
class Shortlist:
    """Nodes as flat arrays (node 0 is the root; a child < 0 is the leaf -1 - child; no
    node at all: one leaf); `feature` indexes `features`, problem-feature names of the
    model's engine; `leaves` name each leaf's kernels, the most valuable first."""
    features: tuple[str, ...]
    feature: tuple[int, ...]
    threshold: tuple[float, ...]
    left: tuple[int, ...]
    right: tuple[int, ...]
    leaves: tuple[tuple[str, ...], ...]
    summary: dict = field(default_factory=dict, compare=False)

    @property
    def size(self) -> int:
        """The most kernels a leaf names."""
        return max((len(kernels) for kernels in self.leaves), default=0)

    def truncated(self, size: int) -> "Shortlist":
        """The same tree, each leaf keeping its first `size` kernels."""
        if size < 1:
            raise ShortlistError(f"shortlist size {size} must be >= 1")
        return replace(self, leaves=tuple(kernels[:size] for kernels in self.leaves))

    def leaf(self, values: Sequence[float]) -> int:
        """The leaf of a problem whose feature values, in `features` order, are `values`."""
        node = 0 if self.feature else -1
        while node >= 0:
            value = float(values[self.feature[node]])
            if math.isnan(value) or abs(value) <= ZERO_THRESHOLD:
                value = 0.0
            node = self.left[node] if value <= self.threshold[node] else self.right[node]
        return -1 - node

    def kernels(self, values: Sequence[float]) -> tuple[str, ...]:
        return self.leaves[self.leaf(values)]

    def to_json(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION,
                "features": list(self.features),
                "nodes": {"feature": list(self.feature), "threshold": list(self.threshold),
                          "left": list(self.left), "right": list(self.right)},
                "leaves": [list(kernels) for kernels in self.leaves],
                "summary": self.summary}

    @classmethod
    def from_json(cls, document: Any, where: str = FILE) -> "Shortlist":
        """The shortlist of a to_json document; ShortlistError says what is wrong with it."""
        if not isinstance(document, Mapping) or document.get("format") != FORMAT:
            raise ShortlistError(f"{where} is not a {FORMAT} document")
        if document.get("format_version") != FORMAT_VERSION:
            raise ShortlistError(f"{where} has format_version {document.get('format_version')!r};"
                                 f" this tilecast reads {FORMAT_VERSION}")
        try:
            nodes = document["nodes"]
            shortlist = cls(
                features=tuple(str(f) for f in document["features"]),
                feature=tuple(int(f) for f in nodes["feature"]),
                threshold=tuple(float(t) for t in nodes["threshold"]),
                left=tuple(int(c) for c in nodes["left"]), right=tuple(int(c) for c in nodes["right"]),
                leaves=tuple(tuple(str(k) for k in kernels) for kernels in document["leaves"]),
                summary=dict(document.get("summary") or {}))
        except (KeyError, TypeError, ValueError) as err:
            raise ShortlistError(f"{where} is malformed: {err!r}") from None
        shortlist.check(where)
        return shortlist

    def check(self, where: str = FILE) -> None:
        """ShortlistError unless the arrays form one tree over `features` and `leaves`."""
        count = len(self.feature)
        if not (len(self.threshold) == len(self.left) == len(self.right) == count):
            raise ShortlistError(f"{where}: node arrays of different lengths")
        if any(not 0 <= f < len(self.features) for f in self.feature):
            raise ShortlistError(f"{where}: a node reads a feature it does not list")
        if any(math.isnan(t) for t in self.threshold):
            raise ShortlistError(f"{where}: a node's threshold is NaN")
        if len(self.leaves) != count + 1 or any(not kernels for kernels in self.leaves):
            raise ShortlistError(f"{where}: {count} nodes need {count + 1} non-empty leaves, "
                                 f"it has {len(self.leaves)}")
        children = sorted(self.left + self.right)
        if count and children != sorted([*range(1, count), *range(-count - 1, 0)]):
            raise ShortlistError(f"{where}: the nodes do not form one tree")

    def lightgbm_tree(self, model_feature: Mapping[str, int]) -> dict:
        """The tree in Booster.dump_model() form over the model's feature indices (leaf value
        = leaf number), for tilecast.runtime.export.forest.convert."""
        def node(code: int) -> dict:
            if code < 0:
                return {"leaf_index": -1 - code, "leaf_value": float(-1 - code)}
            return {"split_feature": model_feature[self.features[self.feature[code]]],
                    "threshold": self.threshold[code], "decision_type": "<=",
                    "missing_type": "None", "default_left": False,
                    "left_child": node(self.left[code]), "right_child": node(self.right[code])}
        return {"tree_info": [{"tree_structure": node(0 if self.feature else -1)}]}


# -- learning ---------------------------------------------------------------------------------

def sample_problems(family, problems: Sequence, count: int, seed: int = 0) -> list:
    """`problems` (distinct), then problems drawn around them up to `count` in all: a random
    base problem with each integer field scaled by e^N(0, SPREAD) (at least 1); a drawn
    problem the family refuses is skipped."""
    rng = np.random.default_rng(seed)
    chosen = {family.dims_key(p): p for p in problems}
    bases = []
    for p in chosen.values():
        values = family.problem_dict(p)
        scaled = [key for key, value in values.items()
                  if isinstance(value, (int, np.integer)) and not isinstance(value, bool)
                  and value >= 1]
        bases.append((values, scaled, [float(values[k]) for k in scaled]))
    # small fields scaled and rounded repeat often (and most draws of some families are
    # refused): each distinct draw is validated once, its key or None remembered
    seen: dict[tuple, str | None] = {}
    attempts = 0
    while bases and len(chosen) < count and attempts < 20 * count:
        attempts += 1
        values, scaled, base = bases[int(rng.integers(len(bases)))]
        # one draw per scaled field, in field order: the stream's values, as drawn one by one
        normals = rng.normal(0.0, SPREAD, size=len(scaled)).tolist()
        drawn = [max(1, int(round(v * math.exp(z)))) for v, z in zip(base, normals)]
        memo = (id(values), *drawn)
        if memo in seen:
            continue   # a draw already met adds nothing: its problem is chosen or refused
        try:
            problem = family.problem({**values, **dict(zip(scaled, drawn))})
        except (ValueError, TypeError):   # FamilyError is a ValueError
            seen[memo] = None
            continue
        key = seen[memo] = family.dims_key(problem)
        chosen.setdefault(key, problem)
    return list(chosen.values())


def predicted_efficiency(dispatcher, problems: Sequence) -> tuple[np.ndarray, np.ndarray, list]:
    """(problem features, efficiency, kernels) of the family's `problems` (family.problem's
    results, as sample_problems draws them): per problem its features in the model's
    problem-feature order (shortlist_features) and per kernel (name order) its predicted
    TFLOP/s over the best predicted one (0 where it does not apply or predicts nothing
    finite); problems no candidate runs or with no finite prediction are left out."""
    names = sorted(dispatcher.kernels)
    column = {name: i for i, name in enumerate(names)}
    features, positions = shortlist_features(dispatcher)
    rows, efficiency = [], []
    for problem in problems:
        try:   # as dispatcher.predict(problem), the problem being the family's already
            ranking = dispatcher.validated_ranking(problem)
        except NoKernelError:   # no kernel of the model runs it: nothing to shortlist
            continue
        if ranking.fallback_reason is not None:   # no candidate applies: predict() says {}
            continue
        row = np.zeros(len(names))
        for name, tflops in zip(ranking.kernels, ranking.tflops):
            if math.isfinite(tflops) and tflops > 0:
                row[column[name]] = tflops
        if row.max() <= 0:
            continue
        efficiency.append(row / row.max())
        rows.append(dispatcher.engine.problem_features(problem)[positions])
    width = len(features)
    return (np.array(rows, dtype=np.float64).reshape(-1, width),
            np.array(efficiency).reshape(-1, len(names)), names)


def shortlist_features(dispatcher) -> tuple[list[str], np.ndarray]:
    """(names, positions in engine.problem_features) of the problem features the model
    reads: what a shortlist may split on."""
    engine_names = list(dispatcher.engine.problem_feature_names())
    model_names = set(dispatcher.feature_spec["feature_names"])
    names = [name for name in engine_names if name in model_names]
    return names, np.array([engine_names.index(name) for name in names], dtype=np.intp)


def learn(dispatcher, problems: Sequence, size: int, *, drawn: int = DRAWN_PROBLEMS,
          depth: int = DEPTH, min_leaf: int = MIN_LEAF, seed: int = 0) -> Shortlist:
    """The shortlist of size `size` of a loaded Dispatcher, learned on `problems` (the
    training problems) and problems drawn around them (sample_problems, `drawn` in all)."""
    if size < 1:
        raise ShortlistError(f"shortlist size {size} must be >= 1")
    sample = sample_problems(dispatcher.family, problems, drawn, seed)
    X, E, names = predicted_efficiency(dispatcher, sample)
    if len(X) == 0:
        raise ShortlistError("the model predicts no finite TFLOP/s on any problem drawn")
    features, _ = shortlist_features(dispatcher)
    order = np.random.default_rng(seed + 1).permutation(len(X))
    fit = order[:max(1, int(round(FIT_SHARE * len(X))))]
    kept = order[len(fit):]
    tree = _Tree(X[fit], E[fit], depth, min_leaf)
    leaves = tuple(tuple(names[c] for c in _greedy(E[fit][rows], size)) for rows in tree.leaves)
    shortlist = Shortlist(features=tuple(features), feature=tuple(tree.feature),
                          threshold=tuple(tree.threshold), left=tuple(tree.left),
                          right=tuple(tree.right), leaves=leaves)
    summary = {"size": size, "problems": int(len(X)), "fitted": int(len(fit)),
               "depth": depth, "min_leaf": min_leaf, "seed": seed, "leaves": len(leaves)}
    if len(kept):
        summary["unseen"] = keeps(shortlist, X[kept], E[kept], names)
    return replace(shortlist, summary=summary)


def keeps(shortlist: Shortlist, X: np.ndarray, E: np.ndarray, names: list) -> dict:
    """On problems (features X, predicted efficiency E over `names`): per size 1..size, the
    mean predicted efficiency the shortlist keeps and the share whose forest pick it holds."""
    column = {name: i for i, name in enumerate(names)}
    leaves = [shortlist.leaf(row) for row in X]
    figures = {}
    for size in range(1, shortlist.size + 1):
        kept = np.array([max(E[p, column[k]] for k in shortlist.leaves[leaf][:size])
                         for p, leaf in enumerate(leaves)])
        figures[str(size)] = {"mean_efficiency": round(float(kept.mean()), 4),
                              "holds_pick": round(float((kept >= 1.0).mean()), 4)}
    return figures


def _greedy(E: np.ndarray, size: int) -> list[int]:
    """Up to `size` columns of E, each the one adding most to the rows' best efficiency
    among those chosen (a column adding nothing is taken by its mean, the next surest)."""
    chosen: list[int] = []
    covered = np.zeros(len(E))
    mean = E.mean(axis=0)
    for _ in range(min(size, E.shape[1])):
        gain = np.maximum(E, covered[:, None]).sum(axis=0) - covered.sum()
        gain[chosen] = -np.inf
        best = int(np.argmax(gain))
        if gain[best] <= 1e-12:
            rest = mean.copy()
            rest[chosen] = -np.inf
            best = int(np.argmax(rest))
        chosen.append(best)
        covered = np.maximum(covered, E[:, best])
    return chosen


class _Tree:
    """Greedy splits of (X, E): each keeps the most of `sum over rows of the efficiency of
    one kernel per side`; leaves are row index arrays."""

    def __init__(self, X: np.ndarray, E: np.ndarray, depth: int, min_leaf: int):
        self.X, self.E, self.depth, self.min_leaf = X, E, depth, max(1, min_leaf)
        self.feature: list[int] = []
        self.threshold: list[float] = []
        self.left: list[int] = []
        self.right: list[int] = []
        self.leaves: list[np.ndarray] = []
        self._grow(np.arange(len(X)), 0)

    def _leaf(self, rows: np.ndarray) -> int:
        self.leaves.append(rows)
        return -len(self.leaves)

    def _grow(self, rows: np.ndarray, level: int) -> int:
        E = self.E[rows]
        whole = E.sum(axis=0).max()
        if level >= self.depth or len(rows) < 2 * self.min_leaf or \
                whole >= E.max(axis=1).sum() - 1e-9:
            return self._leaf(rows)
        split = self._best_split(rows, whole)
        if split is None:
            return self._leaf(rows)
        feature, threshold = split
        node = len(self.feature)
        self.feature.append(feature)
        self.threshold.append(threshold)
        self.left.append(0)
        self.right.append(0)
        goes_left = _read(self.X[rows, feature]) <= threshold
        self.left[node] = self._grow(rows[goes_left], level + 1)
        self.right[node] = self._grow(rows[~goes_left], level + 1)
        return node

    def _best_split(self, rows: np.ndarray, whole: float) -> tuple[int, float] | None:
        best, found = whole + 1e-9 * len(rows), None
        count = len(rows)
        for feature in range(self.X.shape[1]):
            values = _read(self.X[rows, feature])
            order = np.argsort(values, kind="stable")
            values = values[order]
            cumulative = np.cumsum(self.E[rows[order]], axis=0)
            gain = cumulative.max(axis=1) + (cumulative[-1] - cumulative).max(axis=1)
            # a split after position i: rows 0..i go left; needs a new value at i + 1
            ok = np.zeros(count, dtype=bool)
            ok[:-1] = values[:-1] < values[1:]
            ok[:self.min_leaf - 1] = False
            ok[count - self.min_leaf:] = False
            if not ok.any():
                continue
            i = int(np.argmax(np.where(ok, gain, -np.inf)))
            if gain[i] > best:
                low, high = float(values[i]), float(values[i + 1])
                threshold = low + (high - low) / 2
                if not low <= threshold < high:
                    threshold = low
                best, found = float(gain[i]), (feature, threshold)
        return found


def _read(values: np.ndarray) -> np.ndarray:
    """What a node compares: NaN and |x| <= 1e-35 read as 0 (Shortlist.leaf)."""
    values = np.where(np.isnan(values), 0.0, values)
    return np.where(np.abs(values) <= ZERO_THRESHOLD, 0.0, values)
