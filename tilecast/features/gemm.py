"""GEMM feature engine: problem, kernel, interaction and hardware features, in a fixed order.

The interactions mirror how `kernels/cpu/gemm/gemm_parallel.hpp` shares out the work: padding waste
of the micro-tile on the edges; the work units each parallel scheme splits across threads
(MR-row panels for `m`, NR-column panels of one NC block for `n`, K for split-K) and how
evenly they divide; the barriers each scheme pays per block; packing and C traffic per
flop; and how the packed panels compare with the cache sizes.

The problem and interaction features are written once, as expression graphs (`formulas`,
tilecast.features.formula): the engine evaluates them with numpy, `tilecast export` prints
them as C (tilecast.runtime.export.gemm) and the native scorer's C++ is generated from them
(tilecast.runtime.native.codegen). The kernel features are functions of a GemmConfig, taken
from this engine by the other two.

Problems are GemmFamily.problem's: m, n, k >= 1 with A, B and C (fp32) at most
MAX_OPERAND_BYTES, so every size and byte count below is a whole number below 2**53 and
exact in float64.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tilecast.spaces.gemm import DTYPES, ISAS, LAYOUTS
from tilecast.features.formula import (Evaluator, Formula, apply, hardware_field,
                                       kernel_column, problem_field)
from tilecast.features.hardware import EngineBase, names

PACKED_BYTES = 4  # panels are packed as fp32 for every dtype

# A problem as numbers, the formulas' inputs (and the exported selector's arguments): a coded
# field is the index of its value (dtype: its TC_DTYPE code).
DTYPE_CODES = {name: dtype.code for name, dtype in DTYPES.items()}
LAYOUT_CODES = {name: index for index, name in enumerate(LAYOUTS)}
FIELD_CODES = {"m": None, "n": None, "k": None, "dtype": DTYPE_CODES,
               "layout_a": LAYOUT_CODES, "layout_b": LAYOUT_CODES}


def problem_values(problem) -> dict[str, float]:
    """A GemmProblem as the formulas' inputs (floats; coded fields as their codes)."""
    return {name: float(getattr(problem, name) if codes is None
                        else codes[getattr(problem, name)])
            for name, codes in FIELD_CODES.items()}


# over one GemmConfig
KERNEL_COLUMNS = (
    ("is_avx512", lambda c: float(c.isa == "avx512")),
    ("mr", lambda c: c.mr),
    ("nr", lambda c: c.nr),
    ("mc", lambda c: c.mc),
    ("nc", lambda c: c.nc),
    ("kc", lambda c: c.kc),
    ("tile_area", lambda c: c.mr * c.nr),
    ("par_m", lambda c: float(c.parallel == "m")),
    ("par_n", lambda c: float(c.parallel == "n")),
    ("par_k", lambda c: float(c.parallel == "k")),
    ("pack_a", lambda c: float(c.pack_a)),
    ("prefetch", lambda c: float(c.prefetch)),
    ("log2_a_block_bytes", lambda c: np.log2(c.mc * c.kc * PACKED_BYTES)),
    ("log2_b_panel_bytes", lambda c: np.log2(c.kc * c.nc * PACKED_BYTES)),
    ("log2_b_micro_bytes", lambda c: np.log2(c.kc * c.nr * PACKED_BYTES)),
    # vector loads (one A broadcast per row, NR/width B vectors) per FMA of the tile
    ("tile_loads_per_fma",
     lambda c: (c.mr + c.nr / ISAS[c.isa].vector_floats) / (c.mr * c.nr)),
)
KERNEL_FEATURES = names(KERNEL_COLUMNS)


def formulas() -> tuple[dict[str, Formula], dict[str, Formula]]:
    """(problem features, interaction features): {name: Formula} each, in column order. The
    one definition of these features; see the module docstring."""
    m, n, k = problem_field("m"), problem_field("n"), problem_field("k")
    col = float(LAYOUT_CODES["col"])
    is_bf16 = apply("eq", problem_field("dtype"), DTYPE_CODES["bf16"])
    a_col = apply("eq", problem_field("layout_a"), col)
    b_col = apply("eq", problem_field("layout_b"), col)
    elt = apply("select", is_bf16, 2.0, 4.0)
    flops = 2.0 * m * n * k
    nbytes = elt * (m * k + k * n) + 4.0 * m * n
    problem = {
        "m": Formula(m), "n": Formula(n), "k": Formula(k),
        "log2_m": Formula(m, log2=True), "log2_n": Formula(n, log2=True),
        "log2_k": Formula(k, log2=True),
        "log2_flops": Formula(flops, log2=True), "log2_bytes": Formula(nbytes, log2=True),
        "log2_intensity": Formula(flops / nbytes, log2=True),
        "log2_m_over_n": Formula(m / n, log2=True),
        "log2_min_mn": Formula(apply("min", m, n), log2=True),
        "is_bf16": Formula(is_bf16), "a_col_major": Formula(a_col),
        "b_col_major": Formula(b_col),
    }

    kf = {name: kernel_column(name) for name in KERNEL_FEATURES}
    mr, nr, mc, nc, kc = kf["mr"], kf["nr"], kf["mc"], kf["nc"], kf["kc"]
    par_m, par_n, par_k = kf["par_m"], kf["par_n"], kf["par_k"]
    threads = apply("max", hardware_field("hw_threads"), 1.0)
    m_tiles, n_tiles = apply("ceil_div", m, mr), apply("ceil_div", n, nr)
    m_eff, n_eff = m / (m_tiles * mr), n / (n_tiles * nr)
    # split-K runs the blocked loops on k / threads per thread
    k_thread = apply("select", apply("gt", par_k, 0.0), apply("ceil_div", k, threads), k)
    k_blocks = apply("ceil_div", k_thread, kc)
    k_tail = (k_blocks * kc - k_thread) / (k_blocks * kc)
    m_blocks, n_blocks = apply("ceil_div", m, mc), apply("ceil_div", n, nc)
    n_panels = apply("ceil_div", apply("min", n, nc), nr)
    units = apply("max", par_m * m_tiles + par_n * n_panels
                  + par_k * apply("min", threads, k), 1.0)
    balance = units / (apply("ceil_div", units, threads) * threads)
    busy = apply("min", units, threads) / threads
    # barriers: m and n sync after each B block (n also around each shared A block)
    barriers = (par_m * n_blocks * k_blocks + par_n * n_blocks * k_blocks * m_blocks * 2.0
                + par_k * 1.0) + 1.0
    kc_eff = apply("min", kc, k_thread)
    a_block = apply("min", mc, m_tiles * mr) * kc_eff * 4.0
    b_panel = kc_eff * apply("min", nc, n_tiles * nr) * 4.0
    b_micro = kc_eff * nr * 4.0
    l1, l2, l3 = (apply("max", hardware_field(name) * 1024.0, 1.0)
                  for name in ("hw_l1d_kib", "hw_l2_kib", "hw_l3_kib"))
    # A is repacked for every NC block; B once per (jc, pc) (per thread for split-K)
    a_pack = kf["pack_a"] * m * k * n_blocks / flops
    c_traffic = m * n * k_blocks * (1.0 + par_k * (threads - 1.0)) / flops
    est_s = flops / (threads * 32.0 * hardware_field("hw_clock_mhz") * 1e6 * busy * m_eff
                     * n_eff + 1.0)
    a_col_unpacked = (1.0 - kf["pack_a"]) * a_col
    interaction = {
        "m_tile_eff": Formula(m_eff), "n_tile_eff": Formula(n_eff),
        "tile_eff": Formula(m_eff * n_eff),
        "log2_m_tiles": Formula(m_tiles, log2=True), "log2_n_tiles": Formula(n_tiles, log2=True),
        "k_blocks": Formula(k_blocks), "k_tail_frac": Formula(k_tail),
        "m_blocks": Formula(m_blocks), "n_blocks": Formula(n_blocks),
        "log2_par_units": Formula(units, log2=True), "par_balance": Formula(balance),
        "par_busy_frac": Formula(busy), "log2_barriers": Formula(barriers, log2=True),
        "log2_barriers_per_mflop": Formula(barriers / (flops / 1e6), log2=True),
        "k_per_thread": Formula(k_thread), "a_block_l2_ratio": Formula(a_block / l2),
        "b_panel_l3_ratio": Formula(b_panel / l3), "b_micro_l1_ratio": Formula(b_micro / l1),
        "log2_flops_per_thread": Formula(flops / threads, log2=True),
        "splitk_reduce_ratio": Formula(par_k * (m * n * threads) / flops),
        "a_pack_traffic_ratio": Formula(a_pack), "b_pack_traffic_ratio": Formula(k * n / flops),
        "c_traffic_ratio": Formula(c_traffic), "a_strided_unpacked": Formula(a_col_unpacked),
        "a_col_unpacked": Formula(a_col_unpacked * mr),
        "log2_est_ms": Formula(est_s * 1e3 + 1e-9, log2=True),
    }
    return problem, interaction


PROBLEM_FORMULAS, INTERACTION_FORMULAS = formulas()
PROBLEM_FEATURES = tuple(PROBLEM_FORMULAS)
INTERACTION_FEATURES = tuple(INTERACTION_FORMULAS)


class GemmFeatureEngine(EngineBase):
    """Features for (GemmProblem, GemmConfig) pairs; see the module docstring."""
    name = "gemm"
    version = 2

    _problem_names = PROBLEM_FEATURES
    _kernel_names = KERNEL_FEATURES
    _interaction_names = INTERACTION_FEATURES
    _problem_evaluator = Evaluator(PROBLEM_FORMULAS)
    _interaction_evaluator = Evaluator(INTERACTION_FORMULAS)

    def __init__(self, hardware):
        super().__init__(hardware)
        self._hardware_floats = {name: float(value) for name, value in self.hw.items()}

    def kernel_features(self, configs: Sequence) -> np.ndarray:
        """One row per kernel (computed once per candidate pool, reused for every problem)."""
        rows = [[formula(c) for _, formula in KERNEL_COLUMNS] for c in configs]
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(KERNEL_COLUMNS))

    def problem_features(self, p) -> np.ndarray:
        return self._problem_evaluator.block(1, problem_values(p), {},
                                              self._hardware_floats)[0]

    def combine(self, problem, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence = ()) -> np.ndarray:
        """The full feature matrix: one row per kernel for this problem."""
        kernels = {name: kernel_matrix[:, i] for i, name in enumerate(KERNEL_FEATURES)}
        interactions = self._interaction_evaluator.block(
            kernel_matrix.shape[0], problem_values(problem), kernels, self._hardware_floats)
        return self.stack(problem_row, kernel_matrix, interactions)

    def matrix(self, problem, configs: Sequence, kernel_matrix: np.ndarray | None = None) -> np.ndarray:
        """Convenience: features of every config for one problem."""
        if kernel_matrix is None:
            kernel_matrix = self.kernel_features(configs)
        return self.combine(problem, self.problem_features(problem), kernel_matrix, configs)
