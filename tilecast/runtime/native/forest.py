"""A LightGBM forest flattened into arrays and evaluated by forest.cpp.

`flatten` turns `Booster.dump_model()` into 16-byte nodes (threshold or leaf value, the
column the split reads, the missing-value mode, tree-relative children); `NativeForest`
evaluates them with the compiled library and returns what `Booster.predict` returns. What
the evaluator does not reproduce (categorical splits, linear trees, several trees per
iteration, averaged or transformed outputs) raises ForestUnsupported, so the caller keeps
the booster.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from tilecast.runtime.native import library

NODE_DTYPE = np.dtype([("value", "<f8"), ("feature", "<i4"), ("left", "<i2"),
                       ("right", "<i2")])
# (missing_type, default_left) -> node mode in forest.cpp (enum Mode); None ignores
# default_left; a leaf is mode LEAF_MODE
MISSING_MODES = {("None", False): 0, ("None", True): 0, ("Zero", False): 1, ("Zero", True): 2,
                 ("NaN", False): 3, ("NaN", True): 4}
LEAF_MODE = 7
MODE_SHIFT = 24
MAX_TREE_NODES = 2 ** 15 - 1      # children are int16
# objectives whose predict() is the raw score (regression with reg_sqrt squares it)
RAW_OBJECTIVES = ("regression", "regression_l1", "huber", "fair", "quantile", "mape")


class ForestUnsupported(ValueError):
    """The model has something the native evaluator does not reproduce; use the booster."""


class ForestView(ctypes.Structure):
    """struct TcForest in forest.cpp."""
    _fields_ = [("nodes", ctypes.c_void_p), ("tree_offsets", ctypes.c_void_p),
                ("n_trees", ctypes.c_int32), ("max_depth", ctypes.c_int32),
                ("general", ctypes.c_int32), ("portable", ctypes.c_int32),
                ("used_columns", ctypes.c_void_p), ("n_used", ctypes.c_int32),
                ("max_column", ctypes.c_int32)]


@dataclass(frozen=True)
class FlatForest:
    """Every tree of a model as one node array; see forest.cpp for the layout."""
    nodes: np.ndarray           # NODE_DTYPE
    tree_offsets: np.ndarray    # int32, first node of each tree
    tree_depths: np.ndarray     # int32, levels to the deepest leaf
    used_columns: np.ndarray    # int32, every column a split reads, once
    general: bool               # some node has missing type Zero or NaN


def check_model(model: Mapping) -> None:
    """ForestUnsupported unless the model's prediction is the plain sum of its trees'
    leaves (one tree per iteration, an objective whose raw score is the prediction, no
    averaging): what the native forest and `tilecast export` both compute."""
    objective = str(model.get("objective", "")).split()
    if not objective or objective[0] not in RAW_OBJECTIVES or "sqrt" in objective:
        raise ForestUnsupported(f"objective {model.get('objective')!r} transforms the raw "
                                f"score; supported: {', '.join(RAW_OBJECTIVES)}")
    if model.get("num_tree_per_iteration", 1) != 1:
        raise ForestUnsupported(f"{model['num_tree_per_iteration']} trees per iteration "
                                "(multiclass); a selector model has one")
    if model.get("average_output"):
        raise ForestUnsupported("averaged output (random-forest mode)")


def _flatten_tree(root: Mapping, columns: Sequence[int] | None, tree_index: int):
    """(records, depth) of one tree, nodes in pre-order (value, feature | mode, left, right)."""
    records: list[tuple[float, int, int, int]] = []
    depth = 0
    pending: list[tuple[Mapping, int, int, str]] = [(root, 0, -1, "")]
    while pending:
        node, level, parent, side = pending.pop()
        index = len(records)
        if parent >= 0:
            value, feature, left, right = records[parent]
            records[parent] = (value, feature, index, right) if side == "left" else (
                value, feature, left, index)
        depth = max(depth, level)
        if "split_feature" not in node:
            if "leaf_coeff" in node or "leaf_features" in node:
                raise ForestUnsupported(f"tree {tree_index} is a linear tree")
            records.append((float(node["leaf_value"]), LEAF_MODE << MODE_SHIFT, index, index))
            continue
        if node.get("decision_type") != "<=":
            raise ForestUnsupported(f"tree {tree_index} has a {node.get('decision_type')!r} "
                                    "(categorical) split; the native forest handles '<='")
        key = (str(node.get("missing_type")), bool(node.get("default_left")))
        if key not in MISSING_MODES:
            raise ForestUnsupported(f"tree {tree_index}: unknown missing type {key[0]!r}")
        column = int(node["split_feature"])
        if columns is not None:
            column = int(columns[column])
        records.append((float(node["threshold"]), column | MISSING_MODES[key] << MODE_SHIFT,
                        -1, -1))
        # right first, so the left subtree follows its parent in memory
        pending.append((node["right_child"], level + 1, index, "right"))
        pending.append((node["left_child"], level + 1, index, "left"))
    if len(records) > MAX_TREE_NODES:
        raise ForestUnsupported(f"tree {tree_index} has {len(records)} nodes; the native "
                                f"forest handles {MAX_TREE_NODES}")
    return records, depth


def flatten(model: Mapping[str, Any], columns: Sequence[int] | None = None) -> FlatForest:
    """A FlatForest from `Booster.dump_model()`. `columns[f]` is the column of the rows that
    holds model feature f (None: the same index); the nodes read those columns."""
    check_model(model)
    trees = model.get("tree_info", [])
    if not trees:
        raise ForestUnsupported("the model has no trees")
    if columns is not None and max(columns, default=0) >= 1 << MODE_SHIFT:
        raise ForestUnsupported(f"column {max(columns)} is out of the evaluator's range")
    records: list[tuple] = []
    offsets, depths = [], []
    for index, tree in enumerate(trees):
        tree_records, depth = _flatten_tree(tree["tree_structure"], columns, index)
        offsets.append(len(records))
        depths.append(depth)
        records.extend(tree_records)
    nodes = np.array(records, dtype=NODE_DTYPE)
    modes = nodes["feature"] >> MODE_SHIFT
    splits = modes != LEAF_MODE
    used = np.unique(nodes["feature"][splits] & ((1 << MODE_SHIFT) - 1)).astype(np.int32)
    return FlatForest(nodes=nodes, tree_offsets=np.array(offsets, dtype=np.int32),
                      tree_depths=np.array(depths, dtype=np.int32), used_columns=used,
                      general=bool((modes[splits] != 0).any()))


class NativeForest:
    """A booster's forest evaluated natively: `predict(x)` equals `booster.predict(x)` for
    rows whose column `columns[f]` holds model feature f. Raises ForestUnsupported for what
    it cannot reproduce and library.NativeBuildError when the library is not available.
    `portable=True` takes the scalar decisions even where AVX-512 exists (for tests)."""

    LIBRARY = "forest"   # its library (library.LIBRARIES), which a version carries prebuilt

    def __init__(self, booster, columns: Sequence[int] | None = None, *,
                 portable: bool = False):
        self.flat = flatten(booster.dump_model(), columns)
        self._lib = library.load(f"{self.LIBRARY}.cpp")
        self._predict = self._lib.tc_forest_predict
        self._predict.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self._predict.restype = ctypes.c_int
        flat = self.flat
        self._view = ForestView(
            nodes=flat.nodes.ctypes.data, tree_offsets=flat.tree_offsets.ctypes.data,
            n_trees=len(flat.tree_offsets), max_depth=int(flat.tree_depths.max()),
            general=int(flat.general), portable=int(portable),
            used_columns=flat.used_columns.ctypes.data, n_used=len(flat.used_columns),
            max_column=int(flat.used_columns.max(initial=0)))
        self._address = ctypes.addressof(self._view)
        self.n_trees = len(flat.tree_offsets)

    def predict_into(self, columns_address: int, n_rows: int, n_cols: int, stride: int,
                     out_address: int) -> None:
        """Raw scores of `n_rows` rows into the float64 buffer at `out_address`; feature c of
        row r is the float64 at columns_address + 8 * (c * stride + r) (the dispatcher's
        allocation-free path)."""
        if self._predict(self._address, columns_address, n_rows, n_cols, stride,
                         out_address) != 0:
            raise ValueError(f"{n_cols} feature columns with stride {stride} for {n_rows} "
                             f"rows; the forest reads column {self._view.max_column}")

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Raw scores (= Booster.predict for the objectives this class accepts) of rows x."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2:
            raise ValueError(f"x must be a 2-D matrix, got shape {x.shape}")
        by_column = np.ascontiguousarray(x.T)
        out = np.empty(x.shape[0], dtype=np.float64)
        self.predict_into(by_column.ctypes.data, x.shape[0], x.shape[1], x.shape[0],
                          out.ctypes.data)
        return out
