"""Hardware features shared by every family's engine: the machine profile as numbers."""
from __future__ import annotations

from typing import Mapping

import numpy as np

HARDWARE_FEATURES = ("hw_threads", "hw_simd_bits", "hw_l1d_kib", "hw_l2_kib", "hw_l3_kib",
                     "hw_clock_mhz", "hw_has_avx512", "hw_has_avx512_bf16")


def hardware_vector(hardware: Mapping) -> np.ndarray:
    """The profile (tilecast.core.hardware.profile) in HARDWARE_FEATURES order."""
    flags = set(hardware.get("flags", ()))
    return np.array([
        float(hardware.get("threads", 1)), float(hardware.get("simd_bits", 256)),
        hardware.get("l1d_bytes", 0) / 1024, hardware.get("l2_bytes", 0) / 1024,
        hardware.get("l3_bytes", 0) / 1024, float(hardware.get("clock_mhz", 0.0)),
        float("avx512f" in flags), float("avx512_bf16" in flags)], dtype=np.float64)


class EngineBase:
    """What every feature engine shares: the hardware vector and the column order
    problem + kernel + interaction + hardware, from the subclass's name tuples."""
    _problem_names: tuple[str, ...] = ()
    _kernel_names: tuple[str, ...] = ()
    _interaction_names: tuple[str, ...] = ()

    def __init__(self, hardware: Mapping):
        self.hardware = dict(hardware)
        self._hw = hardware_vector(hardware)

    def feature_names(self) -> list[str]:
        return [*self._problem_names, *self._kernel_names,
                *self._interaction_names, *HARDWARE_FEATURES]
