"""Run configs and problem files: the shipped ones load; malformed ones are rejected naming the
file, the key path and the value (tests/test_config_faults.py tries many more); the schema
agrees with the families, the protocol and the model spec it is built from."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tilecast.config import load as config, schema
from tilecast.config import (MAX_PROBLEMS, UNLIMITED_BUDGET, ConfigError, expand_problems,
                                  load_config, read_problem_file)
from tilecast.measurement.protocol import Protocol
from tilecast.families import FAMILIES, get_family
from tilecast.families.gemm import DTYPES, ISAS, MICRO_KERNELS

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "tests" / "configs").glob("*.yaml"))
MINIMAL = {"name": "x", "families": {"gemm": {"candidates": {}, "problems": {
    "train": [{"list": [{"m": 1, "n": 2, "k": 3}]}], "holdout": [{"list": [{"m": 4, "n": 5, "k": 6}]}]}}}}


def write(tmp_path: Path, document, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


def with_gemm(**changes) -> dict:
    """MINIMAL with its gemm section's keys replaced."""
    document = json.loads(json.dumps(MINIMAL))
    document["families"]["gemm"].update(changes)
    return document


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.families and cfg.path == path
    for family_config in cfg.families.values():
        assert family_config.problems["train"] and family_config.problems["holdout"]
        assert family_config.sentinel


@pytest.mark.parametrize("name", ["quick", "nightly"])
def test_shipped_configs_load_by_name(name):
    gemm = load_config(name).families["gemm"]
    assert gemm.problems["train"] and gemm.problems["holdout"]


def test_tiny_config_expands_to_its_known_problems():
    cfg = load_config(REPO / "tests" / "configs" / "tiny.yaml")
    gemm = cfg.families["gemm"]
    assert len(gemm.problems["train"]) == 3 * 2 * 2
    assert gemm.problems["train"][0] == {"m": 1, "n": 16, "k": 32}
    assert gemm.problems["holdout"] == [{"m": 7, "n": 50, "k": 100}, {"m": 60, "n": 20, "k": 200},
                                        {"m": 33, "n": 33, "k": 33}]
    assert gemm.sentinel[0] == {"m": 64, "n": 64, "k": 64}
    assert (gemm.budget, gemm.seed, gemm.candidates["kc"]) == (4, 3, [128, 256])
    assert cfg.protocol == Protocol(warmup_ms=1, min_sample_ms=1, samples=3, max_reps=500,
                                    threads=2, timeout_s=20)


def test_nightly_holdout_is_large_skinny_and_non_power_of_two():
    holdout = load_config("nightly").families["gemm"].problems["holdout"]
    assert len(holdout) >= 40
    assert any(min(p["m"], p["n"]) <= 16 for p in holdout)
    assert any(any(p[f] & (p[f] - 1) for f in ("m", "n", "k")) for p in holdout)


def test_a_minimal_config_takes_the_documented_defaults(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL, "minimal.yaml"))
    assert cfg.protocol == Protocol()
    assert (cfg.tie_threshold_pct, cfg.finalists, cfg.confirm_samples, cfg.build_jobs) == (1.0, 3, 5, 2)
    assert (cfg.problems_per_batch, cfg.rounds, cfg.retry_disturbed, cfg.interleave,
            cfg.race_cycles, cfg.race_rounds, cfg.race_margin_pct, cfg.race_keep_pct,
            cfg.race_fresh_process) == (8, 3, 1, True, 16, 3, 25.0, 5.0, True)
    gemm = cfg.families["gemm"]
    assert (gemm.budget, gemm.seed, gemm.model, gemm.warm_start) == (UNLIMITED_BUDGET, 0, {}, None)
    assert gemm.sentinel == gemm.problems["holdout"] == [{"m": 4, "n": 5, "k": 6}]


def test_warm_start_takes_an_alias_or_a_version_number(tmp_path):
    assert load_config(write(tmp_path, with_gemm(warm_start="production"))).families["gemm"].warm_start == "production"
    assert load_config(write(tmp_path, with_gemm(warm_start=3))).families["gemm"].warm_start == "3"


@pytest.mark.parametrize("text, fragment", [
    ("name: x\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\nprotcol: {}\n",
     r"bad.yaml: unknown key\(s\) \['protcol'\]; valid: \["),
    ("name: x\nfamilies: {conv9: {}}\n", "bad.yaml: families: unknown family 'conv9'; valid: gemm"),
    ("name: x\nfamilies: {gemm: {candidates: {}, problems: {train: []}}}\n",
     r"bad.yaml: families.gemm.problems: missing key\(s\) \['holdout'\]"),
    ("name: x\nprotocol: {samples: 0}\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\n",
     r"protocol.samples: expected a whole number >= 1, got 0"),
    ("name: x\nbench: {rounds: 0}\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\n",
     r"bench.rounds: expected a whole number >= 1, got 0"),
    ("name: x\nbench: {retry_disturbed: two}\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\n",
     r"bench.retry_disturbed: expected a whole number >= 0, got 'two'"),
    ("name: x\nbench: {interleave: 'no'}\nfamilies: {gemm: {candidates: {}, problems: {train: [], holdout: []}}}\n",
     r"bench.interleave: expected true or false, got 'no'"),
    ("name: [unclosed\n", "bad.yaml: not valid YAML"),
    ("name: x\nfamilies: {gemm: {candidates: {}, problems: {train: [{grid: {m: [1]}, list: []}], holdout: []}}}\n",
     r"problems.train\[0\]: needs exactly one of grid / list / random, got \['grid', 'list'\]"),
    ("name: x\nname: y\nfamilies: {}\n", "bad.yaml: not valid YAML: .*found the key 'name' twice"),
])
def test_malformed_configs_are_named(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(write(tmp_path, text))


def test_every_error_is_listed_one_a_line_missing_keys_first(tmp_path):
    document = with_gemm(budget=-1, seed="abc")
    document["protocol"] = {"samples": 2.5}
    del document["families"]["gemm"]["problems"]["holdout"]
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, document))
    lines = str(err.value).splitlines()
    assert lines == [
        f"{tmp_path / 'bad.yaml'}: families.gemm.problems: missing key(s) ['holdout']",
        f"{tmp_path / 'bad.yaml'}: protocol.samples: expected a whole number >= 1, got 2.5",
        f"{tmp_path / 'bad.yaml'}: families.gemm.budget: expected a whole number >= 1, got -1",
        f"{tmp_path / 'bad.yaml'}: families.gemm.seed: expected a whole number >= 0, got 'abc'"]


def test_a_long_list_of_errors_is_cut_and_counted(tmp_path):
    document = with_gemm(candidates={"mc": [-i for i in range(1, 31)]})
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, document))
    lines = str(err.value).splitlines()
    assert len(lines) == config.SHOWN_ERRORS + 1 and lines[-1] == "... and 10 more"
    assert lines[0].endswith("families.gemm.candidates.mc[0]: expected a whole number from 1 "
                             "to 2147483647, got -1")


def test_a_key_given_twice_is_refused_but_a_merge_may_override(tmp_path):
    merged = ("name: x\nfamilies:\n  gemm: &g\n    candidates: {}\n    seed: 1\n    problems:\n"
              "      train: [{list: [{m: 1, n: 2, k: 3}]}]\n      holdout: [{list: [{m: 4, n: 5, k: 6}]}]\n"
              "  grouped_conv_forward:\n    <<: *g\n    seed: 2\n    problems:\n"
              "      train: [{list: [{C: 1, K: 1, Hi: 3, Wi: 3, Y: 1, X: 1}]}]\n"
              "      holdout: [{list: [{C: 2, K: 1, Hi: 3, Wi: 3, Y: 1, X: 1}]}]\n")
    cfg = load_config(write(tmp_path, merged, "merged.yaml"))
    assert (cfg.families["gemm"].seed, cfg.families["grouped_conv_forward"].seed) == (1, 2)


def test_the_holdout_set_must_stay_out_of_training(tmp_path):
    document = with_gemm(problems={"train": [{"grid": {"m": [1, 4], "n": [5], "k": [6]}}],
                                   "holdout": [{"list": [{"m": 4, "n": 5, "k": 6}]}]})
    with pytest.raises(ConfigError, match=r"problems.holdout\[0\].list\[0\]: holdout problem "
                                          r"m=4,n=5,k=6,dtype=fp32.* is also a training problem"):
        load_config(write(tmp_path, document))


# -- problems and memory ----------------------------------------------------------------------

@pytest.mark.parametrize("family_name, values, expected", [
    ("gemm", {"m": 2, "n": 3, "k": 4}, 4 * (8 + 12) + 12 * 6),
    ("gemm", {"m": 2, "n": 3, "k": 4, "dtype": "bf16"}, 2 * (8 + 12) + 12 * 6),
    # x 1*4*4*2 = 32, w 3*3*3*2 = 54, y/dy 2*2*3 = 12 floats; the output and its float64 reference
    ("grouped_conv_forward", {"C": 2, "K": 3, "Hi": 4, "Wi": 4, "Y": 3, "X": 3}, 4 * 98 + 12 * 12),
    ("grouped_conv_bwd_data", {"C": 2, "K": 3, "Hi": 4, "Wi": 4, "Y": 3, "X": 3}, 4 * 98 + 12 * 32),
    ("grouped_conv_bwd_weight", {"C": 2, "K": 3, "Hi": 4, "Wi": 4, "Y": 3, "X": 3}, 4 * 98 + 12 * 54),
    # harmonic 3x3: K = 9; 2 channels of 4x8 in, 9 x 4x8 out (the backward the other way)
    ("disco_forward", {"channels": 2, "nlat_in": 4, "nlon_in": 8, "nlat_out": 4, "nlon_out": 8},
     2 * (4 * 32 + 12 * 288)),
    ("disco_backward", {"channels": 2, "nlat_in": 4, "nlon_in": 8, "nlat_out": 4, "nlon_out": 8},
     2 * (4 * 288 + 12 * 32)),
])
def test_operand_bytes_known_answers(family_name, values, expected):
    assert get_family(family_name).operand_bytes(values) == expected


def test_a_problem_larger_than_memory_is_refused_naming_both_sizes(tmp_path, monkeypatch):
    path = write(tmp_path, MINIMAL)
    monkeypatch.setattr(schema, "memory_bytes", lambda: 4 * (4 * 6 + 6 * 5) + 12 * 20)  # m=4,n=5,k=6
    load_config(path)
    monkeypatch.setattr(schema, "memory_bytes", lambda: 455)
    with pytest.raises(ConfigError, match=r"bad.yaml: families.gemm.problems.holdout\[0\].list\[0\]: "
                                          r"problem 'm=4,n=5,k=6' needs about 456 bytes .* more "
                                          r"than the 455 bytes"):
        load_config(path)


def test_memory_bytes_is_this_machines():
    memory = schema.memory_bytes()
    assert memory is None or 2**26 < memory < 2**50


def test_a_problem_the_family_refuses_names_the_problem_and_why(tmp_path):
    document = json.loads(json.dumps(MINIMAL))
    document["families"] = {"grouped_conv_forward": {"candidates": {}, "problems": {
        "train": [{"list": [{"C": 1, "K": 1, "Hi": 3, "Wi": 3, "Y": 1, "X": 1, "Di": 2}]}],
        "holdout": [{"list": [{"C": 2, "K": 1, "Hi": 3, "Wi": 3, "Y": 1, "X": 1}]}]}}}
    with pytest.raises(ConfigError, match=r"families.grouped_conv_forward.problems.train\[0\]"
                                          r".list\[0\]: problem .*missing field\(s\) \['Z'\]"):
        load_config(write(tmp_path, document))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 30), st.integers(0, 2**32))
def test_random_entries_draw_inside_their_ranges_and_repeat(a, b, count, seed):
    lo, hi = min(a, b), max(a, b)
    entries = [{"random": {"count": count, "seed": seed, "ranges": {"m": [lo, hi]}}, "n": 3, "k": 4}]
    drawn = expand_problems("train", entries, get_family("gemm"))
    assert len(drawn) == count and all(lo <= p["m"] <= hi and (p["n"], p["k"]) == (3, 4) for p in drawn)
    assert expand_problems("train", entries, get_family("gemm")) == drawn


def test_expand_problems_checks_the_family_fields_or_any_familys():
    gemm = get_family("gemm")
    assert expand_problems("x", [{"grid": {"m": [1, 2]}, "n": 3, "k": 4}], gemm) == [
        {"n": 3, "k": 4, "m": 1}, {"n": 3, "k": 4, "m": 2}]
    with pytest.raises(ConfigError, match=r"^x\[0\]: unknown key\(s\) \['C'\]"):
        expand_problems("x", [{"list": [{"m": 1}], "C": 3}], gemm)
    assert expand_problems("x", [{"list": [{"C": 3}]}]) == [{"C": 3}]  # any family's field
    with pytest.raises(ConfigError, match=r"^x\[0\].grid.m: expected a non-empty list"):
        expand_problems("x", [{"grid": {"m": 5}}])
    with pytest.raises(ConfigError, match=r"^x: the entries expand to no problem"):
        expand_problems("x", [])


def test_a_grid_too_large_is_refused_before_it_is_expanded():
    side = list(range(1, 501))
    with pytest.raises(ConfigError, match=f"x: the entries expand to {500**3} problems, more "
                                          f"than the {MAX_PROBLEMS}"):
        expand_problems("x", [{"grid": {"m": side, "n": side, "k": side}}], get_family("gemm"))


def test_problem_files_are_checked_like_configs(tmp_path):
    gemm = get_family("gemm")
    good = write(tmp_path, {"problems": [{"list": [{"m": 5, "n": 40, "k": 64}]},
                                         {"grid": {"m": [12], "n": [12, 90]}, "k": 50}]}, "mine.yaml")
    assert [gemm.dims_key(p) for p in read_problem_file(good, gemm)] == [
        "m=5,n=40,k=64,dtype=fp32,layout_a=row,layout_b=row",
        "m=12,n=12,k=50,dtype=fp32,layout_a=row,layout_b=row",
        "m=12,n=90,k=50,dtype=fp32,layout_a=row,layout_b=row"]
    cases = [({"problems": [{"list": [{"m": 5, "n": 0, "k": 64}]}]},
              r"problems file .*mine.yaml: problems\[0\].list\[0\].n: expected a whole number "
              r"from 1 to 2147483647, got 0"),
             ({"problems": [{"list": [{"m": 127.9, "n": 1, "k": 1}]}]},
              r"problems\[0\].list\[0\].m: .* got 127.9"),
             ({"problems": [{"list": [{"m": 10**9, "n": 10**9, "k": 10**9}]}]},
              r"problems\[0\].list\[0\]: problem .* bytes"),
             ({"problems": []}, r"mine.yaml: problems: the entries expand to no problem"),
             ({"problem": []}, r"mine.yaml: unknown key\(s\) \['problem'\]"),
             ([1, 2], r"mine.yaml: expected a mapping of problems, got \[1, 2\]")]
    for document, fragment in cases:
        with pytest.raises(ConfigError, match=fragment):
            read_problem_file(write(tmp_path, document, "mine.yaml"), gemm)
    with pytest.raises(ConfigError, match="problems file .*nowhere.yaml does not exist"):
        read_problem_file(tmp_path / "nowhere.yaml", gemm)


# -- the schema and what it is built from -----------------------------------------------------

@pytest.mark.parametrize("family_name", list(FAMILIES))
def test_the_schema_covers_each_familys_options_and_fields(family_name):
    options, problem_fields = schema.family_rules(family_name)
    family = FAMILIES[family_name]
    assert set(options) == set(family.CANDIDATE_OPTIONS)
    assert set(problem_fields) == set(family.problem_fields)
    schema.family_model(family_name)   # builds


def test_the_schema_agrees_with_protocol_model_spec_and_entry_kinds():
    from tilecast.stages.train import ModelSpec   # pandas: only here

    assert set(schema.MODEL_RULES) == {f.name for f in fields(ModelSpec)}
    assert set(schema.PROTOCOL_RULES) == {f.name for f in fields(Protocol)}
    assert list(schema.VARIED_FIELDS) == list(schema.PROBLEM_KINDS) == list(config.ENTRY_KINDS)


def test_gemm_candidates_take_exactly_the_familys_values(tmp_path):
    tiles = {f"{row.mr}x{row.nr}" for row in MICRO_KERNELS}
    allowed = schema.allowed(schema.family_rules("gemm")[0]["tiles"])
    assert all(repr(tile) in allowed for tile in tiles)
    cfg = load_config(write(tmp_path, with_gemm(candidates={"tiles": sorted(tiles), "isa": list(ISAS)})))
    assert cfg.families["gemm"].candidates["tiles"] == sorted(tiles)
    with pytest.raises(ConfigError, match=r"candidates.tiles\[0\]: expected one of '14x32', .*got '7x7'"):
        load_config(write(tmp_path, with_gemm(candidates={"tiles": ["7x7"]})))


def test_the_json_schema_describes_the_same_configs(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    document = schema.config_json_schema()
    json.dumps(document)
    families = document["$defs"]["Families"]["properties"]
    assert set(families) == set(FAMILIES)
    isa = document["$defs"]["GemmCandidates"]["properties"]["isa"]
    assert isa["items"]["enum"] == list(ISAS)
    dtype = document["$defs"]["GemmProblem"]["properties"]["dtype"]
    assert dtype["enum"] == list(DTYPES)
    validator = jsonschema.Draft202012Validator(document)
    for path in SHIPPED:
        validator.validate(yaml.safe_load(path.read_text()))
    bad = json.loads(json.dumps(MINIMAL))
    bad["protocol"] = {"samples": 2.5}
    assert [error.json_path for error in validator.iter_errors(bad)] == ["$.protocol.samples"]


def test_check_config_file_also_asks_this_cpu(tmp_path, monkeypatch):
    from tilecast.core import hardware

    path = write(tmp_path, with_gemm(candidates={"isa": ["avx512"]}))
    assert load_config(path).families["gemm"].candidates == {"isa": ["avx512"]}
    monkeypatch.setattr(hardware, "profile", lambda threads=None: {"flags": ["avx2", "fma"]})
    with pytest.raises(ConfigError, match=r"bad.yaml: families.gemm.candidates: the options "
                                          r".* allow no candidate kernel this CPU can run"):
        config.check_config_file(path)
    monkeypatch.setattr(hardware, "profile", lambda threads=None: {"flags": ["avx2", "fma", "avx512f"]})
    assert config.check_config_file(path).name == "x"


def test_missing_config_lists_the_available_ones():
    with pytest.raises(ConfigError, match="available: .*quick"):
        load_config("no-such-config")


def test_threads_auto_measures_with_this_machines_cores_and_is_the_default(tmp_path):
    from tilecast.core.hardware import cpu_count

    assert Protocol().threads == cpu_count() == Protocol.from_mapping({"threads": "auto"}).threads
    document = with_gemm()
    document["protocol"] = {"threads": "auto"}
    assert load_config(write(tmp_path, document)).protocol.threads == cpu_count()
    document["protocol"] = {"threads": "many"}
    with pytest.raises(ConfigError, match=r"protocol.threads: expected a whole number >= 1, "
                                          r"'auto'.*a non-empty list.*got 'many'"):
        load_config(write(tmp_path, document))
