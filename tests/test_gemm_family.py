"""GEMM family: the variant tables (one micro-kernel row per tile), the candidate space, and
the family's own known answers for bad names, problems and dims_key. The contract every family
keeps (name round trip, bad names, problem validation, dims_key) is tests/test_family_contract.py."""
from __future__ import annotations

import pytest

from tilecast.families import FamilyError, get_family
from tilecast.families.gemm import (ISAS, MICRO_KERNELS, GemmConfig, MicroKernel, micro_tile_reason,
                                    micro_tiles)

GEMM = get_family("gemm")
FULL_SPACE = {"dtype": ["fp32", "bf16"], "isa": ["avx512", "avx2"], "mc": [48, 96, 192, 384],
              "nc": [256, 512, 2048], "kc": [64, 128, 256, 512], "parallel": ["m", "n", "k"],
              "pack_a": [True, False], "prefetch": [True, False]}


def test_the_whole_space_is_large_and_uses_every_micro_kernel():
    space = GEMM.candidate_space(FULL_SPACE, {"flags": []})
    assert len(space) > 2000
    assert {MicroKernel(c.isa, c.mr, c.nr) for c in space} == set(MICRO_KERNELS)


def test_every_micro_kernel_row_compiles_and_is_unique():
    assert len(set(MICRO_KERNELS)) == len(MICRO_KERNELS)
    for row in MICRO_KERNELS:
        assert row.isa in ISAS and micro_tile_reason(row.isa, row.mr, row.nr) is None, row
    assert micro_tiles("avx2") == ((6, 16), (4, 24), (8, 8))


@pytest.mark.parametrize("isa, mr, nr, fragment", [
    ("avx2", 8, 16, "8x16 needs 19 avx2 vector registers"),     # 8*2 + 2 + 1 > 16
    ("avx512", 15, 32, "15x32 needs 33 avx512 vector registers"),
    ("avx2", 4, 12, "nr=12 must be a positive multiple of the avx2 vector width 8"),
])
def test_micro_tile_rules_mirror_gemm_config_hpp(isa, mr, nr, fragment):
    assert fragment in micro_tile_reason(isa, mr, nr)


def test_a_row_that_cannot_compile_is_refused_by_name(monkeypatch):
    import tilecast.families.gemm as gemm

    monkeypatch.setattr(gemm, "MICRO_KERNELS", (*MICRO_KERNELS, MicroKernel("avx2", 8, 16)))
    with pytest.raises(FamilyError, match=r"MicroKernel\('avx2', 8, 16\) .* cannot compile"):
        GEMM.kernel_name(GemmConfig("fp32", "avx2", 8, 16, 64, 512, 128, "m", True, True))


def test_space_respects_the_tile_table_and_the_cpu():
    space = GEMM.candidate_space(FULL_SPACE, {"flags": ["avx2", "fma"]})
    assert space and all(cfg.isa == "avx2" and cfg.dtype == "fp32" for cfg in space)
    assert {(c.mr, c.nr) for c in space} == set(micro_tiles("avx2"))
    assert all(c.mc % c.mr == 0 and c.nc % c.nr == 0 for c in space)
    bf16 = GEMM.candidate_space({**FULL_SPACE, "dtype": ["bf16"]}, {"flags": []})
    assert bf16 and all(c.pack_a for c in bf16)


@pytest.mark.parametrize("name, fragment", [
    ("gemm_fp32_avx512_14x30_mc112_nc1024_kc256_parm_pa1_pf1", "micro-tile 14x30"),
    ("gemm_fp32_avx512_14x32_mc100_nc1024_kc256_parm_pa1_pf1", "mc=100 must be a positive multiple of mr=14"),
    ("gemm_fp32_avx512_14x32_mc112_nc1024_kc256_parq_pa1_pf1", "unknown parallel scheme 'q'"),
    ("gemm_bf16_avx512_14x32_mc112_nc1024_kc256_parm_pa0_pf1", "pack_a must be 1"),
])
def test_bad_kernel_names_are_named(name, fragment):
    with pytest.raises(FamilyError, match=fragment.replace("(", r"\(")):
        GEMM.parse_name(name)


def test_problem_validation_known_answers():
    assert GEMM.problem({"m": "8", "n": 4, "k": 2}).m == 8
    with pytest.raises(FamilyError, match=r"missing field\(s\) \['k'\]"):
        GEMM.problem({"m": 1, "n": 2})
    with pytest.raises(FamilyError, match="k=0 must be >= 1"):
        GEMM.problem({"m": 1, "n": 2, "k": 0})
    with pytest.raises(FamilyError, match="m=3.5 is not an integer"):
        GEMM.problem({"m": 3.5, "n": 2, "k": 1})


def test_dims_key_holds_every_shape_field():
    p = GEMM.problem({"m": 3, "n": 5, "k": 7, "layout_b": "col"})
    assert GEMM.dims_key(p) == "m=3,n=5,k=7,dtype=fp32,layout_a=row,layout_b=col"


def test_applicability_is_the_dtype():
    fp32 = GemmConfig("fp32", "avx2", 6, 16, 96, 512, 128, "k", True, False)
    bf16_problem = GEMM.problem({"m": 1, "n": 1, "k": 1, "dtype": "bf16"})
    assert GEMM.applicability_key(bf16_problem) == "bf16"
    assert not GEMM.applicable(fp32, bf16_problem)
    assert GEMM.applicable(fp32, GEMM.problem({"m": 1, "n": 1, "k": 1}))


def test_unknown_candidate_option_is_rejected():
    with pytest.raises(FamilyError, match="unknown GEMM candidate option"):
        GEMM.candidate_space({"tile_m": [4]}, {"flags": []})


def test_problem_beyond_any_machine_or_not_whole_is_refused_with_its_values():
    fam = get_family("gemm")
    for values, needle in [({"m": 10**9, "n": 10**9, "k": 10**9}, "beyond any machine"),
                           ({"m": 1, "n": 1, "k": 2**46}, "k=70368744177664"),
                           ({"m": 127.9, "n": 1, "k": 1}, "m=127.9 is not an integer"),
                           ({"m": 2.0**60, "n": 1, "k": 1}, "is not an integer")]:
        with pytest.raises(FamilyError, match=needle):
            fam.problem(values)
    # whole numbers stay exact (no float rounding) and strings of digits are whole numbers
    assert fam.problem({"m": "64", "n": 64.0, "k": 2**20}).k == 2**20
