"""Tests for tilecast.table.dispatch, tilecast.table.train and the train / publish / select
commands on table models: trained with `tilecast train`, published with `tilecast publish`,
loaded back through Dispatcher.from_registry."""
from __future__ import annotations

import json

import lightgbm
import numpy as np
import pytest

from test_table_model import (DEVICES, PROBLEMS, SCHEMA, make_dataset, write_test_dataset)
from tilecast.cli import main
from tilecast.families import get_family
from tilecast.registry import api as registry
from tilecast.runtime.dispatch import Dispatcher, ProblemError
from tilecast.table.confidence import Calibration
from tilecast.table.devices import DeviceTable, UnknownDeviceError
from tilecast.table.dispatch import Choice, TableDispatcher
from tilecast.table.model import TableModel

ROUNDS = "40"
THREADS = "1"     # see test_table_model.THREADS
BIG = "m=512,n=512,k=512"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A dataset, a model trained on it by `tilecast train`, published as 'mm' by `tilecast
    publish`."""
    root = tmp_path_factory.mktemp("table")
    dataset = write_test_dataset(root / "dataset")
    workdir, registry_root = root / "work", root / "registry"
    assert main(["train", "--dataset", str(dataset), "--workdir", str(workdir),
                 "--rounds", ROUNDS, "--threads", THREADS]) == 0
    assert main(["publish", "--workdir", str(workdir), "--registry", str(registry_root),
                 "--model", "mm"]) == 0
    return {"root": root, "dataset": dataset, "workdir": workdir, "registry": registry_root,
            "dispatcher": Dispatcher.from_registry(registry_root, "mm")}


def test_train_prints_one_line_and_writes_the_model_directory(setup):
    directory = setup["workdir"] / "models" / "table"
    names = {p.name for p in directory.iterdir()}
    assert {"model.txt", "feature_spec.json", "candidates.json", "failures.json",
            "calibration.json", "train_manifest.json", "out_of_fold.parquet"} <= names
    manifest = json.loads((directory / "train_manifest.json").read_text())
    assert manifest["devices"] == sorted(DEVICES)
    assert manifest["out_of_fold"]["method"] == "leave-one-device-out"
    assert manifest["out_of_fold"]["n_problems"] == len(DEVICES) * len(PROBLEMS)
    assert 0.0 < manifest["out_of_fold"]["mean_efficiency"] <= 1.0
    assert manifest["in_sample"]["mean_efficiency"] >= manifest["out_of_fold"]["mean_efficiency"]
    spec = json.loads((directory / "feature_spec.json").read_text())
    assert spec["family"] == "table" and sorted(spec["devices"]["devices"]) == sorted(DEVICES)


def test_from_registry_returns_a_table_dispatcher(setup):
    dispatcher = setup["dispatcher"]
    assert isinstance(dispatcher, TableDispatcher)
    assert (dispatcher.model, dispatcher.version) == ("mm", 1)
    metrics = registry.read_metrics(setup["registry"], "mm", 1)
    assert metrics["family"] == "table" and metrics["n_problems"] == len(DEVICES) * len(PROBLEMS)
    path = registry.version_path(setup["registry"], "mm", 1)
    assert isinstance(Dispatcher.from_directory(path), TableDispatcher)


def test_select_is_the_best_prediction_of_the_allowed_candidates(setup):
    dispatcher = setup["dispatcher"]
    for device in DEVICES:
        predicted = dispatcher.table_model.predict(PROBLEMS[2], device)
        assert dispatcher.select(PROBLEMS[2], device=device) == max(predicted, key=predicted.get)
        assert dispatcher.select(BIG, device=device) == dispatcher.select(PROBLEMS[2],
                                                                          device=device)


def test_failed_configurations_are_never_selected(setup):
    dispatcher = setup["dispatcher"]
    for device in DEVICES:
        failed = dispatcher.table_model.failed_on(device)
        for problem in PROBLEMS:
            assert dispatcher.select(problem, device=device) not in failed
            assert not set(dispatcher.shortlist(problem, 50, device=device)) & failed
            assert not set(dispatcher.predict(problem, device=device)) & failed


def test_shortlist_is_the_top_of_the_ranking(setup):
    dispatcher = setup["dispatcher"]
    ranked = dispatcher.rank(PROBLEMS[5], k=10, device="V100-SXM2")
    scores = [score for _, score in ranked]
    assert scores == sorted(scores, reverse=True)
    assert dispatcher.shortlist(PROBLEMS[5], 10, device="V100-SXM2") == [k for k, _ in ranked]
    assert dispatcher.shortlist(PROBLEMS[5], 1, device="V100-SXM2") == \
        [dispatcher.select(PROBLEMS[5], device="V100-SXM2")]
    allowed = dispatcher.table_model.allowed("V100-SXM2")
    everything = dispatcher.shortlist(PROBLEMS[5], 10_000, device="V100-SXM2")
    assert sorted(everything) == allowed                          # fewer when fewer allowed
    with pytest.raises(ValueError, match="k=0 must be >= 1"):
        dispatcher.shortlist(PROBLEMS[5], 0, device="V100-SXM2")


def test_a_device_the_model_never_saw_is_answered_from_its_features(setup):
    dispatcher = setup["dispatcher"]
    answer = dispatcher.choice(BIG, device="NVIDIA H200")
    assert answer.device == "H200" and answer.kernel in dispatcher.kernels


def test_choice_is_unsure_with_a_shortlist_below_the_threshold(setup):
    model = setup["dispatcher"].table_model
    knots = {"slacks": (-5.0, 0.0), "probabilities": (0.2, 0.8)}
    never = TableDispatcher(model, Calibration(**knots, threshold=float("inf")),
                            shortlist_size=7)
    always = TableDispatcher(model, Calibration(**knots, threshold=0.0))
    unsure = never.choice(BIG, device="T4")
    assert isinstance(unsure, Choice) and unsure.unsure
    assert list(unsure.shortlist) == never.shortlist(BIG, 7, device="T4")
    sure = always.choice(BIG, device="T4")
    assert not sure.unsure and sure.shortlist == () and sure.kernel == unsure.kernel
    assert 0.2 <= sure.confidence <= 0.8
    uncalibrated = TableDispatcher(model, None).choice(BIG, device="T4")
    assert uncalibrated.unsure and uncalibrated.confidence == 0.0
    # a device further from its nearest training device than any training device lies from
    # the rest is unsure at any threshold: MI300X lies 4.9 (device feature distance) from
    # MI250X, the training devices at most 4.0 from each other
    assert sure.beyond == ()
    beyond = always.choice(BIG, device="MI300X")
    assert beyond.unsure and len(beyond.shortlist) == 20
    assert "log2_compute_units" in beyond.beyond      # 304 CUs, the training devices <= 220
    # H200 (3.7 from A100) and A100 SXM (0.5) are nearer: the calibration vouches for them,
    # though H200's bandwidth tops every training device's
    for device in ("H200", "A100-SXM4-80GB"):
        inside = always.choice(BIG, device=device)
        assert inside.beyond == () and not inside.unsure
    # a training device answers from the problem-fold calibration, a new one from leave-one-
    # device-out's
    dispatcher = setup["dispatcher"]
    assert dispatcher.calibrations.known_device is not None
    assert dispatcher.calibrations.new_device is not None
    assert dispatcher.calibrations.known_device != dispatcher.calibrations.new_device
    for device, case in (("T4", "known_device"), ("A100-SXM4-80GB", "new_device")):
        published = dispatcher.choice(BIG, device=device)
        calibration = getattr(dispatcher.calibrations, case)
        assert published.confidence == calibration.confidence(
            np.array(list(dispatcher.predict(BIG, device=device).values())))
        assert published.unsure == (published.confidence < calibration.threshold)


def test_the_incumbent_guard_answers_the_incumbent_unless_the_pair_was_measured(setup):
    model = setup["dispatcher"].table_model
    incumbent = model.incumbent
    assert incumbent in model.candidates()
    knots = {"slacks": (-5.0, 0.0), "probabilities": (0.2, 0.8), "threshold": 0.0}
    always = TableDispatcher(model, Calibration(**knots, margin=float("inf")))
    never = TableDispatcher(model, Calibration(**knots, margin=0.0))
    new_problem, measured = "m=3000,n=100,k=700", PROBLEMS[2]
    for device, problem in (("H200", BIG), ("T4", new_problem)):   # a new device, a new problem
        guarded, plain = always.choice(problem, device=device), never.choice(problem, device=device)
        assert guarded.kernel == incumbent and not plain.incumbent
        assert guarded.incumbent == (plain.kernel != incumbent)     # the guard changed it
        predicted = model.predict(never.problem(problem), device)
        assert plain.kernel == max(predicted, key=predicted.get)
        # the incumbent leads the shortlist; the rest keep their predicted order
        ranked = always.rank(problem, k=4, device=device)
        assert ranked[0][0] == incumbent
        assert [k for k, _ in ranked[1:]] == [k for k in never.shortlist(problem, 4, device=device)
                                              if k != incumbent][:3]
    # a problem measured on a training device: the model has seen it, the guard stays out
    assert always.choice(measured, device="T4") == never.choice(measured, device="T4")
    # a margin between: the incumbent exactly where the top prediction's gain is below it
    scores = model.predict(dict(m=3000, n=100, k=700), "H200")
    gain = max(scores.values()) - scores[incumbent]
    if gain > 0:
        below = TableDispatcher(model, Calibration(**knots, margin=gain * 0.99))
        above = TableDispatcher(model, Calibration(**knots, margin=gain * 1.01))
        assert not below.choice(new_problem, device="H200").incumbent
        assert above.choice(new_problem, device="H200").kernel == incumbent


def test_select_json_carries_the_choice(setup):
    answer = setup["dispatcher"].select_json(BIG, device="RTX 3090")
    assert answer["kernel"] == setup["dispatcher"].select(BIG, device="RTX 3090")
    assert set(answer) == {"kernel", "predicted_efficiency", "confidence", "unsure",
                           "shortlist", "device", "beyond", "incumbent", "model", "version"}
    json.dumps(answer)


def test_rankings_are_memoized_per_device_and_problem(setup, monkeypatch):
    dispatcher = TableDispatcher(setup["dispatcher"].table_model, None)
    calls = []
    original = dispatcher.table_model.scores

    def counting(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(dispatcher.table_model, "scores", counting)
    first = dispatcher.ranking(BIG, "T4")
    assert dispatcher.ranking(BIG, "T4") is first
    assert dispatcher.ranking({"m": 512, "n": 512, "k": 512}, "Tesla T4") is first
    dispatcher.ranking(BIG, "A100-PCIE-40GB")
    assert calls == ["T4", "A100-PCIE-40GB"]


@pytest.mark.parametrize("text, message", [
    ("m=1,n=2", r"missing \['k'\]"),
    ("m=1,n=2,k=3,batch=4", r"unknown \['batch'\]"),
    ("m=big,n=2,k=3", "m='big' is not a finite number"),
    ("m=1;n=2,k=3", "malformed pair"),
    ("m=1,m=2,n=2,k=3", "given twice"),
    ("", "empty problem string"),
])
def test_bad_problem_strings_are_named(setup, text, message):
    with pytest.raises(ProblemError, match=message):
        setup["dispatcher"].select(text, device="T4")


def test_unknown_and_missing_devices_are_clear_errors(setup):
    dispatcher = setup["dispatcher"]
    with pytest.raises(UnknownDeviceError, match="unknown device 'Voodoo5'.*--devices FILE"):
        dispatcher.select(BIG, device="Voodoo5")
    with pytest.raises(ProblemError, match="trained on 5 devices.*name the device"):
        dispatcher.select(BIG)


def test_a_model_of_one_device_needs_no_device(setup):
    model = TableModel.fit(make_dataset(devices=("A100-PCIE-40GB",)), DeviceTable.load(),
                           rounds=10, threads=1)
    dispatcher = TableDispatcher(model, None)
    assert dispatcher.select(BIG) == dispatcher.select(BIG, device="A100-PCIE-40GB")
    # no calibration for a new device: the incumbent, unsure, with a shortlist to measure
    choice = dispatcher.choice(BIG, device="MI250X")
    assert choice.kernel == model.incumbent and choice.unsure and choice.shortlist


# -- the command line -----------------------------------------------------------------------

def test_select_command_answers_for_a_device(setup, capsys):
    base = ["select", "--registry", str(setup["registry"]), "--model", "mm", "--problem", BIG]
    assert main([*base, "--device", "MI250X"]) == 0
    assert capsys.readouterr().out.strip() == setup["dispatcher"].select(BIG, device="MI250X")
    assert main([*base, "--device", "A100-PCIE-40GB", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["device"] == "A100-PCIE-40GB" and answer["model"] == "mm"


@pytest.mark.parametrize("extra, message", [
    (["--device", "Voodoo5"], "unknown device 'Voodoo5'"),
    ([], "name the device"),
    (["--device", "T4", "--problem", "m=1,n=2"], r"missing \['k'\]"),
])
def test_select_command_errors_are_one_line(setup, capsys, extra, message):
    args = ["select", "--registry", str(setup["registry"]), "--model", "mm",
            "--problem", BIG, *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tilecast select: error:") and \
        __import__("re").search(message, err[0])


def test_select_ranks_only_the_candidates_the_caller_offers(setup, tmp_path, capsys):
    """An autotuner offers each problem its own choices: the answer, the shortlist and the
    predictions are among them, whatever the model would rank above them."""
    dispatcher, device, problem = setup["dispatcher"], "V100-SXM2", PROBLEMS[5]
    everything = dispatcher.shortlist(problem, 10_000, device=device)
    offered = everything[3:9]                          # the model's top three not offered
    predicted = dispatcher.table_model.predict(problem, device)
    answer = dispatcher.select(problem, device=device, candidates=offered)
    assert answer in offered and answer not in everything[:3]
    guard = dispatcher.table_model.incumbent in offered
    assert guard or answer == max(offered, key=predicted.get)
    assert sorted(dispatcher.shortlist(problem, 50, device=device, candidates=offered)) == \
        sorted(offered)
    assert set(dispatcher.predict(problem, device=device, candidates=offered)) == set(offered)
    choice = dispatcher.choice(problem, device=device, candidates=offered)
    assert choice.kernel == answer and set(choice.shortlist) <= set(offered)
    # a mapping of the configuration columns names the same candidate
    values = dict(part.split("=") for part in offered[0].split(","))
    assert dispatcher.select(problem, device=device, candidates=[values]) == offered[0]
    # the command: ';'-separated keys, or a file of them
    base = ["select", "--registry", str(setup["registry"]), "--model", "mm", "--problem",
            ",".join(f"{k}={v}" for k, v in problem.items()), "--device", device]
    assert main([*base, "--candidates", ";".join(offered)]) == 0
    assert capsys.readouterr().out.strip() == answer
    (tmp_path / "offered.txt").write_text("\n".join(offered) + "\n")
    assert main([*base, "--candidates", f"@{tmp_path / 'offered.txt'}"]) == 0
    assert capsys.readouterr().out.strip() == answer


def test_a_candidate_the_model_never_saw_is_one_line(setup, capsys):
    dispatcher, device, problem = setup["dispatcher"], "V100-SXM2", PROBLEMS[5]
    known = dispatcher.shortlist(problem, 2, device=device)
    stranger = known[0].replace("=", "=9", 1)
    with pytest.raises(ProblemError, match=r"candidate '.*' was never measured ok in the "
                                           r"training data of mm: it cannot be ranked"):
        dispatcher.select(problem, device=device, candidates=[known[1], stranger])
    with pytest.raises(ProblemError, match="an empty list"):
        dispatcher.select(problem, device=device, candidates=[])
    base = ["select", "--registry", str(setup["registry"]), "--model", "mm", "--problem",
            ",".join(f"{k}={v}" for k, v in problem.items()), "--device", device]
    assert main([*base, "--candidates", stranger]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was never measured ok" in err[0]


def test_device_on_a_built_in_family_model_is_an_error(setup, capsys):
    gemm = get_family("gemm")
    hardware = {"threads": 2, "simd_bits": 256, "l1d_bytes": 32 << 10, "l2_bytes": 1 << 20,
                "l3_bytes": 8 << 20, "clock_mhz": 3000.0, "flags": ["avx2", "fma"]}
    engine = gemm.feature_engine(hardware)
    configs = gemm.candidate_space({"dtype": ["fp32"], "isa": ["avx2"], "parallel": ["m"],
                                    "tiles": ["6x16", "8x8"]}, hardware)
    problem = gemm.problem({"m": 64, "n": 64, "k": 64})
    X = engine.combine(problem, engine.problem_features(problem),
                       engine.kernel_features(configs), configs)
    booster = lightgbm.train({"verbose": -1, "min_data_in_leaf": 1}, lightgbm.Dataset(
        X, np.arange(len(X), dtype=float)), num_boost_round=2)
    names = [gemm.kernel_name(c) for c in configs]
    spec = {"family": "gemm", "feature_names": list(engine.feature_names()),
            "target_transform": "log1p_tflops", "hardware": hardware}
    registry.publish(setup["registry"], "gemm-tiny", {
        "model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
        "candidates.json": json.dumps({"family": "gemm", "kernels": names,
                                       "static_best": names[0]})},
        metrics={"mean_efficiency": 0.9, "p10_efficiency": 0.8})
    assert main(["select", "--registry", str(setup["registry"]), "--model", "gemm-tiny",
                 "--problem", "m=64,n=64,k=64", "--device", "T4"]) == 2
    assert "--device is for table models" in capsys.readouterr().err


def test_publish_gate_compares_held_out_picks(setup, capsys):
    root, registry_root = setup["root"], setup["registry"]
    # production trained without T4; the new model's out-of-fold T4 picks are held out too
    partial = root / "work-without-t4"
    assert main(["train", "--dataset", str(setup["dataset"]), "--workdir", str(partial),
                 "--rounds", ROUNDS, "--threads", THREADS, "--exclude-device", "T4"]) == 0
    assert main(["publish", "--workdir", str(partial), "--registry", str(registry_root),
                 "--model", "gated"]) == 0
    capsys.readouterr()
    assert main(["publish", "--workdir", str(setup["workdir"]), "--registry",
                 str(registry_root), "--model", "gated"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("gated: version 2 ") and "devices neither trained on: T4" in line
    # the same model again: production saw every device, so stored metrics decide
    assert main(["publish", "--workdir", str(setup["workdir"]), "--registry",
                 str(registry_root), "--model", "mm"]) == 0
    line = capsys.readouterr().out
    assert "mm: version 2 promoted" in line and "trained on every device" in line


def test_publish_without_a_trained_model_is_a_clear_error(setup, tmp_path, capsys):
    assert main(["publish", "--workdir", str(tmp_path), "--registry", str(setup["registry"]),
                 "--model", "mm"]) == 2
    assert "run `tilecast train --dataset DIR --workdir W` first" in capsys.readouterr().err


def test_a_table_model_is_served_as_it_is_without_a_class_warning(setup, caplog):
    """A table model answers per device, not per host class: no warning that it was
    published without one (the production alias is resolved before its spec is read)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="tilecast.registry"):
        assert registry.serving_name(setup["registry"], "mm") == "mm"
    assert "without a hardware class" not in caplog.text


def test_train_and_evaluate_take_a_formulation(setup, tmp_path, capsys):
    """--formulation lambdarank: trained, saved with it, loaded and answering; evaluate the
    same; a name that is none is one line."""
    work = tmp_path / "rank"
    assert main(["train", "--dataset", str(setup["dataset"]), "--workdir", str(work),
                 "--rounds", ROUNDS, "--threads", THREADS, "--formulation", "lambdarank"]) == 0
    spec = json.loads((work / "models" / "table" / "feature_spec.json").read_text())
    assert spec["formulation"] == "lambdarank"
    loaded = TableModel.load(work / "models" / "table")
    assert loaded.formulation == "lambdarank"
    assert set(loaded.predict(PROBLEMS[1], "T4")) <= set(loaded.candidates())
    capsys.readouterr()
    assert main(["train", "--dataset", str(setup["dataset"]), "--workdir", str(work),
                 "--formulation", "lambda"]) == 2
    assert "valid: log_efficiency, efficiency, lambdarank" in capsys.readouterr().err
