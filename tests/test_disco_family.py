"""DISCO families: names round-trip over the whole table, the table is the runtime's, bad input
is named, every register tile of this CPU benchmarked through the pipeline matches the float64
reference, a wrong kernel output is caught, features are well formed, and a model trained on
a tiny real run chooses a kernel the runtime runs (tilecast.disco.selector)."""
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

from tilecast import bench, pipeline
from tilecast.config import expand_problems
from tilecast.disco import compute_psi, csr_from_psi, native, reference
from tilecast.disco.selector import SelectorError, choose_variant, clear_cache, problem_fields
from tilecast.families import FamilyError, get_family
from tilecast.families.disco import (LANES, LAT_BLOCKS, MAX_LAT_BLOCK, TILES, DiscoConfig,
                                     DiscoFamily, kernel_name, parse_kernel_name)
from tilecast.measure import JobOutcome, Protocol, run_binary

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

FAMILIES = {d: get_family(f"disco_{d}") for d in ("forward", "backward")}
FORWARD, BACKWARD = FAMILIES["forward"], FAMILIES["backward"]
TINY = Path(__file__).parent / "configs" / "disco_tiny.yaml"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = {"batch": 2, "channels": 3, "nlat_in": 12, "nlon_in": 48, "nlat_out": 6, "nlon_out": 24,
         "grid_out": "legendre-gauss"}


def _machine_isa() -> str:
    return {lanes: isa for isa, lanes in LANES.items()}[native.lanes()]


# -- names and the table -------------------------------------------------------------------

def test_families_are_registered_under_their_names():
    for direction, family in FAMILIES.items():
        assert isinstance(family, DiscoFamily) and family.name == f"disco_{direction}"


def test_every_valid_config_round_trips_and_names_are_unique():
    names = set()
    for (direction, variant, isa), tiles in TILES.items():
        for (bt, nv), lat_block in itertools.product(tiles, range(1, MAX_LAT_BLOCK + 1)):
            cfg = DiscoConfig(direction, variant, isa, bt, nv, lat_block)
            name = kernel_name(cfg)
            assert FAMILIES[direction].parse_name(name) == cfg
            names.add(name)
    assert len(names) == sum(len(t) for t in TILES.values()) * MAX_LAT_BLOCK
    assert kernel_name(DiscoConfig("backward", "csr", "avx512", 4, 3, 8)) == \
        "disco_backward_csr_avx512_bt4_nv3_lat8"


def test_candidate_space_is_the_table():
    for direction, family in FAMILIES.items():
        space = family.candidate_space({}, {"flags": []})     # flags unknown: every ISA
        rows = {(c.direction, c.variant, c.isa, c.bt, c.nv) for c in space}
        assert rows == {(*key, bt, nv) for key, tiles in TILES.items() if key[0] == direction
                        for bt, nv in tiles}
        assert {c.lat_block for c in space} == set(LAT_BLOCKS[direction])
    avx512 = FORWARD.candidate_space({}, {"flags": ["avx2", "fma", "avx512f"]})
    assert {c.isa for c in avx512} == {"avx512"}
    avx2 = BACKWARD.candidate_space({"tiles": ["4x3"], "lat_block": [5]}, {"flags": ["avx2", "fma"]})
    assert avx2 == [DiscoConfig("backward", "csr", "avx2", 4, 3, 5)]
    with pytest.raises(FamilyError, match="unknown disco candidate option"):
        FORWARD.candidate_space({"nv": [4]}, {})
    with pytest.raises(FamilyError, match="unknown variant 'dense'"):
        FORWARD.candidate_space({"variant": ["dense"]}, {})


def test_table_matches_the_runtime_library():
    """TILES is what kernels/cpu/disco_csr_variants.hpp instantiates for this CPU."""
    isa = _machine_isa()
    assert native.variant_tiles("forward") == TILES[("forward", "csr", isa)]
    assert native.variant_tiles("transpose") == TILES[("backward", "csr", isa)]


@pytest.mark.parametrize("name, fragment", [
    ("disco_forward_csr_avx512_bt1_nv7_lat8", "tile bt1 x nv7 is not instantiated"),
    ("disco_forward_csr_avx512_bt4_nv4_lat8", "tile bt4 x nv4 is not instantiated"),
    ("disco_forward_kpacked_avx512_bt1_nv4_lat8", "unknown variant 'kpacked'"),
    ("disco_forward_csr_sse_bt1_nv4_lat8", "unknown isa 'sse'"),
    ("disco_forward_csr_avx512_bt1_nv4_lat0", "lat_block=0"),
    ("disco_forward_csr_avx512_bt1_nv4_lat65", "lat_block=65"),
    ("disco_sideways_csr_avx512_bt1_nv4_lat8", "unknown direction 'sideways'"),
    ("disco_backward_csr_avx512_bt8_nv2_lat4", "use disco_backward"),
    ("gemm_fp32_avx2_6x16_mc96_nc512_kc128_parm_pa1_pf1", "not a disco kernel name"),
])
def test_bad_kernel_names_are_named(name, fragment):
    with pytest.raises(FamilyError, match=re.escape(fragment)):
        FORWARD.parse_name(name)


def test_build_spec_sets_every_define():
    spec = BACKWARD.build_spec(parse_kernel_name("disco_backward_csr_avx2_bt4_nv3_lat6"))
    assert spec.source.name == "disco_bench.cpp" and spec.source.exists()
    assert spec.defines == {"TC_DISCO_DIR": 1, "TC_DISCO_VARIANT": 0, "TC_DISCO_ISA": 0,
                            "TC_BT": 4, "TC_NV": 3, "TC_LAT_BLOCK": 6}


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
    ctx, _ = tiny_run
    records = _records(ctx, f"disco_{direction}")
    candidates = [r for r in records if r["role"] == "candidate"]
    built = {r["kernel"] for r in candidates}
    assert built == {kernel_name(DiscoConfig(direction, "csr", _machine_isa(), bt, nv, 3))
                     for bt, nv in TILES[(direction, "csr", _machine_isa())]}
    assert {r["status"] for r in candidates} == {"ok"}
    for r in candidates:
        assert r["max_error"] <= FAMILIES[direction].tolerance(FAMILIES[direction].problem(
            {f: r[f] for f in FAMILIES[direction].problem_fields})), r["kernel"]
        assert r["bt"] <= r["batch"] * r["channels"]   # wider channel tiles are not applicable
    peers = [r for r in records if r["role"] == "peer"]
    assert peers and all(r["status"] == "ok" and r["kernel"].startswith("torch_harmonics")
                         for r in peers)


def test_a_wrong_kernel_output_is_a_wrong_result(tiny_run, tmp_path):
    ctx, _ = tiny_run
    built = pipeline.load_builds(ctx, "disco_forward")[0]
    p = FORWARD.problem({**SMALL, "precision": "bf16"})
    prepared = FORWARD.prepare(p, tmp_path, seed=5)
    # the kernel reads another input than the reference was computed from
    other = torch.randn(2, 3, 12, 48, generator=torch.Generator().manual_seed(6))
    other.to(torch.bfloat16).view(torch.int16).numpy().tofile(prepared.job_args[-2])
    protocol = Protocol(warmup_ms=1, min_sample_ms=1, samples=1, threads=2, timeout_s=30)
    outcome = run_binary(built.binary, [("j", prepared.job_args)], protocol)["j"]
    assert outcome.status == "ok"
    checked, error = bench._validate(FORWARD, prepared, outcome)
    assert checked.status == "wrong_result" and error > 0.5
    assert "norm-relative error" in checked.reason


def test_selector_chooses_a_kernel_the_runtime_runs(tiny_run):
    ctx, summary = tiny_run
    assert summary["published"]["disco_forward"]["version"] == 1
    x = torch.randn(2, 5, 16, 64, generator=torch.Generator().manual_seed(1))
    fields = problem_fields(x.shape, (16, 64), (8, 32), grid_out="legendre-gauss",
                            dtype=x.dtype)
    chosen = choose_variant(ctx.registry, fields)
    candidates = json.loads((Path(ctx.registry) / "disco_forward" / "versions" / "1" /
                             "candidates.json").read_text())["kernels"]
    assert chosen["kernel"] in candidates and chosen["version"] == 1
    assert chosen["tile"] == (chosen["nv"], chosen["lat_block"]) and chosen["predicted_tflops"] > 0
    problem = FORWARD.problem(fields)
    psi = compute_psi((16, 64), (8, 32), (3, 3), basis_type="harmonic", grid_out="legendre-gauss",
                      theta_cutoff=problem.theta_cutoff)
    csr = csr_from_psi(psi)
    y = native.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, 8, 32,
                           tile=chosen["tile"])
    expected = reference.disco_contraction(x.double(), psi, 32)
    assert float((y.double() - expected).norm() / expected.norm()) < 1e-5

    back = choose_variant(ctx.registry, {**fields, "channels": 2}, model="disco_backward")
    assert back["direction"] == "backward" and back["bt"] <= 4
    assert back["tile"] == (back["bt"], back["nv"], back["lat_block"])

    with pytest.raises(SelectorError, match="unknown DISCO model 'gemm'"):
        choose_variant(ctx.registry, fields, model="gemm")
    with pytest.raises(SelectorError, match="cannot load model 'disco_forward'"):
        choose_variant(Path(ctx.registry).parent / "nowhere", fields)
    with pytest.raises(SelectorError, match="nlon_in=64 must be a multiple of nlon_out=30"):
        choose_variant(ctx.registry, {**fields, "nlon_out": 30})


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
