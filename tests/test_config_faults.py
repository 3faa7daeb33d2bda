"""Fault injection on run configs: every malformed config, whether one of issue 19's cases or
one hypothesis makes up (wrong types, negatives, fractions, unknown keys, garbage bytes), ends
in a ConfigError whose first line names the file, the key path and the bad value, never in
another exception. Each case is counted in the fault ledger (tests/faults.py)."""
from __future__ import annotations

import copy
import string
from pathlib import Path

import pytest
import yaml
from faults import note_case
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tilecast.config import ConfigError, load_config
from tilecast.config.schema import key_path, show

GEMM = ("families", "gemm")
# a small valid config; every case below breaks one thing in it
BASE = {
    "name": "faults",
    "protocol": {"warmup_ms": 1, "min_sample_ms": 1, "samples": 3, "max_reps": 100,
                 "flush_cache": False, "threads": 2, "timeout_s": 20},
    "tune": {"tie_threshold_pct": 1.0, "finalists": 2, "confirm_samples": 2},
    "build": {"jobs": 2},
    "bench": {"problems_per_batch": 4, "rounds": 1, "interleave": True, "race_margin_pct": 10},
    "families": {"gemm": {
        "budget": 4, "seed": 3,
        "candidates": {"isa": ["avx2"], "mc": [96], "nc": [512], "kc": [128, 256],
                       "parallel": ["m", "k"], "pack_a": [True], "prefetch": [True]},
        "problems": {
            "train": [{"grid": {"m": [1, 24], "n": [16, 80], "k": [32]}},
                      {"random": {"count": 4, "seed": 1,
                                  "ranges": {"m": [1, 64], "n": [1, 64], "k": [8, 64]}}}],
            "holdout": [{"list": [{"m": 7, "n": 50, "k": 100}]}]},
        "model": {"folds": 3, "n_estimators": 50}}},
}
HOLDOUT_PROBLEM = (*GEMM, "problems", "holdout", 0, "list", 0)
RANDOM = (*GEMM, "problems", "train", 1, "random")
GRID = (*GEMM, "problems", "train", 0, "grid")
CONV = {"candidates": {}, "problems": {
    "train": [{"list": [{"C": 4, "K": 8, "Hi": 6, "Wi": 6, "Y": 3, "X": 3}]}],
    "holdout": [{"list": [{"C": 8, "K": 8, "Hi": 6, "Wi": 6, "Y": 3, "X": 3}]}]}}
DISCO = {"candidates": {}, "problems": {
    "train": [{"list": [{"channels": 2, "nlat_in": 8, "nlon_in": 16, "nlat_out": 8, "nlon_out": 16}]}],
    "holdout": [{"list": [{"channels": 3, "nlat_in": 8, "nlon_in": 16, "nlat_out": 8, "nlon_out": 16}]}]}}
DELETE = object()   # a case's value: the key is removed


def changed(path: tuple, value, document=None) -> dict:
    """BASE (or `document`) with the value at `path` replaced (DELETE: removed; a missing
    last key is added)."""
    document = copy.deepcopy(BASE if document is None else document)
    parent = document
    for part in path[:-1]:
        parent = parent[part]
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return document


def expect_clear(path: Path, *needles: str) -> str:
    """Load `path`, count the case in the fault ledger by how it ended, and assert a
    ConfigError whose first line names the file and each of `needles`; returns that line."""
    try:
        load_config(path)
    except ConfigError as err:
        note_case("clear")
        first = str(err).splitlines()[0]
    except Exception:
        note_case("traceback")
        raise
    else:
        note_case("ok")
        pytest.fail(f"{path} loaded; expected a ConfigError")
    assert first.startswith(f"{path}: ") or first.startswith(f"config {path} "), first
    for needle in needles:
        assert needle in first, f"{needle!r} not in {first!r}"
    return first


def write(directory: Path, document, name: str = "case.yaml") -> Path:
    path = directory / name
    if isinstance(document, bytes):
        path.write_bytes(document)
    else:
        path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


def test_the_base_config_loads(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert len(cfg.families["gemm"].problems["train"]) == 4 + 4


# issue 19's cases, then more: (path, value, needles of the first line)
CASES = [
    (("protocol", "samples"), 2.5, ["protocol.samples: expected a whole number >= 1", "2.5"]),
    ((*GEMM, "budget"), "lots", ["families.gemm.budget: expected a whole number >= 1", "'lots'"]),
    ((*GEMM, "seed"), "abc", ["families.gemm.seed: expected a whole number >= 0", "'abc'"]),
    ((*GEMM, "candidates", "mc"), 96, ["families.gemm.candidates.mc: expected a non-empty list", "got 96"]),
    ((*GEMM, "budget"), -1, ["families.gemm.budget", "got -1"]),
    ((*GEMM, "budget"), 2.5, ["families.gemm.budget", "got 2.5"]),
    ((*GEMM, "budget"), 0, ["families.gemm.budget", "got 0"]),
    ((*GEMM, "seed"), 1.5, ["families.gemm.seed", "got 1.5"]),
    ((*GEMM, "seed"), -3, ["families.gemm.seed", "got -3"]),
    ((*HOLDOUT_PROBLEM, "m"), 127.9, ["problems.holdout[0].list[0].m: expected a whole number", "127.9"]),
    ((*HOLDOUT_PROBLEM, "m"), 128.0, ["problems.holdout[0].list[0].m", "128.0"]),
    ((*HOLDOUT_PROBLEM, "m"), "64", ["problems.holdout[0].list[0].m", "'64'"]),
    ((*HOLDOUT_PROBLEM, "m"), 2**63, ["problems.holdout[0].list[0].m", "to 2147483647", str(2**63)]),
    (HOLDOUT_PROBLEM, {"m": 10**6, "n": 10**6, "k": 10**6},
     ["problems.holdout[0].list[0]: problem 'm=1000000,n=1000000,k=1000000' needs about",
      "bytes", "of memory here"]),
    (HOLDOUT_PROBLEM, {"m": 10**9, "n": 10**9, "k": 10**9},
     ["problems.holdout[0].list[0]: problem 'm=1000000000,n=1000000000,k=1000000000'",
      "beyond any machine"]),
    ((*GEMM, "candidates", "pack_a"), ["no"], ["candidates.pack_a[0]: expected true or false", "'no'"]),
    ((*GEMM, "candidates", "mc"), [-96], ["candidates.mc[0]", "got -96"]),
    ((*GEMM, "candidates", "mc"), [], ["candidates.mc: expected a non-empty list", "got []"]),
    ((*GEMM, "candidates", "isa"), ["sse"], ["candidates.isa[0]: expected one of 'avx2', 'avx512'", "'sse'"]),
    ((*GEMM, "candidates", "tiles"), ["7x7"], ["candidates.tiles[0]", "'7x7'"]),
    ((*GEMM, "candidates", "parallel"), ["x"], ["candidates.parallel[0]", "'m', 'n', 'k'", "'x'"]),
    ((*GEMM, "candidates", "dtype"), ["fp64"], ["candidates.dtype[0]", "'fp64'"]),
    ((*GEMM, "candidates", "kc"), [True], ["candidates.kc[0]", "got True"]),
    ((*GEMM, "candidates", "tiles"), ["14x32"], ["families.gemm.candidates: the options", "allow no candidate"]),
    ((*GEMM, "candidates"), {"dtype": ["bf16"], "pack_a": [False]}, ["families.gemm.candidates", "allow no candidate"]),
    ((*GEMM, "candidates", "unroll"), [4], ["families.gemm.candidates: unknown key(s) ['unroll']", "'mc'"]),
    ((*GEMM, "problems", "train"), [], ["families.gemm.problems.train: the entries expand to no problem"]),
    ((*GEMM, "problems", "holdout"), [], ["families.gemm.problems.holdout: the entries expand to no problem"]),
    ((*GEMM, "problems", "holdout"), DELETE, ["families.gemm.problems: missing key(s) ['holdout']"]),
    ((*GEMM, "problems", "holdout"), {"m": 1}, ["problems.holdout: expected a list of problem entries", "{'m': 1}"]),
    ((*GEMM, "problems", "holdout", 0), {"list": [{"m": 1, "n": 1, "k": 1}], "grid": {"m": [1]}},
     ["problems.holdout[0]: needs exactly one of grid / list / random", "['grid', 'list']"]),
    ((*GEMM, "problems", "holdout", 0), {"lst": [{"m": 1}]},
     ["problems.holdout[0]: needs exactly one of grid / list / random, got ['lst']"]),
    ((*GEMM, "problems", "holdout", 0, "lst"), [], ["problems.holdout[0]: unknown key(s) ['lst']"]),
    (HOLDOUT_PROBLEM, None, ["problems.holdout[0].list[0]: expected a mapping of m, n, k", "got None"]),
    ((*HOLDOUT_PROBLEM, "q"), 3, ["problems.holdout[0].list[0]: unknown key(s) ['q']", "'layout_a'"]),
    ((*HOLDOUT_PROBLEM, "layout_a"), "diagonal", ["list[0].layout_a: expected one of 'row', 'col'", "'diagonal'"]),
    ((*GRID, "m"), [], ["train[0].grid.m: expected a non-empty list", "got []"]),
    ((*GRID, "m"), 5, ["train[0].grid.m: expected a non-empty list", "got 5"]),
    ((*GRID, "n"), [16, -80], ["train[0].grid.n[1]", "got -80"]),
    ((*GEMM, "problems", "train", 0, "m"), 3, ["train[0]: field(s) ['m'] both fixed and varied by the entry's grid"]),
    ((*GRID,), {"m": list(range(1, 1001)), "n": list(range(1, 201)), "k": [1]},
     ["families.gemm.problems.train: the entries expand to 200004 problems, more than the 100000"]),
    ((*RANDOM, "ranges", "m"), [64, 1], ["train[1].random.ranges.m: expected [lo, hi]", "with lo <= hi", "[64, 1]"]),
    ((*RANDOM, "ranges", "m"), [0, 4], ["train[1].random.ranges.m", "[0, 4]"]),
    ((*RANDOM, "ranges", "m"), 64, ["train[1].random.ranges.m", "got 64"]),
    ((*RANDOM, "ranges", "dtype"), [1, 2], ["train[1].random.ranges: unknown problem field(s) ['dtype']"]),
    ((*RANDOM, "ranges"), {}, ["train[1].random.ranges: expected at least one problem field"]),
    ((*RANDOM, "count"), 0, ["train[1].random.count", "got 0"]),
    ((*RANDOM, "count"), 2.5, ["train[1].random.count", "got 2.5"]),
    ((*RANDOM, "count"), 10**7, ["train[1].random.count: expected a whole number from 1 to 100000"]),
    ((*RANDOM, "seed"), -1, ["train[1].random.seed", "got -1"]),
    ((*GEMM, "problems", "holdout", 0, "list"), [{"m": 1, "n": 16, "k": 32}],
     ["problems.holdout[0].list[0]: holdout problem m=1,n=16,k=32", "is also a training problem"]),
    ((*GEMM, "model", "n_trees"), 5, ["families.gemm.model: unknown key(s) ['n_trees']", "'n_estimators'"]),
    ((*GEMM, "model", "learning_rate"), 0, ["families.gemm.model.learning_rate: expected a number > 0", "got 0"]),
    ((*GEMM, "model", "target"), "tflops", ["families.gemm.model.target", "'log1p_tflops'", "'tflops'"]),
    ((*GEMM, "model", "folds"), 1, ["families.gemm.model.folds: expected a whole number >= 2", "got 1"]),
    ((*GEMM, "model", "feature_fraction"), 1.5, ["model.feature_fraction: expected a number in (0, 1]", "1.5"]),
    ((*GEMM, "warm_start"), "../prod", ["families.gemm.warm_start: expected a registry alias", "'../prod'"]),
    ((*GEMM, "warm_start"), 0, ["families.gemm.warm_start", "got 0"]),
    ((*GEMM, "sentinel"), [], ["families.gemm.sentinel: the entries expand to no problem"]),
    ((*GEMM, "sentinel"), "holdout", ["families.gemm.sentinel: expected a list of problem entries", "'holdout'"]),
    ((*GEMM, "candidates"), DELETE, ["families.gemm: missing key(s) ['candidates']"]),
    (GEMM, None, ["families.gemm: missing key(s) ['candidates', 'problems']"]),
    (GEMM, [1], ["families.gemm: expected a mapping of budget, seed, candidates", "got [1]"]),
    (("families",), {}, ["families: expected at least one family; valid: gemm"]),
    (("families",), {"conv9": {}}, ["families: unknown family 'conv9'; valid: gemm, grouped_conv_forward"]),
    (("families",), None, ["families: expected at least one family"]),
    (("tune", "tie_threshold_pct"), 150, ["tune.tie_threshold_pct: expected a number from 0 to 100", "150"]),
    (("tune", "tie_threshold_pct"), "1%", ["tune.tie_threshold_pct", "'1%'"]),
    (("tune", "finalists"), -1, ["tune.finalists", "got -1"]),
    (("bench", "race_margin_pct"), float("nan"), ["bench.race_margin_pct", "got nan"]),
    (("bench", "race_margin_pct"), float("inf"), ["bench.race_margin_pct", "got inf"]),
    (("bench", "interleave"), "no", ["bench.interleave: expected true or false", "'no'"]),
    (("bench", "interleave"), 1, ["bench.interleave", "got 1"]),
    (("bench", "problems_per_batch"), 0, ["bench.problems_per_batch", "got 0"]),
    (("bench", "speed"), "fast", ["bench: unknown key(s) ['speed']"]),
    (("build", "jobs"), "2", ["build.jobs", "'2'"]),
    (("protocol", "stall_limit"), 2, ["protocol.stall_limit: expected a number in (0, 1]", "got 2"]),
    (("protocol", "sync_limit"), 0.5, ["protocol.sync_limit: expected a number 0 (off) or > 1", "0.5"]),
    (("protocol", "threads"), 0, ["protocol.threads", "got 0"]),
    (("protocol", "flush_cache"), "false", ["protocol.flush_cache: expected true or false", "'false'"]),
    (("protocol", "timeout_s"), -1, ["protocol.timeout_s: expected a number > 0", "got -1"]),
    (("protocol", "warmup_ms"), float("inf"), ["protocol.warmup_ms", "got inf"]),
    (("protocol", "samples"), True, ["protocol.samples", "got True"]),
    (("protocol", "samples"), [3], ["protocol.samples", "got [3]"]),
    (("protocol",), [1, 2], ["protocol: expected a mapping of warmup_ms", "got [1, 2]"]),
    (("protocl",), {}, ["unknown key(s) ['protocl']"]),
    (("name",), "", ["name: expected a non-empty string", "got ''"]),
    (("name",), 5, ["name: expected a non-empty string", "got 5"]),
    (("name",), DELETE, ["missing key(s) ['name']"]),
    (("description",), ["x"], ["description: expected a string", "['x']"]),
]


@pytest.mark.parametrize("path, value, needles", CASES,
                         ids=[f"{'.'.join(map(str, p))}={show(v)}" for p, v, _ in CASES])
def test_each_malformed_config_ends_in_a_clear_message(tmp_path, path, value, needles):
    expect_clear(write(tmp_path, changed(path, value)), *needles)


OTHER_FAMILIES = [
    ("grouped_conv_forward", ("candidates", "tiles"), ["30x32x32"],
     ["grouped_conv_forward.candidates.tiles[0]: expected a 'BMxBNxBK' string, BM a multiple of 8", "'30x32x32'"]),
    ("grouped_conv_forward", ("candidates", "pipeline"), ["fft"],
     ["candidates.pipeline[0]: expected one of 'direct', 'im2col', 'dw'", "'fft'"]),
    ("grouped_conv_forward", ("problems", "holdout", 0, "list", 0, "pad_h"), -1,
     ["holdout[0].list[0].pad_h: expected a whole number from 0 to", "got -1"]),
    ("grouped_conv_forward", ("problems", "holdout", 0, "list", 0, "direction"), "bwd_data",
     ["holdout[0].list[0].direction: expected one of 'forward'", "'bwd_data'"]),
    ("grouped_conv_forward", ("problems", "holdout", 0, "list", 0, "Di"), 4,
     ["holdout[0].list[0]: problem", "missing field(s) ['Z']"]),
    ("grouped_conv_forward", ("problems", "holdout", 0, "list", 0),
     {"C": 1000, "K": 1000, "Hi": 10**5, "Wi": 10**5, "Y": 1, "X": 1},
     ["holdout[0].list[0]: problem", "bytes", "of memory here"]),
    ("disco_forward", ("candidates", "lat_block"), [0], ["disco_forward.candidates.lat_block[0]", "from 1 to 64", "got 0"]),
    ("disco_forward", ("candidates", "variant"), ["lines"], ["candidates.variant[0]: expected one of 'csr', 'kpacked'", "'lines'"]),
    ("disco_forward", ("problems", "holdout", 0, "list", 0, "precision"), "fp8",
     ["holdout[0].list[0].precision: expected one of 'fp32', 'bf16', 'fp16'", "'fp8'"]),
    ("disco_forward", ("problems", "holdout", 0, "list", 0, "theta_cutoff"), 4,
     ["holdout[0].list[0].theta_cutoff: expected a number in (0, pi]", "got 4"]),
    ("disco_forward", ("problems", "holdout", 0, "list", 0, "kernel_shape"), "100x3",
     ["holdout[0].list[0].kernel_shape: expected a kernel shape", "from 1 to 64", "'100x3'"]),
    ("disco_forward", ("problems", "holdout", 0, "list", 0, "nlat_in"), 40000,
     ["holdout[0].list[0].nlat_in: expected a whole number from 1 to 32768", "got 40000"]),
    ("disco_forward", ("problems", "holdout", 0, "list", 0, "nlon_out"), 5,
     ["holdout[0].list[0]: problem", "must be a multiple of nlon_out=5"]),
    ("disco_backward", ("problems", "holdout", 0, "list", 0, "grid_in"), "hexagonal",
     ["holdout[0].list[0]: problem", "'hexagonal'", "legendre-gauss"]),
]


@pytest.mark.parametrize("name, path, value, needles", OTHER_FAMILIES,
                         ids=[f"{n}.{'.'.join(map(str, p))}={show(v)}" for n, p, v, _ in OTHER_FAMILIES])
def test_other_families_are_checked_against_their_own_space(tmp_path, name, path, value, needles):
    body = DISCO if name.startswith("disco") else CONV
    document = {"name": "x", "families": {name: body}}
    assert load_config(write(tmp_path, document, "good.yaml")).families[name]
    expect_clear(write(tmp_path, changed(("families", name, *path), value, document)), *needles)


FILES = [
    (b"\xff\xfe\x00garbage", ["not UTF-8 text (byte 0xff at offset 0)"]),
    ("name: [unclosed\n", ["not valid YAML"]),
    ("- a\n- b\n", ["expected a mapping of name, description", "got ['a', 'b']"]),
    ("", ["missing key(s) ['families', 'name']"]),
    ("when: 2001-13-45\n", ["not valid YAML", "month must be in 1..12"]),
    ("just text", ["expected a mapping", "got 'just text'"]),
    ("name: x\nfamilies:\n  gemm: {}\n  gemm: {}\n", ["found the key 'gemm' twice"]),
]


@pytest.mark.parametrize("content, needles", FILES, ids=[show(c) for c, _ in FILES])
def test_unreadable_files_end_in_a_clear_message(tmp_path, content, needles):
    expect_clear(write(tmp_path, content), *needles)


def test_a_directory_or_a_missing_file_ends_in_a_clear_message(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    expect_clear(tmp_path / "dir.yaml", "is a directory")
    try:
        load_config(tmp_path / "nowhere.yaml")
    except ConfigError as err:
        note_case("clear")
        assert "not found" in str(err) and "nowhere.yaml" in str(err)


# -- generated faults ---------------------------------------------------------------------------

def _paths(value, prefix=()):
    """Every (path, value) under `value`, mappings and lists included."""
    yield prefix, value
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, child in items:
        yield from _paths(child, (*prefix, key))


BASE_PATHS = [path for path, _ in _paths(BASE) if path]
MAPPINGS = [path for path, value in _paths(BASE) if isinstance(value, dict)]
# whole-number settings and their least value; each must refuse floats (even 2.0), strings,
# booleans, lists and anything below the least
WHOLE = [(("protocol", "samples"), 1), (("protocol", "max_reps"), 1), (("protocol", "threads"), 1),
         (("tune", "finalists"), 0), (("tune", "confirm_samples"), 0), (("build", "jobs"), 1),
         (("bench", "problems_per_batch"), 1), (("bench", "rounds"), 1),
         ((*GEMM, "budget"), 1), ((*GEMM, "seed"), 0), ((*GEMM, "candidates", "mc", 0), 1),
         ((*GEMM, "candidates", "kc", 1), 1), ((*HOLDOUT_PROBLEM, "m"), 1), ((*GRID, "n", 1), 1),
         ((*RANDOM, "count"), 1), ((*RANDOM, "seed"), 0), ((*GEMM, "model", "n_estimators"), 1),
         ((*GEMM, "model", "folds"), 2)]
FLAGS = [("protocol", "flush_cache"), ("bench", "interleave"), (*GEMM, "candidates", "pack_a", 0)]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
FAULT_SETTINGS = settings(max_examples=80, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture])


def _round_trip(document: dict, path: tuple):
    """The value at `path` of `document` after a YAML round trip (what the loader sees)."""
    value = yaml.safe_load(yaml.safe_dump(document))
    for part in path:
        value = value[part]
    return value


def _where(path: tuple) -> str:
    return key_path("", path)


@settings(FAULT_SETTINGS, max_examples=250)
@given(data=st.data())
def test_any_junk_anywhere_is_loaded_or_refused_clearly(tmp_path, data):
    """Junk of any type at any key of a valid config: it loads (the junk was valid there) or
    ends in a ConfigError naming the file, never another exception."""
    path = data.draw(st.sampled_from(BASE_PATHS), label="path")
    document = changed(path, data.draw(JUNK, label="value"))
    file = write(tmp_path, document)
    try:
        load_config(file)
    except ConfigError as err:
        note_case("clear")
        assert str(err).splitlines()[0].startswith(f"{file}: ")
    except Exception:
        note_case("traceback")
        raise
    else:
        note_case("ok")


@FAULT_SETTINGS
@given(data=st.data())
def test_a_bad_whole_number_is_refused_naming_its_key_and_value(tmp_path, data):
    path, least = data.draw(st.sampled_from(WHOLE), label="key")
    bad = data.draw(st.one_of(
        st.floats(allow_nan=True, allow_infinity=True), st.integers(max_value=least - 1),
        st.text(max_size=8), st.booleans(), st.none(),
        st.lists(st.integers(1, 9), min_size=1, max_size=2)), label="value")
    # protocol.threads also takes 'auto' and a list of counts without repeats (one run each)
    assume(not (path == ("protocol", "threads")
                and (bad == "auto" or (isinstance(bad, list) and len(set(bad)) == len(bad)))))
    document = changed(path, bad)
    expect_clear(write(tmp_path, document), _where(path), show(_round_trip(document, path)))


@FAULT_SETTINGS
@given(data=st.data())
def test_a_flag_takes_only_true_or_false(tmp_path, data):
    path = data.draw(st.sampled_from(FLAGS), label="key")
    bad = data.draw(st.one_of(st.integers(), st.floats(), st.none(),
                              st.sampled_from(["no", "yes", "true", "off", "1"]),
                              st.lists(st.booleans(), min_size=1, max_size=2)), label="value")
    document = changed(path, bad)
    expect_clear(write(tmp_path, document), f"{_where(path)}: expected true or false",
                 show(_round_trip(document, path)))


@FAULT_SETTINGS
@given(data=st.data())
def test_an_unknown_key_is_refused_naming_it(tmp_path, data):
    parent = data.draw(st.sampled_from(MAPPINGS), label="mapping")
    key = data.draw(st.from_regex(r"x_[a-z0-9_]{0,10}", fullmatch=True), label="key")
    document = changed((*parent, key), data.draw(SCALARS, label="value"))
    noun = "family" if parent == ("families",) else "unknown"
    expect_clear(write(tmp_path, document), repr(key), noun,
                 *([f"{_where(parent)}: "] if parent else []))


@FAULT_SETTINGS
@given(content=st.binary(max_size=200) | st.text(alphabet=string.printable, max_size=200))
def test_arbitrary_bytes_are_refused_clearly(tmp_path, content):
    file = write(tmp_path, content)
    try:
        load_config(file)
    except ConfigError as err:
        note_case("clear")
        assert str(file) in str(err).splitlines()[0]
    except Exception:
        note_case("traceback")
        raise
    else:
        note_case("ok")
        pytest.fail(f"{content!r} loaded as a config")
