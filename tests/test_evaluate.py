"""Tests for tilecast.stages.evaluate, tilecast.stages.report and tilecast.core.atomic on hand-built tables.

A stub predictor returns predictions we choose, so every metric has a hand-computed answer.
Kernels K0..K5 are six real fp32 GEMM kernel names (sorted); BF16 is a bf16 kernel that is
a candidate but never applicable to the fp32 problems (the stub fails if asked to score it).
"""
import json

import numpy as np
import pandas as pd
import pytest

from tilecast.core import hardware
from tilecast.stages.evaluate import Evaluation, evaluate, peer_ratios, static_best
from tilecast.families import GEMM
from tilecast.core.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from tilecast.stages.report import write_report

HW = {**hardware.profile(2), "flags": ["avx2", "avx512_bf16", "avx512f", "fma"]}
ENGINE = GEMM.feature_engine(HW)
K = sorted(GEMM.kernel_name(c) for c in GEMM.candidate_space(
    {"isa": ["avx512"], "tiles": ["8x32", "6x48", "4x64"], "parallel": ["m", "n"]}, HW))
BF16 = GEMM.kernel_name(GEMM.candidate_space(
    {"dtype": ["bf16"], "isa": ["avx512"], "tiles": ["14x32"], "parallel": ["k"]}, HW)[0])
CANDIDATES = [*K, BF16]

P = {name: GEMM.problem({"m": m, "n": n, "k": k}) for name, m, n, k in (
    ("P1", 64, 64, 64), ("P2", 128, 96, 32), ("P3", 200, 300, 100), ("P4", 512, 80, 256),
    ("P5", 33, 33, 33), ("T1", 256, 256, 256), ("T2", 100, 700, 50), ("T3", 640, 48, 512))}
KEY = {name: GEMM.dims_key(p) for name, p in P.items()}
FAILED = None    # a row with status timeout and no TFLOP/s
ABSENT = "absent"  # no row at all

HOLDOUT = {"P1": [10, 8, 6, 4, 2, 1], "P2": [5, 10, 8, FAILED, 4, 2],
           "P3": [4, 5, 6, 7, 8, 10], "P4": [3, 10, 9, 3, 3, 3], "P5": [FAILED] * 6}
TRAIN = {"T1": [10, 5, 9, 1, 1, 1], "T2": [ABSENT, 10, 9, 1, 1, 1], "T3": [10, 10, 9, 1, 1, 1]}
# Stub predictions (higher is better) per problem, for K0..K5.
PREDICTED = {"P1": [6, 5, 4, 3, 2, 1], "P2": [3, 5, 4, 6, 2, 1], "P3": [2, 3, 4, 5, 6, 1],
             "P4": [1, 5, 6, 0, 0, 0], "P5": [1, 2, 3, 4, 5, 6]}


def make_final(table: dict, problem_set: str) -> pd.DataFrame:
    rows = []
    for name, values in table.items():
        problem = P[name]
        for kernel, tflops in zip(K, values):
            if tflops == ABSENT:
                continue
            ok = tflops is not FAILED
            rows.append({**GEMM.problem_dict(problem), "dims_key": KEY[name], "kernel": kernel,
                         "status": "ok" if ok else "timeout",
                         "tflops": float(tflops) if ok else np.nan,
                         "median_s": GEMM.flops(problem) / (tflops * 1e12) if ok else np.nan,
                         "problem_set": problem_set, "role": "candidate", "phase": "screen",
                         "time": 1.0})
    return pd.DataFrame(rows)


class StubPredictor:
    """Returns PREDICTED, recovering (problem, kernel) of each row from its features."""

    def __init__(self):
        names = ENGINE.feature_names()
        self.columns = [names.index(c) for c in ("m", "n", "k", "mr", "nr", "par_m", "par_n")]
        self.problems = {(p.m, p.n, p.k): name for name, p in P.items()}
        self.kernels = {}
        for index, kernel in enumerate(K):
            cfg = GEMM.parse_name(kernel)
            self.kernels[(cfg.mr, cfg.nr, cfg.parallel == "m", cfg.parallel == "n")] = index
        self.calls = 0

    def predict_tflops(self, X):
        self.calls += 1
        out = []
        for m, n, k, mr, nr, par_m, par_n in X[:, self.columns]:
            problem = self.problems[(int(m), int(n), int(k))]
            kernel = self.kernels[(int(mr), int(nr), bool(par_m), bool(par_n))]  # KeyError: BF16
            out.append(PREDICTED[problem][kernel])
        return np.array(out, dtype=float)


@pytest.fixture
def evaluation():
    return evaluate(GEMM, ENGINE, StubPredictor(), make_final(HOLDOUT, "holdout"),
                    make_final(TRAIN, "train"), CANDIDATES, tie_threshold_pct=0.0)


def test_metrics_match_hand_computed_values(evaluation):
    m = evaluation.metrics
    assert set(m) == {"n_problems", "mean_efficiency", "median_efficiency", "p10_efficiency",
                      "min_efficiency", "top1", "top5", "top1_tie", "static_best",
                      "margin_over_static_best"}
    # efficiencies P1..P4: 10/10, 0 (pick K3 timed out), 8/10, 9/10; P5 has no valid kernel
    assert m["n_problems"] == 4
    assert m["mean_efficiency"] == pytest.approx(0.675)
    assert m["median_efficiency"] == pytest.approx(0.85)
    assert m["p10_efficiency"] == pytest.approx(0.24)
    assert m["min_efficiency"] == 0.0
    assert (m["top1"], m["top5"], m["top1_tie"]) == (0.25, 0.75, 0.25)
    # K2 never wins a training problem but is the most consistent (K0 would win if the
    # missing T2 measurement were skipped instead of counted as 0)
    assert m["static_best"] == {"kernel": K[2], "mean_efficiency": pytest.approx(0.725)}
    assert m["margin_over_static_best"] == pytest.approx(-0.05)


def test_per_problem_table(evaluation):
    keys = [KEY[p] for p in ("P1", "P2", "P3", "P4")]
    table = evaluation.per_problem.set_index("dims_key").loc[keys]
    assert {"m", "n", "k", "dtype", "layout_a", "layout_b"} <= set(table.columns)
    assert list(table["chosen_kernel"]) == [K[0], K[3], K[4], K[2]]
    assert list(table["chosen_tflops"]) == [10.0, 0.0, 8.0, 9.0]
    assert list(table["best_kernel"]) == [K[0], K[1], K[5], K[1]]
    assert list(table["best_tflops"]) == [10.0] * 4
    assert list(table["efficiency"]) == pytest.approx([1.0, 0.0, 0.8, 0.9])
    assert list(table["static_best_efficiency"]) == pytest.approx([0.6, 0.8, 0.6, 0.9])
    assert list(table["winner_rank"]) == [1, 2, 6, 2]


def test_practical_ties_change_winner_and_tie_hits():
    # at 15 %, P4's K2 (9 TFLOP/s) ties K1 (10): K1 stays the winner (smaller name) and the
    # model's pick K2 is in its tie set; no other problem has a tie
    result = evaluate(GEMM, ENGINE, StubPredictor(), make_final(HOLDOUT, "holdout"),
                      make_final(TRAIN, "train"), CANDIDATES, tie_threshold_pct=15.0)
    assert (result.metrics["top1"], result.metrics["top1_tie"]) == (0.25, 0.5)


def test_static_best_counts_missing_measurements_as_zero():
    kernel, mean = static_best(make_final(TRAIN, "train"), CANDIDATES)
    assert (kernel, mean) == (K[2], pytest.approx(0.9))
    kernel, mean = static_best(make_final({"T1": TRAIN["T1"], "T3": TRAIN["T3"]}, "train"), K)
    assert (kernel, mean) == (K[0], pytest.approx(1.0))


def test_holdout_overlapping_training_is_rejected():
    train = make_final({**TRAIN, "P3": HOLDOUT["P3"]}, "train")
    with pytest.raises(ValueError, match=f"holdout problem '{KEY['P3']}'"):
        evaluate(GEMM, ENGINE, StubPredictor(), make_final(HOLDOUT, "holdout"), train,
                 CANDIDATES, tie_threshold_pct=0.0)


def test_no_applicable_candidate_is_an_error():
    with pytest.raises(ValueError, match="no candidate kernel is applicable"):
        evaluate(GEMM, ENGINE, StubPredictor(), make_final(HOLDOUT, "holdout"),
                 make_final(TRAIN, "train"), [BF16], tie_threshold_pct=0.0)


def make_records() -> pd.DataFrame:
    """Candidates and peer rows for three problems; see test_peer_ratios for the answers."""
    final = make_final({"T1": TRAIN["T1"], "T2": [ABSENT, 4, 2, 1, 1, 1]}, "train")
    final = pd.concat([final, make_final({"P1": [6, 1, 1, 1, 1, 1]}, "holdout")])
    confirm = final[(final["dims_key"] == KEY["T1"]) & (final["kernel"] == K[0])].assign(
        phase="confirm", time=2.0)
    final.loc[(final["dims_key"] == KEY["T1"]) & (final["kernel"] == K[0]), "tflops"] = 20.0
    peers = []
    for name, tflops, status, time in (("T1", 5.0, "ok", 3.0), ("T1", 1.0, "ok", 0.5),
                                       ("T1", 50.0, "crashed", 4.0), ("T2", 8.0, "ok", 1.0),
                                       ("P1", 3.0, "ok", 1.0)):
        problem_set = "holdout" if name == "P1" else "train"
        peers.append({**GEMM.problem_dict(P[name]), "dims_key": KEY[name],
                      "kernel": "torch.matmul", "status": status, "tflops": tflops,
                      "median_s": 1.0, "problem_set": problem_set, "role": "peer",
                      "phase": "screen", "time": time})
    return pd.concat([final, confirm, pd.DataFrame(peers)], ignore_index=True)


def test_peer_ratios():
    # best candidates (confirm beats the 20 TFLOP/s screen of K0 on T1): T1 10, T2 4, P1 6;
    # latest ok peer: T1 5, T2 8, P1 3 -> ratios 2, 0.5 (train), 2 (holdout)
    result = peer_ratios(make_records(), GEMM)
    assert set(result["problem_sets"]) == {"train", "holdout"}
    assert result["problem_sets"]["train"] == {"n_problems": 2, "geomean_ratio": pytest.approx(1.0),
                                               "min_ratio": 0.5, "max_ratio": 2.0}
    assert result["problem_sets"]["holdout"]["geomean_ratio"] == pytest.approx(2.0)
    table = result["per_problem"].set_index("dims_key")
    assert table.loc[KEY["T1"], "best_tflops"] == 10.0
    assert table.loc[KEY["T1"], "peer_tflops"] == 5.0
    records = make_records()
    assert peer_ratios(records[records["role"] == "candidate"], GEMM) == {}


def test_write_report(evaluation, tmp_path):
    peer = peer_ratios(make_records(), GEMM)
    cv = {"folds": [{"fold": 0}], "mean_rmse": 0.1, "mean_efficiency": 0.9}
    directory = write_report(tmp_path, {"gemm_fp32": (evaluation, {"cv": cv})}, peer)
    assert directory == tmp_path / "report"
    assert sorted(p.name for p in directory.iterdir()) == [
        "efficiency_gemm_fp32.png", "evaluation.json", "report.md"]
    entry = json.loads((directory / "evaluation.json").read_text())["models"]["gemm_fp32"]
    for key in ("n_problems", "mean_efficiency", "median_efficiency", "p10_efficiency",
                "min_efficiency", "top1", "top5"):
        assert entry[key] == evaluation.metrics[key]
    assert entry["static_best"] == {"kernel": K[2], "mean_efficiency": pytest.approx(0.725)}
    assert entry["cv"] == cv and entry["peer"]["train"]["n_problems"] == 2
    markdown = (directory / "report.md").read_text()
    worst = markdown.split("### Worst 10 problems")[1]
    assert worst.index(KEY["P2"]) < worst.index(KEY["P3"]) < worst.index(KEY["P1"])
    assert f"static best `{K[2]}`" in markdown and "| -0.0500 |" in markdown
    assert "| train | 2 | 1.0000 |" in markdown
    assert (directory / "efficiency_gemm_fp32.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="'../evil'"):
        write_report(tmp_path, {"../evil": (evaluation, {})}, {})


def test_atomic_writes_replace_whole_files_and_clean_up(tmp_path):
    target = tmp_path / "out.json"
    atomic_write_text(target, "old")
    atomic_write_json(target, {"a": np.float64(1.5), "b": np.arange(2)})
    assert json.loads(target.read_text()) == {"a": 1.5, "b": [0, 1]}
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")
    with pytest.raises(ValueError):
        atomic_write_json(target, {"a": float("nan")})
    assert json.loads(target.read_text()) == {"a": 1.5, "b": [0, 1]}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_write_text(tmp_path / "missing" / "x.txt", "x")


def test_evaluation_is_a_value_object(evaluation):
    assert isinstance(evaluation, Evaluation)
    assert list(evaluation.per_problem.columns) == [
        "dims_key", *GEMM.problem_fields, "chosen_kernel", "chosen_tflops", "best_kernel",
        "best_tflops", "efficiency", "static_best_efficiency", "winner_rank"]


def test_slice_metrics_group_problems_by_the_familys_tags():
    from tilecast.stages.evaluate import slice_metrics
    from tilecast.families import get_family

    gemm = get_family("gemm")
    table = pd.DataFrame([
        {"m": 1, "n": 768, "k": 768, "dtype": "fp32", "layout_a": "row", "layout_b": "row",
         "efficiency": 0.5, "winner_rank": 1, "static_best_efficiency": 0.25},
        {"m": 512, "n": 512, "k": 512, "dtype": "fp32", "layout_a": "col", "layout_b": "row",
         "efficiency": 1.0, "winner_rank": 3, "static_best_efficiency": 0.75},
        {"m": 100, "n": 64, "k": 64, "dtype": "fp32", "layout_a": "row", "layout_b": "row",
         "efficiency": 0.8, "winner_rank": 1, "static_best_efficiency": 0.5}])
    table["winner_rank"] = table["winner_rank"].astype("Int64")
    slices = slice_metrics(gemm, table)
    assert set(slices) == {"skinny", "wide", "non_pow2", "col_major"}
    assert slices["skinny"] == {"n_problems": 1, "mean_efficiency": 0.5, "p10_efficiency": 0.5,
                                "top1": 1.0, "static_best_mean_efficiency": 0.25}
    assert slices["wide"]["n_problems"] == 2 and slices["wide"]["mean_efficiency"] == 0.9
    assert slices["wide"]["top1"] == 0.5
    assert slices["non_pow2"]["n_problems"] == 2  # 768 and 100 are not powers of two


def test_grouped_conv_slices():
    from tilecast.families import get_family

    conv = get_family("grouped_conv_forward")
    dw = conv.problem({"G": 32, "C": 1, "K": 1, "Hi": 8, "Wi": 8, "Y": 3, "X": 3,
                       "stride_h": 2, "stride_w": 2})
    assert conv.slices(dw) == ("2d", "depthwise", "strided")
    pw3d = conv.problem({"C": 8, "K": 8, "Di": 4, "Hi": 4, "Wi": 4, "Z": 1, "Y": 1, "X": 1})
    assert conv.slices(pw3d) == ("3d", "pointwise")
