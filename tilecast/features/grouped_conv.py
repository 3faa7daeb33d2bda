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
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np

from tilecast.spaces.grouped_conv import GroupedConvConfig, TileEngineConvConfig
from tilecast.features.hardware import EngineBase, evaluate, names

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


def _ceil_div(a, b):
    return -(-a // b)


def _log2(x):
    return np.log2(np.maximum(x, 1.0))


def _problem_terms(p) -> SimpleNamespace:
    out = tuple(max(v, 0) for v in p.output_dims())
    gm, gn, gk = IMPLICIT_GEMM[p.direction](p, out)
    elt = ELEMENT_BYTES[p.dtype]
    flops = 2.0 * p.G * gm * gn * gk
    nbytes = elt * (p.N * p.Di * p.Hi * p.Wi * p.G * p.C + p.G * p.K * p.Z * p.Y * p.X * p.C
                    + p.N * np.prod(out) * p.G * p.K)
    return SimpleNamespace(p=p, out=out, gm=gm, gn=gn, gk=gk, elt=elt, flops=flops, nbytes=nbytes,
                           strides=(p.stride_d, p.stride_h, p.stride_w),
                           pads=(p.pad_d, p.pad_h, p.pad_w),
                           dilations=(p.dilation_d, p.dilation_h, p.dilation_w))


def _field(name: str) -> tuple[str, Callable]:
    return name, lambda t: getattr(t.p, name)


# Each feature once, with its formula; the tables' order is the column order.
PROBLEM_COLUMNS = (
    *(_field(name) for name in ("N", "G", "C", "K", "Di", "Hi", "Wi", "Z", "Y", "X", "stride_d",
                                "stride_h", "stride_w", "pad_d", "pad_h", "pad_w", "dilation_d",
                                "dilation_h", "dilation_w")),
    ("Do", lambda t: t.out[0]),
    ("Ho", lambda t: t.out[1]),
    ("Wo", lambda t: t.out[2]),
    ("gemm_m", lambda t: t.gm),
    ("gemm_n", lambda t: t.gn),
    ("gemm_k", lambda t: t.gk),
    ("log2_gemm_m", lambda t: _log2(t.gm)),
    ("log2_gemm_n", lambda t: _log2(t.gn)),
    ("log2_gemm_k", lambda t: _log2(t.gk)),
    ("log2_flops", lambda t: _log2(t.flops)),
    ("log2_bytes", lambda t: _log2(t.nbytes)),
    ("log2_intensity", lambda t: np.log2(max(t.flops, 1.0) / t.nbytes)),
    ("log2_in_spatial", lambda t: _log2(t.p.Di * t.p.Hi * t.p.Wi)),
    ("log2_out_spatial", lambda t: _log2(np.prod(t.out))),
    ("filter_volume", lambda t: t.p.Z * t.p.Y * t.p.X),
    ("log2_total_c", lambda t: np.log2(t.p.G * t.p.C)),
    ("log2_total_k", lambda t: np.log2(t.p.G * t.p.K)),
    ("log2_c_over_k", lambda t: np.log2(t.p.C / t.p.K)),
    ("is_depthwise", lambda t: float(t.p.C == 1 and t.p.K == 1)),
    ("is_3d", lambda t: float(t.p.ndim == 3)),
    ("strided", lambda t: float(max(t.strides) > 1)),
    ("dilated", lambda t: float(max(t.dilations) > 1)),
    ("padded", lambda t: float(max(t.pads) > 0)),
    ("is_pointwise", lambda t: float(t.p.Z * t.p.Y * t.p.X == 1)),
    ("is_bwd_data", lambda t: float(t.p.direction == "bwd_data")),
    ("is_bwd_weight", lambda t: float(t.p.direction == "bwd_weight")),
    ("element_bytes", lambda t: float(t.elt)),
)
PROBLEM_FEATURES = names(PROBLEM_COLUMNS)

# Kernel features are named by the per-config-type functions below (KERNEL_ROWS), which fill
# the ones their kernels have; the rest are 0. Derived ones are added in kernel_features.
KERNEL_FEATURES = (
    "bm", "bn", "bk", "te_block", "log2_tile_area", "is_direct", "is_im2col", "is_dw", "is_gemm",
    "is_winograd", "is_gvec", "is_tile_engine", "is_te_basic", "is_te_async", "is_te_compv",
    "is_te_mem", "is_te_preshuffle", "te_pipeline_version", "is_intrawave", "is_interwave",
    "has_dsb", "has_si", "log2_a_block_bytes", "log2_b_block_bytes", "log2_c_block_bytes",
)
_KERNEL_FEATURE_SET = frozenset(KERNEL_FEATURES)


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


def _bwd_data_reach(size: int, pad: int, dil: int, filt: int, stride: int) -> tuple[int, int]:
    """(lead, reach) of bwd_data's dout copy along one dim (grouped_conv_lanes.hpp's
    reach_of): over din's phases r the taps f with r + pad - f dil = stride a read dout at
    the phase's index plus a."""
    offsets = [(r + pad - f * dil) // stride for r in range(min(stride, size)) for f in range(filt)
               if (r + pad - f * dil) % stride == 0]
    low, high = min(offsets + [0]), max(offsets + [0])
    return -low, high - low


def _pixel_lanes_eff(problem, hw: dict, d: float) -> float | None:
    """The lanes gvec's pixel-lane path keeps busy (kernels/cpu/grouped_conv/grouped_conv_lanes.hpp,
    PixelLaneConv::applies), or None where the layer does not take it: AVX-512, not
    depthwise, D destination channels a group of at most 8 or up to 40 that 16 does not
    divide (bwd_weight: up to 32), strides up to 2 along h and w (bwd_data 1 along d), forward
    and bwd_data on rows at least 80 % kept positions. A vector holds 16 positions of a row
    padded by the filter's reach (the pad columns computed and dropped) and D channels go in
    blocks of 8 (4 at D <= 4 and in bwd_weight); bwd_data at a stride goes in phases of din."""
    p = problem
    source = p.K if p.direction == "bwd_data" else p.C
    channels = d <= 32 if p.direction == "bwd_weight" else d <= 8 or (d % 16 != 0 and d <= 40)
    strided = p.stride_h > 2 or p.stride_w > 2 or (p.direction == "bwd_data" and p.stride_d > 1)
    if not hw.get("hw_has_avx512") or not channels or (d == 1 and source == 1) or strided:
        return None
    if p.direction == "bwd_data":
        lead, reach = _bwd_data_reach(p.Wi, p.pad_w, p.dilation_w, p.X, p.stride_w)
        width = _ceil_div(p.Wi, p.stride_w)
        row = max(width + reach, max(p.output_dims()[2], 1) + lead)
    else:
        width = max(p.output_dims()[2], 1)
        row = max(width + (p.X - 1) * p.dilation_w // p.stride_w,
                  _ceil_div(p.Wi + p.pad_w, p.stride_w))
    if p.direction != "bwd_weight" and 5 * width < 4 * row:
        return None   # rows mostly of pad columns: gvec keeps those (forward, bwd_data)
    block = 4.0 if d <= 4 or p.direction == "bwd_weight" else 8.0
    return d / (_ceil_div(d, block) * block) * width / row


def _interaction_terms(problem, kf: dict, pf: dict, hw: dict) -> SimpleNamespace:
    """The quantities the interaction formulas share, one value per kernel (see the module
    docstring): tiles, the parallel units of each schedule, cache footprints."""
    t = SimpleNamespace(kf=kf, pf=pf)
    gm, gn, gk, groups = pf["gemm_m"], pf["gemm_n"], pf["gemm_k"], pf["G"]
    t.gk, t.groups, t.gm, t.gn = gk, groups, gm, gn
    bm, bn = np.maximum(kf["bm"], 1.0), np.maximum(kf["bn"], 1.0)
    bk = np.where(kf["bk"] > 0, kf["bk"], np.maximum(gk, 1.0))  # no K tile: one block
    t.bm = bm
    t.threads = threads = max(hw["hw_threads"], 1.0)
    t.flops = flops = 2.0 * groups * gm * gn * gk
    t.m_tiles, t.n_tiles = _ceil_div(max(gm, 1.0), bm), _ceil_div(max(gn, 1.0), bn)
    t.k_blocks = _ceil_div(max(gk, 1.0), bk)
    t.m_eff, t.n_eff = gm / (t.m_tiles * bm), gn / (t.n_tiles * bn)
    t.k_eff = gk / (t.k_blocks * bk)
    # gvec (grouped_conv_gvec.hpp) puts 16 / D whole groups in each 16-lane vector when D
    # divides 16, else up to 4 rows of one group's D channels (its column blocks), in blocks of
    # bn lanes; D is the GEMM's columns, K in bwd_weight (whose GEMM is K x (taps C))
    gvec = kf["is_gvec"] > 0
    d = max(gm if problem.direction == "bwd_weight" else gn, 1.0)
    lanes_used = groups * d
    gvec_cols = _ceil_div(lanes_used, 16.0) if 16 % d == 0 else groups * _ceil_div(d, 16.0)
    gvec_blocks = _ceil_div(gvec_cols * 16.0, bn)
    lanes_eff = _pixel_lanes_eff(problem, hw, d)
    t.n_eff = np.where(gvec, lanes_used / (gvec_cols * 16.0) if lanes_eff is None else lanes_eff,
                       t.n_eff)
    # the schedules of kernels/cpu/grouped_conv/grouped_conv_parallel.hpp (dw: grouped_conv_dw.hpp; gvec
    # shares each block's pixel tiles intrawave)
    t.intra = np.where(gvec, t.m_tiles, t.m_tiles * t.n_tiles)   # block grid of one group
    images = 1.0 if problem.direction == "bwd_weight" else pf["N"]
    group_units = np.where(kf["is_dw"] > 0, _ceil_div(groups, bn),
                           np.where(gvec, gvec_blocks, groups))
    t.inter = group_units * images                 # whole (group, image) GEMMs
    t.si_units = np.full_like(bm, min(threads, max(gk, 1.0)))   # K split over threads
    t.k_splits = np.where(kf["has_si"] > 0, t.si_units, 1.0)
    t.units = np.where(kf["has_si"] > 0, t.si_units,
                       np.where(kf["is_intrawave"] > 0, t.intra, t.inter))
    t.l1, t.l2, t.l3 = (max(hw[name] * 1024, 1.0) for name in ("hw_l1d_kib", "hw_l2_kib", "hw_l3_kib"))
    t.ab_block = (bm * bk + bk * bn) * 4
    t.c_block = bm * bn * 4
    t.busy = np.minimum(t.units, threads) / threads
    out_spatial = max(2.0 ** pf["log2_out_spatial"], 1.0)
    in_spatial = 2.0 ** pf["log2_in_spatial"]
    t.expansion = kf["is_im2col"] * pf["filter_volume"] * out_spatial / in_spatial
    # winograd F(2x2, 3x3) does 16 multiply-adds where the direct 3x3 convolution does 36
    winograd = np.where(kf["is_winograd"] > 0, 16.0 / 36.0, 1.0)
    t.est_s = winograd * flops / (threads * 16 * max(hw["hw_clock_mhz"], 1.0) * 1e6 * t.busy
                                  * t.m_eff * t.n_eff + 1.0)
    return t


def _balance(t, units):
    return units / (_ceil_div(units, t.threads) * t.threads)


# over the terms of one problem and every kernel (arrays, or a scalar for all kernels)
INTERACTION_COLUMNS = (
    ("m_tile_eff", lambda t: t.m_eff),
    ("n_tile_eff", lambda t: t.n_eff),
    ("k_tile_eff", lambda t: t.k_eff),
    ("tile_eff", lambda t: t.m_eff * t.n_eff),
    ("log2_m_tiles", lambda t: np.log2(t.m_tiles)),
    ("log2_n_tiles", lambda t: np.log2(t.n_tiles)),
    ("log2_k_blocks", lambda t: np.log2(t.k_blocks)),
    ("k_splits", lambda t: t.k_splits),
    ("log2_intra_units", lambda t: np.log2(t.intra)),
    ("log2_inter_units", lambda t: _log2(t.inter)),
    ("log2_si_units", lambda t: np.log2(t.si_units)),
    ("intra_balance", lambda t: _balance(t, t.intra)),
    ("inter_balance", lambda t: _balance(t, t.inter)),
    ("si_balance", lambda t: _balance(t, t.si_units)),
    ("log2_par_units", lambda t: np.log2(t.units)),
    ("par_balance", lambda t: _balance(t, t.units)),
    ("par_busy_frac", lambda t: t.busy),
    ("ab_block_l1_ratio", lambda t: t.ab_block / t.l1),
    ("c_block_l2_ratio", lambda t: t.c_block / t.l2),
    ("working_set_l3_ratio", lambda t: 2.0 ** t.pf["log2_bytes"] / t.l3),
    ("log2_k_per_thread", lambda t: _log2(t.gk / t.k_splits)),
    ("si_reduce_ratio",
     lambda t: t.kf["has_si"] * t.k_splits * t.groups * t.gm * t.gn / max(t.flops, 1.0)),
    ("im2col_expansion", lambda t: t.expansion),
    ("dw_on_dense", lambda t: t.kf["is_dw"] * (1.0 - t.pf["is_depthwise"])),
    ("log2_flops_per_thread", lambda t: _log2(t.flops / t.threads)),
    ("log2_est_ms", lambda t: np.log2(t.est_s * 1e3 + 1e-9)),
)
INTERACTION_FEATURES = names(INTERACTION_COLUMNS)


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
            unknown = set(values) - _KERNEL_FEATURE_SET
            if unknown:  # a misspelt feature would otherwise read as a silent 0
                raise ValueError(f"kernel feature(s) {sorted(unknown)} of {c} are not in "
                                 f"KERNEL_FEATURES")
            rows.append([float(values.get(name, 0.0)) for name in KERNEL_FEATURES])
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(KERNEL_FEATURES))

    def problem_features(self, p) -> np.ndarray:
        return evaluate(PROBLEM_COLUMNS, _problem_terms(p), 1)[0]

    def combine(self, problem, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence = ()) -> np.ndarray:
        """The full feature matrix: one row per kernel for this problem."""
        kf = {name: kernel_matrix[:, i] for i, name in enumerate(KERNEL_FEATURES)}
        pf = dict(zip(PROBLEM_FEATURES, problem_row))
        terms = _interaction_terms(problem, kf, pf, self.hw)
        interactions = evaluate(INTERACTION_COLUMNS, terms, kernel_matrix.shape[0])
        return self.stack(problem_row, kernel_matrix, interactions)

    def matrix(self, problem, configs: Sequence, kernel_matrix: np.ndarray | None = None) -> np.ndarray:
        """Convenience: features of every config for one problem."""
        if kernel_matrix is None:
            kernel_matrix = self.kernel_features(configs)
        return self.combine(problem, self.problem_features(problem), kernel_matrix, configs)
