"""Grouped-conv feature engine: problem, kernel, interaction and hardware features, fixed order.

Problems are described by every shape field (all spatial dims, strides, pads, dilations,
groups; the seed found dilation essential for 3D) plus the derived output dims and the
per-group implicit GEMM (M, N, K) of the direction. Kernels are described by their tiles,
pipeline one-hots and the wave-mode / dsb / si suffix flags (the seed's de-aliasing lesson);
tile-engine kernels (CK CSV imports) fill their own one-hots and leave tilecast's at 0.
Interactions: tile padding waste, the parallel units of the kernels' schedules (intra-wave:
the block grid of one group; inter-wave: whole (group, image) GEMMs; split-input: the GEMM
reduction split over the threads) and how evenly they spread over the hardware threads, block
bytes against the caches, and the reduction length each thread runs.

The problem and interaction features are written once, as expression graphs per direction
(`formulas`, tilecast.features.formula): the engine evaluates them with numpy and `tilecast
export` prints them as C (tilecast.runtime.export.grouped_conv). The kernel features are
functions of a config, taken from this engine by the exporter.

Counts are whole numbers; the graphs hold them as float64, which is exact while every count
stays below 2**53 (the exported selector accepts only such problems).
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

from tilecast.spaces.grouped_conv import (DIRECTIONS, TILE_ENGINE_DTYPES, GroupedConvConfig,
                                          TileEngineConvConfig)
from tilecast.features.formula import (Evaluator, Expr, Formula, apply, hardware_field,
                                       kernel_column, lift, problem_field)
from tilecast.features.hardware import EngineBase

ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "bf8": 1}

# A problem as numbers, the formulas' inputs (and the exported selector's arguments): the dtype
# as its index in TILE_ENGINE_DTYPES, ndim and every shape field as they are.
DTYPE_CODES = {name: index for index, name in enumerate(TILE_ENGINE_DTYPES)}
SHAPE_FIELDS = ("N", "G", "C", "K", "Di", "Hi", "Wi", "Z", "Y", "X", "stride_d", "stride_h",
                "stride_w", "pad_d", "pad_h", "pad_w", "dilation_d", "dilation_h",
                "dilation_w")
FIELD_CODES = {"dtype": DTYPE_CODES, "ndim": None, **{name: None for name in SHAPE_FIELDS}}

# Tile-engine pipeline (digits stripped) -> the one-hots it sets.
TE_PIPELINE_FLAGS = {
    "basic_v": ("is_te_basic",), "basic_async_v": ("is_te_basic", "is_te_async"),
    "comp_async": ("is_te_compv", "is_te_async"), "compv": ("is_te_compv",),
    "mem": ("is_te_mem",), "preshufflev": ("is_te_preshuffle",),
}


def problem_values(problem) -> dict[str, float]:
    """A GroupedConvProblem as the formulas' inputs (floats; the dtype as its code)."""
    values = {name: float(getattr(problem, name)) for name in SHAPE_FIELDS}
    values.update(dtype=float(DTYPE_CODES[problem.dtype]), ndim=float(problem.ndim))
    return values


def _log2(x):
    return np.log2(np.maximum(x, 1.0))


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


def _not(flag: Expr) -> Expr:
    return 1.0 - flag


def _either(*flags: Expr) -> Expr:
    """1.0 when any 0/1 flag is 1."""
    result = flags[0]
    for flag in flags[1:]:
        result = apply("max", result, flag)
    return result


def _at_most(a, b) -> Expr:
    return _not(apply("gt", a, b))


def _parity(x: Expr) -> Expr:
    """x mod 2 of a whole number (0 or 1, also below 0)."""
    return x - apply("floor_div", x, 2.0) * 2.0


def _element_bytes(dtype: Expr) -> Expr:
    """ELEMENT_BYTES of the dtype code."""
    names = list(DTYPE_CODES)
    result = lift(float(ELEMENT_BYTES[names[-1]]))
    for name in reversed(names[:-1]):
        result = apply("select", apply("eq", dtype, DTYPE_CODES[name]),
                       float(ELEMENT_BYTES[name]), result)
    return result


def _output_dims(f: dict) -> tuple[Expr, Expr, Expr]:
    """GroupedConvProblem.output_dims: (Do, Ho, Wo), below 1 for an empty output."""
    return tuple(apply("floor_div", f[size] + 2.0 * f[f"pad_{axis}"]
                       - f[f"dilation_{axis}"] * (f[filt] - 1.0) - 1.0, f[f"stride_{axis}"]) + 1.0
                 for axis, size, filt in (("d", "Di", "Z"), ("h", "Hi", "Y"), ("w", "Wi", "X")))


def _bwd_data_reach(size: Expr, pad: Expr, dil: Expr, filt: Expr, stride: Expr):
    """(lead, reach) of bwd_data's dout copy along one dim (grouped_conv_lanes.hpp's
    reach_of): over din's phases r < min(stride, size) the taps f with r + pad - f dil =
    stride a read dout at the phase's index plus a; lead = -min(a, 0), reach = max(a, 0) -
    min(a, 0). Closed form for stride 1 and 2, the strides the pixel-lane path takes: with
    every phase present each tap f reads a = ceil((pad - f dil) / stride), largest at f = 0,
    smallest at the last tap; a stride-2 dim of one element has phase 0 only, where a tap
    reads when pad - f dil is even."""
    last = filt - 1.0
    complete = apply("gt", size, stride - 1.0)          # min(stride, size) == stride
    high_all = apply("ceil_div", pad, stride)
    low_all = apply("ceil_div", pad - last * dil, stride)
    # one phase, stride 2: taps f = first, first + 2, ... (odd dil), every tap or none (even)
    odd_dil = _parity(dil)
    first = apply("select", odd_dil, _parity(pad), 0.0)
    final = apply("select", odd_dil, last - _parity(last - first), last)
    any_tap = apply("select", complete, 1.0,
                    apply("select", odd_dil, _at_most(first, last), apply("eq", _parity(pad), 0.0)))
    high = apply("select", complete, high_all, apply("floor_div", pad - first * dil, 2.0))
    low = apply("select", complete, low_all, apply("floor_div", pad - final * dil, 2.0))
    low = apply("select", any_tap, apply("min", low, 0.0), 0.0)
    high = apply("select", any_tap, apply("max", high, 0.0), 0.0)
    return -low, high - low


def _pixel_lanes_eff(direction: str, f: dict, wo: Expr, d: Expr) -> tuple[Expr, Expr]:
    """(applies, lanes kept busy) of gvec's pixel-lane path (kernels/cpu/grouped_conv/
    grouped_conv_lanes.hpp, PixelLaneConv::applies), applies 0.0 where the layer does not take
    it: AVX-512, not depthwise, D destination channels a group of at most 8 or up to 40 that
    16 does not divide (bwd_weight: up to 32), strides up to 2 along h and w (bwd_data 1 along
    d), forward and bwd_data on rows at least 80 % kept positions. A vector holds 16 positions
    of a row padded by the filter's reach (the pad columns computed and dropped) and D channels
    go in blocks of 8 (4 at D <= 4 and in bwd_weight); bwd_data at a stride goes in phases of
    din. `wo` is the output width (below 1 when empty)."""
    source = f["K"] if direction == "bwd_data" else f["C"]
    if direction == "bwd_weight":
        channels = _at_most(d, 32.0)
    else:
        not_16 = _not(apply("eq", d - apply("floor_div", d, 16.0) * 16.0, 0.0))
        channels = _either(_at_most(d, 8.0), not_16 * _at_most(d, 40.0))
    strided = [apply("gt", f["stride_h"], 2.0), apply("gt", f["stride_w"], 2.0)]
    if direction == "bwd_data":
        strided.append(apply("gt", f["stride_d"], 1.0))
    avx512 = _not(apply("eq", hardware_field("hw_has_avx512"), 0.0))
    depthwise = apply("eq", d, 1.0) * apply("eq", source, 1.0)
    applies = avx512 * channels * _not(depthwise) * _not(_either(*strided))
    stride = f["stride_w"]
    if direction == "bwd_data":
        lead, reach = _bwd_data_reach(f["Wi"], f["pad_w"], f["dilation_w"], f["X"], stride)
        width = apply("ceil_div", f["Wi"], stride)
        row = apply("max", width + reach, apply("max", wo, 1.0) + lead)
    else:
        width = apply("max", wo, 1.0)
        row = apply("max", width + apply("floor_div", (f["X"] - 1.0) * f["dilation_w"], stride),
                    apply("ceil_div", f["Wi"] + f["pad_w"], stride))
    if direction != "bwd_weight":   # rows mostly of pad columns: gvec keeps those
        applies = applies * _at_most(4.0 * row, 5.0 * width)
    block = lift(4.0) if direction == "bwd_weight" else apply("select", apply("gt", d, 4.0),
                                                              8.0, 4.0)
    return applies, d / (apply("ceil_div", d, block) * block) * width / row


def formulas(direction: str) -> tuple[dict[str, Formula], dict[str, Formula]]:
    """(problem features, interaction features) of one direction: {name: Formula} each, in
    column order. The one definition of these features; see the module docstring."""
    f = {name: problem_field(name) for name in SHAPE_FIELDS}
    out_raw = _output_dims(f)
    do, ho, wo = (apply("max", v, 0.0) for v in out_raw)
    out_volume = do * ho * wo
    filter_volume = f["Z"] * f["Y"] * f["X"]
    in_volume = f["Di"] * f["Hi"] * f["Wi"]
    gm, gn, gk = {
        "forward": lambda: (f["N"] * out_volume, f["K"], f["C"] * filter_volume),
        "bwd_data": lambda: (f["N"] * in_volume, f["C"], f["K"] * filter_volume),
        "bwd_weight": lambda: (f["K"], f["C"] * filter_volume, f["N"] * out_volume),
    }[direction]()
    elt = _element_bytes(problem_field("dtype"))
    groups = f["G"]
    flops = 2.0 * groups * gm * gn * gk
    elements = (f["N"] * f["Di"] * f["Hi"] * f["Wi"] * groups * f["C"]
                + groups * f["K"] * f["Z"] * f["Y"] * f["X"] * f["C"]
                + f["N"] * out_volume * groups * f["K"])
    nbytes = elt * elements
    is_depthwise = apply("eq", f["C"], 1.0) * apply("eq", f["K"], 1.0)
    spatial = {kind: [f[f"{kind}_{axis}"] for axis in "dhw"]
               for kind in ("stride", "pad", "dilation")}
    at_least_one = {name: apply("max", value, 1.0) for name, value in (
        ("gm", gm), ("gn", gn), ("gk", gk), ("flops", flops), ("bytes", nbytes),
        ("in", in_volume), ("out", out_volume))}
    problem = {
        **{name: Formula(f[name]) for name in SHAPE_FIELDS},
        "Do": Formula(do), "Ho": Formula(ho), "Wo": Formula(wo),
        "gemm_m": Formula(gm), "gemm_n": Formula(gn), "gemm_k": Formula(gk),
        "log2_gemm_m": Formula(at_least_one["gm"], log2=True),
        "log2_gemm_n": Formula(at_least_one["gn"], log2=True),
        "log2_gemm_k": Formula(at_least_one["gk"], log2=True),
        "log2_flops": Formula(at_least_one["flops"], log2=True),
        "log2_bytes": Formula(at_least_one["bytes"], log2=True),
        "log2_intensity": Formula(at_least_one["flops"] / nbytes, log2=True),
        "log2_in_spatial": Formula(at_least_one["in"], log2=True),
        "log2_out_spatial": Formula(at_least_one["out"], log2=True),
        "filter_volume": Formula(filter_volume),
        "log2_total_c": Formula(groups * f["C"], log2=True),
        "log2_total_k": Formula(groups * f["K"], log2=True),
        "log2_c_over_k": Formula(f["C"] / f["K"], log2=True),
        "is_depthwise": Formula(is_depthwise),
        "is_3d": Formula(apply("eq", problem_field("ndim"), 3.0)),
        "strided": Formula(apply("gt", _either(*spatial["stride"]), 1.0)),
        "dilated": Formula(apply("gt", _either(*spatial["dilation"]), 1.0)),
        "padded": Formula(apply("gt", _either(*spatial["pad"]), 0.0)),
        "is_pointwise": Formula(apply("eq", filter_volume, 1.0)),
        "is_bwd_data": Formula(lift(float(direction == "bwd_data"))),
        "is_bwd_weight": Formula(lift(float(direction == "bwd_weight"))),
        "element_bytes": Formula(elt),
    }

    kf = {name: kernel_column(name) for name in KERNEL_FEATURES}
    bm, bn = apply("max", kf["bm"], 1.0), apply("max", kf["bn"], 1.0)
    bk = apply("select", apply("gt", kf["bk"], 0.0), kf["bk"], at_least_one["gk"])  # no K tile
    threads = apply("max", hardware_field("hw_threads"), 1.0)
    m_tiles = apply("ceil_div", at_least_one["gm"], bm)
    n_tiles = apply("ceil_div", at_least_one["gn"], bn)
    k_blocks = apply("ceil_div", at_least_one["gk"], bk)
    m_eff, k_eff = gm / (m_tiles * bm), gk / (k_blocks * bk)
    # gvec (grouped_conv_gvec.hpp) puts 16 / D whole groups in each 16-lane vector when D
    # divides 16, else up to 4 rows of one group's D channels (its column blocks), in blocks of
    # bn lanes; D is the GEMM's columns, K in bwd_weight (whose GEMM is K x (taps C))
    gvec = apply("gt", kf["is_gvec"], 0.0)
    d = apply("max", gm if direction == "bwd_weight" else gn, 1.0)
    lanes_used = groups * d
    divides_16 = apply("eq", 16.0 - apply("floor_div", 16.0, d) * d, 0.0)
    gvec_cols = apply("select", divides_16, apply("ceil_div", lanes_used, 16.0),
                      groups * apply("ceil_div", d, 16.0))
    gvec_blocks = apply("ceil_div", gvec_cols * 16.0, bn)
    pixel_lanes, pixel_eff = _pixel_lanes_eff(direction, f, out_raw[2], d)
    gvec_eff = apply("select", pixel_lanes, pixel_eff, lanes_used / (gvec_cols * 16.0))
    n_eff = apply("select", gvec, gvec_eff, gn / (n_tiles * bn))
    # the schedules of kernels/cpu/grouped_conv/grouped_conv_parallel.hpp (dw: grouped_conv_dw.hpp;
    # gvec shares each block's pixel tiles intrawave)
    intra = apply("select", gvec, m_tiles, m_tiles * n_tiles)   # block grid of one group
    images = 1.0 if direction == "bwd_weight" else f["N"]
    group_units = apply("select", apply("gt", kf["is_dw"], 0.0), apply("ceil_div", groups, bn),
                        apply("select", gvec, gvec_blocks, groups))
    inter = group_units * images                                # whole (group, image) GEMMs
    si_units = apply("min", threads, at_least_one["gk"])        # K split over threads
    has_si = apply("gt", kf["has_si"], 0.0)
    k_splits = apply("select", has_si, si_units, 1.0)
    units = apply("select", has_si, si_units,
                  apply("select", apply("gt", kf["is_intrawave"], 0.0), intra, inter))
    l1, l2, l3 = (apply("max", hardware_field(name) * 1024.0, 1.0)
                  for name in ("hw_l1d_kib", "hw_l2_kib", "hw_l3_kib"))
    ab_block = (bm * bk + bk * bn) * 4.0
    c_block = bm * bn * 4.0
    busy = apply("min", units, threads) / threads
    # the logarithms the problem features hold, raised again (as the engine always has)
    out_spatial = apply("max", apply("exp2", apply("log2", at_least_one["out"])), 1.0)
    in_spatial = apply("exp2", apply("log2", at_least_one["in"]))
    working_set = apply("exp2", apply("log2", at_least_one["bytes"]))
    expansion = kf["is_im2col"] * filter_volume * out_spatial / in_spatial
    # winograd F(2x2, 3x3) does 16 multiply-adds where the direct 3x3 convolution does 36
    winograd = apply("select", apply("gt", kf["is_winograd"], 0.0), 16.0 / 36.0, 1.0)
    est_s = winograd * flops / (threads * 16.0 * apply("max", hardware_field("hw_clock_mhz"), 1.0)
                                * 1e6 * busy * m_eff * n_eff + 1.0)

    def balance(parallel_units):
        return parallel_units / (apply("ceil_div", parallel_units, threads) * threads)

    interaction = {
        "m_tile_eff": Formula(m_eff), "n_tile_eff": Formula(n_eff), "k_tile_eff": Formula(k_eff),
        "tile_eff": Formula(m_eff * n_eff),
        "log2_m_tiles": Formula(m_tiles, log2=True), "log2_n_tiles": Formula(n_tiles, log2=True),
        "log2_k_blocks": Formula(k_blocks, log2=True), "k_splits": Formula(k_splits),
        "log2_intra_units": Formula(intra, log2=True),
        "log2_inter_units": Formula(apply("max", inter, 1.0), log2=True),
        "log2_si_units": Formula(si_units, log2=True),
        "intra_balance": Formula(balance(intra)), "inter_balance": Formula(balance(inter)),
        "si_balance": Formula(balance(si_units)),
        "log2_par_units": Formula(units, log2=True), "par_balance": Formula(balance(units)),
        "par_busy_frac": Formula(busy),
        "ab_block_l1_ratio": Formula(ab_block / l1), "c_block_l2_ratio": Formula(c_block / l2),
        "working_set_l3_ratio": Formula(working_set / l3),
        "log2_k_per_thread": Formula(apply("max", gk / k_splits, 1.0), log2=True),
        "si_reduce_ratio": Formula(kf["has_si"] * k_splits * groups * gm * gn
                                   / at_least_one["flops"]),
        "im2col_expansion": Formula(expansion),
        "dw_on_dense": Formula(kf["is_dw"] * (1.0 - is_depthwise)),
        "log2_flops_per_thread": Formula(apply("max", flops / threads, 1.0), log2=True),
        "log2_est_ms": Formula(est_s * 1e3 + 1e-9, log2=True),
    }
    return problem, interaction


FORMULAS = {direction: formulas(direction) for direction in DIRECTIONS}
PROBLEM_FEATURES = tuple(FORMULAS["forward"][0])
INTERACTION_FEATURES = tuple(FORMULAS["forward"][1])
_EVALUATORS = {direction: (Evaluator(problem), Evaluator(interaction))
               for direction, (problem, interaction) in FORMULAS.items()}


class GroupedConvFeatureEngine(EngineBase):
    """Features for (GroupedConvProblem, config) pairs; see the module docstring."""
    name = "grouped_conv"
    version = 1

    _problem_names = PROBLEM_FEATURES
    _kernel_names = KERNEL_FEATURES
    _interaction_names = INTERACTION_FEATURES

    def __init__(self, hardware):
        super().__init__(hardware)
        self._hardware_floats = {name: float(value) for name, value in self.hw.items()}

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
        return _EVALUATORS[p.direction][0].block(1, problem_values(p), {},
                                                  self._hardware_floats)[0]

    def combine(self, problem, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence = ()) -> np.ndarray:
        """The full feature matrix: one row per kernel for this problem."""
        kernels = {name: kernel_matrix[:, i] for i, name in enumerate(KERNEL_FEATURES)}
        interactions = _EVALUATORS[problem.direction][1].block(
            kernel_matrix.shape[0], problem_values(problem), kernels, self._hardware_floats)
        return self.stack(problem_row, kernel_matrix, interactions)

    def matrix(self, problem, configs: Sequence, kernel_matrix: np.ndarray | None = None) -> np.ndarray:
        """Convenience: features of every config for one problem."""
        if kernel_matrix is None:
            kernel_matrix = self.kernel_features(configs)
        return self.combine(problem, self.problem_features(problem), kernel_matrix, configs)
