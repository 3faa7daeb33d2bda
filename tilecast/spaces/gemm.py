"""GEMM's dtype and vector-ISA tables (kernels/cpu/gemm/gemm_simd.hpp, gemm_config.hpp): shared by
the family (tilecast.families.gemm, which also holds the micro-kernel table) and its feature
engine (tilecast.features.gemm), so neither imports the other."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dtype:
    """One input dtype: its TC_DTYPE code, stored element size, the tolerance against the
    float64 torch reference (norm-relative error) and the CPU flags it needs."""
    code: int
    element_bytes: int
    tolerance: float
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Isa:
    """One vector ISA of kernels/cpu/gemm/gemm_simd.hpp: its TC_ISA code, fp32 lanes and
    architectural registers (gemm_config.hpp's TC_VEC_WIDTH / TC_VEC_REGS), and the CPU flags
    it needs (as /proc/cpuinfo spells them)."""
    code: int
    vector_floats: int
    registers: int
    flags: tuple[str, ...]


DTYPES = {"fp32": Dtype(0, 4, 1e-4), "bf16": Dtype(1, 2, 1e-3, ("avx512_bf16",))}
ISAS = {"avx2": Isa(0, 8, 16, ("avx2", "fma")), "avx512": Isa(1, 16, 32, ("avx512f",))}
PARALLEL = {"m": 0, "n": 1, "k": 2}        # name -> TC_PAR (k = split-K)
LAYOUTS = ("row", "col")
