"""GEMM family: the name grammar round-trips over the whole space; bad input is named."""
from __future__ import annotations

import pytest

from tilecast.families import FamilyError, get_family
from tilecast.families.gemm import MICRO_TILES, GemmConfig

GEMM = get_family("gemm")
FULL_SPACE = {"dtype": ["fp32", "bf16"], "isa": ["avx512", "avx2"], "mc": [48, 96, 192, 384],
              "nc": [256, 512, 2048], "kc": [64, 128, 256, 512], "parallel": ["m", "n", "k"],
              "pack_a": [True, False], "prefetch": [True, False]}


def test_name_round_trip_over_the_whole_space():
    space = GEMM.candidate_space(FULL_SPACE, {"flags": []})
    assert len(space) > 2000
    names = [GEMM.kernel_name(cfg) for cfg in space]
    assert len(set(names)) == len(space), "two variants share a name"
    for cfg, name in zip(space, names):
        assert GEMM.parse_name(name) == cfg


def test_space_respects_the_tile_table_and_the_cpu():
    space = GEMM.candidate_space(FULL_SPACE, {"flags": ["avx2", "fma"]})
    assert space and all(cfg.isa == "avx2" and cfg.dtype == "fp32" for cfg in space)
    assert {(c.mr, c.nr) for c in space} == set(MICRO_TILES["avx2"])
    assert all(c.mc % c.mr == 0 and c.nc % c.nr == 0 for c in space)
    bf16 = GEMM.candidate_space({**FULL_SPACE, "dtype": ["bf16"]}, {"flags": []})
    assert bf16 and all(c.pack_a for c in bf16)


@pytest.mark.parametrize("name, fragment", [
    ("gemm_fp64_avx512_14x32_mc112_nc1024_kc256_parm_pa1_pf1", "unknown dtype 'fp64'"),
    ("gemm_fp32_avx512_14x30_mc112_nc1024_kc256_parm_pa1_pf1", "micro-tile 14x30"),
    ("gemm_fp32_avx512_14x32_mc100_nc1024_kc256_parm_pa1_pf1", "mc=100 must be a positive multiple of mr=14"),
    ("gemm_fp32_avx512_14x32_mc112_nc1024_kc256_parq_pa1_pf1", "unknown parallel scheme 'q'"),
    ("gemm_bf16_avx512_14x32_mc112_nc1024_kc256_parm_pa0_pf1", "pack_a must be 1"),
    ("conv_fp32", "not a GEMM kernel name"),
])
def test_bad_kernel_names_are_named(name, fragment):
    with pytest.raises(FamilyError, match=fragment.replace("(", r"\(")):
        GEMM.parse_name(name)


def test_problem_validation_names_the_field():
    assert GEMM.problem({"m": "8", "n": 4, "k": 2}).m == 8
    with pytest.raises(FamilyError, match="missing field"):
        GEMM.problem({"m": 1, "n": 2})
    with pytest.raises(FamilyError, match="k=0 must be >= 1"):
        GEMM.problem({"m": 1, "n": 2, "k": 0})
    with pytest.raises(FamilyError, match="unknown GEMM problem field"):
        GEMM.problem({"m": 1, "n": 2, "k": 3, "batch": 4})
    with pytest.raises(FamilyError, match="unknown layout_a 'diag'"):
        GEMM.problem({"m": 1, "n": 2, "k": 3, "layout_a": "diag"})


def test_dims_key_holds_every_shape_field():
    p = GEMM.problem({"m": 3, "n": 5, "k": 7, "layout_b": "col"})
    assert GEMM.dims_key(p) == "m=3,n=5,k=7,dtype=fp32,layout_a=row,layout_b=col"
    q = GEMM.problem({"m": 3, "n": 5, "k": 7})
    assert GEMM.dims_key(p) != GEMM.dims_key(q)


def test_unknown_candidate_option_is_rejected():
    with pytest.raises(FamilyError, match="unknown GEMM candidate option"):
        GEMM.candidate_space({"tile_m": [4]}, {"flags": []})
    assert isinstance(GEMM.parse_name(GEMM.kernel_name(
        GemmConfig("fp32", "avx2", 6, 16, 96, 512, 128, "k", True, False))), GemmConfig)
