"""GEMM feature engine: problem, kernel, interaction and hardware features, in a fixed order.

The interactions mirror how `kernels/cpu/gemm_parallel.hpp` shares out the work: padding waste
of the micro-tile on the edges; the work units each parallel scheme splits across threads
(MR-row panels for `m`, NR-column panels of one NC block for `n`, K for split-K) and how
evenly they divide; the barriers each scheme pays per block; packing and C traffic per
flop; and how the packed panels compare with the cache sizes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tilecast.features.hardware import EngineBase

PROBLEM_FEATURES = (
    "m", "n", "k", "log2_m", "log2_n", "log2_k", "log2_flops", "log2_bytes",
    "log2_intensity", "log2_m_over_n", "log2_min_mn", "is_bf16", "a_col_major", "b_col_major",
)
KERNEL_FEATURES = (
    "is_avx512", "mr", "nr", "mc", "nc", "kc", "tile_area", "par_m", "par_n", "par_k",
    "pack_a", "prefetch", "log2_a_block_bytes", "log2_b_panel_bytes", "log2_b_micro_bytes",
    "tile_loads_per_fma",
)
INTERACTION_FEATURES = (
    "m_tile_eff", "n_tile_eff", "tile_eff", "log2_m_tiles", "log2_n_tiles", "k_blocks",
    "k_tail_frac", "m_blocks", "n_blocks", "log2_par_units", "par_balance", "par_busy_frac",
    "log2_barriers", "log2_barriers_per_mflop", "k_per_thread", "a_block_l2_ratio",
    "b_panel_l3_ratio", "b_micro_l1_ratio", "log2_flops_per_thread", "splitk_reduce_ratio",
    "a_pack_traffic_ratio", "b_pack_traffic_ratio", "c_traffic_ratio", "a_strided_unpacked",
    "a_col_unpacked", "log2_est_ms",
)


def _ceil_div(a, b):
    return -(-a // b)


class GemmFeatureEngine(EngineBase):
    """Features for (GemmProblem, GemmConfig) pairs; see the module docstring."""
    name = "gemm"
    version = 2

    _problem_names = PROBLEM_FEATURES
    _kernel_names = KERNEL_FEATURES
    _interaction_names = INTERACTION_FEATURES

    def kernel_features(self, configs: Sequence) -> np.ndarray:
        """One row per kernel (computed once per candidate pool, reused for every problem)."""
        rows = []
        for c in configs:
            elt = 4  # panels are packed as fp32 for every dtype
            rows.append([
                float(c.isa == "avx512"), c.mr, c.nr, c.mc, c.nc, c.kc, c.mr * c.nr,
                float(c.parallel == "m"), float(c.parallel == "n"), float(c.parallel == "k"),
                float(c.pack_a), float(c.prefetch), np.log2(c.mc * c.kc * elt),
                np.log2(c.kc * c.nc * elt), np.log2(c.kc * c.nr * elt),
                (c.mr + c.nr / (16 if c.isa == "avx512" else 8)) / (c.mr * c.nr)])
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(KERNEL_FEATURES))

    def problem_features(self, p) -> np.ndarray:
        elt = 2 if p.dtype == "bf16" else 4
        flops = 2.0 * p.m * p.n * p.k
        nbytes = elt * (p.m * p.k + p.k * p.n) + 4 * p.m * p.n
        return np.array([
            p.m, p.n, p.k, np.log2(p.m), np.log2(p.n), np.log2(p.k), np.log2(flops),
            np.log2(nbytes), np.log2(flops / nbytes), np.log2(p.m / p.n),
            np.log2(min(p.m, p.n)), float(p.dtype == "bf16"), float(p.layout_a == "col"),
            float(p.layout_b == "col")], dtype=np.float64)

    def combine(self, problem, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence = ()) -> np.ndarray:
        """The full feature matrix: one row per kernel for this problem."""
        kf = {name: kernel_matrix[:, i] for i, name in enumerate(KERNEL_FEATURES)}
        m, n, k = float(problem.m), float(problem.n), float(problem.k)
        mr, nr, mc, nc, kc = kf["mr"], kf["nr"], kf["mc"], kf["nc"], kf["kc"]
        par_m, par_n, par_k = kf["par_m"], kf["par_n"], kf["par_k"]
        threads = max(self._hw[0], 1.0)
        flops = 2.0 * m * n * k
        m_tiles, n_tiles = _ceil_div(m, mr), _ceil_div(n, nr)
        m_eff, n_eff = m / (m_tiles * mr), n / (n_tiles * nr)
        # split-K runs the blocked loops on k / threads per thread
        k_thread = np.where(par_k > 0, _ceil_div(k, threads), k)
        k_blocks = _ceil_div(k_thread, kc)
        k_tail = (k_blocks * kc - k_thread) / (k_blocks * kc)
        m_blocks, n_blocks = _ceil_div(m, mc), _ceil_div(n, nc)
        n_panels = _ceil_div(np.minimum(n, nc), nr)
        units = par_m * m_tiles + par_n * n_panels + par_k * min(threads, k)
        units = np.maximum(units, 1.0)
        balance = units / (_ceil_div(units, threads) * threads)
        busy = np.minimum(units, threads) / threads
        # barriers: m and n sync after each B block (n also around each shared A block)
        barriers = (par_m * n_blocks * k_blocks + par_n * n_blocks * k_blocks * m_blocks * 2
                    + par_k * 1.0) + 1.0
        kc_eff = np.minimum(kc, k_thread)
        a_block = np.minimum(mc, m_tiles * mr) * kc_eff * 4
        b_panel = kc_eff * np.minimum(nc, n_tiles * nr) * 4
        b_micro = kc_eff * nr * 4
        l1, l2, l3 = (max(v * 1024, 1.0) for v in self._hw[2:5])
        # A is repacked for every NC block; B once per (jc, pc) (per thread for split-K)
        a_pack = kf["pack_a"] * m * k * n_blocks / flops
        b_pack = np.full_like(mr, k * n / flops)
        c_traffic = m * n * k_blocks * (1 + par_k * (threads - 1)) / flops
        est_s = flops / (threads * 32 * self._hw[5] * 1e6 * busy * m_eff * n_eff + 1.0)
        interactions = np.column_stack([
            m_eff, n_eff, m_eff * n_eff, np.log2(m_tiles), np.log2(n_tiles), k_blocks, k_tail,
            m_blocks, n_blocks, np.log2(units), balance, busy, np.log2(barriers),
            np.log2(barriers / (flops / 1e6)), k_thread, a_block / l2, b_panel / l3,
            b_micro / l1, np.full_like(mr, np.log2(flops / threads)),
            par_k * (m * n * threads) / flops, a_pack, b_pack, c_traffic,
            (1 - kf["pack_a"]) * float(problem.layout_a == "col"),
            (1 - kf["pack_a"]) * float(problem.layout_a == "col") * mr,
            np.log2(est_s * 1e3 + 1e-9)])
        count = kernel_matrix.shape[0]
        return np.hstack([np.broadcast_to(problem_row, (count, problem_row.size)), kernel_matrix,
                          interactions, np.broadcast_to(self._hw, (count, self._hw.size))])

    def matrix(self, problem, configs: Sequence, kernel_matrix: np.ndarray | None = None) -> np.ndarray:
        """Convenience: features of every config for one problem."""
        if kernel_matrix is None:
            kernel_matrix = self.kernel_features(configs)
        return self.combine(problem, self.problem_features(problem), kernel_matrix, configs)
