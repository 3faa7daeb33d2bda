"""Tests for tilecast.runtime.native: the forest evaluator against Booster.predict, the native GEMM
features against the numpy engine, and the Dispatcher's fast path against the booster's own
argmax, including the fallback when nothing can be compiled."""

import itertools
import json
import logging
import subprocess

import lightgbm
import numpy as np
import pytest

from tilecast.runtime import native
from tilecast.registry import prebuilt
from tilecast.registry import api as registry
from tilecast.runtime.dispatch import Dispatcher
from tilecast.families import get_family
from tilecast.runtime.native import library
from tilecast.runtime.native.forest import ForestUnsupported, NativeForest, flatten
from tilecast.runtime.native.gemm_features import MAX_DIM, EngineMismatch, NativeGemmFeatures

GEMM = get_family("gemm")
HARDWARE = {"threads": 8, "simd_bits": 512, "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
            "l3_bytes": 32 << 20, "clock_mhz": 3000.0,
            "flags": ["avx2", "fma", "avx512f", "avx512_bf16"]}
# fp32 and bf16 candidates, so a problem's applicable rows are a proper subset
OPTIONS = {"dtype": ["fp32", "bf16"], "isa": ["avx512", "avx2"], "mc": [96, 192],
           "nc": [512, 2048], "kc": [128, 384], "parallel": ["m", "n", "k"],
           "pack_a": [True, False]}
PARAMS = {"objective": "regression", "num_leaves": 31, "min_data_in_leaf": 5,
          "learning_rate": 0.1, "verbose": -1, "num_threads": 1, "deterministic": True,
          "seed": 0}
METRICS = {"mean_efficiency": 0.9, "median_efficiency": 0.92, "p10_efficiency": 0.8,
           "min_efficiency": 0.6, "static_best": {"kernel": "?", "mean_efficiency": 0.7}}


def random_problem(rng, dtypes=("fp32", "bf16")):
    """m, n, k log-uniform in 1..5000, any layout and dtype."""
    m, n, k = (int(v) for v in np.exp(rng.uniform(0, np.log(5000), 3)).round())
    return GEMM.problem({"m": max(m, 1), "n": max(n, 1), "k": max(k, 1),
                         "dtype": str(rng.choice(dtypes)),
                         "layout_a": str(rng.choice(["row", "col"])),
                         "layout_b": str(rng.choice(["row", "col"]))})


def synthetic_tflops(names, features):
    """A deterministic 'measurement' whose winner depends on the shape."""
    col = {name: features[:, i] for i, name in enumerate(names)}
    size = np.clip((col["log2_flops"] - 10) / 25, 0.05, 1.0)
    isa = np.where(col["is_avx512"] > 0, 1.0, 0.55)
    traffic = 1.0 / (1.0 + 10 * col["c_traffic_ratio"] + 3 * col["a_pack_traffic_ratio"])
    return (3.0 * isa * col["tile_eff"] ** 2 * col["par_balance"] * size * traffic
            + 0.002 * col["mr"])


@pytest.fixture(autouse=True)
def fresh_loaders(monkeypatch):
    """Each test's native libraries as in a new process: none loaded, none offered by a
    registry version another test loaded (tilecast.registry.prebuilt)."""
    monkeypatch.setattr(prebuilt, "_offers", {})
    monkeypatch.setattr(library, "_loaded", {})


@pytest.fixture(scope="module")
def gemm():
    """The engine, a 2-dtype candidate space, and a training matrix of real GEMM features."""
    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space(OPTIONS, HARDWARE)
    kernel_matrix = engine.kernel_features(configs)
    rng = np.random.default_rng(0)
    blocks = []
    for _ in range(60):
        problem = random_problem(rng, ("fp32",))
        blocks.append(engine.combine(problem, engine.problem_features(problem), kernel_matrix,
                                     configs))
    features = np.vstack(blocks)
    return {"engine": engine, "configs": configs, "kernel_matrix": kernel_matrix,
            "names": [GEMM.kernel_name(c) for c in configs], "features": features,
            "target": np.log1p(synthetic_tflops(engine.feature_names(), features))}


# --- the forest evaluator ----------------------------------------------------------------


def odd_rows(rng, features, count):
    """Rows of real features with zeros, -0.0, tiny values (read as 0 by LightGBM) and NaN
    sprinkled in, in counts that straddle the evaluator's 64-row words."""
    rows = features[rng.choice(len(features), count)].copy()
    for value in (0.0, -0.0, 1e-40, -3e-36, np.nan):
        mask = rng.random(rows.shape) < 0.03
        rows[mask] = value
    return rows


@pytest.mark.parametrize("count", [1, 63, 64, 65, 200])
def test_forest_equals_booster_raw_scores_on_gemm_features(gemm, count):
    booster = lightgbm.train(PARAMS, lightgbm.Dataset(gemm["features"], gemm["target"]),
                             num_boost_round=30)
    rng = np.random.default_rng(count)
    rows = gemm["features"][rng.choice(len(gemm["features"]), count)]
    forest = NativeForest(booster)
    assert forest.n_trees == 30 and not forest.flat.general
    expected = booster.predict(rows, raw_score=True)
    np.testing.assert_allclose(forest.predict(rows), expected, rtol=0, atol=1e-9)
    np.testing.assert_allclose(NativeForest(booster, portable=True).predict(rows), expected,
                               rtol=0, atol=1e-9)
    # NaN and tiny values read as 0 by a forest without missing types
    odd = odd_rows(rng, gemm["features"], count)
    np.testing.assert_allclose(forest.predict(odd), booster.predict(odd, raw_score=True),
                               rtol=0, atol=1e-9)


def missing_types(model) -> set:
    found, pending = set(), [tree["tree_structure"] for tree in model["tree_info"]]
    while pending:
        node = pending.pop()
        if "split_feature" in node:
            found.add(node["missing_type"])
            pending += [node["left_child"], node["right_child"]]
    return found


@pytest.mark.parametrize("missing", ["nan", "zero"])
def test_forest_follows_missing_value_rules(gemm, missing):
    """Missing type NaN (NaNs in training) and Zero (zero_as_missing): NaN, zeros, -0.0 and
    tiny values follow each node's default direction exactly as LightGBM does."""
    rng = np.random.default_rng(1)
    features = gemm["features"].copy()
    holes = rng.random(features.shape) < 0.1
    features[holes] = np.nan if missing == "nan" else 0.0
    params = {**PARAMS, "zero_as_missing": missing == "zero"}
    booster = lightgbm.train(params, lightgbm.Dataset(features, gemm["target"]),
                             num_boost_round=25)
    forest = NativeForest(booster)
    assert ("NaN" if missing == "nan" else "Zero") in missing_types(booster.dump_model())
    assert forest.flat.general
    for count in (7, 64, 130):
        rows = odd_rows(rng, gemm["features"], count)
        expected = booster.predict(rows, raw_score=True)
        np.testing.assert_allclose(forest.predict(rows), expected, rtol=0, atol=1e-9)
        np.testing.assert_allclose(NativeForest(booster, portable=True).predict(rows),
                                   expected, rtol=0, atol=1e-9)


def test_forest_with_a_single_leaf_tree(gemm):
    # no leaf can hold min_data_in_leaf rows: one tree with one leaf (the mean)
    params = {**PARAMS, "min_data_in_leaf": len(gemm["features"]) + 1}
    booster = lightgbm.train(params, lightgbm.Dataset(gemm["features"], gemm["target"]),
                             num_boost_round=3)
    forest = NativeForest(booster)
    assert forest.n_trees == 1 and len(forest.flat.nodes) == 1
    rows = gemm["features"][:5]
    np.testing.assert_allclose(forest.predict(rows), booster.predict(rows, raw_score=True),
                               rtol=0, atol=1e-9)
    assert forest.predict(rows)[0] == pytest.approx(gemm["target"].mean(), rel=1e-6)


def test_forest_reads_remapped_columns(gemm):
    """A model over a reordered subset of the engine's columns reads them through `columns`."""
    names = gemm["engine"].feature_names()
    columns = [names.index(n) for n in names[::-1][5:]]
    booster = lightgbm.train(PARAMS, lightgbm.Dataset(gemm["features"][:, columns],
                                                      gemm["target"]), num_boost_round=20)
    forest = NativeForest(booster, columns)
    rows = gemm["features"][::97]
    np.testing.assert_allclose(forest.predict(rows),
                               booster.predict(rows[:, columns], raw_score=True),
                               rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="reads column"):
        forest.predict(rows[:, :10])


def test_forest_declines_what_it_does_not_reproduce():
    rng = np.random.default_rng(2)
    x = np.column_stack([rng.normal(size=400), rng.integers(0, 6, 400)])
    y = x[:, 0] + np.where(x[:, 1] % 2 == 0, 3.0, -3.0)
    categorical = lightgbm.train(PARAMS, lightgbm.Dataset(x, y, categorical_feature=[1]),
                                 num_boost_round=5)
    with pytest.raises(ForestUnsupported, match="categorical"):
        flatten(categorical.dump_model())
    poisson = lightgbm.train({**PARAMS, "objective": "poisson"},
                             lightgbm.Dataset(x, np.abs(y)), num_boost_round=3)
    with pytest.raises(ForestUnsupported, match="objective 'poisson'"):
        flatten(poisson.dump_model())
    linear = lightgbm.train({**PARAMS, "linear_tree": True}, lightgbm.Dataset(x, y),
                            num_boost_round=2)
    with pytest.raises(ForestUnsupported, match="linear tree"):
        flatten(linear.dump_model())


# --- the native GEMM features ------------------------------------------------------------


# a fractional thread count takes the native code's general floor division (fmod, as numpy)
@pytest.mark.parametrize("hardware", [HARDWARE, {**HARDWARE, "threads": 2.5}, {}],
                         ids=["counts", "fractional-threads", "no-profile"])
def test_native_gemm_features_equal_the_numpy_engine(gemm, hardware):
    configs, kernel_matrix = gemm["configs"], gemm["kernel_matrix"]
    engine = GEMM.feature_engine(hardware)
    filler = NativeGemmFeatures(engine, kernel_matrix)
    rng = np.random.default_rng(3)
    problems = [random_problem(rng) for _ in range(100)]
    problems += [GEMM.problem({"m": m, "n": n, "k": k, "layout_a": la, "dtype": dt})
                 for (m, n, k), la, dt in itertools.product(
                     [(1, 1, 1), (5000, 5000, 5000), (1, 4999, 3), (97, 1, 4096)],
                     ["row", "col"], ["fp32", "bf16"])]
    for problem in problems:
        rows = [i for i, cfg in enumerate(configs) if GEMM.applicable(cfg, problem)]
        expected = engine.combine(problem, engine.problem_features(problem),
                                  kernel_matrix[rows], [configs[i] for i in rows])
        got = filler.matrix(problem, rows)
        # the same float64 operations in the same order, and numpy's own log2: bit for bit
        # (rtol 1e-12 is what the design promises; equality is what the code delivers)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
        assert np.array_equal(got, expected), problem
        everything = engine.matrix(problem, configs, kernel_matrix)
        assert np.array_equal(filler.matrix(problem), everything), problem


def test_native_gemm_features_refuse_other_engines(gemm):
    engine = gemm["engine"]

    class NextEngine(type(engine)):
        version = 3

    class RenamedEngine(type(engine)):
        _interaction_names = (*type(engine)._interaction_names[:-1], "log2_est_us")

    with pytest.raises(LookupError, match="no native features for engine 'gemm' version 3"):
        native.feature_filler(NextEngine(HARDWARE), gemm["kernel_matrix"])
    with pytest.raises(EngineMismatch, match="gemm_features.cpp"):
        native.feature_filler(RenamedEngine(HARDWARE), gemm["kernel_matrix"])
    with pytest.raises(EngineMismatch, match="version 3"):
        NativeGemmFeatures(NextEngine(HARDWARE), gemm["kernel_matrix"])
    conv = get_family("grouped_conv_forward").feature_engine(HARDWARE)
    with pytest.raises(LookupError, match="no native features for engine 'grouped_conv'"):
        native.feature_filler(conv, np.zeros((1, 1)))
    filler = native.feature_filler(engine, gemm["kernel_matrix"])
    huge = GEMM.problem({"m": MAX_DIM + 1, "n": 2, "k": 2})
    assert filler.fill(huge, None, 3) is False  # beyond int64 byte counts: numpy's job


# --- the dispatcher ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def published(gemm, tmp_path_factory):
    """Registry models over the 2-dtype space: 'full' (every engine column) and 'subset'
    (a reordered subset, so the column map is exercised)."""
    root = tmp_path_factory.mktemp("registry")
    engine = gemm["engine"]
    names = engine.feature_names()
    subset = names[::-1][3:]
    columns = [names.index(n) for n in subset]
    boosters = {}
    for model, feature_names, cols in (("full", names, None), ("subset", subset, columns)):
        x = gemm["features"] if cols is None else gemm["features"][:, cols]
        boosters[model] = lightgbm.train(PARAMS, lightgbm.Dataset(x, gemm["target"]),
                                         num_boost_round=40)
        spec = {"family": "gemm", "feature_names": list(feature_names), "engine": "gemm",
                "engine_version": 2, "target_transform": "log1p_tflops", "hardware": HARDWARE}
        candidates = {"family": "gemm", "kernels": gemm["names"][::-1],
                      "static_best": gemm["names"][0]}
        files = {"model.txt": boosters[model].model_to_string(),
                 "feature_spec.json": json.dumps(spec),
                 "candidates.json": json.dumps(candidates), "train_manifest.json": "{}"}
        registry.publish(root, model, files, metrics=METRICS)
    return {"root": root, "boosters": boosters, "columns": {"full": None, "subset": columns}}


def booster_ranking(gemm, booster, problem, columns):
    """(names, tflops) best first, ties by name, straight from Booster.predict."""
    rows = [i for i, cfg in enumerate(gemm["configs"]) if GEMM.applicable(cfg, problem)]
    engine = gemm["engine"]
    features = engine.combine(problem, engine.problem_features(problem),
                              gemm["kernel_matrix"][rows], [gemm["configs"][i] for i in rows])
    if columns is not None:
        features = features[:, columns]
    tflops = np.expm1(booster.predict(features, num_threads=1))
    ranked = sorted(zip((gemm["names"][i] for i in rows), tflops),
                    key=lambda pair: (-pair[1], pair[0]))
    return [name for name, _ in ranked], [float(t) for _, t in ranked]


@pytest.mark.parametrize("model", ["full", "subset"])
def test_fast_path_choices_are_the_booster_argmax(gemm, published, model):
    dispatcher = Dispatcher.from_registry(published["root"], model)
    assert dispatcher._scorer.forest is not None and dispatcher._scorer.filler is not None
    booster, columns = published["boosters"][model], published["columns"][model]
    rng = np.random.default_rng(4)
    chosen = set()
    for _ in range(150):
        problem = random_problem(rng)
        names, tflops = booster_ranking(gemm, booster, problem, columns)
        ranking = dispatcher.ranking(GEMM.problem_dict(problem))
        assert dispatcher.select(problem) == names[0], problem
        assert list(ranking.kernels) == names
        assert list(ranking.tflops) == tflops  # same features, same sums: the same floats
        chosen.add(names[0])
    assert len(chosen) >= 5, chosen  # the choice really depends on the problem


def test_problems_beyond_the_native_features_take_the_numpy_engine(gemm, published):
    dispatcher = Dispatcher.from_registry(published["root"], "subset")
    for m, n, k in ((MAX_DIM + 1, 3, 5), (7, 2 ** 33, 2 ** 10)):
        problem = GEMM.problem({"m": m, "n": n, "k": k})
        names, tflops = booster_ranking(gemm, published["boosters"]["subset"], problem,
                                        published["columns"]["subset"])
        ranking = dispatcher.ranking(problem)
        assert list(ranking.kernels) == names and list(ranking.tflops) == tflops


def test_a_categorical_model_keeps_the_booster(gemm, caplog):
    names = gemm["engine"].feature_names()
    booster = lightgbm.train(PARAMS, lightgbm.Dataset(gemm["features"], gemm["target"],
                                                      categorical_feature=[names.index("mr")]),
                             num_boost_round=20)
    assert '"decision_type": "=="' in json.dumps(booster.dump_model())
    spec = {"family": "gemm", "feature_names": names, "target_transform": "log1p_tflops",
            "hardware": HARDWARE}
    candidates = {"family": "gemm", "kernels": gemm["names"], "static_best": gemm["names"][0]}
    with caplog.at_level(logging.INFO, logger="tilecast.runtime.native"):
        dispatcher = Dispatcher(booster, spec, candidates, model="cat", version=1)
    assert dispatcher._scorer.forest is None and dispatcher._scorer.filler is not None
    assert any("declines" in r.getMessage() and "categorical" in r.getMessage()
               for r in caplog.records)
    rng = np.random.default_rng(6)
    for _ in range(30):
        problem = random_problem(rng)
        assert dispatcher.select(problem) == booster_ranking(gemm, booster, problem, None)[0][0]


@pytest.mark.filterwarnings("ignore:overflow encountered in expm1:RuntimeWarning")
def test_overflowing_predictions_rank_last_in_name_order(gemm):
    """expm1 of a raw score above ~709.8 is +inf: such candidates go last, by name."""
    names = gemm["engine"].feature_names()
    huge = np.where(gemm["features"][:, names.index("mr")] >= 8, 800.0, 1.0)
    booster = lightgbm.train({**PARAMS, "learning_rate": 1.0},
                             lightgbm.Dataset(gemm["features"], huge), num_boost_round=2)
    spec = {"family": "gemm", "feature_names": names, "target_transform": "log1p_tflops",
            "hardware": HARDWARE}
    candidates = {"family": "gemm", "kernels": gemm["names"], "static_best": gemm["names"][0]}
    dispatcher = Dispatcher(booster, spec, candidates)
    ranking = dispatcher.ranking({"m": 100, "n": 100, "k": 100})
    finite = [t for t in ranking.tflops if np.isfinite(t)]
    assert 0 < len(finite) < len(ranking.tflops)
    assert list(ranking.tflops[:len(finite)]) == finite  # every +inf after every finite one
    overflowed = list(ranking.kernels[len(finite):])
    assert overflowed == sorted(overflowed)
    assert all(GEMM.parse_name(name).mr >= 8 for name in overflowed)


def test_failed_native_build_falls_back_to_the_booster(gemm, published, monkeypatch, caplog):
    monkeypatch.setenv(library.COMPILER_ENV, "no-such-compiler-tilecast")
    with caplog.at_level(logging.WARNING, logger="tilecast.runtime.native"):
        dispatcher = Dispatcher.from_registry(published["root"], "full")
    assert dispatcher._scorer.forest is None and dispatcher._scorer.filler is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("native forest could not be built" in w and "no-such-compiler-tilecast" in w
               for w in warnings), warnings
    calls = []
    real_predict = dispatcher.booster.predict
    monkeypatch.setattr(dispatcher.booster, "predict",
                        lambda features, **options: calls.append(len(features))
                        or real_predict(features, **options))
    rng = np.random.default_rng(5)
    for _ in range(40):
        problem = random_problem(rng)
        names, _ = booster_ranking(gemm, published["boosters"]["full"], problem, None)
        assert dispatcher.select(problem) == names[0]
    assert len(calls) == 40


def test_libraries_are_built_once_into_the_content_hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(library.CACHE_ENV, str(tmp_path))
    first = library.load("forest.cpp")
    built = sorted(p.name for p in (tmp_path / "native").glob("*.so"))
    assert len(built) == 1 and built[0].startswith("forest-")
    assert {p.name for p in (tmp_path / "native").iterdir()} == {built[0], ".deps"}  # no temps
    assert library.load("forest.cpp") is first
    library._loaded.clear()  # a new process finds the library in the cache
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("rebuilt"))
    library.load("forest.cpp")
