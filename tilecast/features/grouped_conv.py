"""Grouped-conv feature engine: problem, kernel, interaction and hardware features, fixed order.

Problems are described by every shape field (all spatial dims, strides, pads, dilations,
groups; the seed found dilation essential for 3D) plus the derived output dims and the
per-group implicit GEMM (M, N, K) of the direction. Kernels are described by their tiles,
pipeline one-hots and the wave-mode / dsb / si suffix flags (the seed's de-aliasing lesson);
tile-engine kernels (CK CSV imports) fill their own one-hots and leave tilecast's at 0.
Interactions: tile padding waste, the parallel units of the kernels' schedules (intra-wave:
the block grid of one group; inter-wave: whole (group, image) GEMMs; split-input: the GEMM
reduction split over the threads) and how evenly they spread over the hardware threads, block bytes against the caches, and the
reduction length each thread runs.
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

from tilecast.features.hardware import EngineBase

from tilecast.families.grouped_conv_kernels import GroupedConvConfig, TileEngineConvConfig

PROBLEM_FEATURES = (
    "N", "G", "C", "K", "Di", "Hi", "Wi", "Z", "Y", "X", "stride_d", "stride_h", "stride_w",
    "pad_d", "pad_h", "pad_w", "dilation_d", "dilation_h", "dilation_w", "Do", "Ho", "Wo",
    "gemm_m", "gemm_n", "gemm_k", "log2_gemm_m", "log2_gemm_n", "log2_gemm_k", "log2_flops",
    "log2_bytes", "log2_intensity", "log2_in_spatial", "log2_out_spatial", "filter_volume",
    "log2_total_c", "log2_total_k", "log2_c_over_k", "is_depthwise", "is_3d", "strided",
    "dilated", "padded", "is_pointwise", "is_bwd_data", "is_bwd_weight", "element_bytes",
)
KERNEL_FEATURES = (
    "bm", "bn", "bk", "te_block", "log2_tile_area", "is_direct", "is_im2col", "is_dw",
    "is_tile_engine", "is_te_basic", "is_te_async", "is_te_compv", "is_te_mem",
    "is_te_preshuffle", "te_pipeline_version", "is_intrawave", "is_interwave", "has_dsb",
    "has_si", "log2_a_block_bytes", "log2_b_block_bytes", "log2_c_block_bytes",
)
INTERACTION_FEATURES = (
    "m_tile_eff", "n_tile_eff", "k_tile_eff", "tile_eff", "log2_m_tiles", "log2_n_tiles",
    "log2_k_blocks", "k_splits", "log2_intra_units", "log2_inter_units", "log2_si_units",
    "intra_balance", "inter_balance", "si_balance", "log2_par_units", "par_balance",
    "par_busy_frac", "ab_block_l1_ratio", "c_block_l2_ratio", "working_set_l3_ratio",
    "log2_k_per_thread", "si_reduce_ratio", "im2col_expansion", "dw_on_dense",
    "log2_flops_per_thread", "log2_est_ms",
)

ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "bf8": 1}

# Per-group implicit GEMM (M, N, K) of each direction, from (problem, (Do, Ho, Wo)).
IMPLICIT_GEMM: dict[str, Callable] = {
    "forward": lambda p, out: (p.N * np.prod(out), p.K, p.C * p.Z * p.Y * p.X),
    "bwd_data": lambda p, out: (p.N * p.Di * p.Hi * p.Wi, p.C, p.K * p.Z * p.Y * p.X),
    "bwd_weight": lambda p, out: (p.K, p.C * p.Z * p.Y * p.X, p.N * np.prod(out)),
}

# Tile-engine pipeline (digits stripped) -> the one-hots it sets.
TE_PIPELINE_FLAGS = {
    "basic_v": ("is_te_basic",), "basic_async_v": ("is_te_basic", "is_te_async"),
    "comp_async": ("is_te_compv", "is_te_async"), "compv": ("is_te_compv",),
    "mem": ("is_te_mem",), "preshufflev": ("is_te_preshuffle",),
}


def _wave_flags(wave_mode) -> dict:
    return {"is_intrawave": float(wave_mode == "intrawave"),
            "is_interwave": float(wave_mode == "interwave")}


def _own_kernel(c: GroupedConvConfig) -> dict:
    return {"bm": c.bm, "bn": c.bn, "bk": c.bk, f"is_{c.pipeline}": 1.0, **_wave_flags(c.wave_mode),
            "has_dsb": float(c.has_dsb), "has_si": float(c.has_si)}


def _tile_engine_kernel(c: TileEngineConvConfig) -> dict:
    base, version = re.fullmatch(r"(.*?)(\d?)", c.pipeline).groups()
    return {"bm": c.tile_m, "bn": c.tile_n, "bk": 0.0, "te_block": c.block, "is_tile_engine": 1.0,
            **{flag: 1.0 for flag in TE_PIPELINE_FLAGS.get(base, ())},
            "te_pipeline_version": float(version or 0), **_wave_flags(c.wave_mode),
            "has_dsb": float(c.has_dsb), "has_si": float(c.has_si)}


KERNEL_ROWS: dict[type, Callable] = {GroupedConvConfig: _own_kernel,
                                     TileEngineConvConfig: _tile_engine_kernel}


def _ceil_div(a, b):
    return -(-a // b)


def _log2(x):
    return np.log2(np.maximum(x, 1.0))


class GroupedConvFeatureEngine(EngineBase):
    """Features for (GroupedConvProblem, config) pairs; see the module docstring."""
    name = "grouped_conv"
    version = 1

    _problem_names = PROBLEM_FEATURES
    _kernel_names = KERNEL_FEATURES
    _interaction_names = INTERACTION_FEATURES

    def kernel_features(self, configs: Sequence) -> np.ndarray:
        """One row per kernel (computed once per candidate pool, reused for every problem)."""
        rows = []
        for c in configs:
            values = KERNEL_ROWS[type(c)](c)
            bm, bn, bk = (float(values[k]) for k in ("bm", "bn", "bk"))
            values.update(log2_tile_area=np.log2(bm * bn), log2_a_block_bytes=_log2(bm * bk * 4),
                          log2_b_block_bytes=_log2(bk * bn * 4), log2_c_block_bytes=np.log2(bm * bn * 4))
            rows.append([float(values.get(name, 0.0)) for name in KERNEL_FEATURES])
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(KERNEL_FEATURES))

    def problem_features(self, p) -> np.ndarray:
        out = tuple(max(v, 0) for v in p.output_dims())
        gm, gn, gk = IMPLICIT_GEMM[p.direction](p, out)
        elt = ELEMENT_BYTES[p.dtype]
        flops = 2.0 * p.G * gm * gn * gk
        nbytes = elt * (p.N * p.Di * p.Hi * p.Wi * p.G * p.C + p.G * p.K * p.Z * p.Y * p.X * p.C
                        + p.N * np.prod(out) * p.G * p.K)
        strides, pads = (p.stride_d, p.stride_h, p.stride_w), (p.pad_d, p.pad_h, p.pad_w)
        dilations = (p.dilation_d, p.dilation_h, p.dilation_w)
        return np.array([
            p.N, p.G, p.C, p.K, p.Di, p.Hi, p.Wi, p.Z, p.Y, p.X, *strides, *pads, *dilations, *out,
            gm, gn, gk, _log2(gm), _log2(gn), _log2(gk), _log2(flops), _log2(nbytes),
            np.log2(max(flops, 1.0) / nbytes), _log2(p.Di * p.Hi * p.Wi), _log2(np.prod(out)),
            p.Z * p.Y * p.X, np.log2(p.G * p.C), np.log2(p.G * p.K), np.log2(p.C / p.K),
            float(p.C == 1 and p.K == 1), float(p.ndim == 3), float(max(strides) > 1),
            float(max(dilations) > 1), float(max(pads) > 0), float(p.Z * p.Y * p.X == 1),
            float(p.direction == "bwd_data"), float(p.direction == "bwd_weight"), float(elt),
        ], dtype=np.float64)

    def combine(self, problem, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence = ()) -> np.ndarray:
        """The full feature matrix: one row per kernel for this problem."""
        kf = {name: kernel_matrix[:, i] for i, name in enumerate(KERNEL_FEATURES)}
        pf = dict(zip(PROBLEM_FEATURES, problem_row))
        gm, gn, gk, groups = pf["gemm_m"], pf["gemm_n"], pf["gemm_k"], pf["G"]
        bm, bn = np.maximum(kf["bm"], 1.0), np.maximum(kf["bn"], 1.0)
        bk = np.where(kf["bk"] > 0, kf["bk"], np.maximum(gk, 1.0))  # no K tile: one block
        threads = max(self._hw[0], 1.0)
        flops = 2.0 * groups * gm * gn * gk
        m_tiles, n_tiles = _ceil_div(max(gm, 1.0), bm), _ceil_div(max(gn, 1.0), bn)
        k_blocks = _ceil_div(max(gk, 1.0), bk)
        m_eff, n_eff = gm / (m_tiles * bm), gn / (n_tiles * bn)
        k_eff = gk / (k_blocks * bk)
        # the schedules of kernels/cpu/grouped_conv_parallel.hpp (dw: grouped_conv_dw.hpp)
        intra = m_tiles * n_tiles                  # block grid of one group at a time
        images = 1.0 if problem.direction == "bwd_weight" else pf["N"]
        group_units = np.where(kf["is_dw"] > 0, _ceil_div(groups, bn), groups)
        inter = group_units * images               # whole (group, image) GEMMs
        si_units = np.full_like(bm, min(threads, max(gk, 1.0)))   # K split over threads
        k_splits = np.where(kf["has_si"] > 0, si_units, 1.0)
        units = np.where(kf["has_si"] > 0, si_units,
                         np.where(kf["is_intrawave"] > 0, intra, inter))

        def balance(u):
            return u / (_ceil_div(u, threads) * threads)

        l1, l2, l3 = (max(v * 1024, 1.0) for v in self._hw[2:5])
        ab_block = (bm * bk + bk * bn) * 4
        c_block = bm * bn * 4
        busy = np.minimum(units, threads) / threads
        out_spatial = max(2.0 ** pf["log2_out_spatial"], 1.0)
        in_spatial = 2.0 ** pf["log2_in_spatial"]
        expansion = kf["is_im2col"] * pf["filter_volume"] * out_spatial / in_spatial
        est_s = flops / (threads * 16 * max(self._hw[5], 1.0) * 1e6 * busy * m_eff * n_eff + 1.0)
        interactions = np.column_stack([
            m_eff, n_eff, k_eff, m_eff * n_eff, np.log2(m_tiles), np.log2(n_tiles),
            np.log2(k_blocks), k_splits, np.log2(intra), _log2(inter), np.log2(si_units),
            balance(intra), balance(inter), balance(si_units), np.log2(units),
            balance(units), busy, ab_block / l1, c_block / l2,
            np.full_like(bm, 2.0 ** pf["log2_bytes"] / l3), _log2(gk / k_splits),
            kf["has_si"] * k_splits * groups * gm * gn / max(flops, 1.0), expansion,
            kf["is_dw"] * (1.0 - pf["is_depthwise"]), np.full_like(bm, _log2(flops / threads)),
            np.log2(est_s * 1e3 + 1e-9)])
        count = kernel_matrix.shape[0]
        return np.hstack([np.broadcast_to(problem_row, (count, problem_row.size)), kernel_matrix,
                          interactions, np.broadcast_to(self._hw, (count, self._hw.size))])

    def matrix(self, problem, configs: Sequence, kernel_matrix: np.ndarray | None = None) -> np.ndarray:
        """Convenience: features of every config for one problem."""
        if kernel_matrix is None:
            kernel_matrix = self.kernel_features(configs)
        return self.combine(problem, self.problem_features(problem), kernel_matrix, configs)
