"""GEMM feature engine: problem, kernel, interaction and hardware features, in a fixed order.

The interactions mirror how `kernels/cpu/gemm/gemm_parallel.hpp` shares out the work: padding waste
of the micro-tile on the edges; the work units each parallel scheme splits across threads
(MR-row panels for `m`, NR-column panels of one NC block for `n`, K for split-K) and how
evenly they divide; the barriers each scheme pays per block; packing and C traffic per
flop; and how the packed panels compare with the cache sizes.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import numpy as np

from tilecast.families.gemm_isa import ISAS
from tilecast.features.hardware import EngineBase, evaluate, names

PACKED_BYTES = 4  # panels are packed as fp32 for every dtype


def _ceil_div(a, b):
    return -(-a // b)


def _problem_terms(p) -> SimpleNamespace:
    elt = 2 if p.dtype == "bf16" else 4
    flops = 2.0 * p.m * p.n * p.k
    return SimpleNamespace(p=p, flops=flops, nbytes=elt * (p.m * p.k + p.k * p.n) + 4 * p.m * p.n)


# Each feature once, with its formula; the tables' order is the column order (kept in step
# with tilecast/runtime/native/gemm_features.cpp, which computes the same columns).
PROBLEM_COLUMNS = (
    ("m", lambda t: t.p.m),
    ("n", lambda t: t.p.n),
    ("k", lambda t: t.p.k),
    ("log2_m", lambda t: np.log2(t.p.m)),
    ("log2_n", lambda t: np.log2(t.p.n)),
    ("log2_k", lambda t: np.log2(t.p.k)),
    ("log2_flops", lambda t: np.log2(t.flops)),
    ("log2_bytes", lambda t: np.log2(t.nbytes)),
    ("log2_intensity", lambda t: np.log2(t.flops / t.nbytes)),
    ("log2_m_over_n", lambda t: np.log2(t.p.m / t.p.n)),
    ("log2_min_mn", lambda t: np.log2(min(t.p.m, t.p.n))),
    ("is_bf16", lambda t: float(t.p.dtype == "bf16")),
    ("a_col_major", lambda t: float(t.p.layout_a == "col")),
    ("b_col_major", lambda t: float(t.p.layout_b == "col")),
)

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


def _interaction_terms(problem, kf: dict, hw: dict) -> SimpleNamespace:
    """The quantities the interaction formulas share, one value per kernel (see the module
    docstring): tiles, blocks, the parallel units of each scheme, cache footprints, traffic."""
    t = SimpleNamespace(problem=problem, kf=kf)
    t.m, t.n, t.k = m, n, k = float(problem.m), float(problem.n), float(problem.k)
    mr, nr, mc, nc, kc = kf["mr"], kf["nr"], kf["mc"], kf["nc"], kf["kc"]
    par_m, par_n, par_k = kf["par_m"], kf["par_n"], kf["par_k"]
    t.threads = threads = max(hw["hw_threads"], 1.0)
    t.flops = flops = 2.0 * m * n * k
    t.m_tiles, t.n_tiles = _ceil_div(m, mr), _ceil_div(n, nr)
    t.m_eff, t.n_eff = m / (t.m_tiles * mr), n / (t.n_tiles * nr)
    # split-K runs the blocked loops on k / threads per thread
    t.k_thread = np.where(par_k > 0, _ceil_div(k, threads), k)
    t.k_blocks = _ceil_div(t.k_thread, kc)
    t.k_tail = (t.k_blocks * kc - t.k_thread) / (t.k_blocks * kc)
    t.m_blocks, t.n_blocks = _ceil_div(m, mc), _ceil_div(n, nc)
    n_panels = _ceil_div(np.minimum(n, nc), nr)
    units = par_m * t.m_tiles + par_n * n_panels + par_k * min(threads, k)
    t.units = np.maximum(units, 1.0)
    t.balance = t.units / (_ceil_div(t.units, threads) * threads)
    t.busy = np.minimum(t.units, threads) / threads
    # barriers: m and n sync after each B block (n also around each shared A block)
    t.barriers = (par_m * t.n_blocks * t.k_blocks + par_n * t.n_blocks * t.k_blocks * t.m_blocks * 2
                  + par_k * 1.0) + 1.0
    kc_eff = np.minimum(kc, t.k_thread)
    t.a_block = np.minimum(mc, t.m_tiles * mr) * kc_eff * 4
    t.b_panel = kc_eff * np.minimum(nc, t.n_tiles * nr) * 4
    t.b_micro = kc_eff * nr * 4
    t.l1, t.l2, t.l3 = (max(hw[name] * 1024, 1.0) for name in ("hw_l1d_kib", "hw_l2_kib", "hw_l3_kib"))
    # A is repacked for every NC block; B once per (jc, pc) (per thread for split-K)
    t.a_pack = kf["pack_a"] * m * k * t.n_blocks / flops
    t.c_traffic = m * n * t.k_blocks * (1 + par_k * (threads - 1)) / flops
    t.est_s = flops / (threads * 32 * hw["hw_clock_mhz"] * 1e6 * t.busy * t.m_eff * t.n_eff + 1.0)
    t.a_col_unpacked = (1 - kf["pack_a"]) * float(problem.layout_a == "col")
    return t


# over the terms of one problem and every kernel (arrays, or a scalar for all kernels)
INTERACTION_COLUMNS = (
    ("m_tile_eff", lambda t: t.m_eff),
    ("n_tile_eff", lambda t: t.n_eff),
    ("tile_eff", lambda t: t.m_eff * t.n_eff),
    ("log2_m_tiles", lambda t: np.log2(t.m_tiles)),
    ("log2_n_tiles", lambda t: np.log2(t.n_tiles)),
    ("k_blocks", lambda t: t.k_blocks),
    ("k_tail_frac", lambda t: t.k_tail),
    ("m_blocks", lambda t: t.m_blocks),
    ("n_blocks", lambda t: t.n_blocks),
    ("log2_par_units", lambda t: np.log2(t.units)),
    ("par_balance", lambda t: t.balance),
    ("par_busy_frac", lambda t: t.busy),
    ("log2_barriers", lambda t: np.log2(t.barriers)),
    ("log2_barriers_per_mflop", lambda t: np.log2(t.barriers / (t.flops / 1e6))),
    ("k_per_thread", lambda t: t.k_thread),
    ("a_block_l2_ratio", lambda t: t.a_block / t.l2),
    ("b_panel_l3_ratio", lambda t: t.b_panel / t.l3),
    ("b_micro_l1_ratio", lambda t: t.b_micro / t.l1),
    ("log2_flops_per_thread", lambda t: np.log2(t.flops / t.threads)),
    ("splitk_reduce_ratio", lambda t: t.kf["par_k"] * (t.m * t.n * t.threads) / t.flops),
    ("a_pack_traffic_ratio", lambda t: t.a_pack),
    ("b_pack_traffic_ratio", lambda t: t.k * t.n / t.flops),
    ("c_traffic_ratio", lambda t: t.c_traffic),
    ("a_strided_unpacked", lambda t: t.a_col_unpacked),
    ("a_col_unpacked", lambda t: t.a_col_unpacked * t.kf["mr"]),
    ("log2_est_ms", lambda t: np.log2(t.est_s * 1e3 + 1e-9)),
)

PROBLEM_FEATURES = names(PROBLEM_COLUMNS)
KERNEL_FEATURES = names(KERNEL_COLUMNS)
INTERACTION_FEATURES = names(INTERACTION_COLUMNS)


class GemmFeatureEngine(EngineBase):
    """Features for (GemmProblem, GemmConfig) pairs; see the module docstring."""
    name = "gemm"
    version = 2

    _problem_names = PROBLEM_FEATURES
    _kernel_names = KERNEL_FEATURES
    _interaction_names = INTERACTION_FEATURES

    def kernel_features(self, configs: Sequence) -> np.ndarray:
        """One row per kernel (computed once per candidate pool, reused for every problem)."""
        rows = [[formula(c) for _, formula in KERNEL_COLUMNS] for c in configs]
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(KERNEL_COLUMNS))

    def problem_features(self, p) -> np.ndarray:
        return evaluate(PROBLEM_COLUMNS, _problem_terms(p), 1)[0]

    def combine(self, problem, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence = ()) -> np.ndarray:
        """The full feature matrix: one row per kernel for this problem."""
        kf = {name: kernel_matrix[:, i] for i, name in enumerate(KERNEL_FEATURES)}
        terms = _interaction_terms(problem, kf, self.hw)
        interactions = evaluate(INTERACTION_COLUMNS, terms, kernel_matrix.shape[0])
        return self.stack(problem_row, kernel_matrix, interactions)

    def matrix(self, problem, configs: Sequence, kernel_matrix: np.ndarray | None = None) -> np.ndarray:
        """Convenience: features of every config for one problem."""
        if kernel_matrix is None:
            kernel_matrix = self.kernel_features(configs)
        return self.combine(problem, self.problem_features(problem), kernel_matrix, configs)
