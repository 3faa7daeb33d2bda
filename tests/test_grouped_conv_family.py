"""Grouped-conv families: the tile-engine grammar round-trips, the variant table is the one
source of valid kernels, the families' own bad input is named, inputs are written in the kernel
layouts with a correct torch reference, and the real kernels (when their source exists) match
it. The contract every family keeps (own-name round trip, bad names, problem validation,
dims_key) is tests/test_family_contract.py."""
from __future__ import annotations

import itertools
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tilecast.config import expand_problems
from tilecast.families import FamilyError, get_family
from tilecast.families.grouped_conv import GroupedConvFamily, geometry_reason
from tilecast.spaces.grouped_conv import (
    DIRECTIONS, PIPELINE_VARIANTS, REQUIRED_FLAGS, GroupedConvConfig, TileEngineConvConfig, kernel_name,
    parse_kernel_name, validate_config)

FAMILIES = {d: get_family(f"grouped_conv_{d}") for d in DIRECTIONS}
FORWARD = FAMILIES["forward"]
CONFIG_FILE = Path(__file__).resolve().parents[1] / "configs" / "grouped_conv.yaml"


def test_families_are_registered_under_their_names():
    for direction, family in FAMILIES.items():
        assert isinstance(family, GroupedConvFamily)
        assert family.name == f"grouped_conv_{direction}" and family.direction == direction


# -- names ---------------------------------------------------------------------------------

def test_variant_table_holds_the_21_valid_combinations():
    assert len(PIPELINE_VARIANTS) == len(set(PIPELINE_VARIANTS)) == 21
    assert Counter(v[0] for v in PIPELINE_VARIANTS) == {"direct": 4, "im2col": 8, "dw": 2, "gemm": 3,
                                                         "winograd": 2, "gvec": 2}
    assert not any(dsb for p, _, dsb, _ in PIPELINE_VARIANTS
                   if p in ("direct", "dw", "gemm", "winograd", "gvec"))
    assert not any(si for p, _, _, si in PIPELINE_VARIANTS if p in ("dw", "winograd", "gvec"))
    # gemm interwave runs each group's GEMM on one thread: nothing to split K over
    assert ("gemm", "interwave", False, True) not in PIPELINE_VARIANTS


def test_space_is_every_variant_of_the_table_for_every_tile():
    tiles, gemm_tiles = ["8x16x1", "16x32x64", "64x64x32", "128x16x256"], ["96x512x256"]
    for family in FAMILIES.values():
        space = family.candidate_space({"tiles": tiles, "gemm_tiles": gemm_tiles}, {"flags": []})
        # variants x their tiles x (2D, 3D): the gemm pipeline takes gemm_tiles; so does
        # winograd, 2D forward and bwd_data only
        winograd = family.direction != "bwd_weight"
        assert len(space) == (16 * len(tiles) + 3 * len(gemm_tiles)) * 2 + 2 * len(gemm_tiles) * winograd
        assert {(c.pipeline, c.wave_mode, c.has_dsb, c.has_si) for c in space} == \
            {v for v in PIPELINE_VARIANTS if winograd or v[0] != "winograd"}
        assert {(c.bm, c.bn, c.bk) for c in space if c.pipeline in ("gemm", "winograd")} == {(96, 512, 256)}
        assert {c.ndim_spatial for c in space if c.pipeline == "winograd"} <= {2}
    assert FORWARD.kernel_name(GroupedConvConfig("forward", "fp32", 3, 64, 32, 16, "im2col",
                                                 "interwave", True, True)) == \
        "grouped_conv_forward_fp32_3d_64x32x16_im2col_interwave_dsb_si"


def test_candidate_options_filter_the_table():
    space = FORWARD.candidate_space({"pipeline": ["direct"], "ndim": [3], "tiles": ["32x32x32"]}, {})
    assert len(space) == 4 and all(c.pipeline == "direct" and c.ndim_spatial == 3 for c in space)
    with pytest.raises(FamilyError, match="unknown grouped-conv candidate option"):
        FORWARD.candidate_space({"tile_m": [4]}, {})
    with pytest.raises(FamilyError, match="unknown pipeline 'fft'"):
        FORWARD.candidate_space({"pipeline": ["fft"]}, {})
    # AVX2 with FMA runs the kernels (AVX-512 where the CPU has it); less runs none
    assert FORWARD.candidate_space({}, {"flags": ["avx2", "fma"]}) == FORWARD.candidate_space({}, {})
    assert FORWARD.candidate_space({}, {"flags": ["sse4_2", "avx"]}) == []


TE_PIPELINES = st.one_of(
    st.sampled_from(["comp_async", "mem"]),
    st.builds(lambda base, n: f"{base}{n}", st.sampled_from(["basic_v", "basic_async_v", "compv",
                                                             "preshufflev"]),
              st.integers(0, 9)))


@settings(max_examples=300, deadline=None)
@given(direction=st.sampled_from(sorted(DIRECTIONS)),
       dtype=st.sampled_from(["fp16", "bf16", "fp32", "fp8", "bf8"]), ndim=st.sampled_from([2, 3]),
       tiles=st.tuples(*[st.integers(1, 1024)] * 3), pipeline=TE_PIPELINES,
       wave=st.sampled_from([None, "intrawave", "interwave"]), dsb=st.booleans(), si=st.booleans())
def test_tile_engine_names_round_trip(direction, dtype, ndim, tiles, pipeline, wave, dsb, si):
    cfg = TileEngineConvConfig(direction, dtype, ndim, *tiles, pipeline, wave, dsb, si)
    name = kernel_name(cfg)
    assert parse_kernel_name(name) == cfg
    assert FAMILIES[direction].parse_name(name) == cfg


def test_seed_tile_engine_name():
    cfg = FORWARD.parse_name("grouped_conv_forward_bf16_2d_64x64x64_compv3_intrawave_dsb_si")
    assert cfg == TileEngineConvConfig("forward", "bf16", 2, 64, 64, 64, "compv3", "intrawave",
                                       True, True)
    with pytest.raises(FamilyError, match="tile-engine kernel; tilecast builds only"):
        FORWARD.build_spec(cfg)


@pytest.mark.parametrize("name, fragment", [
    ("grouped_conv_forward_bf16_2d_64x64x64_compv9x_intrawave_dsb",
     "unknown pipeline 'compv9x' in kernel name 'grouped_conv_forward_bf16_2d_64x64x64_compv9x"
     "_intrawave_dsb'; valid: direct, im2col, dw, gemm, winograd, gvec, basic_vN, basic_async_vN, comp_async, compvN"),
    ("grouped_conv_forward_fp16_2d_64x64x64_direct_intrawave", "unknown dtype 'fp16'"),
    ("grouped_conv_forward_fp32_2d_64x64x64_direct", "lacks the wave mode"),
    ("grouped_conv_forward_fp32_2d_64x64x64_dw_intrawave_si", "pipeline variant dw_intrawave_si"),
    ("grouped_conv_forward_fp32_2d_64x64x64_direct_interwave_dsb", "direct_interwave_dsb"),
    ("grouped_conv_forward_fp32_4d_64x64x64_direct_interwave", "unknown ndim_spatial 4"),
    ("grouped_conv_forward_fp32_2d_0x64x64_direct_interwave", "bm=0"),
    ("grouped_conv_forward_fp32_2d_64x24x64_direct_interwave", "bn=24 in"),
    ("grouped_conv_forward_fp32_2d_64x32x5000_direct_interwave", "must be a multiple of 1 in [1, 4096]"),
    ("grouped_conv_bwd_data_fp32_2d_64x64x64_direct_interwave", "use grouped_conv_bwd_data"),
])
def test_bad_kernel_names_are_named(name, fragment):
    with pytest.raises(FamilyError, match=re.escape(fragment)):
        FORWARD.parse_name(name)


def test_build_spec_sets_every_define():
    cfg = GroupedConvConfig("bwd_weight", "fp32", 3, 64, 32, 16, "im2col", "interwave", True, False)
    spec = FAMILIES["bwd_weight"].build_spec(cfg)
    assert spec.source.name == "grouped_conv.cpp"
    assert dict(spec.defines) == {"TC_DIR": 2, "TC_NDIM": 3, "TC_BM": 64, "TC_BN": 32, "TC_BK": 16,
                                  "TC_PIPELINE": 1, "TC_WAVE": 1, "TC_DSB": 1, "TC_SI": 0}


# -- problems ------------------------------------------------------------------------------

BASE = {"G": 2, "C": 3, "K": 4, "Hi": 9, "Wi": 7, "Y": 3, "X": 3}
BASE_3D = {**BASE, "Di": 5, "Z": 3}


@pytest.mark.parametrize("values, fragment", [
    ({"G": 2, "C": 3, "K": 4, "Hi": 9, "Y": 3, "X": 3}, "missing field(s) ['Wi']"),
    ({**BASE, "Di": 4, "ndim": 2}, "2D grouped-conv problem has Di=4"),
    ({**BASE, "stride_d": 2, "ndim": 2}, "stride_d=2"),
    ({**BASE, "ndim": 3}, "missing field(s) ['Di', 'Z']"),
    ({**BASE, "ndim": 4}, "unknown ndim 4"),
    ({**BASE, "C": 0}, "field C=0 must be >= 1"),
    ({**BASE, "pad_h": -1}, "field pad_h=-1 must be >= 0"),
    ({**BASE, "direction": "bwd_data"}, "use family grouped_conv_bwd_data"),
])
def test_problem_validation_names_the_field(values, fragment):
    with pytest.raises(FamilyError, match=re.escape(fragment)):
        FORWARD.problem(values)


def test_2d_problems_are_normalized():
    p = FORWARD.problem({k: str(v) for k, v in BASE.items()})
    assert (p.ndim, p.Di, p.Z, p.stride_d, p.pad_d, p.dilation_d, p.N) == (2, 1, 1, 1, 0, 1, 1)
    assert FORWARD.problem({**BASE_3D, "pad_d": 1}).ndim == 3


def test_dims_key_holds_every_shape_field():
    p = FORWARD.problem({**BASE_3D, "dilation_d": 2, "pad_w": 1})
    key = FORWARD.dims_key(p)
    for field in FORWARD.problem_fields[1:]:
        assert f"{field}=" in key
    assert "dilation_d=2" in key and "direction" not in key
    changed = {"N": 2, "G": 1, "C": 2, "K": 3, "Di": 6, "Hi": 8, "Wi": 6, "Z": 1, "Y": 1, "X": 2,
               "stride_d": 2, "stride_h": 2, "stride_w": 2, "pad_d": 1, "pad_h": 1, "pad_w": 0,
               "dilation_d": 1, "dilation_h": 2, "dilation_w": 3}
    for field, value in changed.items():
        other = FORWARD.problem({**FORWARD.problem_dict(p), field: value})
        assert FORWARD.dims_key(other) != key, field


def test_unsupported_and_applicable():
    dense = FORWARD.problem(BASE)
    depthwise = FORWARD.problem({**BASE, "G": 8, "C": 1, "K": 1, "pad_h": 1, "pad_w": 1})
    dw = GroupedConvConfig("forward", "fp32", 2, 32, 32, 32, "dw", "intrawave", False, False)
    im2col = GroupedConvConfig("forward", "fp32", 2, 32, 32, 32, "im2col", "intrawave", True, True)
    assert "dw pipeline needs a depthwise problem" in FORWARD.unsupported_reason(dw, dense)
    assert not FORWARD.applicable(dw, dense) and FORWARD.applicable(dw, depthwise)
    assert FORWARD.unsupported_reason(dw, depthwise) is None
    assert FORWARD.unsupported_reason(im2col, dense) is None
    # what applicable reads: dense and depthwise problems get different masks, so different keys
    assert FORWARD.applicability_key(dense) != FORWARD.applicability_key(depthwise)
    three_d = FORWARD.problem(BASE_3D)
    assert not FORWARD.applicable(im2col, three_d)
    assert "ndim 2 != problem ndim 3" in FORWARD.unsupported_reason(im2col, three_d)
    padded = FORWARD.problem({**BASE, "pad_h": 4})
    assert "pad_h=4 exceeds the filter extent 3" in FORWARD.unsupported_reason(im2col, padded)
    empty = FORWARD.problem({**BASE, "Hi": 2})
    assert "empty output along h" in FORWARD.unsupported_reason(im2col, empty)
    with pytest.raises(FamilyError, match="empty output"):
        FORWARD.prepare(empty, Path("/nonexistent"), seed=0)


def test_winograd_runs_3x3_stride_1_undilated_2d_layers_forward_and_bwd_data_only():
    winograd = GroupedConvConfig("forward", "fp32", 2, 96, 512, 256, "winograd", "intrawave", False, False)
    dense = FORWARD.problem(BASE)
    assert FORWARD.applicable(winograd, dense) and FORWARD.unsupported_reason(winograd, dense) is None
    for change, said in (({"stride_h": 2}, "stride 2x1"), ({"dilation_w": 2}, "dilation 1x2"),
                         ({"X": 5, "pad_w": 2}, "got 3x5")):
        other = FORWARD.problem({**BASE, **change})
        assert not FORWARD.applicable(winograd, other)
        assert said in FORWARD.unsupported_reason(winograd, other)
        # applicable reads the winograd geometry: the key tells the problems apart
        assert FORWARD.applicability_key(other) != FORWARD.applicability_key(dense)
    assert not FORWARD.applicable(winograd, FORWARD.problem(BASE_3D))
    for direction, ndim in (("bwd_weight", 2), ("forward", 3)):
        with pytest.raises(FamilyError, match="winograd pipeline is 2D forward and bwd_data only"):
            validate_config(GroupedConvConfig(direction, "fp32", ndim, 96, 512, 256, "winograd",
                                              "intrawave", False, False))
    with pytest.raises(FamilyError, match="pipeline variant winograd_intrawave_si"):
        validate_config(GroupedConvConfig("forward", "fp32", 2, 96, 512, 256, "winograd",
                                          "intrawave", False, True))


def test_gvec_runs_every_layer():
    for family, channel in ((FORWARD, "K"), (FAMILIES["bwd_data"], "C"), (FAMILIES["bwd_weight"], "K")):
        gvec = GroupedConvConfig(family.direction, "fp32", 2, 32, 32, 32, "gvec", "interwave",
                                 False, False)
        # whole groups a vector where the destination's channels divide 16, channel rows of
        # one group otherwise
        for per_group in (1, 2, 4, 8, 16, 3, 12, 40, 200):
            problem = family.problem({**BASE, "G": 4, channel: per_group})
            assert family.applicable(gvec, problem) and family.unsupported_reason(gvec, problem) is None


def test_flops_and_bytes_known_answer():
    p = FORWARD.problem({**BASE_3D, "N": 2, "stride_w": 2, "pad_h": 1})
    assert p.output_dims() == (3, 9, 3)
    assert FORWARD.flops(p) == 2 * 2 * 2 * 4 * 3 * 27 * (3 * 9 * 3)
    assert FORWARD.bytes_moved(p) == 4 * (2 * 5 * 9 * 7 * 2 * 3 + 2 * 4 * 27 * 3 + 2 * 81 * 2 * 4)
    assert FAMILIES["bwd_weight"].flops(p) == FORWARD.flops(p)


# -- inputs and reference ------------------------------------------------------------------

def _naive_forward(x, w, p):
    """Direct loops over filter taps in the kernel layouts (x NDHWGC, w GKZYXC -> NDHWGK)."""
    do, ho, wo = p.output_dims()
    pad = ((0, 0), (p.pad_d,) * 2, (p.pad_h,) * 2, (p.pad_w,) * 2, (0, 0), (0, 0))
    xp = np.pad(x.astype(np.float64), pad)
    y = np.zeros((p.N, do, ho, wo, p.G, p.K))
    for z, r, s in itertools.product(range(p.Z), range(p.Y), range(p.X)):
        d0, h0, w0 = z * p.dilation_d, r * p.dilation_h, s * p.dilation_w
        patch = xp[:, d0:d0 + p.stride_d * (do - 1) + 1:p.stride_d,
                   h0:h0 + p.stride_h * (ho - 1) + 1:p.stride_h,
                   w0:w0 + p.stride_w * (wo - 1) + 1:p.stride_w]       # N Do Ho Wo G C
        y += np.einsum("ndhwgc,gkc->ndhwgk", patch, w[:, :, z, r, s, :])
    return y


SHAPES_3D = [dict(N=2, G=3, C=2, K=4, Di=4, Hi=6, Wi=5, Z=2, Y=3, X=2, stride_d=2, stride_w=2,
                  pad_h=1, pad_w=1, dilation_h=2), dict(G=5, C=1, K=1, Di=3, Hi=5, Wi=4, Z=3, Y=3,
                                                       X=3, pad_d=1, pad_h=1, pad_w=1)]


@pytest.mark.parametrize("values", SHAPES_3D)
def test_prepared_files_are_in_the_kernel_layouts(values, tmp_path):
    """The forward reference equals loops over the files as written (layouts are right), and
    the backward references satisfy the adjoint identity <y, dy> = <x, dx> = <w, dW>."""
    prepared = {d: f.prepare(f.problem(values), tmp_path / d, seed=3) for d, f in FAMILIES.items()}
    p = prepared["forward"].problem
    do, ho, wo = p.output_dims()
    shapes = {"x": (p.N, p.Di, p.Hi, p.Wi, p.G, p.C), "w": (p.G, p.K, p.Z, p.Y, p.X, p.C),
              "dy": (p.N, do, ho, wo, p.G, p.K)}

    def load(direction, index, key):
        path = Path(prepared[direction].job_args[-3 + index])
        return np.fromfile(path, dtype=np.float32).reshape(shapes[key])

    x, w = load("forward", 0, "x"), load("forward", 1, "w")
    y = prepared["forward"].reference.reshape(shapes["dy"])
    np.testing.assert_allclose(y, _naive_forward(x, w, p), rtol=1e-10, atol=1e-10)
    dy = load("bwd_data", 0, "dy")
    np.testing.assert_array_equal(load("bwd_data", 1, "w"), w)
    np.testing.assert_array_equal(load("bwd_weight", 0, "x"), x)
    np.testing.assert_array_equal(load("bwd_weight", 1, "dy"), dy)
    dx = prepared["bwd_data"].reference.reshape(shapes["x"])
    dw = prepared["bwd_weight"].reference.reshape(shapes["w"])
    inner = float(np.sum(y * dy))
    assert np.isclose(np.sum(x * dx), inner, rtol=1e-10) and np.isclose(np.sum(w * dw), inner, rtol=1e-10)
    assert prepared["forward"].job_args[:19] == tuple(str(getattr(p, f)) for f in FORWARD.problem_fields[3:])


@pytest.mark.parametrize("direction", sorted(DIRECTIONS))
def test_peer_computes_the_same_quantity(direction, tmp_path):
    family = FAMILIES[direction]
    prepared = family.prepare(family.problem(SHAPES_3D[0]), tmp_path, seed=1)
    name, fn = family.peer(prepared, threads=1)
    result = fn()
    tensor = result if direction == "forward" else next(t for t in result if t is not None)
    from tilecast.families.grouped_conv import DIRECTION_IO

    layout = DIRECTION_IO[direction].output_layout(tensor, prepared.problem.G).numpy()
    assert name == "torch.conv"
    np.testing.assert_allclose(layout, prepared.reference, rtol=1e-4, atol=1e-4)


# -- the feature engine --------------------------------------------------------------------

def test_feature_engine_shape_and_finite(hw):
    te = [parse_kernel_name("grouped_conv_bwd_weight_bf16_3d_64x64x64_compv3_intrawave_dsb_si"),
          parse_kernel_name("grouped_conv_bwd_weight_fp16_2d_256x128x32_basic_async_v1")]
    family = FAMILIES["bwd_weight"]
    engine = family.feature_engine(hw)
    names = engine.feature_names()
    assert engine.name == "grouped_conv" and engine.version == 1 and len(names) == len(set(names))
    for required in ("dilation_d", "Di", "Do", "gemm_k", "is_depthwise", "is_3d", "is_direct",
                     "is_im2col", "is_dw", "is_intrawave", "has_dsb", "has_si", "log2_si_units"):
        assert required in names
    configs = family.candidate_space({}, hw) + te
    for values in (BASE, SHAPES_3D[0], SHAPES_3D[1], {**BASE, "C": 1, "K": 1, "G": 1, "Hi": 3, "Wi": 3}):
        problem = family.problem(values)
        matrix = engine.matrix(problem, configs)
        assert matrix.shape == (len(configs), len(names))
        assert np.all(np.isfinite(matrix))
    row = dict(zip(names, engine.matrix(family.problem(SHAPES_3D[1]), te[:1])[0]))
    assert (row["is_te_compv"], row["te_pipeline_version"], row["is_depthwise"], row["Do"]) == (1, 3, 1, 3)


def test_feature_engine_describes_every_pipeline_of_the_forward_space(hw):
    engine = FORWARD.feature_engine(hw)
    names = engine.feature_names()
    configs = FORWARD.candidate_space({}, hw)
    assert {c.pipeline for c in configs} == {"direct", "im2col", "dw", "gemm", "winograd", "gvec"}
    problem = FORWARD.problem(BASE)
    matrix = engine.matrix(problem, configs)
    assert matrix.shape == (len(configs), len(names)) and np.all(np.isfinite(matrix))
    for config, row in zip(configs, matrix):
        flags = {p: row[names.index(f"is_{p}")]
                 for p in ("direct", "im2col", "dw", "gemm", "winograd", "gvec")}
        assert flags == {p: float(p == config.pipeline) for p in flags}, config


def test_gvec_lane_feature_follows_the_path_the_kernel_takes(hw):
    """n_tile_eff of a gvec kernel describes pixel lanes (kernels/cpu/grouped_conv/grouped_conv_lanes.hpp,
    PixelLaneConv::applies) on AVX-512 and gvec's own vectors elsewhere."""
    def eff(values, direction="forward", avx512=True):
        family = FAMILIES[direction]
        flags = {f for f in hw.get("flags", ()) if not f.startswith("avx512")}
        engine = family.feature_engine({**hw, "flags": sorted(flags | ({"avx512f"} if avx512 else set()))})
        gvec = GroupedConvConfig(direction, "fp32", 2, 32, 32, 32, "gvec", "intrawave", False, False)
        names = engine.feature_names()
        return engine.matrix(family.problem(values), [gvec])[0][names.index("n_tile_eff")]

    layer = dict(G=32, C=8, K=8, Hi=56, Wi=56, Y=3, X=3, pad_h=1, pad_w=1)
    # AVX-512: 56 of a padded row's 58 positions; 8 of a block of 8 channels
    assert eff(layer) == pytest.approx(56 / 58)
    assert eff(layer, "bwd_weight") == pytest.approx(56 / 58)
    # AVX2, a 7x7 map (rows of 7 in 9), a stride of 3: gvec's own, 2 groups a row
    assert eff(layer, avx512=False) == 1.0
    assert eff({**layer, "Hi": 7, "Wi": 7}) == 1.0
    assert eff({**layer, "stride_h": 3, "stride_w": 3}) == 1.0
    # bwd_data at stride 2: din's phases of 28 columns, dout's copy one column wider
    assert eff({**layer, "stride_h": 2, "stride_w": 2}, "bwd_data") == pytest.approx(28 / 29)
    # at stride 2 forward: 28 positions of phase rows of 29; 24 channels a group in 3 blocks
    assert eff({**layer, "stride_h": 2, "stride_w": 2}) == pytest.approx(28 / 29)
    assert eff({**layer, "C": 24, "K": 24}) == pytest.approx(56 / 58)
    # 16 channels: gvec's own rows (full), so no pixel lanes forward
    assert eff({**layer, "C": 16, "K": 16}) == 1.0


# -- the problem sets ----------------------------------------------------------------------

def test_problem_sets_are_valid_small_and_disjoint():
    families = yaml.safe_load(CONFIG_FILE.read_text())["families"]
    assert set(families) == {f"grouped_conv_{d}" for d in DIRECTIONS}
    for name, body in families.items():
        family = get_family(name)
        sets = {ps: [family.problem(v) for v in expand_problems(f"{name}.{ps}", body["problems"][ps])]
                for ps in ("train", "holdout")}
        keys = {ps: {family.dims_key(p) for p in problems} for ps, problems in sets.items()}
        assert len(sets["holdout"]) >= 40 and len(keys["holdout"]) == len(sets["holdout"])
        assert not keys["train"] & keys["holdout"], "a holdout layer is in train"
        for problem in sets["train"] + sets["holdout"]:
            assert geometry_reason(problem) is None, problem
            assert family.flops(problem) <= 150e6, problem
        train = sets["train"]
        assert {p.G for p in train} >= {1, 2, 4, 8} and any(p.is_depthwise() for p in train)
        assert any(p.ndim == 3 for p in train) and any(p.dilation_h == 2 for p in train)
        assert any(p.stride_h == 2 for p in train)
    holdout_lines = [line for line in CONFIG_FILE.read_text().split("holdout: &holdout")[1]
                     .split("grouped_conv_bwd_data")[0].splitlines() if line.strip().startswith("- {")]
    assert len(holdout_lines) >= 40 and all("#" in line for line in holdout_lines)


# -- the real kernels ----------------------------------------------------------------------

KERNEL_SOURCE = GroupedConvFamily.source
KERNEL_SHAPES = {2: [dict(N=2, G=3, C=5, K=7, Hi=9, Wi=11, Y=3, X=2, stride_h=2, pad_h=1, pad_w=1,
                          dilation_w=2),
                     dict(G=1, C=19, K=33, Hi=7, Wi=6, Y=1, X=1),
                     dict(G=12, C=1, K=1, Hi=10, Wi=7, Y=3, X=3, stride_w=2, pad_h=1, pad_w=1),
                     # im2col of all four images outgrows the gemm pipeline's scratch (2^23
                     # floats): it takes them three, then one (bwd_weight sums the chunks)
                     dict(N=4, C=64, K=16, Hi=64, Wi=64, Y=3, X=3, pad_h=1, pad_w=1),
                     # winograd's: no padding, odd outputs (edge tiles of one row or column)
                     dict(N=2, G=2, C=5, K=7, Hi=9, Wi=8, Y=3, X=3),
                     # pad 2 and 3: bwd_data's forward-equivalent offsets 0 and -1
                     dict(C=3, K=20, Hi=5, Wi=7, Y=3, X=3, pad_h=2, pad_w=3),
                     # 576 tiles of C + K = 1008 channels outgrow winograd's scratch (2^23
                     # floats of V and M): it takes them 520, then 56
                     dict(C=1000, K=8, Hi=48, Wi=48, Y=3, X=3, pad_h=1, pad_w=1),
                     # gvec's: 4 groups of 4 channels a vector (its source relaid out), 8 of 2
                     # (bwd_data 2 of 8) with the last vector's groups partly past G, and one
                     # group of 16 channels a vector (the source copied as it is laid out)
                     dict(N=2, G=8, C=4, K=4, Hi=9, Wi=10, Y=3, X=3, pad_h=1, pad_w=1),
                     dict(G=5, C=8, K=2, Hi=7, Wi=9, Y=3, X=3, stride_h=2, stride_w=2, pad_h=1,
                          pad_w=1, dilation_w=2),
                     dict(G=2, C=16, K=16, Hi=6, Wi=5, Y=3, X=3, pad_h=1, pad_w=1),
                     # pad 3 past the 3-wide filter: gvec's bwd_data looks its sources up
                     dict(G=4, C=2, K=4, Hi=5, Wi=7, Y=3, X=3, pad_h=2, pad_w=3),
                     # gvec's channel rows: 40 (3 rows, the last partial) and 72 (two blocks of
                     # 4 rows) per group, strided 7x7 like a stem
                     dict(G=2, C=3, K=40, Hi=13, Wi=11, Y=7, X=7, stride_h=2, stride_w=2,
                          pad_h=3, pad_w=3),
                     dict(C=72, K=5, Hi=6, Wi=7, Y=3, X=3, pad_h=1, pad_w=1),
                     # bwd_data's phases: odd rows of din meet no filter row (a 1-row filter
                     # at stride 2: zeros, a phase of no taps), and each column residue modulo
                     # 3 one tap of the 3
                     dict(G=2, C=4, K=4, Hi=7, Wi=8, Y=1, X=3, stride_h=2, stride_w=3, pad_w=1),
                     # the gemm pipeline's forward in bands of output rows that read the same
                     # filter rows (each of >= 24 pixels): dilated like DeepLab's ASPP (3 bands,
                     # two images), and a pad of 3 rows where the first and last output rows
                     # read padding only (bands of no taps)
                     dict(N=2, G=2, C=6, K=5, Hi=9, Wi=9, Y=3, X=3, pad_h=6, pad_w=6,
                          dilation_h=6, dilation_w=6),
                     dict(C=2, K=3, Hi=4, Wi=30, Y=3, X=3, pad_h=3, pad_w=1),
                     # gvec's depthwise in place (one phase; G = 12 above too): lines of
                     # 7-pixel tiles, a partial tile and edge pixels, two column blocks, lines
                     # split between blocks; a stride, a dilation and pads of 1-2; a filter
                     # wider than the row (edge pixels only); bwd_data at stride 1 with
                     # reversed taps and a last column block of 4 groups
                     dict(N=2, G=32, C=1, K=1, Hi=9, Wi=13, Y=3, X=3, pad_h=1, pad_w=1),
                     dict(G=16, C=1, K=1, Hi=11, Wi=17, Y=5, X=3, stride_h=2, stride_w=2, pad_h=2,
                          pad_w=1, dilation_w=2),
                     dict(G=20, C=1, K=1, Hi=8, Wi=20, Y=3, X=5, pad_h=1, pad_w=2, dilation_h=2),
                     dict(G=16, C=1, K=1, Hi=5, Wi=3, Y=1, X=5, pad_w=2),
                     # gvec's depthwise bwd_data in place at a stride, a phase at a time: a
                     # stride of 3 along h (a tap a phase), a residue of w no tap reaches (its
                     # pixels zero), 16 + 8 groups; and at stride 1 with a pad past the filter
                     dict(G=24, C=1, K=1, Hi=7, Wi=9, Y=3, X=1, stride_h=3, stride_w=2, pad_h=1),
                     dict(G=16, C=1, K=1, Hi=5, Wi=6, Y=3, X=3, pad_h=1, pad_w=3),
                     # the dw pipeline's bwd_weight: 9 filter columns in chunks of 4 and 5,
                     # a last group vector of 4 lanes (AVX2; 12 of 16 with AVX-512)
                     dict(G=12, C=1, K=1, Hi=4, Wi=15, Y=2, X=9, pad_h=1, pad_w=4),
                     # gvec's one group's channels a row, in place (forward; bwd_data at
                     # stride 1): a dilated 5-wide filter, pads of 1 and 3, rows of 16 then 4
                     # (forward) or 8 (bwd_data) channels
                     dict(C=24, K=20, Hi=7, Wi=9, Y=3, X=5, pad_h=1, pad_w=3, dilation_w=2),
                     # gvec's pixel lanes (AVX-512, stride 1, at most 8 destination channels):
                     # bands of 8 rows and a last of 5, chunks of 7 and 6 groups, tiles of one
                     # vector; 6 and 5 of a block of 8 channels in tiles of three vectors; 7
                     # of 8 against 60 source channels, bwd_weight's bands of 6 rows and a last of 5
                     dict(N=2, G=13, C=8, K=8, Hi=21, Wi=19, Y=3, X=3, pad_h=1, pad_w=1),
                     dict(G=3, C=5, K=6, Hi=20, Wi=22, Y=3, X=3, pad_h=1, pad_w=1),
                     dict(G=2, C=60, K=7, Hi=29, Wi=38, Y=3, X=3, pad_h=1, pad_w=1),
                     # pixel lanes at stride 2: phase planes of an odd width (forward,
                     # bwd_weight), bwd_weight two groups of 4 channels a unit, bwd_data's
                     # phases of 8 and 7 rows, 9 and 8 columns; and a 1x1 filter, whose din
                     # phases off the stride read no tap (zeros)
                     dict(N=2, G=6, C=4, K=4, Hi=15, Wi=17, Y=3, X=3, stride_h=2, stride_w=2,
                          pad_h=1, pad_w=1),
                     dict(G=2, C=3, K=5, Hi=14, Wi=15, Y=1, X=1, stride_h=2, stride_w=2)],
                 3: [dict(G=2, C=3, K=4, Di=5, Hi=6, Wi=5, Z=3, Y=2, X=3, stride_d=2, pad_d=1,
                          pad_w=1, dilation_h=2),
                     dict(G=6, C=1, K=1, Di=4, Hi=5, Wi=6, Z=3, Y=3, X=3, stride_h=2, pad_d=1,
                          pad_h=1, pad_w=2, dilation_w=2),
                     # gvec's depthwise in place in 3D: slices of padding skipped
                     dict(G=16, C=1, K=1, Di=4, Hi=5, Wi=9, Z=3, Y=3, X=3, pad_d=1, pad_h=1,
                          pad_w=1, stride_w=2),
                     dict(C=5, K=17, Di=4, Hi=5, Wi=6, Z=3, Y=3, X=3, pad_d=1, pad_h=1, pad_w=1),
                     # gvec at stride 1 in 3D: bwd_data reads a padded dout too
                     dict(G=4, C=4, K=2, Di=4, Hi=5, Wi=6, Z=3, Y=3, X=3, pad_d=1, pad_h=1,
                          pad_w=1, dilation_w=2),
                     # the gemm pipeline's forward in bands of output slices (two images)
                     dict(N=2, C=3, K=4, Di=4, Hi=5, Wi=5, Z=3, Y=3, X=3, pad_d=2, pad_h=1,
                          pad_w=1, dilation_d=2)]}
# every pipeline in every direction, each pipeline in 2D and 3D (winograd: 2D forward and
# bwd_data), both waves, dsb and si
KERNEL_VARIANTS = [GroupedConvConfig(d, "fp32", ndim, bm, bn, bk, *variant)
                   for d, ndim, bm, bn, bk, variant in (
                       ("forward", 2, 16, 16, 16, ("im2col", "interwave", True, True)),
                       ("forward", 3, 32, 16, 8, ("direct", "intrawave", False, False)),
                       ("forward", 3, 16, 32, 16, ("dw", "interwave", False, False)),
                       ("bwd_data", 3, 16, 16, 32, ("im2col", "intrawave", False, False)),
                       ("bwd_data", 2, 32, 16, 16, ("direct", "interwave", False, True)),
                       ("bwd_data", 2, 16, 16, 16, ("dw", "intrawave", False, False)),
                       ("bwd_weight", 3, 16, 32, 16, ("im2col", "intrawave", True, True)),
                       ("bwd_weight", 2, 16, 16, 8, ("direct", "interwave", False, False)),
                       ("bwd_weight", 3, 24, 16, 16, ("dw", "intrawave", False, False)),
                       ("bwd_weight", 2, 16, 16, 8, ("dw", "interwave", False, False)),
                       # gemm: blocks smaller than the shapes, so every GEMM loop turns
                       ("forward", 2, 16, 32, 8, ("gemm", "intrawave", False, True)),
                       ("forward", 3, 24, 16, 16, ("gemm", "interwave", False, False)),
                       ("bwd_data", 2, 16, 16, 8, ("gemm", "interwave", False, False)),
                       ("bwd_data", 3, 96, 512, 256, ("gemm", "intrawave", False, True)),
                       ("bwd_weight", 2, 32, 32, 16, ("gemm", "intrawave", False, False)),
                       ("bwd_weight", 3, 16, 16, 8, ("gemm", "interwave", False, False)),
                       # winograd: small blocks (every GEMM loop turns) and the default's
                       ("forward", 2, 16, 32, 8, ("winograd", "intrawave", False, False)),
                       ("forward", 2, 192, 512, 256, ("winograd", "interwave", False, False)),
                       ("bwd_data", 2, 16, 16, 8, ("winograd", "interwave", False, False)),
                       ("bwd_data", 2, 192, 512, 256, ("winograd", "intrawave", False, False)),
                       # gvec: 2-tap passes and two group blocks a block; whole 3D filters
                       ("forward", 2, 16, 32, 2, ("gvec", "intrawave", False, False)),
                       ("forward", 3, 64, 16, 16, ("gvec", "interwave", False, False)),
                       ("bwd_data", 2, 24, 16, 4, ("gvec", "interwave", False, False)),
                       ("bwd_data", 3, 8, 64, 27, ("gvec", "intrawave", False, False)),
                       ("bwd_weight", 2, 16, 32, 16, ("gvec", "interwave", False, False)),
                       ("bwd_weight", 3, 32, 64, 32, ("gvec", "intrawave", False, False)))]


@pytest.fixture(scope="module")
def built_conv(build_cache, hw):
    if not KERNEL_SOURCE.exists():
        pytest.skip(f"{KERNEL_SOURCE} is not written yet")
    if not set(REQUIRED_FLAGS) <= set(hw["flags"]):
        pytest.skip(f"the grouped-conv kernels need {', '.join(REQUIRED_FLAGS)}, which this CPU lacks")
    from tilecast.core.build import build_candidates

    by_direction = {}
    results = build_candidates(FORWARD, KERNEL_VARIANTS, build_cache, jobs=2)
    assert [b.event.status for b in results] == ["ok"] * len(results), \
        [(b.kernel, b.event.reason[-400:]) for b in results if b.event.status != "ok"]
    for b in results:
        by_direction.setdefault(b.config.direction, []).append(b)
    return by_direction


@pytest.mark.parametrize("direction", sorted(DIRECTIONS))
def test_real_kernels_match_torch(direction, built_conv, tmp_path):
    from tilecast.stages.bench import _validate
    from tilecast.measurement.protocol import Protocol, run_binary

    family = FAMILIES[direction]
    protocol = Protocol(warmup_ms=0.2, min_sample_ms=0.2, samples=1, threads=2, timeout_s=60)
    prepared = {}
    for ndim, shapes in KERNEL_SHAPES.items():
        for i, values in enumerate(shapes):
            prepared[f"d{ndim}s{i}"] = family.prepare(family.problem(values), tmp_path / f"{ndim}_{i}",
                                                      seed=7 + i)
    checked = 0
    for built in built_conv[direction]:
        jobs = {job_id: prep for job_id, prep in prepared.items()
                if family.applicable(built.config, prep.problem)}
        assert jobs, built.kernel
        outcomes = run_binary(built.binary, [(j, p.job_args) for j, p in jobs.items()], protocol)
        for job_id, prep in jobs.items():
            outcome, error = _validate(family, prep, outcomes[job_id])
            assert outcome.status == "ok", (built.kernel, prep.problem, outcome.reason)
            assert error < family.tolerance(prep.problem), (built.kernel, prep.problem, error)
            checked += 1
    assert checked >= 5


def test_describe_reports_the_build_defines(built_conv):
    import subprocess

    for built in built_conv["bwd_weight"]:
        out = subprocess.run([str(built.binary), "--describe"], capture_output=True, text=True,
                             check=True)
        params = {name: int(value) for name, value in
                  (line.split()[1:] for line in out.stdout.splitlines())}
        defines = FORWARD.build_spec(built.config).defines
        assert params == {name.removeprefix("TC_"): value for name, value in defines.items()}
