"""Tests for tilecast.runtime.dispatch: a real tiny LightGBM model on real GEMM features, published
through the registry and loaded back by the Dispatcher."""

import itertools
import json
import logging
import math
import subprocess
import sys
from types import SimpleNamespace

import lightgbm
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tilecast.registry import api as registry
from tilecast.runtime.dispatch import (MAX_FIELD_VALUE, Dispatcher, NoKernelError, ProblemError,
                                       parse_problem, parse_problem_string)
from tilecast.families import get_family
from tilecast.core.family import FamilyError
from tilecast.families.gemm import MAX_OPERAND_BYTES
from tilecast.registry.api import RegistryError

GEMM = get_family("gemm")
HARDWARE = {"threads": 8, "simd_bits": 512, "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
            "l3_bytes": 32 << 20, "clock_mhz": 3000.0,
            "flags": ["avx2", "fma", "avx512f", "avx512_bf16"]}
OPTIONS = {"dtype": ["fp32"], "isa": ["avx512", "avx2"], "parallel": ["m", "n", "k"],
           "tiles": ["14x32", "6x48", "4x64", "16x16", "6x16", "8x8"]}
METRICS = {"mean_efficiency": 0.9, "median_efficiency": 0.92, "p10_efficiency": 0.8,
           "min_efficiency": 0.6, "static_best": {"kernel": "?", "mean_efficiency": 0.7}}
TRAIN_SIZES = (17, 64, 100, 256, 1000, 2048)
PARAMS = {"objective": "regression", "num_leaves": 15, "min_data_in_leaf": 5,
          "learning_rate": 0.2, "verbose": -1, "num_threads": 1, "deterministic": True,
          "seed": 0}
QUERIES = [
    {"m": 300, "n": 70, "k": 129},
    {"m": 33, "n": 4096, "k": 512},
    {"m": 2048, "n": 2048, "k": 2048},
    {"m": 7, "n": 9, "k": 1000},
    {"m": 4096, "n": 24, "k": 64, "layout_a": "col"},
    {"m": 100, "n": 100, "k": 100, "layout_b": "col"},
    {"m": 1, "n": 1, "k": 1},
]


def synthetic_tflops(names, features):
    """A deterministic 'measurement' whose winner depends on the shape: tile padding waste,
    parallel balance and ISA all matter."""
    col = {name: features[:, i] for i, name in enumerate(names)}
    size = np.clip((col["log2_flops"] - 10) / 25, 0.05, 1.0)
    isa = np.where(col["is_avx512"] > 0, 1.0, 0.55)
    return 3.0 * isa * col["tile_eff"] ** 2 * col["par_balance"] * size + 0.002 * col["mr"]


def training_set(engine, configs, columns=None):
    kernel_matrix = engine.kernel_features(configs)
    blocks = []
    for m, n, k in itertools.product(TRAIN_SIZES, repeat=3):
        problem = GEMM.problem({"m": m, "n": n, "k": k})
        blocks.append(engine.combine(problem, engine.problem_features(problem), kernel_matrix,
                                     configs))
    features = np.vstack(blocks)
    tflops = synthetic_tflops(engine.feature_names(), features)
    if columns is not None:
        features = features[:, columns]
    return features, tflops


def publish_model(root, model, booster, feature_names, kernels, transform, static_best=None):
    spec = {"family": "gemm", "feature_names": list(feature_names), "engine": "gemm",
            "engine_version": 1, "target_transform": transform, "hardware": HARDWARE,
            "model_spec": {"num_boost_round": 40, **PARAMS}}
    candidates = {"family": "gemm", "kernels": list(kernels),
                  "static_best": static_best or kernels[0]}
    files = {"model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
             "candidates.json": json.dumps(candidates), "train_manifest.json": "{}"}
    return registry.publish(root, model, files, metrics=METRICS)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A registry with 'gemm-full' (every engine feature, log1p) and 'gemm-subset' (a
    reordered subset of the features, log), both trained on the synthetic target."""
    root = tmp_path_factory.mktemp("registry")
    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space(OPTIONS, HARDWARE)
    names = [GEMM.kernel_name(c) for c in configs]
    assert len(names) == 18

    features, tflops = training_set(engine, configs)
    full = lightgbm.train(PARAMS, lightgbm.Dataset(features, np.log1p(tflops)),
                          num_boost_round=40)
    publish_model(root, "gemm-full", full, engine.feature_names(), names, "log1p_tflops",
                  static_best=names[3])

    subset_names = engine.feature_names()[::-1][5:]  # reordered, and 5 features dropped
    columns = [engine.feature_names().index(n) for n in subset_names]
    features, tflops = training_set(engine, configs, columns)
    subset = lightgbm.train(PARAMS, lightgbm.Dataset(features, np.log(tflops)),
                            num_boost_round=40)
    publish_model(root, "gemm-subset", subset, subset_names, names, "log_tflops")
    return {"root": root, "engine": engine, "configs": configs, "names": names,
            "full": full, "subset": subset, "subset_columns": columns}


def expected_ranking(setup, booster, problem_values, inverse, columns=None):
    """(name, tflops) best first, computed straight from the booster."""
    problem = GEMM.problem(problem_values)
    features = setup["engine"].matrix(problem, setup["configs"])
    if columns is not None:
        features = features[:, columns]
    tflops = inverse(booster.predict(features))
    return sorted(zip(setup["names"], tflops), key=lambda pair: (-pair[1], pair[0]))


# --- choices agree with the booster ------------------------------------------------------


def test_select_is_the_argmax_of_the_booster_for_every_problem(setup):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-full")
    assert dispatcher.version == 1 and dispatcher.model == "gemm-full"
    assert dispatcher.kernels == tuple(setup["names"])
    chosen = []
    for values in QUERIES:
        expected = expected_ranking(setup, setup["full"], values, np.expm1)
        chosen.append(dispatcher.select(values))
        assert chosen[-1] == expected[0][0], values
        assert dispatcher.last_fallback_reason is None
    assert len(set(chosen)) >= 3, chosen  # the choice really depends on the shape


def test_rank_and_predict_are_ordered_predictions_in_tflops(setup):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-full", "production")
    for values in QUERIES[:4]:
        expected = expected_ranking(setup, setup["full"], values, np.expm1)
        top = dispatcher.rank(values, k=4)
        assert [name for name, _ in top] == [name for name, _ in expected[:4]]
        assert [t for _, t in top] == pytest.approx([t for _, t in expected[:4]], rel=1e-9)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))
        assert len(dispatcher.rank(values, k=100)) == 18
        assert dispatcher.predict(values) == pytest.approx(dict(expected), rel=1e-9)
    with pytest.raises(ValueError, match="k=0"):
        dispatcher.rank(QUERIES[0], k=0)


def test_feature_subset_in_another_order_is_mapped_and_log_is_inverted(setup):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-subset", 1)
    chosen = set()
    for values in QUERIES:
        expected = expected_ranking(setup, setup["subset"], values, np.exp,
                                    setup["subset_columns"])[:3]
        top = dispatcher.rank(values, k=3)
        assert [name for name, _ in top] == [name for name, _ in expected]
        assert [t for _, t in top] == pytest.approx([t for _, t in expected], rel=1e-9)
        chosen.add(top[0][0])
    assert len(chosen) >= 3, chosen


def test_equal_predictions_are_broken_by_kernel_name(setup):
    names = setup["names"]
    features, _ = training_set(setup["engine"], setup["configs"])
    flat = lightgbm.train(PARAMS, lightgbm.Dataset(features, np.full(len(features), 2.0)),
                          num_boost_round=3)
    spec = {"family": "gemm", "feature_names": setup["engine"].feature_names(),
            "target_transform": "log1p_tflops", "hardware": HARDWARE}
    shuffled = names[5:] + names[:5]
    dispatcher = Dispatcher(flat, spec, {"family": "gemm", "kernels": shuffled,
                                         "static_best": names[0]})
    assert dispatcher.select(QUERIES[0]) == min(names)
    assert [n for n, _ in dispatcher.rank(QUERIES[1], k=18)] == sorted(names)


# --- queries -----------------------------------------------------------------------------


def test_results_are_memoized_per_validated_problem(setup, monkeypatch):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-full")
    calls = []
    real_scores = dispatcher._scorer.raw_scores
    monkeypatch.setattr(dispatcher._scorer, "raw_scores",
                        lambda problem, rows: calls.append(problem) or real_scores(problem, rows))
    first = dispatcher.ranking({"m": 256, "n": 128, "k": 64})
    assert calls == [GEMM.problem({"m": 256, "n": 128, "k": 64})]
    # the same problem spelled three other ways hits the cache
    assert dispatcher.ranking("m=256,n=128,k=64") is first
    assert dispatcher.ranking({"m": "256", "n": 128, "k": 64, "dtype": "fp32"}) is first
    assert dispatcher.select("k=64, n=128, m=256") == first.kernels[0]
    assert len(calls) == 1
    dispatcher.select({"m": 256, "n": 128, "k": 65})
    assert len(calls) == 2


def test_string_problems_match_mappings(setup):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-full")
    for values in QUERIES:
        text = ",".join(f"{key}={value}" for key, value in values.items())
        assert dispatcher.select(text) == dispatcher.select(values)
    assert parse_problem_string(" m=1, n=2 ,k=3,layout_a=col,") == {
        "m": "1", "n": "2", "k": "3", "layout_a": "col"}


@pytest.mark.parametrize(("text", "message"), [
    ("m=1,n", r"malformed pair 'n'"),
    ("m", r"malformed pair 'm' in problem 'm'; expected field=value pairs"),
    ("m=1,=4", r"malformed pair '=4'"),
    ("m=1,n=", r"malformed pair 'n='"),
    ("m=1,2n=3", r"malformed pair '2n=3'"),
    ("m=1;n=2", r"malformed pair 'm=1;n=2'"),
    ("m=1,m=2", r"field 'm' given twice in problem 'm=1,m=2' \(m=1 and m=2\)"),
    ("", r"empty problem string ''"),
    (",", r"empty problem string ','"),
    (" , ,", r"empty problem string"),
    (f"m={2**63},n=1,k=1", rf"field m={2**63} in problem .* is too large: .* at most {2**63 - 1}"),
    (f"m=1,n=-{2**64}", rf"field n=-{2**64} .* is too large"),
    ("k=" + "9" * 5000, r"field k=9+ in problem .* is too large"),  # past int()'s digit limit
])
def test_malformed_problem_strings_name_the_pair(text, message):
    with pytest.raises(ProblemError, match=message):
        parse_problem_string(text)


def test_the_largest_field_value_is_read_and_a_value_that_is_not_an_integer_left_to_the_family():
    assert parse_problem_string(f"m={MAX_FIELD_VALUE},dtype=bf16,x=1e999") == {
        "m": str(MAX_FIELD_VALUE), "dtype": "bf16", "x": "1e999"}


@pytest.mark.parametrize(("text", "error", "message"), [
    ("m=127.9,n=8,k=8", FamilyError, r"field m='127\.9' is not an integer"),
    ("m=1e3,n=8,k=8", ProblemError, r"field m='1e3' in problem 'm=1e3,n=8,k=8' is not a whole "
                                    r"number written in digits; e.g. m=1000"),
    ("m=8,n=64.0,k=8", ProblemError, r"field n='64\.0' .* e\.g\. n=64"),
    ("m=8,n=8,k=-5", FamilyError, r"field k=-5 must be >= 1"),
    ("m=0,n=8,k=8", FamilyError, r"field m=0 must be >= 1"),
    ("m=8,n=8,k=nan", FamilyError, r"field k='nan' is not an integer"),
    (f"m=8,n=8,k={2**63}", ProblemError, rf"field k={2**63} .* too large"),
])
def test_typed_integer_fields_must_be_whole_numbers_in_digits(setup, text, error, message):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-full")
    with pytest.raises(error, match=message):
        dispatcher.select(text)
    # a mapping (a config's, a dataset's row) keeps the family's own conversion
    expected = GEMM.problem({"m": 64, "n": 8, "k": 8})
    assert dispatcher.problem({"m": 64.0, "n": "8", "k": 8}) == expected
    assert dispatcher.problem("m=+64,n=8,k=8") == expected


class _RoundingFamily:
    """A family whose conversion goes through a float, as a careless one's would."""
    name = "rounding"

    @staticmethod
    def problem(values):
        return SimpleNamespace(m=int(float(values["m"])))


def test_a_size_the_family_cannot_hold_exactly_is_refused_not_rounded():
    assert parse_problem(f"m={2**53}", _RoundingFamily).m == 2**53
    with pytest.raises(ProblemError, match=rf"field m={2**53 + 1} .* beyond what the rounding "
                                           rf"family holds exactly \(it reads {2**53}\)"):
        parse_problem(f"m={2**53 + 1}", _RoundingFamily)


@settings(max_examples=200, deadline=None)
@given(dims=st.one_of(  # one dimension up to 2**42, or all three up to 2**14: within the
                       # family's operand limit (gemm.MAX_OPERAND_BYTES)
           st.tuples(st.integers(1, 2**42), st.integers(1, 4), st.integers(1, 4)),
           st.tuples(st.integers(1, 4), st.integers(1, 2**42), st.integers(1, 4)),
           st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 2**42)),
           st.tuples(*[st.integers(1, 2**14)] * 3)),
       dtype=st.sampled_from(["fp32", "bf16"]),
       layouts=st.tuples(*[st.sampled_from(["row", "col"])] * 2))
def test_a_dims_key_parses_back_to_its_problem(dims, dtype, layouts):
    m, n, k = dims
    assume(4 * (m * k + k * n + m * n) <= MAX_OPERAND_BYTES)   # else no GEMM problem at all
    problem = GEMM.problem({"m": dims[0], "n": dims[1], "k": dims[2], "dtype": dtype,
                            "layout_a": layouts[0], "layout_b": layouts[1]})
    assert parse_problem(GEMM.dims_key(problem), GEMM) == problem


@pytest.mark.parametrize(("problem", "message"), [
    ("m=64,n=64,k=64,q=3", r"unknown GEMM problem field\(s\) \['q'\]"),
    ({"m": "abc", "n": 1, "k": 1}, r"field m='abc' is not an integer"),
    ({"m": 8, "n": 0, "k": 1}, r"field n=0 must be >= 1"),
    ({"m": 8, "n": 8}, r"missing field\(s\) \['k'\]"),
    ("m=8,n=8,k=8,dtype=fp64", r"unknown dtype 'fp64'"),
])
def test_bad_problem_fields_are_named(setup, problem, message):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-full")
    with pytest.raises(FamilyError, match=message):
        dispatcher.select(problem)


BF16_STATIC_BEST = "gemm_bf16_avx512_14x32_mc28_nc64_kc48_parn_pa1_pf0"


def test_no_applicable_candidate_falls_back_to_a_static_best_that_applies(setup, caplog):
    # fp32 candidates, a bf16 static best: a bf16 problem has no candidate but the static best
    spec = {"family": "gemm", "feature_names": setup["engine"].feature_names(),
            "target_transform": "log1p_tflops", "hardware": HARDWARE}
    dispatcher = Dispatcher(setup["full"], spec, {"family": "gemm", "kernels": setup["names"],
                                                  "static_best": BF16_STATIC_BEST})
    with caplog.at_level(logging.WARNING, logger="tilecast.runtime.dispatch"):
        chosen = dispatcher.select("m=64,n=64,k=64,dtype=bf16")
    assert chosen == BF16_STATIC_BEST
    assert "static best" in dispatcher.last_fallback_reason
    assert BF16_STATIC_BEST in dispatcher.last_fallback_reason
    assert any("falling back" in r.getMessage() for r in caplog.records)
    result = dispatcher.select_json("m=64,n=64,k=64,dtype=bf16")
    assert result["kernel"] == BF16_STATIC_BEST and result["predicted_tflops"] is None
    assert dispatcher.predict("m=64,n=64,k=64,dtype=bf16") == {}
    assert dispatcher.select("m=64,n=64,k=64") in setup["names"]
    assert dispatcher.last_fallback_reason is None


def test_a_problem_no_kernel_of_the_model_runs_is_an_error_not_a_kernel(setup):
    # every candidate and the static best are fp32: none can run a bf16 problem
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-full")
    for _ in range(2):  # never memoized: the second query fails the same way
        with pytest.raises(NoKernelError, match=(
                r"no kernel of model 'gemm-full' version 1 can run problem "
                r"m=64,n=64,k=64,dtype=bf16,layout_a=row,layout_b=row: none of its 18 "
                rf"candidates applies, nor its static best '{setup['names'][3]}' "
                r"\(kernel dtype fp32 != problem dtype bf16\)")):
            dispatcher.select("m=64,n=64,k=64,dtype=bf16")
    with pytest.raises(NoKernelError):
        dispatcher.select_json({"m": 64, "n": 64, "k": 64, "dtype": "bf16"})
    assert dispatcher.select("m=64,n=64,k=64") in setup["names"]


def test_select_json_reports_kernel_prediction_model_and_version(setup):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-subset")
    result = dispatcher.select_json(QUERIES[2])
    name, tflops = dispatcher.rank(QUERIES[2], k=1)[0]
    assert result == {"kernel": name, "predicted_tflops": tflops, "model": "gemm-subset",
                      "version": 1}
    assert tflops > 0 and math.isfinite(tflops)
    json.dumps(result)


# --- broken artifacts --------------------------------------------------------------------


def artifact_files(setup, **overrides):
    engine = setup["engine"]
    files = {"model.txt": setup["full"].model_to_string(),
             "feature_spec.json": json.dumps({"family": "gemm",
                                              "feature_names": engine.feature_names(),
                                              "target_transform": "log1p_tflops",
                                              "hardware": HARDWARE}),
             "candidates.json": json.dumps({"family": "gemm", "kernels": setup["names"],
                                            "static_best": setup["names"][0]})}
    files.update(overrides)
    return {name: body for name, body in files.items() if body is not None}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"feature_spec.json": None}, r"no feature_spec\.json \(no file .*feature_spec\.json\)"),
    ({"model.txt": None}, r"no model\.txt"),
    ({"model.txt": "tree\nnot a model"}, r"corrupt LightGBM model .*model\.txt"),
    ({"candidates.json": "{not json"}, r"corrupt candidates\.json .*candidates\.json"),
    ({"candidates.json": json.dumps({"family": "gemm", "kernels": ["gemm_fp32_avx9"],
                                     "static_best": "gemm_fp32_avx9"})},
     r"candidates\.json: not a GEMM kernel name: 'gemm_fp32_avx9'"),
    ({"feature_spec.json": json.dumps({"family": "gemm", "feature_names": ["m", "warp_size"],
                                       "target_transform": "log1p_tflops",
                                       "hardware": HARDWARE})},
     r"needs feature\(s\) \['warp_size'\]"),
    ({"feature_spec.json": json.dumps({"family": "gemm", "feature_names": ["m"],
                                       "target_transform": "sqrt", "hardware": HARDWARE})},
     r"'target_transform' is 'sqrt'"),
    ({"feature_spec.json": json.dumps({"family": "gemm", "feature_names": ["m", "n"],
                                       "target_transform": "log_tflops",
                                       "hardware": HARDWARE})},
     r"model\.txt expects \d+ features, feature_spec\.json lists 2"),
    ({"feature_spec.json": json.dumps({"family": "gemm", "feature_names": ["m"],
                                       "engine": "gemm", "engine_version": 99,
                                       "target_transform": "log_tflops", "hardware": HARDWARE})},
     r"'engine_version' is 99, newer than the installed 'gemm' engine"),
])
def test_broken_artifacts_raise_registry_error_naming_the_file(setup, tmp_path, overrides,
                                                                message):
    registry.publish(tmp_path, "broken", artifact_files(setup, **overrides), metrics=METRICS)
    with pytest.raises(RegistryError, match=message):
        Dispatcher.from_registry(tmp_path, "broken")


def test_unknown_alias_is_a_registry_error(setup):
    with pytest.raises(RegistryError, match="no alias 'staging'"):
        Dispatcher.from_registry(setup["root"], "gemm-full", "staging")


def test_import_tilecast_is_lazy_about_lightgbm():
    # neither `import tilecast` nor the dispatcher's module imports lightgbm: loading a
    # model does (Dispatcher.from_directory)
    code = ("import sys, tilecast; assert 'tilecast.runtime.dispatch' not in sys.modules "
            "and 'lightgbm' not in sys.modules, 'eager'; "
            "from tilecast import Dispatcher; assert 'lightgbm' not in sys.modules, 'dispatch'; "
            "print(Dispatcher.__module__, tilecast.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["tilecast.runtime.dispatch", "0.1.0"]


def test_a_bad_query_is_never_memoized(setup):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-full")
    for _ in range(2):  # the second call validates again and fails again
        with pytest.raises((ValueError, FamilyError), match="'x'"):
            dispatcher.select({"m": "x", "n": 4, "k": 4})
    good = dispatcher.ranking({"m": 8, "n": 4, "k": 4})
    assert dispatcher.ranking({"k": 4, "n": 4, "m": 8}) is good


def test_applicability_masks_are_computed_once_per_key(setup, monkeypatch):
    dispatcher = Dispatcher.from_registry(setup["root"], "gemm-full")
    calls = []
    real = GEMM.applicable
    monkeypatch.setattr(GEMM, "applicable", lambda cfg, p: calls.append(1) or real(cfg, p))
    for m in (3, 5, 7):
        dispatcher.select({"m": m, "n": 9, "k": 11})
    assert len(calls) == len(dispatcher.kernels)  # one mask for the fp32 key, reused
    assert GEMM.applicability_key(GEMM.problem({"m": 1, "n": 1, "k": 1, "dtype": "bf16"})) == "bf16"


def test_ranking_best_is_the_first_of_the_sorted_order():
    from tilecast.runtime.dispatch import Ranking

    names = np.array(["a", "b", "c", "d"])
    ranking = Ranking(names, [1.0, np.nan, 3.0, 3.0])
    assert ranking.best == "c" == ranking.kernels[0]
    assert ranking.kernels == ("c", "d", "a", "b") and math.isnan(ranking.tflops[-1])
    assert Ranking(names, [np.inf, np.nan, 0.5, 0.1]).kernels[0] == "c"
    assert Ranking(names, [np.nan] * 4).best == "a"
