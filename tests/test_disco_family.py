"""DISCO families: names round-trip over the whole table (csr and kpacked), the table is the
runtime's, bad input is named, every named runtime tile equals the automatic path bit for bit,
every register tile of this CPU benchmarked through the pipeline matches the float64 reference
(kpacked ones where psi has the layout and K <= KREG), a wrong kernel output is caught, features
are well formed, and a model trained on a tiny real run chooses a kernel the runtime runs
(tilecast.runtime.disco.selector)."""
from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tilecast.stages import bench
from tilecast.workflows import pipeline
from tilecast.core import tune
from tilecast.config import expand_problems, load_config
from tilecast.disco import compute_psi, csr_from_psi, native, reference
from tilecast.disco.kpacked import kpack_psi
from tilecast.runtime.disco.selector import SelectorError, choose_variant, clear_cache, problem_fields
from tilecast.families import FamilyError, get_family
from tilecast.families.disco import LINE_BLOCK, DiscoFamily
from tilecast.spaces.disco import (LANES, LAT_BLOCKS, MAX_LAT_BLOCK, RUNTIME, TILES,
                                             UNUSED_TILE_FIELD, VARIANTS, DiscoConfig,
                                             kernel_name, parse_kernel_name)
from tilecast.measurement.protocol import Protocol, run_binary

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

FAMILIES = {d: get_family(f"disco_{d}") for d in ("forward", "backward")}
FORWARD, BACKWARD = FAMILIES["forward"], FAMILIES["backward"]
TINY = Path(__file__).parent / "configs" / "disco_tiny.yaml"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = {"batch": 2, "channels": 3, "nlat_in": 12, "nlon_in": 48, "nlat_out": 6, "nlon_out": 24,
         "grid_out": "legendre-gauss"}


def _machine_isa() -> str:
    return {lanes: isa for isa, lanes in LANES.items()}[native.lanes()]


def _config(direction: str, variant: str, isa: str, tile: tuple, lat_block: int) -> DiscoConfig:
    """The config of a TILES row (tile in the variant's tile_fields order)."""
    named = dict(zip(VARIANTS[variant].tile_fields, tile))
    return DiscoConfig(direction, variant, isa, lat_block=lat_block,
                       **{**UNUSED_TILE_FIELD, **named})


def _tile_of(cfg: DiscoConfig) -> tuple:
    return tuple(getattr(cfg, name) for name in VARIANTS[cfg.variant].tile_fields)


# -- names and the table -------------------------------------------------------------------

def test_families_are_registered_under_their_names():
    for direction, family in FAMILIES.items():
        assert isinstance(family, DiscoFamily) and family.name == f"disco_{direction}"


def test_every_valid_config_round_trips_and_names_are_unique():
    names = set()
    blocks = {variant: range(1, MAX_LAT_BLOCK + 1) if spec.lat_blocked else (1,)
              for variant, spec in VARIANTS.items()}
    for (direction, variant, isa), tiles in TILES.items():
        for tile, lat_block in itertools.product(tiles, blocks[variant]):
            cfg = _config(direction, variant, isa, tile, lat_block)
            name = kernel_name(cfg)
            assert FAMILIES[direction].parse_name(name) == cfg
            names.add(name)
    assert len(names) == sum(len(t) * len(blocks[variant]) for (_, variant, _), t in TILES.items())
    assert kernel_name(DiscoConfig("backward", "csr", "avx512", 4, 3, 8)) == \
        "disco_backward_csr_avx512_bt4_nv3_lat8"
    assert set(RUNTIME) == {(direction, variant) for direction, variant, _ in TILES}
    kpacked = parse_kernel_name("disco_forward_kpacked_avx2_kreg12_nv1_lat16")
    assert kpacked == DiscoConfig("forward", "kpacked", "avx2", 1, 1, 16, kreg=12)
    assert (kpacked.tile(), kpacked.runtime_entry()) == ((12, 1, 16), "kpacked_contraction")
    assert parse_kernel_name("disco_forward_csr_avx2_bt1_nv8_lat4").tile() == (8, 4)
    assert parse_kernel_name("disco_backward_csr_avx2_bt4_nv3_lat4").tile() == (4, 3, 4)
    lines = parse_kernel_name("disco_backward_lines_avx2_lb4_nv3_lat1")
    assert lines == DiscoConfig("backward", "lines", "avx2", 1, 3, 1, lb=4)
    assert (lines.tile(), lines.runtime_entry()) == ((), "transpose_lines")


def test_candidate_space_is_the_table():
    for direction, family in FAMILIES.items():
        space = family.candidate_space({}, {"flags": []})     # flags unknown: every ISA
        rows = {(c.direction, c.variant, c.isa, _tile_of(c)) for c in space}
        assert rows == {(*key, tile) for key, tiles in TILES.items() if key[0] == direction
                        for tile in tiles}
        for variant in {c.variant for c in space}:
            blocks = LAT_BLOCKS[direction] if VARIANTS[variant].lat_blocked else (1,)
            assert {c.lat_block for c in space if c.variant == variant} == set(blocks)
    avx512 = FORWARD.candidate_space({}, {"flags": ["avx2", "fma", "avx512f"]})
    assert {c.isa for c in avx512} == {"avx512"}
    # 4x3 is a csr tile (BT 4, NV 3) and the AVX2 lines tile (LB 4, NV 3); lines take no block
    avx2 = BACKWARD.candidate_space({"tiles": ["4x3"], "lat_block": [5]}, {"flags": ["avx2", "fma"]})
    assert avx2 == [DiscoConfig("backward", "csr", "avx2", 4, 3, 5),
                    DiscoConfig("backward", "lines", "avx2", 1, 3, 1, lb=4)]
    # kpacked: forward only; lines: backward only
    assert {c.variant for c in BACKWARD.candidate_space({}, {})} == {"csr", "lines"}
    assert {c.variant for c in FORWARD.candidate_space({}, {})} == {"csr", "kpacked"}
    packed = FORWARD.candidate_space({"variant": ["kpacked"], "tiles": ["9x3", "1x8"],
                                      "lat_block": [8]}, {"flags": ["avx2", "fma", "avx512f"]})
    assert packed == [DiscoConfig("forward", "kpacked", "avx512", 1, 3, 8, kreg=9),
                      DiscoConfig("forward", "kpacked", "avx512", 1, 8, 8, kreg=1)]
    with pytest.raises(FamilyError, match="unknown disco candidate option"):
        FORWARD.candidate_space({"nv": [4]}, {})
    with pytest.raises(FamilyError, match="unknown variant 'dense'"):
        FORWARD.candidate_space({"variant": ["dense"]}, {})


def test_table_matches_the_runtime_library():
    """TILES is what kernels/cpu/disco/disco_csr_variants.hpp and disco_kpacked_variants.hpp
    instantiate for this CPU."""
    isa = _machine_isa()
    assert native.variant_tiles("forward") == TILES[("forward", "csr", isa)]
    assert native.variant_tiles("transpose") == TILES[("backward", "csr", isa)]
    assert native.kpacked_variant_tiles() == TILES[("forward", "kpacked", isa)]
    # the lines tile's LB is the kernel's line block and the layout's (its NV the bench
    # binary checks at compile time: the tiny run builds it)
    assert {tile[0] for tile in TILES[("backward", "lines", isa)]} == {native.line_block()}
    assert LINE_BLOCK == native.line_block()


@pytest.mark.parametrize("name, fragment", [
    ("disco_forward_csr_avx512_bt1_nv7_lat8", "tile bt1 x nv7 is not instantiated"),
    ("disco_forward_csr_avx512_bt4_nv4_lat8", "tile bt4 x nv4 is not instantiated"),
    ("disco_forward_dense_avx512_bt1_nv4_lat8", "unknown variant 'dense'"),
    ("disco_forward_kpacked_avx512_bt1_nv3_lat8", "kpacked tiles are kreg<int>_nv<int>"),
    ("disco_forward_csr_avx512_kreg1_nv8_lat8", "csr tiles are bt<int>_nv<int>"),
    ("disco_forward_kpacked_avx512_kreg9_nv4_lat8", "tile kreg9 x nv4 is not instantiated"),
    ("disco_forward_kpacked_avx2_kreg9_nv3_lat8", "tile kreg9 x nv3 is not instantiated"),
    ("disco_backward_kpacked_avx512_kreg9_nv3_lat8", "no kpacked backward kernels"),
    ("disco_forward_csr_sse_bt1_nv4_lat8", "unknown isa 'sse'"),
    ("disco_forward_csr_avx512_bt1_nv4_lat0", "lat_block=0"),
    ("disco_forward_csr_avx512_bt1_nv4_lat65", "lat_block=65"),
    ("disco_sideways_csr_avx512_bt1_nv4_lat8", "unknown direction 'sideways'"),
    ("disco_backward_csr_avx512_bt8_nv2_lat4", "use disco_backward"),
    ("gemm_fp32_avx2_6x16_mc96_nc512_kc128_parm_pa1_pf1", "not a disco kernel name"),
    ("disco_forward_lines_avx2_lb4_nv3_lat1", "no lines forward kernels"),
    ("disco_backward_lines_avx2_lb4_nv3_lat4", "lines kernels take no latitude block"),
    ("disco_backward_lines_avx2_lb2_nv3_lat1", "tile lb2 x nv3 is not instantiated"),
    ("disco_backward_lines_avx2_bt4_nv3_lat1", "lines tiles are lb<int>_nv<int>"),
])
def test_bad_kernel_names_are_named(name, fragment):
    with pytest.raises(FamilyError, match=re.escape(fragment)):
        (BACKWARD if name.startswith("disco_backward_lines") else FORWARD).parse_name(name)


def test_build_spec_sets_every_define():
    spec = BACKWARD.build_spec(parse_kernel_name("disco_backward_csr_avx2_bt4_nv3_lat6"))
    assert spec.source.name == "disco_bench.cpp" and spec.source.exists()
    assert spec.defines == {"TC_DISCO_DIR": 1, "TC_DISCO_VARIANT": 0, "TC_DISCO_ISA": 0,
                            "TC_BT": 4, "TC_KREG": 0, "TC_LB": 0, "TC_NV": 3, "TC_LAT_BLOCK": 6}
    packed = FORWARD.build_spec(parse_kernel_name("disco_forward_kpacked_avx512_kreg12_nv2_lat4"))
    assert packed.defines == {"TC_DISCO_DIR": 0, "TC_DISCO_VARIANT": 1, "TC_DISCO_ISA": 1,
                              "TC_BT": 1, "TC_KREG": 12, "TC_LB": 0, "TC_NV": 2, "TC_LAT_BLOCK": 4}
    lines = BACKWARD.build_spec(parse_kernel_name("disco_backward_lines_avx512_lb4_nv6_lat1"))
    assert lines.defines == {"TC_DISCO_DIR": 1, "TC_DISCO_VARIANT": 2, "TC_DISCO_ISA": 1,
                             "TC_BT": 1, "TC_KREG": 0, "TC_LB": 4, "TC_NV": 6, "TC_LAT_BLOCK": 1}
    with pytest.raises(FamilyError, match="csr tiles do not name kreg; it must be 0"):
        FORWARD.build_spec(DiscoConfig("forward", "csr", "avx512", 1, 8, 8, kreg=9))


# -- problems ------------------------------------------------------------------------------

def test_problem_defaults_round_trip_and_key():
    p = FORWARD.problem({"channels": "8", "nlat_in": "16", "nlon_in": "32", "nlat_out": "8",
                         "nlon_out": "16", "kernel_shape": "(3, 3)", "basis": "piecewise linear"})
    assert (p.batch, p.precision, p.grid_in, p.basis, p.kernel_shape) == \
        (1, "fp32", "equiangular", "piecewise_linear", "3x3")
    assert p.theta_cutoff == pytest.approx(math.pi / 7, rel=1e-6)   # default: one latitude gap
    assert FORWARD.problem(FORWARD.problem_dict(p)) == p
    key = FORWARD.dims_key(p)
    assert all(f"{field}=" in key for field in FORWARD.problem_fields)
    assert FORWARD.dims_key(FORWARD.problem({**SMALL, "precision": "bf16"})) != \
        FORWARD.dims_key(FORWARD.problem(SMALL))


@pytest.mark.parametrize("values, fragment", [
    ({**SMALL, "nlon_out": 20}, "nlon_in=48 must be a multiple of nlon_out=20"),
    ({**SMALL, "precision": "fp8"}, "unknown precision 'fp8'"),
    ({**SMALL, "grid_in": "healpix"}, "unknown grid_in 'healpix'"),
    ({**SMALL, "channels": 0}, "channels=0 must be a positive integer"),
    ({**SMALL, "theta_cutoff": -1}, "theta_cutoff=-1.0 must be in (0, pi]"),
    ({**SMALL, "stride": 2}, "unknown disco problem field(s) ['stride']"),
    ({"channels": 3, "nlat_in": 8}, "missing field(s) ['nlon_in', 'nlat_out', 'nlon_out']"),
])
def test_bad_problems_are_named(values, fragment):
    with pytest.raises(FamilyError, match=re.escape(fragment)):
        FORWARD.problem(values)


def test_unsupported_reasons_and_applicability():
    wide = parse_kernel_name("disco_backward_csr_avx512_bt8_nv2_lat4")
    narrow = parse_kernel_name("disco_backward_csr_avx512_bt4_nv3_lat4")
    four = BACKWARD.problem({**SMALL, "batch": 2, "channels": 2})
    assert "channel tile BT=8 exceeds batch*channels=4" in BACKWARD.unsupported_reason(wide, four)
    assert not BACKWARD.applicable(wide, four) and BACKWARD.applicable(narrow, four)
    assert BACKWARD.unsupported_reason(narrow, four) is None
    forward = parse_kernel_name("disco_forward_csr_avx512_bt1_nv4_lat4")
    assert "direction forward != family direction backward" in BACKWARD.unsupported_reason(forward, four)


def test_kpacked_kernels_need_the_layout_and_run_k_above_kreg_in_passes():
    """Where a kpacked kernel cannot run (no kpacked layout), it is not applicable (a
    dispatcher never picks it) and unsupported_reason says why; a tile with KREG < K runs K in
    passes, so it applies; csr kernels run every problem."""
    fits, short = (parse_kernel_name(f"disco_forward_kpacked_avx512_kreg{k}_nv{nv}_lat8")
                   for k, nv in ((9, 3), (6, 4)))
    harmonic = FORWARD.problem(SMALL)                     # K = 9
    linear = FORWARD.problem({**SMALL, "basis": "piecewise_linear", "kernel_shape": "3"})
    csr = parse_kernel_name("disco_forward_csr_avx512_bt1_nv4_lat8")
    assert FORWARD.applicable(fits, harmonic) and FORWARD.unsupported_reason(fits, harmonic) is None
    assert FORWARD.applicable(short, harmonic) and FORWARD.unsupported_reason(short, harmonic) is None
    for packed in (fits, short):
        assert not FORWARD.applicable(packed, linear)
        assert "need psi in the kpacked layout, which a piecewise_linear basis lacks" in \
            FORWARD.unsupported_reason(packed, linear)
    assert FORWARD.applicable(csr, linear) and FORWARD.applicable(csr, harmonic)
    assert FORWARD.applicability_key(harmonic) != FORWARD.applicability_key(linear)
    small_k = FORWARD.problem({**SMALL, "kernel_shape": "3x1"})   # K = 3
    assert FORWARD.applicable(short, small_k)


def test_flops_count_every_entry_at_every_output_longitude():
    p = FORWARD.problem(SMALL)
    psi = compute_psi((12, 48), (6, 24), (3, 3), basis_type="harmonic", grid_out="legendre-gauss",
                      theta_cutoff=p.theta_cutoff)
    assert FORWARD.flops(p) == BACKWARD.flops(p) == 2.0 * 6 * psi.nnz * 24


# -- the runtime's explicit-tile entries -----------------------------------------------------

def test_every_runtime_tile_and_block_equals_the_automatic_choice():
    """The per-output summation order does not depend on the tile or the block: every named
    variant must give the automatic path's result bit for bit (and that one the reference)."""
    psi = compute_psi((13, 36), (7, 12), (3, 3), basis_type="harmonic", grid_out="legendre-gauss")
    csr = csr_from_psi(psi)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 9, 13, 36, generator=gen)
    gy = torch.randn(1, 9, psi.kernel_size, 7, 12, generator=gen)
    y_auto = native.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, 7, 12)
    g_auto = native.transpose_contraction(gy, csr.troff, csr.tcol, csr.tvals, 13, 36)
    expected = reference.disco_contraction(x.double(), psi, 12)
    assert float((y_auto.double() - expected).norm() / expected.norm()) < 1e-5
    for lat_block in (1, 3, 8):
        for _, nv in native.variant_tiles("forward"):
            y = native.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, 7, 12,
                                   tile=(nv, lat_block))
            assert torch.equal(y, y_auto), (nv, lat_block)
        for bt, nv in native.variant_tiles("transpose"):
            g = native.transpose_contraction(gy, csr.troff, csr.tcol, csr.tvals, 13, 36,
                                             tile={"bt": bt, "nv": nv, "lat_block": lat_block})
            assert torch.equal(g, g_auto), (bt, nv, lat_block)
    with pytest.raises(ValueError, match="no such register tile"):
        native.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, 7, 12, tile=(7, 8))
    with pytest.raises(ValueError, match="no such register tile"):
        native.transpose_contraction(gy, csr.troff, csr.tcol, csr.tvals, 13, 36, tile=(2, 2, 4))
    with pytest.raises(ValueError, match="positive integers"):
        native.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, 7, 12, tile=(4, 0))


@pytest.mark.parametrize("kernel_shape", [(1, 1), (3, 1), (3, 3), (4, 4)])
def test_every_kpacked_tile_and_block_equals_the_automatic_choice(kernel_shape):
    """Every kpacked tile (KREG < K ones in passes) and latitude block gives the automatic
    kpacked path's result bit for bit, on whole grids and on latitude ranges; tiles the
    library lacks are refused with the reason."""
    psi = compute_psi((13, 36), (7, 12), kernel_shape, basis_type="harmonic",
                      grid_out="legendre-gauss")
    packed, k = kpack_psi(psi), psi.kernel_size
    x = torch.randn(1, 5, 13, 36, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    auto = native.kpacked_contraction(x, *packed.tensors(), k, 7, 12)
    expected = reference.disco_contraction(x.double(), psi, 12)
    assert float((auto.double() - expected).norm() / expected.norm()) < 1e-2
    part = native.kpacked_contraction(x, *packed.tensors(), k, 7, 12, 2, 4)
    tiles = native.kpacked_variant_tiles()
    # the table holds tiles that take one pass and tiles that take several for K = 9 and 16
    assert k < 9 or {kreg >= k for kreg, _ in tiles} == {True, False}
    for (kreg, nv), lat_block in itertools.product(tiles, (1, 3, 8)):
        y = native.kpacked_contraction(x, *packed.tensors(), k, 7, 12, tile=(kreg, nv, lat_block))
        assert torch.equal(y, auto), (kreg, nv, lat_block)
        y = native.kpacked_contraction(x, *packed.tensors(), k, 7, 12, 2, 4,
                                       tile={"kreg": kreg, "nv": nv, "lat_block": lat_block})
        assert torch.equal(y, part), (kreg, nv, lat_block)
    with pytest.raises(ValueError, match=r"no such \(kreg, nv\) register tile"):
        native.kpacked_contraction(x, *packed.tensors(), k, 7, 12, tile=(16, 7, 8))
    with pytest.raises(ValueError, match="positive integers"):
        native.kpacked_contraction(x, *packed.tensors(), k, 7, 12, tile=(*tiles[0], 0))
    with pytest.raises(ValueError, match="lacks \\['lat_block'\\]"):
        native.kpacked_contraction(x, *packed.tensors(), k, 7, 12, tile={"kreg": 16, "nv": 1})


# -- features ------------------------------------------------------------------------------

def test_features_have_one_named_finite_column_each():
    engine = FORWARD.feature_engine({"threads": 2, "simd_bits": 512, "l1d_bytes": 32768,
                                     "l2_bytes": 1 << 20, "l3_bytes": 32 << 20,
                                     "clock_mhz": 2500.0, "flags": ["avx512f"]})
    names = engine.feature_names()
    assert len(names) == len(set(names))
    for direction, family in FAMILIES.items():
        configs = family.candidate_space({}, {"flags": []})
        for precision in ("fp32", "bf16", "fp16"):
            p = family.problem({**SMALL, "precision": precision})
            matrix = engine.matrix(p, configs)
            assert matrix.shape == (len(configs), len(names)) and np.isfinite(matrix).all()
            column = dict(zip(names, matrix.T))
            assert (column[f"is_{precision}"] == 1).all() and (column["lon_tile_eff"] <= 1).all()
            assert (column["is_backward"] == (direction == "backward")).all()
            widest = configs.index(max(configs, key=lambda c: c.tile_lons))
            assert column["narrow_lon"][widest] == 1.0     # 24 longitudes < one wide tile
            packed = np.array([c.variant == "kpacked" for c in configs])
            lined = np.array([c.variant == "lines" for c in configs])
            assert (column["is_kpacked"] == packed).all() and (column["is_lines"] == lined).all()
            assert (column["is_csr"] == ~(packed | lined)).all()
            assert lined.any() == (direction == "backward")
            kreg = np.array([c.kreg for c in configs])
            # K = 9: rows idle in the last pass (KREG 9: none; 12: 3; 6: 6 + 3, so 3; 4: 3)
            last_pass = -(-9 // np.maximum(kreg, 1)) * kreg - 9
            assert (column["kreg_waste"] == np.where(packed, last_pass, 0)).all()
            assert (column["kreg_waste"] >= 0).all()
            # a kpacked neighbour feeds min(KREG, K) basis functions per loaded slice, a lines
            # key the LB lines of its block
            assert (column["psi_reuse"] == np.where(packed, np.minimum(kreg, 9), 1)
                    * np.array([c.bt * c.nv * max(c.lb, 1) for c in configs])).all()


# -- the pipeline on a tiny real run ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("disco")
    ctx = pipeline.RunContext.create(TINY, root / "work", root / "registry")
    summary = pipeline.run_all(ctx)
    yield ctx, summary
    clear_cache()


def _records(ctx, family: str) -> list[dict]:
    return [json.loads(line) for line in ctx.path("bench", f"{family}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_every_tile_of_this_cpu_matches_the_reference(tiny_run, direction):
    """Every tile of this CPU (csr and, forward, kpacked) ran exactly the problems it applies
    to and matched the reference there: kpacked ones where psi has the layout and K <= KREG
    (every one on the K = 1 problem, none on the piecewise-linear one)."""
    ctx, _ = tiny_run
    family = FAMILIES[direction]
    records = _records(ctx, f"disco_{direction}")
    candidates = [r for r in records if r["role"] == "candidate"]
    isa = _machine_isa()
    tiles = {kernel_name(_config(direction, variant, isa, tile,
                                 3 if VARIANTS[variant].lat_blocked else 1))
             for (d, variant, i), rows in TILES.items() if (d, i) == (direction, isa)
             for tile in rows}
    assert {r["kernel"] for r in candidates} == tiles
    assert {r["status"] for r in candidates} == {"ok"}
    for r in candidates:
        problem = family.problem({f: r[f] for f in family.problem_fields})
        assert r["max_error"] <= family.tolerance(problem), r["kernel"]
    problems = [p for _, p in pipeline.problems(ctx, f"disco_{direction}")]
    assert {p.basis for p in problems} == {"harmonic", "piecewise_linear"}
    for kernel in tiles:
        cfg = family.parse_name(kernel)
        measured = {r["dims_key"] for r in candidates if r["kernel"] == kernel}
        assert measured == {family.dims_key(p) for p in problems if family.applicable(cfg, p)}
    packed = {r["kernel"] for r in candidates if r["variant"] == "kpacked"}
    assert len(packed) == (len(TILES[("forward", "kpacked", isa)]) if direction == "forward" else 0)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_torch_harmonics_ran_as_the_peer(tiny_run, direction):
    """Beside the tiles, torch-harmonics' optimized contraction was measured as the peer, ok."""
    pytest.importorskip("torch_harmonics", reason="torch-harmonics is not installed (it needs "
                        "Python >= 3.11; the README's set-up installs it with --no-deps)")
    ctx, _ = tiny_run
    records = _records(ctx, f"disco_{direction}")
    peers = [r for r in records if r["role"] == "peer"]
    assert peers and all(r["status"] == "ok" and r["kernel"].startswith("torch_harmonics")
                         for r in peers)


PROTOCOL = Protocol(warmup_ms=1, min_sample_ms=1, samples=1, threads=2, timeout_s=30)


def _forward_build(ctx, variant: str, widest: bool = True):
    """The tiny run's forward build of `variant` with the most (or fewest) register rows."""
    builds = [b for b in pipeline.load_builds(ctx, "disco_forward") if b.config.variant == variant]
    return (max if widest else min)(builds, key=lambda b: (b.config.kreg, b.config.nv))


@pytest.mark.parametrize("variant", ["csr", "kpacked"])
def test_a_wrong_kernel_output_is_a_wrong_result(tiny_run, tmp_path, variant):
    ctx, _ = tiny_run
    built = _forward_build(ctx, variant)
    p = FORWARD.problem({**SMALL, "precision": "bf16"})
    prepared = FORWARD.prepare(p, tmp_path, seed=5)
    # the kernel reads another input than the reference was computed from
    other = torch.randn(2, 3, 12, 48, generator=torch.Generator().manual_seed(6))
    other.to(torch.bfloat16).view(torch.int16).numpy().tofile(prepared.job_args[-2])
    outcome = run_binary(built.binary, [("j", prepared.job_args)], PROTOCOL)["j"]
    assert outcome.status == "ok"
    checked, error = bench._validate(FORWARD, prepared, outcome)
    assert checked.status == "wrong_result" and error > 0.5
    assert "norm-relative error" in checked.reason


def test_a_kpacked_binary_answers_unsupported_where_it_cannot_run(tiny_run, tmp_path):
    """Run anyway (the bench never does: not applicable), a kpacked binary refuses a problem
    without the layout and says why; its narrowest tile (KREG < K = 9) runs K in passes and
    matches the reference."""
    ctx, _ = tiny_run
    linear = FORWARD.prepare(FORWARD.problem({**SMALL, "basis": "piecewise_linear",
                                              "kernel_shape": "3"}), tmp_path / "linear", seed=1)
    assert linear.job_args[11:16] == ("0", "0", "-", "-", "-")
    outcome = run_binary(_forward_build(ctx, "kpacked").binary, [("j", linear.job_args)],
                         PROTOCOL)["j"]
    assert outcome.status == "unsupported" and "no kpacked layout" in outcome.reason
    nine = FORWARD.prepare(FORWARD.problem(SMALL), tmp_path / "nine", seed=1)
    narrowest = _forward_build(ctx, "kpacked", widest=False)
    assert narrowest.config.kreg < 9
    outcome = run_binary(narrowest.binary, [("j", nine.job_args)], PROTOCOL)["j"]
    assert outcome.status == "ok", outcome.reason
    checked, error = bench._validate(FORWARD, nine, outcome)
    assert checked.status == "ok" and error < 1e-5, (checked.reason, error)


def test_selector_chooses_a_kernel_the_runtime_runs(tiny_run):
    ctx, summary = tiny_run
    assert summary["published"]["disco_forward"]["version"] == 1
    x = torch.randn(2, 5, 16, 64, generator=torch.Generator().manual_seed(1))
    fields = problem_fields(x.shape, (16, 64), (8, 32), grid_out="legendre-gauss",
                            dtype=x.dtype)
    model = summary["published"]["disco_forward"]["model"]   # disco_forward@<this class>
    candidates = json.loads((Path(ctx.registry) / model / "versions" / "1" /
                             "candidates.json").read_text())["kernels"]
    assert any("_kpacked_" in name for name in candidates)
    for basis, kernel_shape in (("harmonic", (3, 3)), ("piecewise linear", (3,))):
        asked = problem_fields(x.shape, (16, 64), (8, 32), kernel_shape=kernel_shape,
                               basis_type=basis, grid_out="legendre-gauss", dtype=x.dtype)
        chosen = choose_variant(ctx.registry, asked)
        assert chosen["kernel"] in candidates and chosen["version"] == 1
        assert chosen["predicted_tflops"] > 0
        problem = FORWARD.problem(asked)
        config = FORWARD.parse_name(chosen["kernel"])
        assert FORWARD.applicable(config, problem)    # kpacked only where psi has the layout
        psi = compute_psi((16, 64), (8, 32), kernel_shape, basis_type=basis,
                          grid_out="legendre-gauss", theta_cutoff=problem.theta_cutoff)
        if chosen["entry"] == "kpacked_contraction":
            assert chosen["tile"] == (chosen["kreg"], chosen["nv"], chosen["lat_block"])
            y = native.kpacked_contraction(x, *kpack_psi(psi).tensors(), psi.kernel_size, 8, 32,
                                           tile=chosen["tile"])
        else:
            assert chosen["entry"] == "contraction" and chosen["variant"] == "csr"
            assert chosen["tile"] == (chosen["nv"], chosen["lat_block"])
            csr = csr_from_psi(psi)
            y = native.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, 8, 32,
                                   tile=chosen["tile"])
        expected = reference.disco_contraction(x.double(), psi, 32)
        assert float((y.double() - expected).norm() / expected.norm()) < 1e-5

    back = choose_variant(ctx.registry, {**fields, "channels": 2}, model="disco_backward")
    assert back["direction"] == "backward" and back["bt"] <= 4
    # which backward variant wins is measured (the csr transpose or the line-blocked one,
    # both candidates here: CI once measured the other): either way it names its entry and
    # the tile that entry takes
    assert (back["entry"], back["tile"]) in {
        ("transpose_contraction", (back["bt"], back["nv"], back["lat_block"])),
        ("transpose_lines", ())}
    assert back["entry"] == BACKWARD.parse_name(back["kernel"]).runtime_entry()
    # batch * channels = 1: a kernel whose channel tile fits, or None where no candidate's
    # does (the module then runs its own choice), never an error
    for model in ("disco_forward", "disco_backward"):
        one = choose_variant(ctx.registry, {**fields, "batch": 1, "channels": 1}, model=model)
        assert one is None or one["bt"] == 1, one

    with pytest.raises(SelectorError, match="unknown DISCO model 'gemm'"):
        choose_variant(ctx.registry, fields, model="gemm")
    with pytest.raises(SelectorError, match="cannot load model 'disco_forward'"):
        choose_variant(Path(ctx.registry).parent / "nowhere", fields)
    with pytest.raises(SelectorError, match="nlon_in=64 must be a multiple of nlon_out=30"):
        choose_variant(ctx.registry, {**fields, "nlon_out": 30})


def test_disco_conv_runs_the_kernels_the_published_selector_chose(tiny_run, monkeypatch):
    """DiscoConvS2(registry=...) passes the selector's forward and backward choices to the
    kernels, and its output and gradients stay those of the float64 reference."""
    from tilecast.runtime.disco import DiscoConvS2

    ctx, _ = tiny_run
    used = []
    for name in ("contraction", "kpacked_contraction", "transpose_contraction",
                 "transpose_lines"):
        original = getattr(native, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            used.append((_name, kwargs.get("tile", ())))  # transpose_lines: its one tile, ()
            return _original(*args, **kwargs)
        monkeypatch.setattr(native, name, spy)
    torch.manual_seed(3)
    conv = DiscoConvS2(5, 4, (16, 48), (8, 16), (3, 3), basis_type="harmonic",
                       grid_out="legendre-gauss", registry=ctx.registry)
    x = torch.randn(2, 5, 16, 48, requires_grad=True)
    out = conv(x)
    out.backward(torch.ones_like(out))
    fields = problem_fields(x.shape, (16, 48), (8, 16), (3, 3), "harmonic", "equiangular",
                            "legendre-gauss", conv.theta_cutoff, x.dtype)
    forward = choose_variant(ctx.registry, fields)
    backward = choose_variant(ctx.registry, fields, model="disco_backward")
    assert (forward["entry"], tuple(forward["tile"])) in used
    # the CSR transpose or the line-blocked one, whichever the tiny run measured faster
    assert (backward["entry"], tuple(backward["tile"])) in used
    x64 = x.detach().double().requires_grad_()
    expected = reference.disco_conv(x64, conv.psi, conv.weight.detach().double(), 16, 1,
                                    conv.bias.detach().double())
    expected.backward(torch.ones_like(expected))
    expected = expected.detach()
    assert float((out.detach().double() - expected).norm() / expected.norm()) < 1e-5
    assert float((x.grad.double() - x64.grad).norm() / x64.grad.norm()) < 1e-5
    with pytest.raises(SelectorError, match="cannot load model 'disco_forward'"):
        DiscoConvS2(5, 4, (16, 48), (8, 16), (3, 3), registry=Path(ctx.registry) / "missing")


# -- configs -------------------------------------------------------------------------------

# the estimate's bound for one call: ~50 ms on 2 cores at the few GFLOP/s these sizes reach
MAX_FLOPS_EST = 64e6


@pytest.mark.parametrize("config, families", [
    ("disco.yaml", ("disco_forward", "disco_backward")),
    ("quick.yaml", ("disco_forward", "disco_backward")),
])
def test_config_problems_are_valid_small_and_held_out(config, families):
    raw = yaml.safe_load((CONFIGS / config).read_text())
    engine = FORWARD.feature_engine({"threads": 2})
    index = engine.feature_names().index("log2_flops_est")
    for name in families:
        family = get_family(name)
        problems = raw["families"][name]["problems"]
        keys = {}
        for problem_set in ("train", "holdout"):
            expanded = [family.problem(v) for v in expand_problems(name, problems[problem_set])]
            assert expanded, (config, name, problem_set)
            keys[problem_set] = {family.dims_key(p) for p in expanded}
            for p in expanded:
                assert 2.0 ** engine.problem_features(p)[index] <= MAX_FLOPS_EST, family.dims_key(p)
        assert not keys["train"] & keys["holdout"], "a holdout problem is in train"


@pytest.mark.parametrize("isa_flags", [["avx2", "fma", "avx512f"], ["avx2", "fma"]])
@pytest.mark.parametrize("direction, variants", [("forward", {"csr", "kpacked"}),
                                                 ("backward", {"csr", "lines"})])
def test_the_quick_slices_compare_csr_with_another_variant_that_runs(direction, variants,
                                                                     isa_flags):
    """On either ISA the quick run's candidates (the seeded first `budget`) hold a csr tile
    and, forward, a kpacked tile, backward the line-blocked transpose, each applicable to every
    problem (forward: harmonic, K <= KREG)."""
    family = FAMILIES[direction]
    family_config = load_config(CONFIGS / "quick.yaml").families[f"disco_{direction}"]
    space = {family.kernel_name(c): c
             for c in family.candidate_space(family_config.candidates, {"flags": isa_flags})}
    chosen = [space[name] for name in
              tune.seeded_order(list(space), family_config.seed)[:family_config.budget]]
    assert {c.variant for c in chosen} == variants
    problems = [family.problem(v) for ps in ("train", "holdout")
                for v in family_config.problems[ps]]
    assert all(family.applicable(c, p) for c in chosen for p in problems)
