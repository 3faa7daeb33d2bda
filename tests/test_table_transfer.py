"""Cross-hardware evaluation of the table family: the confidence calibration behind "unsure",
the exact random best-of-k, `evaluate_transfer` on a small synthetic dataset whose times
follow a rule of the devices' real figures (shipped hardware table), and `tilecast transfer`
(and its old spelling `tilecast evaluate --dataset`) end to end with its error cases."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from tilecast.cli import main
from tilecast.table.confidence import (MIN_PROBLEMS, Calibration, fit_calibration, fit_margin,
                                       guarded, slack)
from tilecast.table.dataset import Column, TableDataset, TableSchema, finish_frame, write_dataset
from tilecast.table.devices import DeviceTable
from tilecast.table.transfer import TransferError, resolve_default, run_transfer
from tilecast.table.transfer_baselines import best_on_average, random_expectations

DEVICES = ("V100-SXM2", "A100-SXM4-80GB", "H100-SXM5-80GB", "MI250X")
SCHEMA = TableSchema(problem=(Column("m", "numeric"), Column("n", "numeric")),
                     config=(Column("block", "numeric"), Column("unroll", "numeric"),
                             Column("layout", "categorical")))
PROBLEMS = [(m, n) for m in (256, 1024, 4096) for n in (128, 512, 2048)]
CONFIGS = [(b, u, layout) for b in (16, 32, 64, 128, 256) for u in (1, 2, 4)
           for layout in ("row", "col")]
DEFAULT = "layout=row,block=64,unroll=1"        # any order: resolve_default spells it
ROUNDS = 30
THREADS = 1           # tiny data: one thread is faster, and immune to a busy machine
KS = ("1", "5", "20", "50")
FIGURES = {"mean_efficiency", "p10_efficiency", "min_efficiency", "top1"}
BLOCK_KEYS = {"n_problems", "median_efficiency", "top5", "shortlist", "shortlist_random",
              "unsure", "unmeasured_picks", "failed_picks", "baselines", "beats_default"} | FIGURES
BASELINES = {"most_similar_device", "best_on_average", "random", "plain_lightgbm", "default"}


# -- a dataset whose best configuration follows the devices' figures ------------------------

def _time(entry: dict, m: int, n: int, block: int, unroll: int, layout: str) -> float:
    """Seconds of one configuration: work over the device's peak, times the padding of m to
    whole blocks, times penalties away from the device's ideal block (from its shared memory)
    and unroll (from its warp size), and for the layout that does not match the shape."""
    ideal_block = math.log2(entry["shared_memory_kib"]) - 1.0
    ideal_unroll = 1.0 if entry["warp_size"] == 32 else 2.0
    work = 2.0 * m * n * 512 / (entry["peak_tflops"]["fp32"] * 1e12)
    padding = math.ceil(m / block) * block / m
    penalty = (math.exp(0.35 * (math.log2(block) - ideal_block) ** 2)
               * (1.0 + 0.12 * abs(math.log2(unroll) - ideal_unroll))
               * (1.0 if (layout == "row") == (m >= n) else 1.2))
    return work * padding * penalty


def _rows(devices=DEVICES, seed: int = 0) -> list[dict]:
    table, rng, rows = DeviceTable.load(), np.random.default_rng(seed), []
    for device in devices:
        entry = table.entry(device)
        for (m, n), (block, unroll, layout) in ((p, c) for p in PROBLEMS for c in CONFIGS):
            row = {"device": device, "m": m, "n": n, "block": block, "unroll": unroll,
                   "layout": layout, "status": "ok",
                   "median_s": _time(entry, m, n, block, unroll, layout)
                   * math.exp(rng.normal(0.0, 0.02))}
            if block == 256 and unroll == 4 and entry["shared_memory_kib"] < 100:
                row.update(status="build_failed", median_s=math.nan)
            rows.append(row)
    return rows


def _dataset(rows) -> TableDataset:
    return TableDataset(frame=finish_frame(rows, SCHEMA), schema=SCHEMA)


@pytest.fixture(scope="module")
def devices() -> DeviceTable:
    return DeviceTable.load()


@pytest.fixture(scope="module")
def transfer(devices):
    return run_transfer(_dataset(_rows()), devices, rounds=ROUNDS, threads=THREADS,
                        default=DEFAULT)


# -- confidence -----------------------------------------------------------------------------

def _outcomes(count: int, seed: int = 1):
    """Problems whose pick reaches 0.9 more often the wider its predicted margin."""
    rng = np.random.default_rng(seed)
    margins = rng.uniform(0.0, 1.0, count)
    scores = [np.array([1.0, math.exp(-m), 0.5 * math.exp(-m)]) for m in margins]
    reached = rng.uniform(size=count) < np.clip(margins * 2.0, 0.0, 1.0)
    efficiency = np.where(reached, rng.uniform(0.9, 1.0, count), rng.uniform(0.3, 0.89, count))
    return scores, efficiency, margins


def test_confidence_is_monotone_in_the_margin_and_the_threshold_honours_max_wrong():
    scores, efficiency, margins = _outcomes(600)
    calibration = fit_calibration(scores, efficiency, target=0.9, max_wrong=0.02)
    confidence = np.array([calibration.confidence(s) for s in scores])
    order = np.argsort(margins)
    assert np.all(np.diff(confidence[order]) >= -1e-12)
    assert confidence[order[0]] < 0.2 < 0.9 < confidence[order[-1]]
    sure = confidence >= calibration.threshold
    wrong = efficiency < 0.9
    assert np.mean(sure & wrong) <= 0.02
    assert 0.3 < sure.mean() < 0.8          # margins above ~0.5 always reach the target
    # the next lower confidence level would break the budget: the coverage is the largest
    lower = confidence[confidence < calibration.threshold]
    assert np.mean((confidence >= lower.max()) & wrong) > 0.02
    assert calibration.sure(scores[order[-1]]) and not calibration.sure(scores[order[0]])


def test_calibration_round_trips_through_json():
    scores, efficiency, _ = _outcomes(200, seed=2)
    calibration = fit_calibration(scores, efficiency, target=0.8, max_wrong=0.05)
    again = Calibration.from_json(json.loads(json.dumps(calibration.to_json())))
    assert again == calibration
    assert [again.confidence(s) for s in scores] == [calibration.confidence(s) for s in scores]


def test_calibrations_hold_both_cases_and_read_a_single_calibration_as_both():
    from tilecast.table.confidence import Calibrations

    scores, efficiency, _ = _outcomes(200, seed=2)
    new = fit_calibration(scores, efficiency, target=0.8, max_wrong=0.05)
    known = fit_calibration(scores, efficiency, target=0.9, max_wrong=0.02)
    both = Calibrations(new_device=new, known_device=known)
    again = Calibrations.from_json(json.loads(json.dumps(both.to_json())))
    assert again == both and again.for_device(True) == known and again.for_device(False) == new
    assert Calibrations.from_json(json.loads(json.dumps(
        Calibrations(new_device=new, known_device=None).to_json()))).known_device is None
    assert Calibrations.from_json(new.to_json()) == Calibrations(new, new)   # format 3 file
    with pytest.raises(ValueError, match="need new_device and known_device"):
        Calibrations.from_json({"new_device": None})


def test_the_guard_margin_keeps_the_incumbent_where_the_model_showed_no_gain():
    # picks predicted to gain little over the incumbent lost to it, large gains won
    gains = np.array([0.001, 0.005, 0.015, 0.03, 0.08, 0.3, np.nan])
    pick = np.array([0.6, 0.7, 0.8, 0.99, 1.0, 1.0, 0.5])
    incumbent = np.array([0.95, 0.95, 0.95, 0.95, 0.9, 0.5, 0.0])
    # twenty of each: means over the 120 with a gain: margin 0 -> 0.848, 0.01 -> 0.948,
    # 0.02 -> 0.973, 0.05 -> 0.967 (more than a standard error below), 0.1 and 0.2 -> 0.950,
    # 0.5 and inf -> 0.867
    margin, note = fit_margin(*(np.tile(values, 20) for values in (gains, pick, incumbent)))
    assert margin == 0.02
    assert "incumbent on 50% of 120" in note and "0.973" in note and "model alone 0.848" in note
    assert list(guarded(gains, margin)) == [True, True, True, False, False, False, False]
    # the model a little ahead on three picks is within a standard error: the incumbent; on
    # ninety it is a clear win, and the largest margin that keeps it is 0.2
    ahead = (np.full(3, 0.3), np.array([1.0, 0.9, 1.0]), np.full(3, 0.95))
    assert fit_margin(*ahead)[0] == math.inf
    assert fit_margin(*(np.tile(values, 30) for values in ahead))[0] == 0.2
    # no evidence either way: the larger margin, the incumbent keeps what the model cannot beat
    assert fit_margin(gains, np.full(7, 0.9), np.full(7, 0.9))[0] == math.inf
    assert fit_margin(np.full(3, np.nan), np.ones(3), np.ones(3)) == (
        0.0, "no held-out pick had the incumbent to choose: no guard")
    with pytest.raises(ValueError, match="one each"):
        fit_margin(gains[:3], pick, incumbent)


def test_the_confidence_is_fitted_to_the_guarded_answers():
    scores, efficiency, margins = _outcomes(200, seed=3)
    # every pick with a gain under 0.1 over an incumbent at 0.95 misses; the rest are the best
    gains = np.where(np.arange(200) % 2 == 0, 0.05, 0.4)
    efficiency = np.where(gains < 0.1, 0.5, 1.0)
    plain = fit_calibration(scores, efficiency)
    with_guard = fit_calibration(scores, efficiency, gains=gains,
                                 efficiency_of_incumbent=np.full(200, 0.95))
    # half the picks miss, whatever their slack: sure on a lucky few at most
    assert plain.margin == 0.0 and np.mean([plain.sure(s) for s in scores]) < 0.1
    # margins 0.1 and 0.2 both guard exactly the misses (mean 0.975): the larger; every
    # guarded answer reaches the target, so every one is sure
    assert with_guard.margin == 0.2
    assert all(with_guard.sure(s) for s in scores)
    again = Calibration.from_json(json.loads(json.dumps(with_guard.to_json(), allow_nan=False)))
    assert again == with_guard
    inf = Calibration.from_json({**with_guard.to_json(), "margin": None})
    assert inf.margin == math.inf
    older = {k: v for k, v in with_guard.to_json().items() if not k.startswith("margin")}
    assert Calibration.from_json(older).margin == 0.0      # a calibration from before the guard
    with pytest.raises(ValueError, match="margin -1.0 must be >= 0"):
        Calibration.from_json({**with_guard.to_json(), "margin": -1})


def test_too_little_data_answers_unsure_always_and_says_so():
    scores, efficiency, _ = _outcomes(MIN_PROBLEMS - 1)
    calibration = fit_calibration(scores, np.ones(len(scores)))
    assert calibration.threshold == math.inf and "too little calibration data" in calibration.note
    assert not calibration.sure(np.array([1.0, 0.01]))
    document = json.loads(json.dumps(calibration.to_json(), allow_nan=False))
    assert document["threshold"] is None
    assert Calibration.from_json(document).threshold == math.inf


def test_no_threshold_when_every_pick_misses():
    scores, _, _ = _outcomes(100)
    calibration = fit_calibration(scores, np.full(100, 0.5))
    assert calibration.threshold == math.inf and "every pick answers unsure" in calibration.note


def test_with_devices_as_groups_the_worst_device_sets_the_threshold():
    scores, efficiency, margins = _outcomes(600)
    # a fourth "device" whose wide-margin picks all miss: pooled, its misses hide among the
    # other devices' hits; by device, no level may let them through
    groups = np.array(["a", "b", "c"] * 200)
    bad = margins > 0.6
    efficiency = np.where(bad & (np.arange(600) % 7 == 0), 0.5, efficiency)
    groups = np.where(bad & (np.arange(600) % 7 == 0), "d", groups)
    grouped = fit_calibration(scores, efficiency, target=0.9, max_wrong=0.02, groups=groups)
    pooled = fit_calibration(scores, efficiency, target=0.9, max_wrong=0.02)
    wrong = np.asarray(efficiency) < 0.9
    for label in "abcd":
        members = groups == label
        sure = np.array([grouped.sure(s) for s in np.array(scores, dtype=object)[members]])
        assert np.sum(sure & wrong[members]) <= 0.02 * members.sum() + 1e-9, label
    coverage = lambda c: np.mean([c.sure(s) for s in scores])   # noqa: E731
    assert coverage(grouped) < coverage(pooled)
    two = fit_calibration(scores, efficiency, groups=np.where(groups == "a", "a", "b"))
    assert two.threshold == math.inf and "need 3" in two.note


def test_slack_reads_one_problem_and_refuses_nonsense():
    assert slack(np.array([0.5, 1.0])) == pytest.approx(2 * math.log(1.0) - math.log(0.5))
    assert slack(np.array([0.8])) == pytest.approx(math.log(0.8) + 1.0)
    for bad in (np.array([]), np.array([1.0, math.nan])):
        with pytest.raises(ValueError):
            slack(bad)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0), st.floats(0.0, 1.0)),
                min_size=MIN_PROBLEMS, max_size=120),
       st.sampled_from([0.0, 0.02, 0.1]))
def test_threshold_never_exceeds_the_wrong_budget(cases, max_wrong):
    scores = [np.array([a, b]) for a, b, _ in cases]
    efficiency = [e for _, _, e in cases]
    calibration = fit_calibration(scores, efficiency, target=0.9, max_wrong=max_wrong)
    sure = np.array([calibration.sure(s) for s in scores])
    assert np.sum(sure & (np.array(efficiency) < 0.9)) <= max_wrong * len(cases) + 1e-9


# -- random best-of-k -----------------------------------------------------------------------

def test_random_best_of_k_is_exact():
    efficiency = pd.DataFrame({"a": [0.2, 0.5], "b": [0.5, 1.0], "c": [1.0, np.nan]},
                              index=pd.Index(["p", "q"], name="dims_key"))
    expected = random_expectations(efficiency, (1, 2, 3), tie=0.99)
    assert expected.loc["p", "random"] == pytest.approx(1.7 / 3)
    assert expected.loc["p", "random_best_of_2"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    assert expected.loc["p", "random_best_of_3"] == 1.0
    assert expected.loc["q", "random_best_of_2"] == 1.0       # only two ran on q
    assert expected.loc["p", "random_top1"] == pytest.approx(1 / 3)


# -- evaluate_transfer ----------------------------------------------------------------------

def test_report_has_the_issue_shape(transfer):
    report = transfer.report
    assert set(report["devices"]) == set(DEVICES)
    for block in [report["overall"], *report["devices"].values()]:
        assert BLOCK_KEYS <= set(block)
        assert list(block["shortlist"]) == list(KS) == list(block["shortlist_random"])
        assert set(block["unsure"]) == {"coverage", "precision", "confident_wrong"}
        assert set(block["baselines"]) == BASELINES
        for figures in block["baselines"].values():
            assert FIGURES <= set(figures)
            assert 0.0 <= figures["min_efficiency"] <= figures["mean_efficiency"] <= 1.0
    assert report["overall"]["n_problems"] == len(DEVICES) * len(PROBLEMS)
    assert report["overall"]["devices_beating_default"] == sum(
        d["beats_default"] for d in report["devices"].values())
    assert report["overall"]["baselines"]["default"]["kernel"] == "block=64,unroll=1,layout=row"
    # plain JSON: no NaN, no numpy scalars (json.dumps has no fallback for them)
    assert json.loads(json.dumps(report, allow_nan=False)) == report


def test_figures_are_efficiencies_and_shortlists_grow(transfer):
    for block in [transfer.report["overall"], *transfer.report["devices"].values()]:
        assert 0.0 <= block["min_efficiency"] <= block["p10_efficiency"] \
            <= block["mean_efficiency"] <= 1.0
        assert block["top1"] <= block["top5"]
        for curve in (block["shortlist"], block["shortlist_random"]):
            values = [curve[k] for k in KS]
            assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
            assert values[-1] == pytest.approx(1.0)            # 50 >= the 30 configurations
        assert block["shortlist"]["1"] == pytest.approx(block["mean_efficiency"])
        assert block["shortlist_random"]["1"] == pytest.approx(
            block["baselines"]["random"]["mean_efficiency"])
        unsure = block["unsure"]
        assert 0.0 <= unsure["confident_wrong"] <= unsure["coverage"] <= 1.0
        if unsure["precision"] is not None:
            assert unsure["confident_wrong"] == pytest.approx(
                unsure["coverage"] * (1.0 - unsure["precision"]))
    rows = transfer.per_problem
    assert len(rows) == len(DEVICES) * len(PROBLEMS)
    assert rows["efficiency"].between(0.0, 1.0).all()
    # a pick without an ok time scores 0 and is counted
    assert (rows.loc[~rows["pick_measured"], "efficiency"] == 0.0).all()
    assert transfer.report["overall"]["unmeasured_picks"] == int((~rows["pick_measured"]).sum())


class RuleModel:
    """A perfect model of the dataset: predicts with its noise-free rule (from the device
    table, never from measurements), so what the evaluation reports is the pipeline's doing."""

    def __init__(self, dataset, exclude_devices):
        frame = dataset.frame[~dataset.frame["device"].isin(exclude_devices)]
        self._candidates = sorted(set(frame.loc[frame["status"] == "ok", "kernel"]))
        self._table = DeviceTable.load()
        # as TableModel's: the guard must leave a perfect model's picks alone
        self.incumbent = best_on_average(frame[frame["status"] == "ok"], self._candidates)

    @classmethod
    def fit(cls, dataset, devices, *, exclude_devices=(), **options):
        return cls(dataset, exclude_devices)

    def candidates(self):
        return list(self._candidates)

    def failed_on(self, device):
        return set()

    def beyond(self, device):
        return []          # the rule knows every device: nothing is an extrapolation

    def predict_many(self, frame):
        times = np.array([_time(self._table.entry(r.device), r.m, r.n, r.block, r.unroll,
                                r.layout) for r in frame.itertuples()])
        best = pd.Series(times).groupby(frame["dims_key"].to_numpy()).transform("min")
        return best.to_numpy() / times


class BlindModel(RuleModel):
    """A model that knows nothing: seeded random predictions."""

    def predict_many(self, frame):
        return np.random.default_rng(len(frame)).uniform(0.1, 1.0, len(frame))


def test_a_blind_model_keeps_the_near_best_incumbent(devices, monkeypatch):
    from tilecast.table import model

    monkeypatch.setattr(model, "TableModel", BlindModel)
    # a vendor configuration 2-4 % behind the best on every device and problem
    rows, rng = _rows(), np.random.default_rng(5)
    best = pd.DataFrame(rows).query("status == 'ok'").groupby(["device", "m", "n"])["median_s"].min()
    rows += [{"device": d, "m": m, "n": n, "block": 1, "unroll": 1, "layout": "vendor",
              "status": "ok", "median_s": t * rng.uniform(1.02, 1.04)} for (d, m, n), t in best.items()]
    vendor = "block=1,unroll=1,layout=vendor"
    result = run_transfer(_dataset(rows), devices, rounds=ROUNDS, threads=THREADS, default=vendor)
    overall, table = result.report["overall"], result.per_problem
    assert set(table["incumbent"]) == {vendor}         # best on average on every fold
    # inner picks showed the blind top predictions far behind: the incumbent everywhere
    assert overall["incumbent"]["share"] == 1.0 and overall["incumbent"]["model_alone"] < 0.8
    assert (table["pick"] == vendor).all() and table["guarded"].all()
    assert np.allclose(table["efficiency"], table["incumbent_efficiency"])
    assert np.allclose(table["shortlist_1"], table["efficiency"])
    assert overall["mean_efficiency"] == pytest.approx(
        overall["baselines"]["default"]["mean_efficiency"])
    assert all(fold["margin"] is None for block in result.report["devices"].values()
               for fold in block["folds"])                          # inf, written as null


def test_a_perfect_model_scores_near_one_and_is_sure(devices, monkeypatch):
    from tilecast.table import model

    monkeypatch.setattr(model, "TableModel", RuleModel)
    result = run_transfer(_dataset(_rows()), devices, rounds=ROUNDS, threads=THREADS)
    overall = result.report["overall"]
    assert overall["mean_efficiency"] > 0.95 and overall["top5"] > 0.9
    for name, figures in overall["baselines"].items():
        assert overall["mean_efficiency"] >= figures["mean_efficiency"] - 0.02, name
    assert overall["baselines"]["random"]["mean_efficiency"] < 0.8
    # the guard left the perfect top predictions alone (or took an incumbent as good)
    assert overall["mean_efficiency"] >= overall["incumbent"]["model_alone"] - 1e-9
    # every calibration pick reached the target: sure everywhere, as often right as the picks
    unsure = overall["unsure"]
    assert unsure["coverage"] == 1.0
    assert unsure["confident_wrong"] == pytest.approx(float(np.mean(
        result.per_problem["efficiency"] < 0.9)))


def test_most_similar_device_is_the_nearest_training_device(transfer, devices):
    for device, block in transfer.report["devices"].items():
        others = [d for d in DEVICES if d != device]
        nearest = min(sorted(others), key=lambda d: devices.distance(device, d))
        assert block["baselines"]["most_similar_device"]["devices"] == [nearest]
        assert block["folds"][0]["trained_on"] == sorted(others)


def test_a_held_out_device_never_sees_its_own_measurements(transfer, devices):
    """Scale the held-out device's times by random factors (a different oracle there): its
    picks and their confidences must not move, while its efficiencies do."""
    held_out = "A100-SXM4-80GB"
    rng = np.random.default_rng(7)
    rows = [dict(row, median_s=row["median_s"] * rng.uniform(0.3, 3.0))
            if row["device"] == held_out else row for row in _rows()]
    perturbed = run_transfer(_dataset(rows), devices, rounds=ROUNDS, threads=THREADS,
                             default=DEFAULT)

    def of(result):
        table = result.per_problem
        return table[table["device"] == held_out].set_index("dims_key").sort_index()

    before, after = of(transfer), of(perturbed)
    for picks in ("pick", "most_similar_device_pick", "best_on_average_pick",
                  "plain_lightgbm_pick"):
        assert list(after[picks]) == list(before[picks]), picks
    np.testing.assert_allclose(after["confidence"], before["confidence"])
    assert not np.allclose(after["efficiency"], before["efficiency"])


def test_problem_split_has_the_same_shape(devices):
    """--split problems: problem folds held out on every device, same JSON shape."""
    result = run_transfer(_dataset(_rows(DEVICES[:2])), devices, split="problems",
                          rounds=ROUNDS, threads=THREADS)
    report = result.report
    assert set(report["devices"]) == set(DEVICES[:2])
    assert report["overall"]["n_problems"] == 2 * len(PROBLEMS)
    for block in [report["overall"], *report["devices"].values()]:
        assert (BLOCK_KEYS - {"beats_default"}) <= set(block)
        assert set(block["baselines"]) == BASELINES - {"default"}
    for block in report["devices"].values():
        assert len(block["folds"]) == 5 and block["n_problems"] == len(PROBLEMS)
        assert all(f["trained_on"] == sorted(DEVICES[:2]) for f in block["folds"])
    folds_of = result.per_problem.groupby("dims_key")["fold"]
    assert (folds_of.nunique() == 1).all() and folds_of.first().nunique() == 5


def test_nothing_to_hold_out_with_one_device(devices):
    with pytest.raises(TransferError, match=r"1 device\(s\).*nothing to hold out"):
        run_transfer(_dataset(_rows(DEVICES[:1])), devices, rounds=ROUNDS, threads=THREADS)


def test_default_is_any_spelling_of_a_dataset_configuration():
    dataset = _dataset(_rows(DEVICES[:1]))
    assert resolve_default(dataset, "unroll=2,layout=col,block=16") == \
        "block=16,unroll=2,layout=col"
    for bad, needle in [("block=16", "every configuration column"),
                        ("block=17,unroll=2,layout=col", "not a configuration")]:
        with pytest.raises(TransferError, match=needle):
            resolve_default(dataset, bad)


# -- tilecast transfer (and the old spelling, tilecast evaluate --dataset) -------------------

DEPRECATED = "tilecast evaluate: --dataset is deprecated"


def _write(tmp_path, devices=DEVICES):
    frame = finish_frame(_rows(devices), SCHEMA)
    return write_dataset(tmp_path / f"dataset{len(devices)}", frame, SCHEMA, [])


@pytest.mark.parametrize("command", ["transfer", "evaluate"])
def test_cli_writes_the_report(tmp_path, capsys, command):
    dataset, workdir = _write(tmp_path, DEVICES[:3]), tmp_path / "w"
    status = main([command, "--dataset", str(dataset), "--split", "leave-one-device-out",
                   "--workdir", str(workdir), "--rounds", str(ROUNDS), "--threads", str(THREADS),
                   "--default", DEFAULT])
    assert status == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "mean efficiency" in out and "most similar device" in out
    # the old spelling runs the same command and says, in one line, what replaced it
    notices = [line for line in captured.err.splitlines() if DEPRECATED in line]
    assert len(notices) == (command == "evaluate")
    assert all("use `tilecast transfer --dataset" in line for line in notices)
    report = json.loads((workdir / "report" / "transfer.json").read_text())
    assert set(report["devices"]) == set(DEVICES[:3])
    assert BLOCK_KEYS | {"devices_beating_default"} <= set(report["overall"])
    markdown = (workdir / "report" / "transfer.md").read_text()
    for needle in ("## Overall", "## Shortlist", "## Unsure", "## Per device", "plain LightGBM",
                   *DEVICES[:3]):
        assert needle in markdown
    rows = pd.read_parquet(workdir / "report" / "transfer_per_problem.parquet")
    assert len(rows) == 3 * len(PROBLEMS)


def _paths(tmp_path) -> dict:
    return {"one": _write(tmp_path, DEVICES[:1]), "four": _write(tmp_path),
            "missing": tmp_path / "nowhere", "workdir": tmp_path}


@pytest.mark.parametrize("command", ["transfer", "evaluate"])
@pytest.mark.parametrize("arguments, needle", [
    (["--dataset", "{one}"], "nothing to hold out"),
    (["--dataset", "{four}", "--default", "block=3,unroll=1,layout=row"], "not a configuration"),
    (["--dataset", "{four}", "--rounds", "0"], "--rounds 0"),
    (["--dataset", "{four}", "--split", "random"], "unknown split 'random'"),
    (["--dataset", "{missing}"], "does not exist"),
    (["--dataset", "{workdir}"], "not an imported dataset"),
])
def test_cli_names_what_is_wrong(tmp_path, capsys, command, arguments, needle):
    arguments = [a.format(**_paths(tmp_path)) for a in arguments]
    status = main([command, *arguments, "--workdir", str(tmp_path / "w")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and error.startswith(f"tilecast {command}: error: ") and needle in error
    assert not (tmp_path / "w" / "report").exists()


@pytest.mark.parametrize("arguments, needle", [
    (["--model", "m", "--dataset", "D"], "--model and --dataset belong to different modes"),
    (["--problems", "p.yaml"], "--model missing"),
    ([], "--model and --problems missing"),
    (["--split", "problems"], "--split need(s) --dataset"),
])
def test_evaluate_names_options_of_the_two_spellings_mixed_or_missing(tmp_path, capsys,
                                                                     arguments, needle):
    status = main(["evaluate", *arguments, "--workdir", str(tmp_path / "w")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and error.startswith("tilecast evaluate: error: ") and needle in error
    assert not (tmp_path / "w" / "report").exists()


def test_transfer_requires_a_dataset(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["transfer", "--workdir", str(tmp_path / "w")])
    assert exit_.value.code == 2
    assert "the following arguments are required: --dataset" in capsys.readouterr().err


def test_the_model_and_the_baselines_choose_among_what_the_held_out_device_ran(devices):
    # MI250X's cache covers only the row layout (as devices' caches of one kernel often cover
    # different spaces): a col pick there could not be scored, so none may be made
    rows = [r for r in _rows() if not (r["device"] == "MI250X" and r["layout"] == "col")]
    table = run_transfer(_dataset(rows), devices, rounds=ROUNDS, threads=THREADS).per_problem
    held_out = table[table["device"] == "MI250X"]
    picks = pd.concat([held_out[column] for column in held_out.columns
                       if column == "pick" or column.endswith("_pick")])
    assert len(held_out) == len(PROBLEMS) and not picks.str.contains("layout=col").any()
    assert held_out["pick_measured"].all()


def test_a_choice_never_offered_for_a_problem_is_no_choice_there(devices):
    """An autotuner offers each problem its own choices: a configuration far ahead wherever
    it was offered, and offered for half the problems, is never picked, shortlisted or
    scored where it was not; there every figure is among the offered ones."""
    rows, magic = _rows(DEVICES[:3]), "block=1,unroll=1,layout=magic"
    best = pd.DataFrame(rows).query("status == 'ok'").groupby(["device", "m", "n"])["median_s"].min()
    offered_on = {p for i, p in enumerate(PROBLEMS) if i % 2 == 0}
    rows += [{"device": d, "m": m, "n": n, "block": 1, "unroll": 1, "layout": "magic",
              "status": "ok", "median_s": t / 3.0}
             for (d, m, n), t in best.items() if (m, n) in offered_on]
    result = run_transfer(_dataset(rows), devices, rounds=ROUNDS, threads=THREADS)
    table = result.per_problem
    has_magic = table["dims_key"].isin({f"m={m},n={n}" for m, n in offered_on})
    assert has_magic.any() and (~has_magic).any()
    absent = table[~has_magic]
    for column in ("pick", "model_pick", "best_on_average_pick", "most_similar_device_pick",
                   "plain_lightgbm_pick"):
        assert (absent[column] != magic).all(), column
    # every configuration is a candidate in every fold: offered = the problem's records there
    records = _dataset(rows).frame.groupby(["device", "dims_key"]).size()
    expected = [records[(d, k)] for d, k in zip(table["device"], table["dims_key"])]
    assert list(table["offered"]) == expected
    assert set(table.loc[has_magic, "offered"]) == {len(CONFIGS) + 1}
    # where it was not offered the oracle is the offered best: the picks score as before
    assert absent["pick_measured"].all() and (absent["efficiency"] > 0).all()
    # where offered, the model learned it wins
    assert (table.loc[has_magic, "model_pick"] == magic).mean() > 0.8


def test_sources_split_holds_out_each_files_problems(devices):
    """--split sources: a workload the model never saw (each file's problems in turn)."""
    rows = _rows(DEVICES[:2])
    for row in rows:
        row["source"] = "hf.txt" if row["m"] <= 1024 else "timm.txt"
    result = run_transfer(_dataset(rows), devices, split="sources", rounds=ROUNDS,
                          threads=THREADS)
    table = result.per_problem
    assert sorted(table["fold"].unique()) == [1, 2]
    small = table["dims_key"].str.contains(r"m=(?:256|1024),")
    assert table.loc[small, "fold"].eq(1).all() and table.loc[~small, "fold"].eq(2).all()
    assert result.report["overall"]["n_problems"] == 2 * len(PROBLEMS)
    with pytest.raises(TransferError, match="needs 2 or more"):
        run_transfer(_dataset(_rows(DEVICES[:2])), devices, split="sources", rounds=ROUNDS,
                     threads=THREADS)


def test_a_device_held_out_from_one_training_device_gets_the_incumbent_unsure(devices):
    """With one training device nothing calibrates a pick on a new device: the answer is
    the incumbent, unsure, as the dispatcher gives it; the shortlist still ranks."""
    result = run_transfer(_dataset(_rows(DEVICES[:2])), devices, rounds=ROUNDS,
                          threads=THREADS, default=DEFAULT)
    table = result.per_problem
    assert (table["pick"] == table["incumbent"]).all() and not table["sure"].any()
    for block in result.report["devices"].values():
        assert block["unsure"]["coverage"] == 0.0
        assert block["folds"][0]["method"] == "none" and "one training device" in \
            block["folds"][0]["note"]
    assert (table["shortlist_5"] >= table["efficiency"]).all()
