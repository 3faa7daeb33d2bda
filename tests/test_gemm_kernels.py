"""Every micro-tile, parallel scheme, packing mode and dtype of the real GEMM kernels, built
by the build stage and run through the benchmark path, matches torch on edge shapes."""
from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

from gemm_checks import expect_gemm_matches_torch
from tilecast.measurement.protocol import Protocol
from tilecast.core.family import KERNELS_DIR
from tilecast.families import get_family
from tilecast.families.gemm import ISAS, GemmConfig, micro_tiles
from tilecast.core.build import DEFAULT_FLAGS, build_candidates

FIXTURES = Path(__file__).parent / "fixtures"

GEMM = get_family("gemm")
PROTOCOL = Protocol(warmup_ms=0.5, min_sample_ms=0.5, samples=2, threads=2, timeout_s=60)
SCHEMES = itertools.cycle([("m", True, True), ("n", False, True), ("k", True, False),
                           ("m", False, False), ("n", True, False), ("k", False, True)])
# small cache blocks so that every shape below crosses several MC, NC and KC blocks
VARIANTS = [GemmConfig("fp32", isa, mr, nr, 2 * mr, 2 * nr, 48, par, pack_a, prefetch)
            for isa in sorted(ISAS, reverse=True) for (mr, nr), (par, pack_a, prefetch)
            in zip(micro_tiles(isa), SCHEMES)]
# bf16: on AVX-512 BF16 pairs of k steps packed for vdpbf16ps (KC 47: blocks of an odd depth,
# pairs starting at odd offsets), 8- and 16-row A panels beside the 14- and 6-row ones; and
# an AVX2 build, which widens bf16 to fp32 (and in the GEMV-class path widens as it loads)
VARIANTS += [GemmConfig("bf16", "avx512", 14, 32, 28, 64, 48, "m", True, True),
             GemmConfig("bf16", "avx512", 6, 48, 96, 480, 256, "k", True, False),
             GemmConfig("bf16", "avx512", 8, 32, 32, 96, 47, "n", True, False),
             GemmConfig("bf16", "avx512", 16, 16, 32, 64, 47, "k", True, True),
             GemmConfig("bf16", "avx2", 6, 16, 12, 32, 48, "k", True, True)]
SHAPES = [(1, 1, 1), (7, 13, 5), (1, 300, 200), (130, 1, 70), (33, 65, 300), (129, 257, 65),
          (64, 64, 1000)]
LAYOUTS = [("row", "row"), ("col", "row"), ("row", "col"), ("col", "col")]


@pytest.fixture(scope="module")
def built(build_cache, hw):
    flags = set(hw["flags"])
    configs = [c for c in VARIANTS if "avx512f" in flags or c.isa == "avx2"]
    results = build_candidates(GEMM, configs, build_cache, jobs=2)
    assert [b.event.status for b in results] == ["ok"] * len(results), \
        [b.event.reason for b in results if b.event.status != "ok"]
    return results


@pytest.mark.parametrize("index", range(len(VARIANTS)))
def test_variant_matches_torch(index, built, tmp_path):
    if index >= len(built):
        pytest.skip("this CPU lacks AVX-512")
    b = built[index]
    problems = [(*shape, *layouts) for shape, layouts in zip(SHAPES, itertools.cycle(LAYOUTS))]
    expect_gemm_matches_torch([b], problems, tmp_path, PROTOCOL, b.config.dtype)


# past the GEMV-class limit, so the blocked path: odd K (a pair's upper half past the end),
# K of 1 and 2, odd leading dimensions (pairs read at odd offsets), partial panels
BF16_SHAPES = [(37, 70, 301), (29, 45, 99), (100, 130, 517), (64, 96, 1), (40, 33, 2),
               (65, 129, 48), (9, 17, 3)]


def test_bf16_pairs_match_torch_in_every_layout(built, tmp_path):
    """bf16 variants (vdpbf16ps on two k steps at a time where the CPU has AVX-512 BF16)
    on odd depths and leading dimensions, every layout of A and B."""
    bf16 = [b for b in built if b.config.dtype == "bf16"]   # the AVX2 one on every CPU
    problems = [(*shape, *layouts) for shape, layouts in itertools.product(BF16_SHAPES, LAYOUTS)]
    expect_gemm_matches_torch(bf16, problems, tmp_path, PROTOCOL, "bf16")


def test_describe_reports_the_compiled_parameters(built):
    import subprocess

    b = built[0]
    out = subprocess.run([str(b.binary), "--describe"], capture_output=True, text=True, check=True)
    params = dict(line.split()[1:] for line in out.stdout.splitlines())
    assert int(params["MR"]) == b.config.mr and int(params["NR"]) == b.config.nr
    assert int(params["KC"]) == b.config.kc and int(params["PACK_A"]) == int(b.config.pack_a)


# GEMV-class shapes (min(m, n) <= 8) take kernels/cpu/gemm/gemm_skinny.hpp: both of its forms (rows
# of T contiguous, columns contiguous), every small dimension 1-8 on either side, column
# tails of every width, K tails, split-K with K below the thread count, past the serial limit,
# and several of the rows form's column chunks (16384 / R floats, whole pages) with a tail
# (at 8 rows in ymm, blocks of 14 columns: tails of 1-13 columns), groups of T's rows cut
# short where they would share an L1 set (rows 4 KiB or 6 KiB apart: 7 or 14 rows a group)
# with K tails;
# then the cols form's dots past 8 rows (9-24 rows or columns, K >= 256, B column-major or
# A row-major; blocked in the other layouts): row and column blocks with tails, both sides,
# K = 256 exactly, split between threads, and just past the limits (25 rows, K = 255)
SKINNY_SHAPES = [(1, 1, 1), (1, 300, 200), (3, 70, 131), (5, 2, 333), (8, 40, 17), (200, 8, 9),
                 (2, 3, 1129), (1, 1, 4097), (6, 1000, 3), (7, 1003, 517), (130, 1, 70),
                 (1000, 5, 700), (8, 8, 8), (4, 17, 2049), (1, 9000, 1), (4500, 7, 1),
                 (8, 4100, 20), (3, 10250, 9), (1, 16390, 3), (8, 29, 40), (8, 2063, 9),
                 (9, 33, 256), (16, 100, 300), (24, 41, 1029), (100, 12, 517), (23, 3000, 300),
                 (3000, 21, 260), (25, 30, 300), (20, 20, 255), (8, 1024, 37), (8, 1536, 45),
                 (5, 2048, 30)]


def test_gemv_class_shapes_match_torch_in_every_layout(built, tmp_path):
    fp32 = [b for b in built if b.config.dtype == "fp32"]
    assert {b.config.parallel for b in fp32} == {"m", "n", "k"}
    problems = [(*shape, *layouts) for shape, layouts in itertools.product(SKINNY_SHAPES, LAYOUTS)]
    expect_gemm_matches_torch(fp32, problems, tmp_path, PROTOCOL)


def test_gemv_class_bf16_shapes_match_torch_in_every_layout(built, tmp_path):
    """bf16 GEMV-class shapes take the same path as fp32 ones, the large operand widened as
    it is loaded (zmm: a masked 16-bit load for column tails; ymm: a copy of the tail) and the
    small one widened once a call: the shapes above in every layout, AVX-512 and AVX2."""
    bf16 = [b for b in built if b.config.dtype == "bf16"]
    assert {b.config.isa for b in bf16} >= {"avx2"}
    problems = [(*shape, *layouts) for shape, layouts in itertools.product(SKINNY_SHAPES, LAYOUTS)]
    expect_gemm_matches_torch(bf16, problems, tmp_path, PROTOCOL, "bf16")


def test_panel_packing_matches_a_plain_loop(tmp_path):
    """The packer's whole-vector stores that spill into the next step (tests/fixtures/
    pack_check.cpp): every panel width, valid-lane count and step count, both source
    layouts, panels packed in either order, sentinels around them."""
    run = _run_fixture("pack_check", tmp_path, TC_PAR=0)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 failures"), run.stdout


def test_gemv_groups_of_rows_avoid_full_l1_sets(tmp_path):
    """group_depth (kernels/cpu/gemm/gemm_skinny.hpp), the rows of T a GEMV-class group reads side
    by side (tests/fixtures/group_depth_check.cpp): for 2-12 ways and row strides of 0-12 KiB,
    no L1 set holds `ways` of a group's lines and a group is cut only one row short of that;
    and the comment's figures (7 rows 4 KiB apart, 14 at 6 KiB, 16 otherwise, 8 on 12 ways)."""
    run = _run_fixture("group_depth_check", tmp_path, TC_PAR=2)
    assert run.returncode == 0 and run.stdout.strip().endswith("0 failures"), run.stdout


def _run_fixture(name: str, tmp_path: Path, **params: int) -> subprocess.CompletedProcess:
    """Build tests/fixtures/NAME.cpp against the GEMM headers (an AVX2 fp32 6x16 variant's
    parameters, `params` overriding them) and run it."""
    binary = tmp_path / name
    defines = {"TC_DTYPE": 0, "TC_ISA": 0, "TC_MR": 6, "TC_NR": 16, "TC_MC": 96, "TC_NC": 256,
               "TC_KC": 64, "TC_PACK_A": 1, "TC_PAR": 0, "TC_PREFETCH": 0, **params}
    subprocess.run(["g++", *DEFAULT_FLAGS, *(f"-D{k}={v}" for k, v in defines.items()),
                    f"-I{KERNELS_DIR / 'cpu' / 'gemm'}", str(FIXTURES / f"{name}.cpp"),
                    "-o", str(binary)],
                   check=True)
    return subprocess.run([str(binary)], capture_output=True, text=True)
