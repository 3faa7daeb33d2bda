"""The grouped-convolution kernel space: directions, pipelines and the table of valid pipeline
variants (PIPELINE_VARIANTS, the single source of truth), the block-size rules, the configs of
tilecast's own kernels and of the CK tile engine's, and the two name grammars one parser reads
(`parse_kernel_name(kernel_name(cfg)) == cfg` for both). The families that measure tilecast's
kernels are in tilecast/families/grouped_conv.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tilecast.core.family import FamilyError, table_choice

DIRECTIONS = {"forward": 0, "bwd_data": 1, "bwd_weight": 2}   # name -> TC_DIR
NDIMS = (2, 3)
DTYPES = ("fp32",)                                # dtypes tilecast's kernels compute in
TILE_ENGINE_DTYPES = ("fp16", "bf16", "fp32", "fp8", "bf8")   # dtypes of foreign records
PIPELINES = {"direct": 0, "im2col": 1, "dw": 2, "gemm": 3, "winograd": 4,
             "gvec": 5}                          # name -> TC_PIPELINE
WAVE_MODES = {"intrawave": 0, "interwave": 1}     # name -> TC_WAVE

# The single source of truth for valid (pipeline, wave_mode, has_dsb, has_si) combinations:
# direct has no double-buffered staging (dsb), dw (depthwise) neither dsb nor split-input;
# gemm (one GEMM per group on the GEMM library, kernels/cpu/grouped_conv/grouped_conv_gemm.hpp) shares a
# group's GEMM m-split or split-K (si) intrawave, or runs whole groups per thread interwave;
# winograd (F(2x2, 3x3), kernels/cpu/grouped_conv/grouped_conv_winograd.hpp) shares each of its 16 GEMMs
# intrawave, or deals them out whole interwave; gvec (a direct convolution with whole groups
# side by side in each vector when they have few channels, kernels/cpu/grouped_conv/grouped_conv_gvec.hpp)
# has the dw pipeline's two waves, in every direction.
PIPELINE_VARIANTS: tuple[tuple[str, str, bool, bool], ...] = tuple(
    (pipeline, wave, dsb, si)
    for pipeline, dsb_values, si_values in (("direct", (False,), (False, True)),
                                            ("im2col", (False, True), (False, True)),
                                            ("dw", (False,), (False,)))
    for wave in WAVE_MODES for dsb in dsb_values for si in si_values) + (
    ("gemm", "intrawave", False, False), ("gemm", "intrawave", False, True),
    ("gemm", "interwave", False, False),
    ("winograd", "intrawave", False, False), ("winograd", "interwave", False, False),
    ("gvec", "intrawave", False, False), ("gvec", "interwave", False, False))

# The pipelines that run on the GEMM library and take its cache blocks (gemm_tiles) as tiles.
GEMM_PIPELINES = ("gemm", "winograd")

# The tile engine's pipelines, N a digit (e.g. compv3, basic_async_v1, preshufflev2).
TILE_ENGINE_PIPELINES = ("basic_vN", "basic_async_vN", "comp_async", "compvN", "mem",
                         "preshufflevN")

# Block-size rules of kernels/cpu/grouped_conv/grouped_conv_config.hpp, field -> (multiple of, min, max):
# BM is a multiple of the micro-tile's MR = 8, BN of its NR = 16.
TILE_RULES = {"bm": (8, 8, 4096), "bn": (16, 16, 4096), "bk": (1, 1, 4096)}
# the kernels' SIMD (kernels/cpu/grouped_conv/grouped_conv_microkernel.hpp): AVX-512 where -march=native
# has it, else AVX2 with FMA
REQUIRED_FLAGS = ("avx2", "fma")

@dataclass(frozen=True, order=True)
class GroupedConvConfig:
    """Every compile-time parameter of one tilecast grouped-conv kernel binary."""
    direction: str
    dtype: str
    ndim_spatial: int
    bm: int
    bn: int
    bk: int
    pipeline: str
    wave_mode: str
    has_dsb: bool
    has_si: bool


@dataclass(frozen=True)
class TileEngineConvConfig:
    """A CK tile-engine grouped-conv kernel, as its name spells it (read, never built)."""
    direction: str
    dtype: str
    ndim_spatial: int
    block: int
    tile_m: int
    tile_n: int
    pipeline: str
    wave_mode: str | None   # optional in tile-engine names
    has_dsb: bool
    has_si: bool



@dataclass(frozen=True)
class NameFlavour:
    """One kernel-name grammar: its pipelines, dtypes, tile fields and config type."""
    name: str
    grammar: str
    config_type: type
    pipeline_re: str
    pipelines_doc: tuple[str, ...]
    dtypes: tuple[str, ...]
    tile_fields: tuple[str, str, str]
    wave_required: bool


NAME_FLAVOURS = (
    NameFlavour("tilecast",
                "grouped_conv_{direction}_{dtype}_{ndim}d_{bm}x{bn}x{bk}_{pipeline}_{wave_mode}[_dsb][_si]",
                GroupedConvConfig, "|".join(PIPELINES), tuple(PIPELINES), DTYPES,
                ("bm", "bn", "bk"), True),
    NameFlavour("tile_engine",
                "grouped_conv_{direction}_{dtype}_{ndim}d_{block}x{m}x{n}_{pipeline}[_{wave}][_dsb][_si]",
                TileEngineConvConfig,
                r"basic_v\d|basic_async_v\d|comp_async|compv\d|mem|preshufflev\d",
                TILE_ENGINE_PIPELINES, TILE_ENGINE_DTYPES, ("block", "tile_m", "tile_n"), False),
)
_FLAVOUR_OF_TYPE = {f.config_type: f for f in NAME_FLAVOURS}

NAME_RE = re.compile(
    r"^grouped_conv_(?P<direction>forward|bwd_data|bwd_weight)_(?P<dtype>[a-z0-9]+)"
    r"_(?P<ndim>\d+)d_(?P<t0>\d+)x(?P<t1>\d+)x(?P<t2>\d+)_(?P<pipeline>[a-z0-9_]+?)"
    rf"(?:_(?P<wave>{'|'.join(WAVE_MODES)}))?(?P<dsb>_dsb)?(?P<si>_si)?$")


_choice = table_choice


def validate_config(cfg) -> Any:
    """Raise FamilyError naming the offending field when cfg is not a valid kernel."""
    flavour = _FLAVOUR_OF_TYPE.get(type(cfg))
    if flavour is None:
        raise FamilyError(f"not a grouped-conv config: {cfg!r}")
    ctx = f"grouped-conv config {cfg}"
    _choice(cfg.direction, DIRECTIONS, "direction", ctx)
    _choice(cfg.dtype, flavour.dtypes, "dtype", ctx)
    _choice(cfg.ndim_spatial, NDIMS, "ndim_spatial", ctx)
    for name in flavour.tile_fields:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FamilyError(f"{name}={value!r} in {ctx} must be a positive integer")
    if not re.fullmatch(flavour.pipeline_re, cfg.pipeline):
        raise FamilyError(f"unknown pipeline {cfg.pipeline!r} in {ctx}; "
                          f"valid: {', '.join(flavour.pipelines_doc)}")
    if cfg.wave_mode is not None or flavour.wave_required:
        _choice(cfg.wave_mode, WAVE_MODES, "wave_mode", ctx)
    if flavour.config_type is GroupedConvConfig:
        for name, (multiple, low, high) in TILE_RULES.items():
            value = getattr(cfg, name)
            if value % multiple or not low <= value <= high:
                raise FamilyError(f"{name}={value} in {ctx} must be a multiple of {multiple} "
                                  f"in [{low}, {high}]")
        variant = (cfg.pipeline, cfg.wave_mode, cfg.has_dsb, cfg.has_si)
        if variant not in PIPELINE_VARIANTS:
            valid = ", ".join(_variant_label(*v) for v in PIPELINE_VARIANTS)
            raise FamilyError(f"pipeline variant {_variant_label(*variant)} (pipeline, wave_mode, "
                              f"has_dsb, has_si) is not valid; valid: {valid}")
        if cfg.pipeline == "winograd" and (cfg.direction == "bwd_weight" or cfg.ndim_spatial != 2):
            raise FamilyError(f"the winograd pipeline is 2D forward and bwd_data only; {ctx} is "
                              f"{cfg.ndim_spatial}D {cfg.direction}")
    return cfg


def _variant_label(pipeline, wave, dsb, si) -> str:
    return f"{pipeline}_{wave}" + ("_dsb" if dsb else "") + ("_si" if si else "")


def kernel_name(cfg) -> str:
    """The unique name of a kernel of either flavour; parse_kernel_name inverts it."""
    flavour = _FLAVOUR_OF_TYPE[type(validate_config(cfg))]
    tiles = "x".join(str(getattr(cfg, f)) for f in flavour.tile_fields)
    return (f"grouped_conv_{cfg.direction}_{cfg.dtype}_{cfg.ndim_spatial}d_{tiles}_{cfg.pipeline}"
            + (f"_{cfg.wave_mode}" if cfg.wave_mode else "") + ("_dsb" if cfg.has_dsb else "")
            + ("_si" if cfg.has_si else ""))


def parse_kernel_name(name: str):
    """A GroupedConvConfig or TileEngineConvConfig from a kernel name (flavour chosen by its
    pipeline); FamilyError says what is wrong and what was expected."""
    match = NAME_RE.match(name) if isinstance(name, str) else None
    if not match:
        grammars = "; ".join(f.grammar for f in NAME_FLAVOURS)
        raise FamilyError(f"not a grouped-conv kernel name: {name!r}; expected {grammars}")
    g = match.groupdict()
    flavour = next((f for f in NAME_FLAVOURS if re.fullmatch(f.pipeline_re, g["pipeline"])), None)
    if flavour is None:
        valid = ", ".join(p for f in NAME_FLAVOURS for p in f.pipelines_doc)
        raise FamilyError(f"unknown pipeline {g['pipeline']!r} in kernel name {name!r}; "
                          f"valid: {valid}")
    _choice(g["dtype"], flavour.dtypes, "dtype", f"kernel name {name!r}")
    if flavour.wave_required and g["wave"] is None:
        raise FamilyError(f"kernel name {name!r} lacks the wave mode; expected {flavour.grammar}")
    tiles = dict(zip(flavour.tile_fields, (int(g["t0"]), int(g["t1"]), int(g["t2"]))))
    try:
        cfg = flavour.config_type(direction=g["direction"], dtype=g["dtype"],
                                  ndim_spatial=int(g["ndim"]), pipeline=g["pipeline"],
                                  wave_mode=g["wave"], has_dsb=g["dsb"] is not None,
                                  has_si=g["si"] is not None, **tiles)
        return validate_config(cfg)
    except FamilyError as err:
        raise FamilyError(f"invalid kernel name {name!r}: {err}") from None
