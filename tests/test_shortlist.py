"""Tests for tilecast.runtime.shortlist: learning a model's shortlist, reading it back, and
Dispatcher(shortlist=K) choosing among the shortlisted candidates only."""

import json

import lightgbm
import numpy as np
import pytest

from test_dispatch import HARDWARE, METRICS, PARAMS, synthetic_tflops
from tilecast.families import get_family
from tilecast.registry import api as registry
from tilecast.registry.api import RegistryError
from tilecast.runtime import shortlist as shortlists
from tilecast.runtime.dispatch import Dispatcher
from tilecast.runtime.shortlist import Shortlist, ShortlistError

GEMM = get_family("gemm")
OPTIONS = {"dtype": ["fp32", "bf16"], "isa": ["avx512", "avx2"], "parallel": ["m", "n", "k"],
           "tiles": ["14x32", "6x16", "8x8"], "kc": [64, 256]}
SIZES = (1, 8, 64, 300, 2048)


def problems_of(sizes, dtypes=("fp32", "bf16")):
    return [GEMM.problem({"m": m, "n": n, "k": k, "dtype": dtype, "layout_a": "row",
                          "layout_b": "row"})
            for m in sizes for n in sizes for k in sizes for dtype in dtypes]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A small real GEMM model (a synthetic target over real features), its training
    problems, and a registry holding it with a shortlist of 4 (version 1) and without
    one (version 2)."""
    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space(OPTIONS, HARDWARE)
    names = [GEMM.kernel_name(c) for c in configs]
    problems = problems_of(SIZES)
    features = np.vstack([engine.matrix(p, [c for c in configs if GEMM.applicable(c, p)])
                          for p in problems])
    booster = lightgbm.train(PARAMS, lightgbm.Dataset(
        features, np.log1p(synthetic_tflops(engine.feature_names(), features))),
        num_boost_round=40)
    spec = {"family": "gemm", "feature_names": engine.feature_names(), "engine": "gemm",
            "engine_version": engine.version, "target_transform": "log1p_tflops",
            "hardware": HARDWARE}
    candidates = {"family": "gemm", "kernels": names, "static_best": names[0]}
    dispatcher = Dispatcher(booster, spec, candidates)
    shortlist = shortlists.learn(dispatcher, problems, 4, drawn=800, seed=3)
    files = {"model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
             "candidates.json": json.dumps(candidates), "train_manifest.json": "{}"}
    root = tmp_path_factory.mktemp("registry")
    registry.publish(root, "gemm", {**files, shortlists.FILE: json.dumps(shortlist.to_json())},
                     metrics=METRICS)
    registry.publish(root, "gemm", files, metrics=METRICS)
    return {"root": root, "dispatcher": dispatcher, "shortlist": shortlist,
            "problems": problems, "names": names, "booster": booster, "spec": spec}


def test_problems_no_kernel_of_the_model_runs_are_left_out(model):
    fp32 = [k for k in model["names"] if GEMM.parse_name(k).dtype == "fp32"]
    dispatcher = Dispatcher(model["booster"], model["spec"],
                            {"family": "gemm", "kernels": fp32, "static_best": fp32[0]})
    shortlist = shortlists.learn(dispatcher, model["problems"], 2, drawn=300)
    assert {k for kernels in shortlist.leaves for k in kernels} <= set(fp32)
    # bf16 problems raised NoKernelError in the dispatcher: only fp32 ones were scored
    assert 0 < shortlist.summary["problems"] < 300


def test_a_learned_shortlist_is_one_tree_whose_leaves_hold_up_to_size_candidates(model):
    shortlist, names = model["shortlist"], set(model["names"])
    shortlist.check()
    assert shortlist.size == 4 and len(shortlist.leaves) >= 4
    assert all(1 <= len(kernels) <= 4 and set(kernels) <= names for kernels in shortlist.leaves)
    # splits read problem features only; a problem's leaf holds kernels of its dtype
    engine = model["dispatcher"].engine
    assert set(shortlist.features) <= set(engine.problem_feature_names())
    positions = [engine.problem_feature_names().index(f) for f in shortlist.features]
    hits = [any(GEMM.parse_name(k).dtype == problem.dtype
                for k in shortlist.kernels(engine.problem_features(problem)[positions]))
            for problem in model["problems"]]
    assert np.mean(hits) >= 0.95
    summary = shortlist.summary
    assert summary["size"] == 4 and summary["problems"] > 500
    unseen = summary["unseen"]
    # more kernels a leaf keep more of the forest's predicted efficiency
    kept = [unseen[str(k)]["mean_efficiency"] for k in range(1, 5)]
    assert kept == sorted(kept) and 0.5 < kept[0] <= kept[-1] <= 1.0


def test_the_shortlisted_dispatcher_picks_the_forests_best_among_the_leafs_candidates(model):
    full = Dispatcher.from_registry(model["root"], "gemm", 1)
    for size in (1, 2, 4):
        listed = Dispatcher.from_registry(model["root"], "gemm", 1, shortlist=size)
        assert listed.shortlist.size == size
        for problem in problems_of((3, 100, 1500), ("fp32", "bf16")):
            leaf = listed.shortlist.kernels(listed.engine.problem_features(problem)[
                listed._shortlist_positions])
            applicable = [k for k in leaf if GEMM.applicable(GEMM.parse_name(k), problem)]
            predicted = full.predict(problem)
            if not applicable:
                assert listed.select(problem) == full.select(problem)
                continue
            assert set(listed.predict(problem)) == set(applicable)
            best = max(sorted(applicable), key=lambda k: predicted[k])
            assert listed.select(problem) == best
            assert listed.predict(problem)[best] == pytest.approx(predicted[best])


def test_the_whole_shortlist_keeps_most_of_the_forests_choices(model):
    full = Dispatcher.from_registry(model["root"], "gemm", 1)
    listed = Dispatcher.from_registry(model["root"], "gemm", 1, shortlist=4)
    problems = problems_of((2, 30, 200, 1000))
    same = sum(listed.select(p) == full.select(p) for p in problems)
    assert same >= 0.6 * len(problems)
    # the predicted efficiency it keeps is close to the forest's own
    kept = [full.predict(p)[listed.select(p)] / max(full.predict(p).values())
            for p in problems]
    assert np.mean(kept) > 0.95


def test_a_version_without_a_shortlist_says_so(model):
    with pytest.raises(RegistryError, match="trained without a shortlist"):
        Dispatcher.from_registry(model["root"], "gemm", 2, shortlist=2)
    assert Dispatcher.from_registry(model["root"], "gemm", 2).shortlist is None


def test_asking_for_more_than_the_shortlist_keeps_is_refused(model):
    with pytest.raises(RegistryError, match="keeps at most 4 kernels a leaf; shortlist=5"):
        Dispatcher.from_registry(model["root"], "gemm", 1, shortlist=5)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="must be a whole number >= 1"):
            Dispatcher.from_registry(model["root"], "gemm", 1, shortlist=bad)


def test_the_json_form_round_trips_and_damage_is_named(model):
    shortlist = model["shortlist"]
    document = shortlist.to_json()
    assert Shortlist.from_json(json.loads(json.dumps(document))) == shortlist
    broken = {**document, "format_version": 9}
    with pytest.raises(ShortlistError, match="format_version 9"):
        Shortlist.from_json(broken)
    cycle = json.loads(json.dumps(document))
    cycle["nodes"]["left"][0] = 0          # the root its own child: not a tree
    with pytest.raises(ShortlistError, match="do not form one tree"):
        Shortlist.from_json(cycle)
    short = json.loads(json.dumps(document))
    short["leaves"] = short["leaves"][:-1]
    with pytest.raises(ShortlistError, match="non-empty leaves"):
        Shortlist.from_json(short)
    with pytest.raises(ShortlistError, match="not a tilecast-shortlist"):
        Shortlist.from_json([1, 2])


def test_a_shortlist_without_a_split_is_one_leaf_for_every_problem(model):
    # every problem with the same best kernel: nothing to split on
    X = np.arange(40, dtype=float).reshape(20, 2)
    E = np.tile([0.5, 1.0, 0.7], (20, 1))
    tree = shortlists._Tree(X, E, depth=5, min_leaf=2)
    assert tree.feature == [] and len(tree.leaves) == 1
    one = Shortlist(features=("a", "b"), feature=(), threshold=(), left=(), right=(),
                    leaves=(("k1", "k2"),))
    again = Shortlist.from_json(json.loads(json.dumps(one.to_json())))
    assert again == one and again.kernels([5.0, 1e9]) == ("k1", "k2")
    assert one.lightgbm_tree({"a": 0, "b": 1})["tree_info"][0]["tree_structure"] == \
        {"leaf_index": 0, "leaf_value": 0.0}


def test_a_shortlist_naming_a_kernel_the_model_lacks_is_refused(model, tmp_path):
    document = model["shortlist"].to_json()
    document["leaves"][0] = ["gemm_no_such_kernel"]
    directory = registry.local_copy(model["root"], "gemm", 2)
    copy = tmp_path / "version"
    copy.mkdir()
    for name in ("model.txt", "feature_spec.json", "candidates.json"):
        (copy / name).write_text((directory / name).read_text())
    (copy / shortlists.FILE).write_text(json.dumps(document))
    with pytest.raises(RegistryError, match="not candidates of model"):
        Dispatcher.from_directory(copy, shortlist=2)


def test_drawn_problems_stay_near_the_training_ones_and_valid():
    base = problems_of((64, 512), ("fp32",))
    drawn = shortlists.sample_problems(GEMM, base, 300, seed=1)
    assert drawn[:len(base)] == base and len(drawn) == 300
    assert len({GEMM.dims_key(p) for p in drawn}) == 300
    sizes = np.array([[p.m, p.n, p.k] for p in drawn])
    assert sizes.min() >= 1 and 16 <= np.median(sizes) <= 1024
    assert {p.dtype for p in drawn} == {"fp32"}
    # the same seed draws the same problems
    assert shortlists.sample_problems(GEMM, base, 300, seed=1) == drawn


def test_a_leaf_keeps_the_kernels_adding_most_to_its_problems_best():
    # kernel 0 is best on half the problems, kernel 1 on the other half, kernel 2 second
    # everywhere: one kernel a leaf takes 2 (0.9 on all), two take 0 and 1 (1.0 on all)
    efficiency = np.array([[1.0, 0.2, 0.9]] * 5 + [[0.2, 1.0, 0.9]] * 5)
    assert shortlists._greedy(efficiency, 1) == [2]
    assert sorted(shortlists._greedy(efficiency, 3)[1:]) == [0, 1]


def test_select_on_the_command_line_takes_a_shortlist(model, capsys):
    from tilecast.cli import main

    problem = "m=100,n=100,k=1500,dtype=fp32"
    assert main(["select", "--registry", str(model["root"]), "--model", "gemm", "--alias", "1",
                 "--problem", problem, "--shortlist", "1"]) == 0
    chosen = capsys.readouterr().out.strip()
    listed = Dispatcher.from_registry(model["root"], "gemm", 1, shortlist=1)
    assert chosen == listed.select(problem) and chosen in model["names"]
    assert main(["select", "--registry", str(model["root"]), "--model", "gemm", "--alias", "1",
                 "--problem", problem, "--shortlist", "0"]) == 2
    assert "--shortlist 0 must be a number of kernels >= 1" in capsys.readouterr().err
    assert main(["select", "--registry", str(model["root"]), "--model", "gemm", "--alias", "2",
                 "--problem", problem, "--shortlist", "3"]) == 2
    assert "trained without a shortlist" in capsys.readouterr().err
