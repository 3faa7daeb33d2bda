"""The publish gate against production on the same holdout (tilecast.runtime.gate), alias
history, promote / rollback, and the `tilecast registry` command line."""
from __future__ import annotations

import json

import lightgbm
import numpy as np
import pandas as pd
import pytest

from tilecast import cli
from tilecast.registry import api as registry
from tilecast.runtime import gate as promotion
from tilecast.families import get_family

GEMM = get_family("gemm")
HARDWARE = {"threads": 2, "simd_bits": 512, "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
            "l3_bytes": 32 << 20, "clock_mhz": 3000.0, "flags": ["avx2", "fma", "avx512f"]}
OPTIONS = {"dtype": ["fp32"], "isa": ["avx512", "avx2"], "parallel": ["m", "n"],
           "tiles": ["14x32", "6x16"]}
METRICS = {"mean_efficiency": 0.9, "median_efficiency": 0.9, "p10_efficiency": 0.8}


def table(values: dict) -> pd.DataFrame:
    return pd.DataFrame({"dims_key": list(values), "chosen_kernel": "k",
                         "efficiency": list(values.values())})


# --- compare: the gate's arithmetic --------------------------------------------------------


def test_equal_choices_are_promoted_with_every_check_stated():
    production = table({f"p{i}": 0.9 + i / 100 for i in range(10)})
    promote, reason, details = promotion.compare(production, production.copy())
    assert promote and reason.startswith("promoted:")
    for key in ("mean_efficiency", "median_efficiency", "p10_efficiency", "0 problem(s) lose"):
        assert key in reason
    assert details["n_problems"] == 10 and details["problems_losing"] == 0


def test_one_problem_losing_more_than_ten_percent_blocks_promotion():
    production = table({f"p{i}": 0.95 for i in range(40)})
    candidate = table({**{f"p{i}": 0.97 for i in range(39)}, "p39": 0.80})  # mean improves
    promote, reason, details = promotion.compare(production, candidate)
    assert not promote and details["problems_losing"] == 1
    assert "1 problem(s) lose more than 10%" in reason and "p39: 0.800 vs 0.950" in reason
    assert "mean_efficiency" not in reason  # a refusal names only what failed


@pytest.mark.parametrize("shift, failing", [(-0.006, "mean_efficiency"),
                                            (-0.004, None)])
def test_mean_and_median_tolerance_is_half_a_percent(shift, failing):
    production = table({f"p{i}": 0.90 for i in range(20)})
    candidate = table({f"p{i}": 0.90 + shift for i in range(20)})
    promote, reason, _ = promotion.compare(production, candidate)
    assert promote == (failing is None), reason
    if failing:
        assert failing in reason and "median_efficiency" in reason


def test_p10_may_lose_two_percent_but_not_more():
    production = table({f"p{i}": (0.80 if i < 4 else 0.99) for i in range(20)})
    slightly = table({f"p{i}": (0.785 if i < 4 else 0.99) for i in range(20)})
    worse = table({f"p{i}": (0.75 if i < 4 else 1.0) for i in range(20)})
    assert promotion.compare(production, slightly)[0]
    promote, reason, _ = promotion.compare(production, worse)
    assert not promote and "p10_efficiency" in reason


def test_tables_without_common_problems_are_an_error():
    with pytest.raises(ValueError, match="share no holdout problem"):
        promotion.compare(table({"a": 1.0}), table({"b": 1.0}))


# --- production scored on this run's holdout ------------------------------------------------


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A registry whose production gemm model is a real LightGBM booster over GEMM features,
    trained so that it prefers avx512 kernels, and a holdout where avx2 kernels win."""
    root = tmp_path_factory.mktemp("registry")
    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space(OPTIONS, HARDWARE)
    names = [GEMM.kernel_name(c) for c in configs]
    rows, target = [], []
    for m in (32, 256, 1024):
        problem = GEMM.problem({"m": m, "n": m, "k": m})
        features = engine.combine(problem, engine.problem_features(problem),
                                  engine.kernel_features(configs), configs)
        rows.append(features)
        target += [np.log(2.0 if c.isa == "avx512" else 1.0) + i * 1e-3 for i, c in enumerate(configs)]
    booster = lightgbm.train({"objective": "regression", "min_data_in_leaf": 1, "verbose": -1,
                              "num_threads": 1}, lightgbm.Dataset(np.vstack(rows), target),
                             num_boost_round=20)
    spec = {"family": "gemm", "feature_names": engine.feature_names(), "engine": engine.name,
            "engine_version": engine.version, "target_transform": "log_tflops",
            "hardware": HARDWARE}
    files = {"model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
             "candidates.json": json.dumps({"family": "gemm", "kernels": names,
                                            "static_best": names[0]}),
             "train_manifest.json": "{}"}
    registry.publish(root, "gemm", files, metrics=METRICS)

    records = []
    for m in (48, 300, 700):
        problem = GEMM.problem({"m": m, "n": 64, "k": 64})
        for config, name in zip(configs, names):
            median_s = 1e-3 if config.isa == "avx2" else 2e-3
            records.append({"problem_set": "holdout", "dims_key": GEMM.dims_key(problem),
                            **GEMM.problem_dict(problem), "kernel": name, "status": "ok",
                            "median_s": median_s, "tflops": GEMM.flops(problem) / median_s / 1e12,
                            "binary_bytes": 0})
    return {"root": root, "files": files, "names": names, "holdout": pd.DataFrame(records)}


def test_production_is_scored_by_its_own_choices_on_this_holdout(published):
    baseline = promotion.production_baseline(published["root"], "gemm", GEMM,
                                             published["holdout"], 1.0)
    assert baseline.version == 1 and baseline.why_not == ""
    assert len(baseline.per_problem) == 3
    assert all("avx512" in k for k in baseline.per_problem["chosen_kernel"])
    assert baseline.per_problem["efficiency"].to_numpy() == pytest.approx([0.5, 0.5, 0.5])

    # a candidate that picks the avx2 winners beats production on the same holdout
    better = baseline.per_problem.assign(efficiency=1.0)
    gate = promotion.make_gate(baseline, better)
    result = registry.publish(published["root"], "gemm", published["files"], metrics=METRICS,
                              gate=gate)
    assert result.promoted and "same holdout, 3 problems" in result.reason
    assert "production version 1" in result.reason
    # and a worse one is published as a candidate, with the reason in promotion.json
    baseline = promotion.production_baseline(published["root"], "gemm", GEMM,
                                             published["holdout"], 1.0)
    assert baseline.version == 2
    worse = baseline.per_problem.assign(efficiency=0.3)
    refused = registry.publish(published["root"], "gemm", published["files"], metrics=METRICS,
                               gate=promotion.make_gate(baseline, worse))
    assert not refused.promoted and refused.aliases == ("candidate",)
    written = json.loads((refused.path / "promotion.json").read_text())
    assert written["reason"].startswith("not promoted:") and "mean_efficiency" in written["reason"]
    assert registry.read_alias(published["root"], "gemm", "production") == 2


def test_unloadable_production_falls_back_to_stored_metrics_and_says_why(tmp_path, published):
    root = tmp_path / "reg"
    first = registry.publish(root, "gemm", {**published["files"], "model.txt": "not a model"},
                             metrics=METRICS)
    baseline = promotion.production_baseline(root, "gemm", GEMM, published["holdout"], 1.0)
    assert baseline.per_problem is None and "does not load" in baseline.why_not
    assert "model.txt" in baseline.why_not
    gate = promotion.make_gate(baseline, table({"x": 1.0}))
    result = registry.publish(root, "gemm", published["files"],
                              metrics={**METRICS, "mean_efficiency": 0.95}, gate=gate)
    assert result.promoted and f"production version {first.version} does not load" in result.reason

    empty = promotion.production_baseline(tmp_path / "none", "gemm", GEMM, published["holdout"], 1.0)
    assert empty.version is None and "no usable production version" in empty.why_not


# --- alias history, promote, rollback, CLI ---------------------------------------------------


def _versions(root, count):
    for i in range(count):
        registry.publish(root, "m", {"model.txt": f"v{i}"}, metrics=METRICS,
                         gate=lambda prod, new: (True, "ok"))


def test_rollback_walks_back_through_the_history(tmp_path):
    _versions(tmp_path, 3)
    assert registry.read_alias(tmp_path, "m", "production") == 3
    assert registry.rollback(tmp_path, "m") == 2
    assert registry.rollback(tmp_path, "m") == 1  # further back, not back to 3
    with pytest.raises(registry.RegistryError, match="no earlier version"):
        registry.rollback(tmp_path, "m")
    assert registry.promote(tmp_path, "m", 3) == 1
    assert registry.rollback(tmp_path, "m") == 1
    moves = registry.alias_history(tmp_path, "m", "production")
    assert [m["version"] for m in moves] == [1, 2, 3, 2, 1, 3, 1]
    assert moves[3]["why"] == "rollback from 3" and moves[3]["previous"] == 3


def test_rollback_after_promoting_3_2_3_walks_back_and_never_bounces(tmp_path):
    _versions(tmp_path, 3)                       # production went 1, 2, 3
    for version in (3, 2, 3):
        registry.promote(tmp_path, "m", version)
    assert registry.rollback(tmp_path, "m") == 2
    assert registry.rollback(tmp_path, "m") == 1  # further back, not 3 -> 2 -> 3
    with pytest.raises(registry.RegistryError, match="no earlier version"):
        registry.rollback(tmp_path, "m")


@pytest.mark.parametrize("promotions, expected", [
    ([1, 2, 3], [1, 2, 3]),
    ([1, 2, 3, 3, 2, 3], [1, 2, 3]),   # a version promoted again moves to the top, once
    ([1, 2, 1], [2, 1]),
])
def test_the_promotion_stack_holds_each_version_once_most_recent_last(promotions, expected):
    moves = [{"version": v, "why": "promote"} for v in promotions]
    assert registry.promotion_stack(moves) == expected
    # a rollback takes off the version it left, and puts its target on top
    rolled = moves + [{"version": expected[-2], "previous": expected[-1],
                       "why": f"rollback from {expected[-1]}"}]
    assert registry.promotion_stack(rolled) == expected[:-1]


def test_rollback_skips_versions_that_were_deleted(tmp_path):
    _versions(tmp_path, 3)
    import shutil
    shutil.rmtree(tmp_path / "m" / "versions" / "2")
    assert registry.rollback(tmp_path, "m") == 1


def test_history_survives_a_torn_last_line(tmp_path):
    _versions(tmp_path, 2)
    with open(tmp_path / "m" / registry.HISTORY_FILE, "a") as f:
        f.write('{"alias": "production", "vers')
    assert [m["version"] for m in registry.alias_history(tmp_path, "m")] == [1, 2]
    # the next move ends the torn line before its own, so it is kept
    registry.promote(tmp_path, "m", 1)
    assert [m["version"] for m in registry.alias_history(tmp_path, "m")] == [1, 2, 1]
    assert registry.rollback(tmp_path, "m") == 2


def test_registry_command_line(tmp_path, capsys):
    _versions(tmp_path, 2)
    assert cli.main(["registry", "list", "--registry", str(tmp_path)]) == 0
    assert "m [no hardware class]: versions [1, 2]; aliases production -> 2" in \
        capsys.readouterr().out
    assert cli.main(["registry", "show", "m", "1", "--registry", str(tmp_path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == 1 and shown["mean_efficiency"] == 0.9 and shown["aliases"] == []
    assert "unreadable" in shown["train_manifest.json"]
    assert cli.main(["registry", "promote", "m", "1", "--registry", str(tmp_path)]) == 0
    assert "alias production -> version 1 (was 2)" in capsys.readouterr().out
    assert cli.main(["registry", "rollback", "m", "--registry", str(tmp_path)]) == 0
    assert "rolled back to version 2" in capsys.readouterr().out
    assert cli.main(["registry", "promote", "m", "7", "--registry", str(tmp_path)]) == 2
    assert "has no version 7" in capsys.readouterr().err
    assert cli.main(["registry", "show", "nope", "--registry", str(tmp_path)]) == 2


# --- serving through registry trouble ------------------------------------------------------


def test_refresh_keeps_the_last_good_model_and_says_why(tmp_path, published):
    from tilecast.runtime import serving

    root = tmp_path / "reg"
    registry.publish(root, "gemm", published["files"], metrics=METRICS)
    service = serving.serve(root, "gemm")
    assert service.version == 1 and service.last_reload_error is None
    problem = {"m": 64, "n": 64, "k": 64}
    chosen = service.select(problem)

    # production moves to a version whose model file is corrupt: version 1 keeps serving
    registry.publish(root, "gemm", {**published["files"], "model.txt": "garbage"}, metrics=METRICS,
                     gate=lambda prod, new: (True, "forced"))
    kept = serving.refresh(service, root, "gemm")
    assert kept is service and kept.select(problem) == chosen
    assert "still serving version 1" in kept.last_reload_error and "model.txt" in kept.last_reload_error
    # an alias file pointing at a version that is gone: same
    (root / "gemm" / "aliases" / "production").write_text("9\n")
    assert serving.refresh(service, root, "gemm") is service
    assert "version 9" in service.last_reload_error
    # a good version: the service moves to it
    registry.publish(root, "gemm", published["files"], metrics=METRICS,
                     gate=lambda prod, new: (True, "forced"))
    moved = serving.refresh(service, root, "gemm")
    assert moved.version == 3 and moved.last_reload_error is None


def test_unreachable_registry_serves_the_named_static_kernel(tmp_path, published):
    from tilecast.runtime import serving

    kernel = published["names"][0]
    with pytest.raises(registry.RegistryError):
        serving.serve(tmp_path / "nowhere", "gemm")
    static = serving.serve(tmp_path / "nowhere", "gemm", fallback_kernel=kernel)
    assert static.select({"m": 1, "n": 2, "k": 3}) == kernel
    answer = static.select_json("m=1,n=2,k=3")
    assert answer["kernel"] == kernel and answer["predicted_tflops"] is None
    assert "cannot be loaded" in answer["fallback"] and "nowhere" in answer["fallback"]
