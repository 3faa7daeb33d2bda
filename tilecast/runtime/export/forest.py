"""A LightGBM forest (Booster.dump_model()) as flat arrays over the selector's slots.

Each model feature is bound to a constant (a hardware feature: its splits are decided here
and vanish) or to a slot. A node keeps LightGBM's decision on the value the dense predictor
reads (tree.h NumericalDecision): |x| <= kZeroThreshold reads as 0, NaN reads as 0 unless
the node's missing type is NaN, and a missing value (0 for missing type Zero, NaN for NaN)
follows the node's default direction; otherwise left when x <= threshold.

A slot of a log2 feature holds the argument of np.log2, never the logarithm: its splits
compare the argument with the largest float64 whose np.log2 is at most the threshold, found
here with numpy's own log2. The exported code then needs no log2 and picks what the
dispatcher (which takes numpy's log2) picks, whatever libm it is linked with. Its "zero" is
1.0 (log2(x) == 0 only at x == 1; the log of a positive float64 is never as small as
kZeroThreshold without being 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from tilecast.runtime.native import forest as native_forest
from tilecast.runtime.native.forest import ForestUnsupported

# LightGBM's kZeroThreshold: the float 1e-35f widened to double
ZERO_THRESHOLD = float(np.float32(1e-35))
# node missing types (the dump's "missing_type"), as stored in the arrays
MISSING_TYPES = {"None": 0, "Zero": 1, "NaN": 2}
MISSING_NONE, MISSING_ZERO, MISSING_NAN = 0, 1, 2
INFINITY_BITS = 0x7FF0000000000000


class ForestError(ValueError):
    """The model holds something the exported selector does not reproduce."""


@dataclass(frozen=True)
class Binding:
    """What a model feature reads: a constant, or slot `slot` (log2: its argument)."""
    constant: float | None = None
    slot: int = -1
    log2: bool = False


@dataclass
class Forest:
    """Every tree's nodes in one set of arrays. A child (and a root) >= 0 is a node index,
    < 0 the leaf -1 - child of `leaves`. Scores are summed tree by tree from 0.0."""
    roots: list[int] = field(default_factory=list)
    slot: list[int] = field(default_factory=list)
    threshold: list[float] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    default_left: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    right: list[int] = field(default_factory=list)
    leaves: list[float] = field(default_factory=list)
    max_depth: int = 0          # internal nodes on the longest path from a root

    ARRAYS = ("slot", "threshold", "missing", "default_left", "left", "right")

    def to_json(self) -> dict:
        return {"roots": self.roots, "leaves": self.leaves, "max_depth": self.max_depth,
                "nodes": {name: getattr(self, name) for name in self.ARRAYS}}

    @classmethod
    def from_json(cls, document: Mapping) -> "Forest":
        nodes = document["nodes"]
        return cls(roots=list(document["roots"]), leaves=[float(v) for v in document["leaves"]],
                   max_depth=int(document["max_depth"]),
                   **{name: list(nodes[name]) for name in cls.ARRAYS})


def lightgbm_read(value: float) -> float:
    """The value LightGBM's dense predictor reads for `value` (tiny magnitudes become 0)."""
    return 0.0 if abs(value) <= ZERO_THRESHOLD else value


def goes_left(value: float, zero: float, threshold: float, missing: int,
              default_left: int) -> bool:
    """LightGBM's NumericalDecision on a read value; `zero` is what reads as 0 in the slot's
    space (1.0 for a log2 argument)."""
    if math.isnan(value):
        if missing == MISSING_NAN:
            return bool(default_left)
        value = zero
    if missing == MISSING_ZERO and value == zero:
        return bool(default_left)
    return value <= threshold


def check_model(dump: Mapping) -> None:
    """ForestError unless the model's prediction is the sum of numerical trees' leaves."""
    try:
        native_forest.check_model(dump)
    except ForestUnsupported as err:
        raise ForestError(f"{err}: not exportable") from None
    if not dump.get("tree_info"):
        raise ForestError("the model has no trees")


def convert(dump: Mapping, bindings: Sequence[Binding | None]) -> Forest:
    """The forest of `dump` (Booster.dump_model()) over slots: model feature f reads
    bindings[f] (None for a feature no split reads)."""
    check_model(dump)
    return convert_trees(dump["tree_info"], bindings)


def convert_trees(trees: Sequence[Mapping], bindings: Sequence[Binding | None]) -> Forest:
    """The forest of dump_model()'s "tree_info" entries, unchecked (convert checks a whole
    model first; a shortlist's tree is written by tilecast.runtime.shortlist)."""
    forest = Forest()
    log_nodes: list[int] = []
    for number, tree in enumerate(trees):
        _convert_tree(tree["tree_structure"], number, bindings, forest, log_nodes)
    if log_nodes:
        thresholds = np.array([forest.threshold[i] for i in log_nodes], dtype=np.float64)
        for node, bound in zip(log_nodes, log2_bounds(thresholds)):
            forest.threshold[node] = float(bound)
    return forest


def _convert_tree(root: Mapping, number: int, bindings: Sequence[Binding | None],
                  forest: Forest, log_nodes: list[int]) -> None:
    # (node, parent index or -1, which child, depth); nodes get their index in pre-order
    pending: list[tuple[Mapping, int, str, int]] = [(root, -1, "", 0)]
    while pending:
        node, parent, side, depth = pending.pop()
        node = _skip_constant_splits(node, number, bindings)
        if "split_feature" not in node:
            if "leaf_coeff" in node or "leaf_features" in node:
                raise ForestError(f"tree {number} is a linear tree; leaves must be constants")
            code = -1 - len(forest.leaves)
            forest.leaves.append(float(node["leaf_value"]))
        else:
            code = len(forest.slot)
            binding = bindings[node["split_feature"]]
            forest.slot.append(binding.slot)
            forest.threshold.append(float(node["threshold"]))
            forest.missing.append(MISSING_TYPES[node["missing_type"]])
            forest.default_left.append(int(bool(node["default_left"])))
            forest.left.append(0)
            forest.right.append(0)
            if binding.log2:
                log_nodes.append(code)
            forest.max_depth = max(forest.max_depth, depth + 1)
            pending.append((node["right_child"], code, "right", depth + 1))
            pending.append((node["left_child"], code, "left", depth + 1))
        if parent < 0:
            forest.roots.append(code)
        else:
            getattr(forest, side)[parent] = code


def _skip_constant_splits(node: Mapping, number: int,
                          bindings: Sequence[Binding | None]) -> Mapping:
    """The first node on `node`'s path that is a leaf or splits on a slot: a split on a
    constant is decided here."""
    while "split_feature" in node:
        if node.get("decision_type") != "<=":
            raise ForestError(f"tree {number} has a categorical split "
                              f"({node.get('decision_type')!r} on feature "
                              f"{node['split_feature']}); the exported selector handles "
                              "numerical splits ('<=') only")
        if node.get("missing_type") not in MISSING_TYPES:
            raise ForestError(f"tree {number}: unknown missing type {node.get('missing_type')!r}")
        binding = bindings[node["split_feature"]]
        if binding.constant is None:
            return node
        left = goes_left(lightgbm_read(binding.constant), 0.0, float(node["threshold"]),
                         MISSING_TYPES[node["missing_type"]], node["default_left"])
        node = node["left_child"] if left else node["right_child"]
    return node


def _largest_where(predicate: Callable[[np.ndarray], np.ndarray], count: int) -> np.ndarray:
    """Per lane, the largest float64 x in [0, inf) with predicate(x) true, for a predicate
    true at 0, false at +inf and monotone between (bisection on the bit patterns, which
    order non-negative float64 values)."""
    low = np.zeros(count, dtype=np.int64)
    high = np.full(count, INFINITY_BITS, dtype=np.int64)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        while (high - low > 1).any():
            middle = low + (high - low) // 2
            ok = predicate(middle.view(np.float64))
            low = np.where(ok, middle, low)
            high = np.where(ok, high, middle)
    return low.view(np.float64)


def log2_bounds(thresholds: np.ndarray) -> np.ndarray:
    """For each threshold t, the largest x >= 0 with np.log2(x) <= t: a split `log2(x) <= t`
    is `x <= bound` (x >= 0)."""
    thresholds = np.asarray(thresholds, dtype=np.float64)
    return _largest_where(lambda x: np.log2(x) <= thresholds, len(thresholds))


def raw_score_bound(inverse: Callable[[np.ndarray], np.ndarray]) -> float:
    """The largest raw score whose TFLOP/s (`inverse`, the dispatcher's target transform)
    is finite: above it the dispatcher counts a prediction as not finite."""
    return float(_largest_where(lambda x: np.isfinite(inverse(x)), 1)[0])


def split_features(dump: Mapping) -> set[int]:
    """The model features some split of `dump` reads."""
    used: set[int] = set()
    for tree in dump.get("tree_info", ()):
        pending = [tree["tree_structure"]]
        while pending:
            node = pending.pop()
            if "split_feature" in node:
                used.add(int(node["split_feature"]))
                pending += (node["left_child"], node["right_child"])
    return used
