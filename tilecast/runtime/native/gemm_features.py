"""The GEMM engine's feature matrix for all candidates of one problem, filled by
gemm_features.cpp; the numpy engine (tilecast.features.gemm) stays the reference.

The formulas in C++ (gemm_features_formulas.hpp) are generated from the engine's own
(tilecast.runtime.native.codegen). NativeGemmFeatures runs only the engine they were
generated for (WRITTEN_FOR) and only while the checked-in header is what the formulas
generate now: a change to gemm.py that was not regenerated switches the dispatcher back to
the numpy engine instead of computing stale features.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Sequence

import numpy as np

from tilecast.features import gemm as definition
from tilecast.features.hardware import HARDWARE_FEATURES, hardware_vector
from tilecast.runtime.native import codegen, library

_ENGINE = definition.GemmFeatureEngine
# (engine name, version, feature names) that gemm_features.cpp computes, in its column order
WRITTEN_FOR = (_ENGINE.name, _ENGINE.version, (
    *definition.PROBLEM_FEATURES, *definition.KERNEL_FEATURES,
    *definition.INTERACTION_FEATURES, *HARDWARE_FEATURES))
LAYOUT = codegen.layout(codegen.gemm())
SCALAR_LOGS, ROW_LOGS = len(LAYOUT.scalar_logs), len(LAYOUT.row_logs)
MAX_DIM = 1 << 30               # kMaxDim: larger problems take the numpy engine


@functools.lru_cache(maxsize=None)
def _stale_header() -> str | None:
    """Why the checked-in header cannot be used (it is not what the formulas generate), or
    None when it can."""
    family = codegen.gemm()
    path = codegen.header_path(family)
    try:
        if path.read_text() == codegen.header(family):
            return None
    except OSError as err:
        return f"cannot read {path.name}: {err}"
    return (f"{path.name} is not what the formulas of tilecast.features.gemm generate; run "
            "python -m tilecast.runtime.native.generate")


class EngineMismatch(ValueError):
    """The engine is not the one gemm_features.cpp was generated for, or its generated
    header is stale."""


class NativeGemmFeatures:
    """Fills the feature matrix of one problem x the candidates `rows` into `self.columns`
    (column-major: feature c of row r is columns[c, r]), equal to
    engine.combine(problem, engine.problem_features(problem), kernel_matrix[rows]).
    Not thread-safe: one buffer per instance."""

    LIBRARY = "gemm_features"   # its library (library.LIBRARIES), which a version carries prebuilt

    def __init__(self, engine, kernel_matrix: np.ndarray):
        name, version, names = WRITTEN_FOR
        if (engine.name, engine.version) != (name, version) or \
                tuple(engine.feature_names()) != names:
            raise EngineMismatch(f"engine {engine.name!r} version {engine.version} with "
                                 f"{len(engine.feature_names())} features is not the "
                                 f"{name!r} version {version} that gemm_features.cpp computes")
        stale = _stale_header()
        if stale is not None:
            raise EngineMismatch(f"gemm_features.cpp cannot run: {stale}")
        kernel_matrix = np.asarray(kernel_matrix, dtype=np.float64)
        self.n_kernels = kernel_matrix.shape[0]
        self._kernel_columns = np.ascontiguousarray(kernel_matrix.T)
        self._hardware = np.ascontiguousarray(hardware_vector(engine.hardware))
        self.columns = np.zeros((len(names), max(self.n_kernels, 1)), dtype=np.float64)
        # the hardware features are the same in every row: stored once
        self.columns[-len(self._hardware):] = self._hardware[:, None]
        self._kernels_of_all = False  # whether `columns` holds every kernel's features
        self._logs = np.zeros(SCALAR_LOGS + ROW_LOGS * max(self.n_kernels, 1))
        self._log_views: dict[int, np.ndarray] = {}
        lib = library.load(f"{self.LIBRARY}.cpp")
        self._fill = lib.tc_gemm_features
        self._fill.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self._fill.restype = ctypes.c_int
        self._put_logs = lib.tc_gemm_put_logs
        self._put_logs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_int64]
        self._put_logs.restype = None
        built = lib.tc_gemm_layout
        built.argtypes, built.restype = [ctypes.c_int64], ctypes.c_int64
        expected = (len(names), len(LAYOUT.inputs), SCALAR_LOGS, ROW_LOGS)
        if tuple(built(i) for i in range(4)) != expected:
            raise EngineMismatch(f"gemm_features.cpp was built with columns, inputs and logs "
                                 f"{tuple(built(i) for i in range(4))}, not {expected}")
        self._inputs = np.zeros(len(LAYOUT.inputs), dtype=np.float64)
        self._pointers = (self._kernel_columns.ctypes.data, self._hardware.ctypes.data,
                          self.columns.ctypes.data, self._logs.ctypes.data,
                          self._inputs.ctypes.data)
        self.stride = self.columns.shape[1]
        self.columns_address = self.columns.ctypes.data

    def fill(self, problem, rows_address: int | None, n_rows: int) -> bool:
        """Compute the features of the `n_rows` candidates whose int64 indices are at
        `rows_address` (None: candidates 0..n_rows-1) into `self.columns[:, :n_rows]`.
        False (nothing written) when the problem is beyond what the native code handles."""
        if max(problem.m, problem.n, problem.k) > MAX_DIM or n_rows > self.n_kernels:
            return False
        kernel_columns, hardware, columns, logs, inputs = self._pointers
        copy_kernels = rows_address is not None or not self._kernels_of_all
        self._inputs[:] = tuple(definition.problem_values(problem).values())
        if self._fill(inputs, kernel_columns, self.n_kernels, rows_address, n_rows,
                      copy_kernels, hardware, columns, self.stride, logs) != 0:
            self._kernels_of_all = False
            return False
        self._kernels_of_all = rows_address is None and n_rows == self.n_kernels
        view = self._log_views.get(n_rows)
        if view is None:
            view = self._log_views[n_rows] = self._logs[:SCALAR_LOGS + ROW_LOGS * n_rows]
        np.log2(view, out=view)
        self._put_logs(logs, n_rows, columns, self.stride)
        return True

    def matrix(self, problem, rows: Sequence[int] | None = None) -> np.ndarray:
        """The row-major feature matrix (a copy) of `rows` (None: every candidate); the
        convenience form of `fill` for tests and checks."""
        index = None if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
        count = self.n_kernels if index is None else len(index)
        if not self.fill(problem, None if index is None else index.ctypes.data, count):
            raise ValueError(f"problem {problem} is beyond the native GEMM features "
                             f"(dimensions up to {MAX_DIM})")
        return self.columns[:, :count].T.copy()
