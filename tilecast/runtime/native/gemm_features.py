"""The GEMM engine's feature matrix for all candidates of one problem, filled by
gemm_features.cpp; the numpy engine (tilecast.features.gemm) stays the reference.

The native code was written for one engine version and its exact feature names (WRITTEN_FOR);
NativeGemmFeatures refuses any other engine, so a change to gemm.py that is not carried into
gemm_features.cpp switches the dispatcher back to the numpy engine instead of computing stale
features.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from tilecast.features.hardware import hardware_vector
from tilecast.runtime.native import library

# (engine name, version, feature names) that gemm_features.cpp computes, in its column order
WRITTEN_FOR = ("gemm", 2, (
    "m", "n", "k", "log2_m", "log2_n", "log2_k", "log2_flops", "log2_bytes",
    "log2_intensity", "log2_m_over_n", "log2_min_mn", "is_bf16", "a_col_major", "b_col_major",
    "is_avx512", "mr", "nr", "mc", "nc", "kc", "tile_area", "par_m", "par_n", "par_k",
    "pack_a", "prefetch", "log2_a_block_bytes", "log2_b_panel_bytes", "log2_b_micro_bytes",
    "tile_loads_per_fma",
    "m_tile_eff", "n_tile_eff", "tile_eff", "log2_m_tiles", "log2_n_tiles", "k_blocks",
    "k_tail_frac", "m_blocks", "n_blocks", "log2_par_units", "par_balance", "par_busy_frac",
    "log2_barriers", "log2_barriers_per_mflop", "k_per_thread", "a_block_l2_ratio",
    "b_panel_l3_ratio", "b_micro_l1_ratio", "log2_flops_per_thread", "splitk_reduce_ratio",
    "a_pack_traffic_ratio", "b_pack_traffic_ratio", "c_traffic_ratio", "a_strided_unpacked",
    "a_col_unpacked", "log2_est_ms",
    "hw_threads", "hw_simd_bits", "hw_l1d_kib", "hw_l2_kib", "hw_l3_kib", "hw_clock_mhz",
    "hw_has_avx512", "hw_has_avx512_bf16"))
SCALAR_LOGS, ROW_LOGS = 9, 6    # kScalarLogs, kRowLogs in gemm_features.cpp
MAX_DIM = 1 << 30               # kMaxDim: larger problems take the numpy engine


class EngineMismatch(ValueError):
    """The engine is not the one gemm_features.cpp was written for."""


class NativeGemmFeatures:
    """Fills the feature matrix of one problem x the candidates `rows` into `self.columns`
    (column-major: feature c of row r is columns[c, r]), equal to
    engine.combine(problem, engine.problem_features(problem), kernel_matrix[rows]).
    Not thread-safe: one buffer per instance."""

    def __init__(self, engine, kernel_matrix: np.ndarray):
        name, version, names = WRITTEN_FOR
        if (engine.name, engine.version) != (name, version) or \
                tuple(engine.feature_names()) != names:
            raise EngineMismatch(f"engine {engine.name!r} version {engine.version} with "
                                 f"{len(engine.feature_names())} features is not the "
                                 f"{name!r} version {version} that gemm_features.cpp computes")
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
        lib = library.load("gemm_features.cpp")
        self._fill = lib.tc_gemm_features
        self._fill.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int32] * 3 + [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self._fill.restype = ctypes.c_int
        self._put_logs = lib.tc_gemm_put_logs
        self._put_logs.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_int64]
        self._put_logs.restype = None
        self._pointers = (self._kernel_columns.ctypes.data, self._hardware.ctypes.data,
                          self.columns.ctypes.data, self._logs.ctypes.data)
        self.stride = self.columns.shape[1]
        self.columns_address = self.columns.ctypes.data

    def fill(self, problem, rows_address: int | None, n_rows: int) -> bool:
        """Compute the features of the `n_rows` candidates whose int64 indices are at
        `rows_address` (None: candidates 0..n_rows-1) into `self.columns[:, :n_rows]`.
        False (nothing written) when the problem is beyond what the native code handles."""
        if max(problem.m, problem.n, problem.k) > MAX_DIM or n_rows > self.n_kernels:
            return False
        kernel_columns, hardware, columns, logs = self._pointers
        copy_kernels = rows_address is not None or not self._kernels_of_all
        if self._fill(problem.m, problem.n, problem.k, problem.dtype == "bf16",
                      problem.layout_a == "col", problem.layout_b == "col", kernel_columns,
                      self.n_kernels, rows_address, n_rows, copy_kernels, hardware, columns,
                      self.stride, logs) != 0:
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
