"""Adding a GEMM variant takes one kernel source and one table row: in a temporary copy of the
kernels/ tree, a new 5x16 AVX2 micro-kernel (its own A-prefetch distance in
gemm_microkernel.hpp) plus one MicroKernel row in MICRO_KERNELS gives a variant that the
candidate space offers, names, builds from the copy, features and runs correctly."""
from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest

import tilecast.families.gemm as gemm
from gemm_checks import expect_gemm_matches_torch
from tilecast.measurement.protocol import Protocol
from tilecast.core.family import KERNELS_DIR
from tilecast.families.gemm import MicroKernel
from tilecast.core.build import DEFAULT_FLAGS, build_candidates, cache_key

GEMM = gemm.FAMILY
NEW_ROW = MicroKernel("avx2", 5, 16)       # 5*2 + 2 + 1 = 13 of AVX2's 16 registers
PROTOCOL = Protocol(warmup_ms=0.2, min_sample_ms=0.2, samples=1, threads=2, timeout_s=60)
# edge shapes: partial MR/NR tiles, several MC/NC/KC blocks with the small blocks below
SHAPES = [(1, 1, 1), (7, 13, 5), (11, 40, 97), (33, 65, 130)]

# the one kernel source change: this tile's micro-kernel prefetches A closer than the default
PREFETCH_USE = "kPrefetchStepsA * a_cs"
PREFETCH_TABLE = "constexpr int kPrefetchStepsB = 8;\n"
PREFETCH_FOR_TILE = (PREFETCH_TABLE +
                     "template <int MR, int NR> constexpr int kPrefetchStepsAFor = kPrefetchStepsA;\n"
                     "template <> constexpr int kPrefetchStepsAFor<5, 16> = 8;\n")


@pytest.fixture
def kernels_copy(tmp_path):
    """kernels/ copied, with the new micro-kernel written into the copy's gemm_microkernel.hpp."""
    copy = tmp_path / "kernels"
    shutil.copytree(KERNELS_DIR / "cpu", copy / "cpu")
    source = copy / "cpu" / "gemm" / "gemm_microkernel.hpp"
    text = source.read_text()
    assert PREFETCH_USE in text and PREFETCH_TABLE in text, \
        f"{source}: the micro-kernel changed; update this test's edit"
    source.write_text(text.replace(PREFETCH_TABLE, PREFETCH_FOR_TILE)
                      .replace(PREFETCH_USE, "kPrefetchStepsAFor<MR, NR> * a_cs"))
    return copy


@pytest.fixture
def new_row(monkeypatch):
    """The one table row."""
    assert NEW_ROW not in gemm.MICRO_KERNELS
    monkeypatch.setattr(gemm, "MICRO_KERNELS", (*gemm.MICRO_KERNELS, NEW_ROW))
    return NEW_ROW


def configs_of_the_new_tile() -> list:
    """The new tile's variants in the candidate space: both packing modes, both prefetch
    modes, every parallel scheme, small cache blocks."""
    space = GEMM.candidate_space({"isa": ["avx2"], "mc": [10], "nc": [32], "kc": [48],
                                  "pack_a": [True, False], "prefetch": [True, False]},
                                 {"flags": ["avx2", "fma"]})
    return [cfg for cfg in space if (cfg.mr, cfg.nr) == (NEW_ROW.mr, NEW_ROW.nr)]


def test_without_the_row_the_tile_is_refused():
    cfg = gemm.GemmConfig("fp32", "avx2", 5, 16, 10, 32, 48, "m", True, True)
    with pytest.raises(gemm.FamilyError, match="micro-tile 5x16 is not valid for avx2"):
        GEMM.kernel_name(cfg)
    assert not configs_of_the_new_tile()


def test_one_row_adds_the_variant_to_space_names_and_features(new_row, hw):
    configs = configs_of_the_new_tile()
    assert len(configs) == 3 * 2 * 2           # parallel schemes x pack_a x prefetch
    for cfg in configs:
        assert GEMM.parse_name(GEMM.kernel_name(cfg)) == cfg
    row = dict(zip(GEMM.feature_engine(hw).feature_names(),
                   GEMM.feature_engine(hw).matrix(GEMM.problem({"m": 9, "n": 20, "k": 4}),
                                                  configs[:1])[0]))
    assert (row["mr"], row["nr"], row["tile_area"]) == (5, 16, 80)
    assert row["tile_loads_per_fma"] == pytest.approx((5 + 16 / 8) / 80)


def test_the_new_variant_builds_from_the_copy_and_matches_torch(new_row, kernels_copy, hw,
                                                                  tmp_path):
    if not {"avx2", "fma"} <= set(hw["flags"]):
        pytest.skip("this CPU lacks AVX2 with FMA")
    # every parallel scheme, both packing modes, both prefetch modes
    wanted = {("m", True, True), ("n", False, True), ("k", True, False), ("k", False, False)}
    configs = [c for c in configs_of_the_new_tile() if (c.parallel, c.pack_a, c.prefetch) in wanted]
    assert len(configs) == len(wanted)
    built = build_candidates(GEMM, configs, tmp_path / "build", jobs=2, kernels_dir=kernels_copy)
    assert [b.event.status for b in built] == ["ok"] * len(built), \
        [(b.kernel, b.event.reason[-400:]) for b in built if b.event.status != "ok"]
    # the copy's source is what was compiled: the project's own tree gives another key
    spec = GEMM.build_spec(configs[0])
    assert built[0].cache_key != cache_key(spec.source, spec.defines, DEFAULT_FLAGS, "g++")
    described = subprocess.run([str(built[0].binary), "--describe"], capture_output=True,
                               text=True, check=True).stdout
    params = dict(line.split()[1:] for line in described.splitlines())
    assert (int(params["MR"]), int(params["NR"])) == (5, 16)

    layouts = itertools.cycle([("row", "row"), ("col", "row"), ("row", "col"), ("col", "col")])
    problems = [(*shape, *pair) for shape, pair in zip(SHAPES, layouts)]
    expect_gemm_matches_torch(built, problems, tmp_path, PROTOCOL)
