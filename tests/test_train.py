"""Tests for tilecast.stages.train: spec, features, group-aware CV, artifacts, predictor.

The training table is constructed: TFLOP/s is a deterministic function of GEMM engine
features (tile padding waste, parallel scheme vs aspect ratio, problem size), so a model
that learns anything must rank kernels on unseen problems far better than chance.
"""
import json
import statistics

import numpy as np
import pandas as pd
import pytest

from tilecast.core import hardware
from tilecast.families import GEMM
from tilecast.stages.train import (
    TARGETS,
    ModelArtifactError,
    ModelSpec,
    featurize,
    group_folds,
    load_predictor,
    target_transform,
    train_model,
)

# A fixed machine (a 2-core Zen 4 EPYC's caches and clock) so neither the candidate space
# nor the features, and so neither the synthetic truth below nor the trained models, depend
# on the CPU the tests run on (the warm-start test's holdout comparison came out otherwise
# on a 260 MiB-L3 Xeon). One thread: LightGBM's OpenMP threads crawl when the CPUs are
# shared with other tests.
HW = {**hardware.profile(1), "cores": 2, "threads": 1, "simd_bits": 512, "clock_mhz": 2450.0,
      "l1d_bytes": 32768, "l2_bytes": 1048576, "l3_bytes": 33554432,
      "flags": ["avx2", "avx512_bf16", "avx512f", "fma"]}
ENGINE = GEMM.feature_engine(HW)
CONFIGS = GEMM.candidate_space({"isa": ["avx512"], "tiles": ["8x32", "6x48", "4x64", "16x16"],
                                "parallel": ["m", "n"]}, HW)
KERNELS = [GEMM.kernel_name(c) for c in CONFIGS]
FAST_SPEC = ModelSpec(n_estimators=300, learning_rate=0.1, early_stopping_rounds=30, folds=4,
                      min_data_in_leaf=5)


def true_tflops(problem) -> np.ndarray:
    """Known TFLOP/s of every kernel in CONFIGS on `problem` (one per kernel)."""
    f = dict(zip(ENGINE.feature_names(), ENGINE.matrix(problem, CONFIGS).T))
    wide = float(problem.m >= problem.n)
    scheme = 1 + 0.6 * f["par_m"] * wide + 0.6 * f["par_n"] * (1 - wide)
    return f["log2_flops"] / 10 * f["tile_eff"] ** 2 * scheme


def problems(ms, ns, ks):
    return [GEMM.problem({"m": m, "n": n, "k": k}) for m in ms for n in ns for k in ks]


def frame_for(problem_list, problem_set="train") -> pd.DataFrame:
    rows = []
    for p in problem_list:
        for kernel, tflops in zip(KERNELS, true_tflops(p)):
            rows.append({**GEMM.problem_dict(p), "dims_key": GEMM.dims_key(p), "kernel": kernel,
                         "status": "ok", "tflops": float(tflops),
                         "median_s": GEMM.flops(p) / (tflops * 1e12),
                         "problem_set": problem_set, "role": "candidate"})
    return pd.DataFrame(rows)


TRAIN_PROBLEMS = problems([40, 100, 200, 333, 500, 777, 1000], [48, 130, 250, 600, 900], [64, 512])
HOLDOUT_PROBLEMS = problems([70, 260, 650, 900], [90, 420, 1100], [128])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("model") / "gemm_fp32"
    frame = frame_for(TRAIN_PROBLEMS)
    result = train_model(GEMM, ENGINE, frame, FAST_SPEC, out_dir, HW, lineage=["v1"])
    return frame, result


def test_spec_from_mapping_and_unknown_keys():
    spec = ModelSpec.from_mapping({"num_leaves": 15, "target": "log_tflops"})
    assert (spec.num_leaves, spec.target, spec.n_estimators) == (15, "log_tflops", 2000)
    with pytest.raises(ValueError, match=r"num_leavs.*valid:.*num_leaves"):
        ModelSpec.from_mapping({"num_leavs": 15})
    with pytest.raises(ValueError, match=r"'sqrt'.*log1p_tflops"):
        ModelSpec(target="sqrt")
    with pytest.raises(ValueError, match="folds=1"):
        ModelSpec(folds=1)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_transforms_round_trip(name):
    forward, inverse = target_transform(name)
    values = np.array([0.01, 0.5, 3.0, 250.0])
    assert np.allclose(inverse(forward(values)), values)
    assert np.all(np.diff(forward(values)) > 0)


def test_featurize_rows_match_the_engine_in_frame_order():
    frame = frame_for(problems([64, 300], [96, 500], [256])).sample(frac=1.0, random_state=3)
    features = featurize(GEMM, ENGINE, frame)
    assert features.X.shape == (len(frame), len(ENGINE.feature_names()))
    assert list(features.groups) == list(frame["dims_key"])
    assert features.kernels == list(frame["kernel"])
    assert np.array_equal(features.y_tflops, frame["tflops"].to_numpy())
    for i, row in enumerate(frame.itertuples()):
        problem = GEMM.problem({f: getattr(row, f) for f in GEMM.problem_fields})
        expected = ENGINE.matrix(problem, [GEMM.parse_name(row.kernel)])[0]
        assert np.array_equal(features.X[i], expected)


def test_featurize_rejects_one_dims_key_with_two_shapes():
    frame = frame_for(problems([64, 300], [96], [256]))
    frame["dims_key"] = "same"
    with pytest.raises(ValueError, match="'same' has 2 different problem"):
        featurize(GEMM, ENGINE, frame)


def test_group_folds_never_split_a_problem():
    groups = frame_for(TRAIN_PROBLEMS[:7])["dims_key"].to_numpy()
    splits = group_folds(groups, folds=5)
    assert len(splits) == 5
    for train_idx, val_idx in splits:
        assert not set(groups[train_idx]) & set(groups[val_idx])
        assert len(train_idx) + len(val_idx) == len(groups)
    assert set(np.concatenate([groups[v] for _, v in splits])) == set(groups)
    assert len(group_folds(groups[groups != groups[0]][:16], folds=5)) == 2  # min(folds, groups)
    with pytest.raises(ValueError, match="at least 2 problems.*got 1"):
        group_folds(groups[:3], folds=5)


def test_train_writes_artifacts_with_the_contract_keys(trained):
    frame, result = trained
    out = result.out_dir
    assert sorted(p.name for p in out.iterdir()) == ["feature_spec.json", "model.txt",
                                                     "train_manifest.json"]
    spec = json.loads((out / "feature_spec.json").read_text())
    assert spec["feature_names"] == ENGINE.feature_names()
    assert (spec["family"], spec["engine"], spec["engine_version"]) == ("gemm", "gemm", ENGINE.version)
    assert spec["target_transform"] == "log1p_tflops"
    assert spec["hardware"]["fingerprint"] == HW["fingerprint"]
    assert spec["model_spec"]["n_estimators"] == 300 and spec["model_spec"]["folds"] == 4
    manifest = json.loads((out / "train_manifest.json").read_text())
    assert set(manifest) == {"data_hash", "rows", "problems", "kernels", "cv", "num_boost_round",
                             "base_trees",
                             "lineage", "versions", "git_sha", "created"}
    assert (manifest["rows"], manifest["problems"], manifest["kernels"]) == (
        len(frame), len(TRAIN_PROBLEMS), len(KERNELS))
    assert manifest["lineage"] == ["v1"] and len(manifest["data_hash"]) == 64
    assert {"tilecast", "python", "lightgbm", "numpy", "pandas", "sklearn"} <= set(
        manifest["versions"])
    assert manifest["created"].endswith("+00:00")
    folds = manifest["cv"]["folds"]
    assert len(folds) == 4
    for fold in folds:  # a problem on both sides would make these sums exceed the total
        assert fold["train_problems"] + fold["val_problems"] == len(TRAIN_PROBLEMS)
        assert 0.0 < fold["mean_efficiency"] <= 1.0 and fold["rmse"] > 0
    assert sum(f["val_problems"] for f in folds) == len(TRAIN_PROBLEMS)
    assert manifest["cv"]["mean_efficiency"] == pytest.approx(
        np.mean([f["mean_efficiency"] for f in folds]))
    expected_rounds = max(1, round(statistics.median(f["best_iteration"] for f in folds)))
    assert manifest["num_boost_round"] == result.num_boost_round == expected_rounds
    assert result.booster.num_trees() == expected_rounds
    assert result.cv == manifest["cv"]


def test_model_ranks_unseen_problems_far_better_than_chance(trained):
    predictor = load_predictor(trained[1].out_dir)
    model, chance = [], []
    for problem in HOLDOUT_PROBLEMS:
        tflops = true_tflops(problem)
        predicted = predictor.predict_tflops(ENGINE.matrix(problem, CONFIGS))
        model.append(tflops[np.argmax(predicted)] / tflops.max())
        chance.append(tflops.mean() / tflops.max())
    assert np.mean(model) >= 0.9
    assert np.mean(model) >= np.mean(chance) + 0.15


def test_predictor_applies_the_inverse_target_transform(trained):
    predictor = load_predictor(trained[1].out_dir)
    X = ENGINE.matrix(HOLDOUT_PROBLEMS[0], CONFIGS)
    assert np.allclose(predictor.predict_tflops(X), np.expm1(trained[1].booster.predict(X)))
    with pytest.raises(ValueError, match=r"shape \(8, 3\)"):
        predictor.predict_tflops(X[:, :3])


def test_load_predictor_names_the_missing_or_corrupt_file(trained, tmp_path):
    source = trained[1].out_dir
    for name in ("model.txt", "feature_spec.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    (tmp_path / "feature_spec.json").write_text("{not json")
    with pytest.raises(ModelArtifactError, match="feature_spec.json is corrupt"):
        load_predictor(tmp_path)
    (tmp_path / "feature_spec.json").write_bytes((source / "feature_spec.json").read_bytes())
    (tmp_path / "model.txt").write_text("garbage\n")
    with pytest.raises(ModelArtifactError, match="model.txt is corrupt"):
        load_predictor(tmp_path)
    (tmp_path / "model.txt").unlink()
    with pytest.raises(ModelArtifactError, match="model.txt is missing"):
        load_predictor(tmp_path)


def test_train_rejects_bad_input(tmp_path):
    frame = frame_for(TRAIN_PROBLEMS[:1])
    with pytest.raises(ValueError, match="at least 2 problems.*got 1"):
        train_model(GEMM, ENGINE, frame, FAST_SPEC, tmp_path / "one", HW)
    frame = frame_for(TRAIN_PROBLEMS[:3])
    frame.loc[4, "tflops"] = np.nan
    with pytest.raises(ValueError, match="1 training row.*dataset.valid"):
        train_model(GEMM, ENGINE, frame, FAST_SPEC, tmp_path / "nan", HW)
    assert not (tmp_path / "one").exists() and not (tmp_path / "nan").exists()


def test_training_is_deterministic(tmp_path):
    frame = frame_for(TRAIN_PROBLEMS[:12])
    spec = ModelSpec(n_estimators=40, folds=3, min_data_in_leaf=3, early_stopping_rounds=10)
    first = train_model(GEMM, ENGINE, frame, spec, tmp_path / "a", HW)
    second = train_model(GEMM, ENGINE, frame, spec, tmp_path / "b", HW)
    assert first.cv == second.cv
    assert (tmp_path / "a" / "model.txt").read_text() == (tmp_path / "b" / "model.txt").read_text()


def test_row_weights_favour_each_problems_best_rows():
    from tilecast.stages.train import row_weights

    tflops = np.array([1.0, 0.5, 4.0, 2.0, 1.0])
    groups = np.array(["a", "a", "b", "b", "b"])
    assert np.allclose(row_weights(tflops, groups, 0.0), 1.0)
    assert np.allclose(row_weights(tflops, groups, 2.0), [1.0, 0.25, 1.0, 0.25, 0.0625])
    with pytest.raises(ValueError, match="top_weight=-1"):
        ModelSpec(top_weight=-1)


def _holdout_efficiency(model_dir) -> float:
    predictor = load_predictor(model_dir)
    efficiencies = []
    for p in HOLDOUT_PROBLEMS:
        truth = true_tflops(p)
        chosen = int(np.argmax(predictor.predict_tflops(ENGINE.matrix(p, CONFIGS))))
        efficiencies.append(truth[chosen] / truth.max())
    return float(np.mean(efficiencies))


def test_warm_start_continues_the_base_model_with_new_data(trained, tmp_path):
    from tilecast.stages.train import check_warm_start

    _, base = trained
    init = check_warm_start(base.out_dir, GEMM, ENGINE, FAST_SPEC)
    new_data = frame_for(problems([60, 150, 420, 850], [70, 300, 700], [256]))
    warm = train_model(GEMM, ENGINE, new_data, FAST_SPEC, tmp_path / "warm", HW,
                       lineage=[{"base": 1}], init_model=init)
    manifest = json.loads((tmp_path / "warm" / "train_manifest.json").read_text())
    assert manifest["base_trees"] == base.booster.current_iteration() > 0
    assert warm.booster.current_iteration() == manifest["base_trees"] + warm.num_boost_round
    assert manifest["lineage"] == [{"base": 1}]
    # the continued model keeps what the base learned: at least its holdout quality
    assert _holdout_efficiency(tmp_path / "warm") >= _holdout_efficiency(base.out_dir) - 1e-9


def test_warm_start_refuses_a_base_with_another_schema(trained, tmp_path):
    from tilecast.stages.train import check_warm_start

    _, base = trained
    with pytest.raises(ModelArtifactError, match="its target_transform differs"):
        check_warm_start(base.out_dir, GEMM, ENGINE, ModelSpec(target="log_tflops"))
    spec = json.loads((base.out_dir / "feature_spec.json").read_text())
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / "model.txt").write_text((base.out_dir / "model.txt").read_text())
    spec["feature_names"] = spec["feature_names"][::-1]
    (changed / "feature_spec.json").write_text(json.dumps(spec))
    with pytest.raises(ModelArtifactError, match="its feature_names differ"):
        check_warm_start(changed, GEMM, ENGINE, FAST_SPEC)
