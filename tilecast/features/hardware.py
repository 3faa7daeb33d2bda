"""Hardware features shared by every family's engine: the machine profile as numbers."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

# Each hardware feature once, with its formula over (profile, CPU flags); the column order.
HARDWARE_COLUMNS: tuple[tuple[str, Callable[[Mapping, set], float]], ...] = (
    ("hw_threads", lambda hw, flags: float(hw.get("threads", 1))),
    ("hw_simd_bits", lambda hw, flags: float(hw.get("simd_bits", 256))),
    ("hw_l1d_kib", lambda hw, flags: hw.get("l1d_bytes", 0) / 1024),
    ("hw_l2_kib", lambda hw, flags: hw.get("l2_bytes", 0) / 1024),
    ("hw_l3_kib", lambda hw, flags: hw.get("l3_bytes", 0) / 1024),
    ("hw_clock_mhz", lambda hw, flags: float(hw.get("clock_mhz", 0.0))),
    ("hw_has_avx512", lambda hw, flags: float("avx512f" in flags)),
    ("hw_has_avx512_bf16", lambda hw, flags: float("avx512_bf16" in flags)),
)
HARDWARE_FEATURES = tuple(name for name, _ in HARDWARE_COLUMNS)


def hardware_vector(hardware: Mapping) -> np.ndarray:
    """The profile (tilecast.core.hardware.profile) in HARDWARE_FEATURES order."""
    flags = set(hardware.get("flags", ()))
    return np.array([formula(hardware, flags) for _, formula in HARDWARE_COLUMNS],
                    dtype=np.float64)


def names(columns: Sequence[tuple[str, Callable]]) -> tuple[str, ...]:
    """The feature names of a (name, formula) table, in its order."""
    return tuple(name for name, _ in columns)


def evaluate(columns: Sequence[tuple[str, Callable]], terms, count: int) -> np.ndarray:
    """A (count, len(columns)) float64 block: each formula applied to `terms`, a scalar
    broadcast down its column."""
    block = np.empty((count, len(columns)), dtype=np.float64)
    for index, (_, formula) in enumerate(columns):
        block[:, index] = formula(terms)
    return block


class EngineBase:
    """What every feature engine shares: the hardware features (by name in `hw`, as a vector
    in `_hw`) and the column order problem + kernel + interaction + hardware, from the
    subclass's name tuples."""
    _problem_names: tuple[str, ...] = ()
    _kernel_names: tuple[str, ...] = ()
    _interaction_names: tuple[str, ...] = ()

    def __init__(self, hardware: Mapping):
        self.hardware = dict(hardware)
        self._hw = hardware_vector(hardware)
        self.hw = dict(zip(HARDWARE_FEATURES, self._hw))

    def feature_names(self) -> list[str]:
        return [*self._problem_names, *self._kernel_names,
                *self._interaction_names, *HARDWARE_FEATURES]

    def problem_feature_names(self) -> list[str]:
        """The names of problem_features' columns: what depends on the problem alone."""
        return list(self._problem_names)

    def stack(self, problem_row: np.ndarray, kernel_matrix: np.ndarray,
              interactions: np.ndarray) -> np.ndarray:
        """The full matrix: the problem row and the hardware vector repeated on every kernel's
        row, around its kernel and interaction features."""
        count = kernel_matrix.shape[0]
        return np.hstack([np.broadcast_to(problem_row, (count, problem_row.size)), kernel_matrix,
                          interactions, np.broadcast_to(self._hw, (count, self._hw.size))])
