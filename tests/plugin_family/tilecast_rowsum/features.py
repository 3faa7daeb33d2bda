"""The rowsum family's feature engine: problem, kernel, interaction and hardware features in a
fixed order (tilecast's EngineBase supplies the hardware columns and the stacking)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tilecast.features.hardware import EngineBase, names

# over one RowsumProblem
PROBLEM_COLUMNS = (
    ("log2_m", lambda p: np.log2(p.m)),
    ("log2_n", lambda p: np.log2(p.n)),
    ("log2_bytes", lambda p: np.log2(4.0 * p.m * p.n)),
    ("stride_ratio", lambda p: p.ld / p.n),
)
# over one RowsumConfig
KERNEL_COLUMNS = (
    ("accumulators", lambda c: float(c.accumulators)),
    ("rows", lambda c: float(c.rows)),
    ("threaded", lambda c: float(c.parallel == "threads")),
)


def _interactions(problem, kernel: np.ndarray, threads: float) -> np.ndarray:
    """Per kernel row: the share of a row left to the scalar tail, the share of rows left
    outside whole row blocks, and the row blocks each thread gets (log2)."""
    accumulators, rows, threaded = kernel[:, 0], kernel[:, 1], kernel[:, 2]
    tail = (problem.n % accumulators) / problem.n
    leftover_rows = (problem.m % rows) / problem.m
    blocks = np.floor(problem.m / rows)
    per_thread = np.where(threaded > 0, np.ceil(blocks / max(threads, 1.0)), blocks)
    return np.column_stack([tail, leftover_rows, np.log2(per_thread + 1.0)])


class RowsumFeatureEngine(EngineBase):
    """Features for (RowsumProblem, RowsumConfig) pairs."""
    name = "rowsum"
    version = 1
    _problem_names = names(PROBLEM_COLUMNS)
    _kernel_names = names(KERNEL_COLUMNS)
    _interaction_names = ("tail_share", "leftover_row_share", "log2_blocks_per_thread")

    def kernel_features(self, configs: Sequence) -> np.ndarray:
        rows = [[formula(c) for _, formula in KERNEL_COLUMNS] for c in configs]
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(KERNEL_COLUMNS))

    def problem_features(self, problem) -> np.ndarray:
        return np.array([formula(problem) for _, formula in PROBLEM_COLUMNS], dtype=np.float64)

    def combine(self, problem, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence = ()) -> np.ndarray:
        """One row per kernel for this problem: problem, kernel, interaction, hardware."""
        interactions = _interactions(problem, kernel_matrix, self.hw["hw_threads"])
        return self.stack(problem_row, kernel_matrix, interactions)
