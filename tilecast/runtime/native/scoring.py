"""Raw model scores of one problem's candidates, on the fastest path available.

Two stages, each native where it can be and the Python reference where it cannot:
features (a native filler registered for the engine in tilecast.runtime.native.FEATURE_FILLERS, else
the engine's numpy `combine`) and the forest (tilecast.runtime.native.forest, else Booster.predict).
Everything that does not depend on the problem is prepared in the constructor; a query
reuses preallocated buffers under a lock.
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence

import numpy as np

from tilecast.runtime.native import feature_filler
from tilecast.runtime.native.forest import ForestUnsupported, NativeForest
from tilecast.runtime.native.gemm_features import EngineMismatch
from tilecast.runtime.native.library import NativeBuildError

logger = logging.getLogger(__name__)


class CandidateScorer:
    """`raw_scores(problem, rows)` equals booster.predict of the engine's features of the
    candidates `rows` (kernel_matrix rows) with the model's columns `columns` (None: the
    engine's order). `forest` / `filler` are None where the Python reference is used, and
    `notes` says why."""

    def __init__(self, engine, kernel_matrix: np.ndarray, configs: Sequence, booster,
                 columns: np.ndarray | None, *, label: str = ""):
        self.engine = engine
        self.booster = booster
        self.notes: list[str] = []
        self._kernel_matrix = kernel_matrix
        self._configs = tuple(configs)
        self._columns = columns
        self._lock = threading.Lock()
        self.forest = self._native_forest(booster, columns, label)
        self.filler = self._native_filler(engine, kernel_matrix, label)
        self._scores = np.empty(max(len(kernel_matrix), 1), dtype=np.float64)
        self._scores_address = self._scores.ctypes.data
        self._all_rows = np.arange(len(kernel_matrix), dtype=np.int64)

    def _native_forest(self, booster, columns, label: str) -> NativeForest | None:
        try:
            return NativeForest(booster, columns)
        except NativeBuildError as err:
            note = f"{label}: the native forest could not be built; using Booster.predict ({err})"
            logger.warning(note)
        except ForestUnsupported as err:
            note = f"{label}: the native forest declines this model ({err}); using Booster.predict"
            logger.info(note)
        self.notes.append(note)
        return None

    def _native_filler(self, engine, kernel_matrix, label: str):
        try:
            return feature_filler(engine, kernel_matrix)
        except NativeBuildError as err:
            note = (f"{label}: the native {engine.name!r} features could not be built; using "
                    f"the numpy engine ({err})")
            logger.warning(note)
        except (LookupError, EngineMismatch) as err:
            note = f"{label}: {err}; using the numpy engine"
            logger.info(note)
        self.notes.append(note)
        return None

    def raw_scores(self, problem, rows: np.ndarray | None) -> np.ndarray:
        """Raw scores (a new array) of the candidates `rows` (int64 indices; None: all)."""
        count = len(self._kernel_matrix) if rows is None else len(rows)
        with self._lock:
            filled = self.filler is not None and self.filler.fill(
                problem, None if rows is None else rows.ctypes.data, count)
            if filled and self.forest is not None:
                self.forest.predict_into(self.filler.columns_address, count,
                                         self.filler.columns.shape[0], self.filler.stride,
                                         self._scores_address)
                return self._scores[:count].copy()
            if filled:
                features = self.filler.columns[:, :count].T
            else:
                index = self._all_rows if rows is None else rows
                features = self.engine.combine(problem, self.engine.problem_features(problem),
                                               self._kernel_matrix[index],
                                               [self._configs[i] for i in index])
            if self.forest is not None:
                by_column = np.ascontiguousarray(features.T)
                self.forest.predict_into(by_column.ctypes.data, count, by_column.shape[0],
                                         count, self._scores_address)
                return self._scores[:count].copy()
            if self._columns is not None:
                features = features[:, self._columns]
            # one thread: a few dozen rows gain nothing from OpenMP, and a dispatcher must
            # not compete for cores with the kernels it dispatches
            return np.asarray(self.booster.predict(features, num_threads=1), dtype=np.float64)
