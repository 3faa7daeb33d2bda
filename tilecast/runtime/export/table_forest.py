"""A table model's booster (Booster.dump_model()) as flat arrays over its feature vector,
categorical splits included, for the exported table selector (tilecast.runtime.export.table).

Unlike a GEMM forest (tilecast.runtime.export.forest) nothing is folded at export: a node
reads one entry of the candidate's feature vector, which holds the float32 value LightGBM's
dense predictor reads (the dispatcher's feature matrix is float32). A node decides as
LightGBM 4's Tree does:

- numerical (decision '<='): a value with |x| <= kZeroThreshold reads as 0; NaN reads as 0
  unless the node's missing type is NaN; a missing value (0 for missing type Zero, NaN for
  NaN) follows the node's default direction; otherwise left when x <= threshold;
- categorical (decision '=='; the dump lists the categories that go left): NaN and a
  negative value go right; otherwise left when int(x) is one of the listed categories (a
  bitset of 32-bit words per node, as LightGBM stores it).

A leaf is -1 - its index in `leaves`; a booster's score is its trees' leaves summed in tree
order from 0.0, as LightGBM sums them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from tilecast.runtime.export.forest import MISSING_TYPES, ForestError, check_model

CATEGORICAL, DEFAULT_LEFT = 1, 2          # bits of a node's flags; the missing type is << 2


@dataclass
class TableForest:
    """One booster's nodes. flags: CATEGORICAL | DEFAULT_LEFT | missing type << 2; a
    categorical node's `threshold` is its index into `cat_boundaries`."""
    roots: list[int] = field(default_factory=list)
    feature: list[int] = field(default_factory=list)
    threshold: list[float] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    right: list[int] = field(default_factory=list)
    leaves: list[float] = field(default_factory=list)
    cat_boundaries: list[int] = field(default_factory=lambda: [0])
    cat_words: list[int] = field(default_factory=list)

    ARRAYS = ("roots", "feature", "threshold", "flags", "left", "right", "leaves",
              "cat_boundaries", "cat_words")

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in self.ARRAYS}

    @classmethod
    def from_json(cls, document: Mapping) -> "TableForest":
        forest = cls(**{name: list(document[name]) for name in cls.ARRAYS})
        forest.threshold = [float(v) for v in forest.threshold]
        forest.leaves = [float(v) for v in forest.leaves]
        return forest

    def features(self) -> set[int]:
        """The feature indices some split reads."""
        return set(self.feature)


def convert(dump: Mapping) -> TableForest:
    """The TableForest of Booster.dump_model(); ForestError for what it cannot hold (several
    trees per iteration, linear trees)."""
    check_model(dump)
    forest = TableForest()
    for number, tree in enumerate(dump["tree_info"]):
        forest.roots.append(_convert_tree(tree["tree_structure"], number, forest))
    return forest


def _convert_tree(root: Mapping, number: int, forest: TableForest) -> int:
    # (node, parent index or -1, which child); nodes numbered in pre-order
    pending: list[tuple[Mapping, int, str]] = [(root, -1, "")]
    root_code = 0
    while pending:
        node, parent, side = pending.pop()
        if "split_feature" not in node:
            if "leaf_coeff" in node or "leaf_features" in node:
                raise ForestError(f"tree {number} is a linear tree; leaves must be constants")
            code = -1 - len(forest.leaves)
            forest.leaves.append(float(node["leaf_value"]))
        else:
            code = len(forest.feature)
            missing = node.get("missing_type")
            if missing not in MISSING_TYPES:
                raise ForestError(f"tree {number}: unknown missing type {missing!r}")
            flags = MISSING_TYPES[missing] << 2 | (DEFAULT_LEFT if node["default_left"] else 0)
            decision = node.get("decision_type")
            if decision == "<=":
                threshold = float(node["threshold"])
            elif decision == "==":
                flags |= CATEGORICAL
                threshold = float(len(forest.cat_boundaries) - 1)
                forest.cat_words += _bitset(node["threshold"], number)
                forest.cat_boundaries.append(len(forest.cat_words))
            else:
                raise ForestError(f"tree {number}: unknown decision type {decision!r}")
            forest.feature.append(int(node["split_feature"]))
            forest.threshold.append(threshold)
            forest.flags.append(flags)
            forest.left.append(0)
            forest.right.append(0)
            pending.append((node["right_child"], code, "right"))
            pending.append((node["left_child"], code, "left"))
        if parent < 0:
            root_code = code
        else:
            getattr(forest, side)[parent] = code
    return root_code


def _bitset(categories: str, number: int) -> list[int]:
    """32-bit words with bit c set for each category c of a dump's '1||4||9' threshold."""
    try:
        values = [int(part) for part in str(categories).split("||")]
    except ValueError:
        raise ForestError(f"tree {number}: unreadable categorical threshold "
                          f"{categories!r}") from None
    if min(values) < 0:
        raise ForestError(f"tree {number}: negative category in {categories!r}")
    words = [0] * (max(values) // 32 + 1)
    for value in values:
        words[value // 32] |= 1 << (value % 32)
    return words
