"""The rebenchmark: its statistics on sample arrays (no hardware needed), its bad inputs, and
an end-to-end run on real kernels: a first run without a baseline, a resumed second run that
compares every kernel, and a genuinely slower kernel built from a commit of a clone."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tilecast import cli
from tilecast.workflows import rebench, regression
from tilecast.core import stats
from tilecast.workflows.regression import (IMPROVEMENT, NO_BASELINE, NOT_COMPARABLE, REGRESSION, UNCHANGED,
                                 RunRecords, compare, exit_status, render_markdown)
from tilecast.measurement.rawlog import read_records
from tilecast.core.stats import benjamini_hochberg, mann_whitney_p

TINY = Path(__file__).parent / "configs" / "tiny.yaml"
HW = "hw-a"


# -- statistics on synthetic sample arrays -----------------------------------------------------

def _run(run_id, table, hardware=HW, status=None):
    """RunRecords from {(kernel, problem): samples}; `status` {(kernel, problem): status}."""
    status = status or {}
    records = []
    for (kernel, problem), samples in table.items():
        state = status.get((kernel, problem), "ok")
        records.append({"run_id": run_id, "kernel": kernel, "dims_key": problem,
                        "role": "candidate", "phase": "screen", "status": state,
                        "reason": "" if state == "ok" else "norm-relative error 3 > tolerance",
                        "samples_s": [float(s) for s in samples] if state == "ok" else []})
    return RunRecords(run_id, hardware, "sha-" + run_id, records)


def _samples(seed, kernels=3, problems=4, n=10, noise=0.02, scale=None):
    """Lognormal timings around a per-pair base time; `scale(kernel, problem)` multiplies."""
    rng = np.random.default_rng(seed)
    table = {}
    for k in range(kernels):
        for p in range(problems):
            base = 1e-4 * (1 + k) * (1 + 0.5 * p)
            factor = scale(k, p) if scale else 1.0
            table[f"k{k}", f"m={p + 1}"] = base * factor * rng.lognormal(0.0, noise, n)
    return table


def test_a_1_5x_slowdown_everywhere_is_a_regression_with_exit_1():
    old = _run("old", _samples(1))
    new = _run("new", _samples(2, scale=lambda k, p: 1.5))
    result = compare(new, old, "gemm")
    assert result.verdict == REGRESSION and result.exit_status == 1
    assert exit_status([result]) == 1
    assert [k["verdict"] for k in result.kernels] == [REGRESSION] * 3
    assert all(p["verdict"] == REGRESSION and p["q"] <= 0.01 for p in result.pairs)
    for kernel in result.kernels:
        assert kernel["geomean_ratio"] == pytest.approx(1.5, rel=0.03)
        assert len(kernel["regressed_problems"]) == 4
    assert result.baseline_run_id == "old"


def test_a_1_5x_speedup_is_an_improvement_with_exit_0():
    result = compare(_run("new", _samples(2, scale=lambda k, p: 1 / 1.5)), _run("old", _samples(1)),
                     "gemm")
    assert result.verdict == IMPROVEMENT and result.exit_status == 0
    assert {k["verdict"] for k in result.kernels} == {IMPROVEMENT}


def test_identical_distributions_are_unchanged():
    result = compare(_run("new", _samples(2)), _run("old", _samples(1)), "gemm")
    assert result.verdict == UNCHANGED and result.exit_status == 0
    assert {k["verdict"] for k in result.kernels} == {UNCHANGED}
    assert {p["verdict"] for p in result.pairs} == {UNCHANGED}
    assert all(0.9 < p["ratio"] < 1.1 for p in result.pairs)


def test_a_2_percent_shift_measured_very_precisely_is_unchanged_by_the_practical_rule():
    old = _run("old", _samples(1, kernels=2, problems=12, n=2000, noise=0.01))
    new = _run("new", _samples(2, kernels=2, problems=12, n=2000, noise=0.01,
                               scale=lambda k, p: 1.02))
    result = compare(new, old, "gemm")
    # every test is significant: the shift is real ...
    assert all(p["q"] < 1e-6 for p in result.pairs)
    assert all(k["q"] <= 0.01 for k in result.kernels)
    # ... but 2 % is below the 5 % that counts
    assert result.verdict == UNCHANGED and result.exit_status == 0
    assert {p["verdict"] for p in result.pairs} == {UNCHANGED}
    assert "practical threshold" in result.pairs[0]["reason"]
    # the practical threshold is what decided: at 1 % the same samples regress
    assert compare(new, old, "gemm", min_effect=0.01).verdict == REGRESSION


def test_a_large_median_shift_without_significance_is_unchanged():
    # three samples a side cannot reach alpha 0.01 whatever the shift (exact p >= 0.1)
    old = _run("old", _samples(1, kernels=1, problems=1, n=3))
    new = _run("new", _samples(2, kernels=1, problems=1, n=3, scale=lambda k, p: 2.0))
    [pair] = compare(new, old, "gemm").pairs
    assert pair["ratio"] == pytest.approx(2.0, rel=0.1) and pair["p"] >= 0.1
    assert pair["verdict"] == UNCHANGED and "not significant" in pair["reason"]


def test_one_badly_regressed_problem_is_not_averaged_away():
    old = _run("old", _samples(1, kernels=2, problems=6))
    new = _run("new", _samples(2, kernels=2, problems=6,
                               scale=lambda k, p: 3.0 if (k, p) == (0, 4) else 1.0))
    result = compare(new, old, "gemm")
    k0, k1 = result.kernels
    # the geometric mean over six problems is ~1.2x and the signed-rank test cannot see it ...
    assert k0["geomean_ratio"] < 1.25 and (k0["q"] is None or k0["q"] > 0.01)
    # ... the per-pair rule does
    assert k0["verdict"] == REGRESSION and k0["regressed_problems"] == ["m=5"]
    assert k1["verdict"] == UNCHANGED
    assert result.exit_status == 1


def test_a_kernel_broken_where_it_worked_is_a_regression():
    table = _samples(2, kernels=2, problems=2)
    new = _run("new", table, status={("k1", "m=2"): "wrong_result"})
    result = compare(new, _run("old", _samples(1, kernels=2, problems=2)), "gemm")
    broken = next(p for p in result.pairs if (p["kernel"], p["problem"]) == ("k1", "m=2"))
    assert broken["verdict"] == REGRESSION and broken["reason"].startswith("broken: wrong_result")
    assert result.kernels[1]["verdict"] == REGRESSION and result.exit_status == 1
    # and the other way round: fixed is not a regression
    fixed = compare(_run("new", _samples(2, kernels=2, problems=2)),
                    _run("old", _samples(1, kernels=2, problems=2),
                         status={("k1", "m=2"): "crashed"}), "gemm")
    assert fixed.exit_status == 0 and fixed.kernels[1]["verdict"] == IMPROVEMENT


def test_kernels_on_one_side_only_are_listed_as_added_and_removed():
    old = {key: s for key, s in _samples(1).items() if key[0] != "k2"}
    new = {key: s for key, s in _samples(2).items() if key[0] != "k0"}
    result = compare(_run("new", new), _run("old", old), "gemm")
    verdicts = {k["kernel"]: k["verdict"] for k in result.kernels}
    assert verdicts == {"k0": "removed", "k1": UNCHANGED, "k2": "added"}
    assert result.exit_status == 0
    assert {p["kernel"] for p in result.pairs} == {"k1"}


def test_different_hardware_is_not_comparable_with_exit_3():
    old = _run("old", _samples(1), hardware="hw-a")
    new = _run("new", _samples(2, scale=lambda k, p: 1.5), hardware="hw-b")
    result = compare(new, old, "gemm")
    assert result.verdict == NOT_COMPARABLE and result.exit_status == 3
    assert "hw-b" in result.message and "hw-a" in result.message and not result.pairs
    assert {k["verdict"] for k in result.kernels} == {NOT_COMPARABLE}
    # a regression elsewhere wins: CI sees 1
    regressed = compare(_run("new", _samples(2, scale=lambda k, p: 1.5)), _run("old", _samples(1)),
                        "other")
    assert exit_status([result, regressed]) == 1 and exit_status([result]) == 3


def test_a_first_run_has_no_baseline_and_exit_0():
    result = compare(_run("new", _samples(2)), None, "gemm")
    assert result.verdict == NO_BASELINE and result.exit_status == 0
    assert result.baseline_run_id is None and "no baseline" in result.message


def test_benjamini_hochberg_known_answer_and_properties():
    assert benjamini_hochberg([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    assert benjamini_hochberg([0.02, None, 0.02]) == [0.02, None, 0.02]
    assert benjamini_hochberg([]) == []
    p_values = list(np.random.default_rng(7).uniform(size=300))
    q_values = benjamini_hochberg(p_values)
    assert all(p <= q <= 1 for p, q in zip(p_values, q_values))
    order = np.argsort(p_values)
    assert all(np.diff(np.asarray(q_values)[order]) >= 0)  # monotone in p
    # 300 true null hypotheses: raw p-values flag some at 0.05, the corrected ones none
    assert sum(p <= 0.05 for p in p_values) > 5 and not any(q <= 0.05 for q in q_values)
    with pytest.raises(ValueError, match="not in"):
        benjamini_hochberg([0.5, 1.5])


def test_the_correction_is_applied_to_the_comparison():
    # one kernel, one pair on the edge: p 0.002 alone, many unchanged pairs around it
    old = _samples(1, kernels=1, problems=1, n=6)
    new = {key: s * 1.5 for key, s in _samples(2, kernels=1, problems=1, n=6).items()}
    [(key, old_s)], [(_, new_s)] = old.items(), new.items()
    raw_p = mann_whitney_p(new_s, old_s)
    assert raw_p < 0.01
    alone = compare(_run("new", new), _run("old", old), "gemm")
    assert alone.pairs[0]["verdict"] == REGRESSION
    crowd_old, crowd_new = dict(old), dict(new)
    for i in range(40):  # unchanged problems of the same kernel
        base = 1e-4 * np.random.default_rng(100 + i).lognormal(0, 0.02, 6)
        crowd_old["k0", f"m={i + 10}"] = base
        crowd_new["k0", f"m={i + 10}"] = base * np.random.default_rng(200 + i).lognormal(0, 0.02, 6)
    crowded = compare(_run("new", crowd_new), _run("old", crowd_old), "gemm")
    pair = next(p for p in crowded.pairs if p["problem"] == key[1])
    assert pair["p"] == pytest.approx(raw_p) and pair["q"] > 0.01
    assert pair["verdict"] == UNCHANGED


def test_required_samples_gives_the_tests_power():
    assert regression.required_samples(16, 0.01) == 8
    assert regression.required_samples(448, 0.01) > regression.required_samples(16, 0.01)
    n = regression.required_samples(80, 0.01)
    assert 2 / math.comb(2 * n, n) * 80 <= 0.01 / 4 < 2 / math.comb(2 * n - 2, n - 1) * 80


def test_markdown_lists_every_kernel_and_the_regressed_pairs():
    old = _run("old", _samples(1))
    new = _run("new", _samples(2, scale=lambda k, p: 1.5 if k == 1 else 1.0))
    text = render_markdown([compare(new, old, "gemm")], {"gemm": "header line"})
    assert text.startswith("# Rebenchmark") and "Exit status 1" in text
    assert "## gemm: REGRESSION" in text and "header line" in text
    for kernel in ("k0", "k1", "k2"):
        assert f"| `{kernel}` | 4 |" in text
    assert "### Regressed pairs (4)" in text
    assert text.count("| `k1` | `m=") == 4


@pytest.mark.parametrize("alpha, min_effect, fragment", [
    (0.0, 0.05, "alpha=0.0"), (1.0, 0.05, "alpha=1.0"), (0.01, -0.1, "min_effect=-0.1")])
def test_bad_thresholds_are_named(alpha, min_effect, fragment):
    with pytest.raises(ValueError, match=fragment):
        compare(_run("new", _samples(2)), _run("old", _samples(1)), "gemm", alpha, min_effect)


# -- bad inputs: clear errors before anything is compiled --------------------------------------

def test_problem_subset_accepts_problem_strings_and_dims_keys(tmp_path):
    p = rebench.plan(TINY, tmp_path / "w", tmp_path / "h",
                     problems=["m=64,n=64,k=64", "m=24,n=128,k=96,dtype=fp32,layout_a=row,layout_b=row"])
    assert [f"{q.m}x{q.n}x{q.k}" for q in p.problems["gemm"]] == ["64x64x64", "24x128x96"]
    assert len(rebench.plan(TINY, tmp_path / "w", tmp_path / "h").problems["gemm"]) == 3


def test_an_unknown_problem_is_named(tmp_path, capsys):
    with pytest.raises(rebench.RebenchError, match=r"'m=40,n=70,k=90' is not a sentinel problem"):
        rebench.plan(TINY, tmp_path / "w", tmp_path / "h", problems=["m=64,n=64,k=64", "m=40,n=70,k=90"])
    with pytest.raises(rebench.RebenchError, match=r"'m=4,n=x,k=1'.*n='x'"):
        rebench.plan(TINY, tmp_path / "w", tmp_path / "h", problems=["m=4,n=x,k=1"])
    status = cli.main(["rebench", "--config", str(TINY), "--workdir", str(tmp_path / "w"),
                       "--history", str(tmp_path / "h"), "--problems", "m=40,n=70,k=90"])
    assert status == 2
    assert "m=40,n=70,k=90" in capsys.readouterr().err
    assert not (tmp_path / "w" / "rebench").exists()  # nothing built or measured


def test_a_bad_git_ref_is_named(tmp_path, capsys):
    with pytest.raises(rebench.RebenchError, match="git ref 'no-such-ref-42' does not name a commit"):
        rebench.plan(TINY, tmp_path / "w", tmp_path / "h", git_ref="no-such-ref-42")
    with pytest.raises(rebench.RebenchError, match="is not a git repository"):
        rebench.plan(TINY, tmp_path / "w", tmp_path / "h", git_ref="HEAD", repo=tmp_path)
    with pytest.raises(rebench.RebenchError, match="not a ref"):
        rebench.plan(TINY, tmp_path / "w", tmp_path / "h", git_ref="--output=/tmp/x")
    status = cli.main(["rebench", "--config", str(TINY), "--workdir", str(tmp_path / "w"),
                       "--history", str(tmp_path / "h"), "--git-ref", "no-such-ref-42"])
    assert status == 2 and "no-such-ref-42" in capsys.readouterr().err


def test_a_truncated_history_is_a_clear_error(tmp_path):
    history = tmp_path / "h"
    run = _run("20260101T000000Z-aaaaaa", _samples(1))
    pointer = rebench.store_run(history, "gemm", run, {"family": "gemm"})
    assert rebench.load_run(history, "gemm", pointer).records == run.records
    path = history / "gemm" / pointer["file"]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut mid-record
    with pytest.raises(rebench.RebenchError, match="truncated or corrupt"):
        rebench.plan(TINY, tmp_path / "w", history)
    path.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1])  # a whole record short
    with pytest.raises(rebench.RebenchError, match="truncated or was modified"):
        rebench.plan(TINY, tmp_path / "w", history)
    path.write_bytes(data)
    rebench.plan(TINY, tmp_path / "w", history)  # restored: fine
    latest = history / "gemm" / "latest.json"
    latest.write_text(latest.read_text()[:40])
    with pytest.raises(rebench.RebenchError, match="latest.json is unreadable"):
        rebench.plan(TINY, tmp_path / "w", history)


def test_config_sentinel_defaults_to_the_holdout_set(tmp_path):
    from tilecast.config import ConfigError, load_config

    base = ("name: x\nfamilies:\n  gemm:\n    candidates: {}\n    problems:\n"
            "      train: [{list: [{m: 1, n: 2, k: 3}]}]\n      holdout: [{list: [{m: 4, n: 5, k: 6}]}]\n")
    path = tmp_path / "c.yaml"
    path.write_text(base)
    assert load_config(path).families["gemm"].sentinel == [{"m": 4, "n": 5, "k": 6}]
    path.write_text(base + "    sentinel: [{grid: {m: [7, 8], n: [9], k: [10]}}]\n")
    assert load_config(path).families["gemm"].sentinel == [{"m": 7, "n": 9, "k": 10},
                                                           {"m": 8, "n": 9, "k": 10}]
    path.write_text(base + "    sentinel: []\n")
    with pytest.raises(ConfigError, match="sentinel: the entries expand to no problem"):
        load_config(path)
    path.write_text(base + "    sentinel: [{lst: []}]\n")
    with pytest.raises(ConfigError, match=r"sentinel\[0\]: needs exactly one of"):
        load_config(path)


# -- end to end on real kernels ----------------------------------------------------------------

def _cli(tmp_path, *extra) -> int:
    return cli.main(["rebench", "--config", str(TINY), "--workdir", str(tmp_path / "w"),
                     "--history", str(tmp_path / "h"), *extra])


def _report(tmp_path) -> dict:
    return json.loads((tmp_path / "w" / "report" / "rebench_gemm.json").read_text())


@pytest.mark.slow
def test_rebench_end_to_end(tmp_path, build_cache, monkeypatch, caplog, capsys,
                            slower_gemm_commit):
    monkeypatch.setenv("TILECAST_BUILD_CACHE", str(build_cache))
    caplog.set_level("INFO")
    history = tmp_path / "h" / "gemm"

    # 1. first run: no baseline, exit 0, the run stored as the history's latest
    assert _cli(tmp_path) == 0
    first = _report(tmp_path)
    assert first["verdict"] == NO_BASELINE and first["baseline_run_id"] is None
    kernels = [k["kernel"] for k in first["kernels"]]
    assert len(kernels) == 4
    latest = json.loads((history / "latest.json").read_text())
    assert latest["run_id"] == first["run_id"] and latest["records"] == 12
    assert (history / f"{first['run_id']}.jsonl").exists()
    assert "bench gemm: batch 1/1 done" in caplog.text  # progress while measuring
    assert "# Rebenchmark" in capsys.readouterr().out

    # 2. an interrupted second run resumes: only what is missing is measured again
    def interrupted(*args, **kwargs):
        raise RuntimeError("interrupted before the history was written")

    with monkeypatch.context() as patch:
        patch.setattr(rebench, "store_run", interrupted)
        with pytest.raises(RuntimeError, match="interrupted"):
            _cli(tmp_path)
    unfinished = read_records(tmp_path / "w" / "rebench" / "gemm.jsonl")
    assert len(unfinished) == 12
    caplog.clear()
    status = _cli(tmp_path)
    assert "0 new records, 12 already measured" in caplog.text
    second = _report(tmp_path)
    assert second["run_id"] == unfinished[0]["run_id"] != first["run_id"]
    assert second["baseline_run_id"] == first["run_id"]
    # the table covers every kernel on every problem (timing noise may move a verdict)
    assert status in (0, 1) and status == second["exit_status"]
    assert sorted(k["kernel"] for k in second["kernels"]) == sorted(kernels)
    assert all(k["problems"] == 3 and k["geomean_ratio"] > 0 for k in second["kernels"])
    assert len(second["pairs"]) == 12
    markdown = (tmp_path / "w" / "report" / "rebench.md").read_text()
    assert all(f"| `{k}` | 3 |" in markdown for k in kernels)

    # 3. a genuinely slower kernel from a commit of a clone: regression, exit 1
    clone, sha = slower_gemm_commit
    assert _cli(tmp_path, "--git-ref", sha, "--repo", str(clone)) == 1
    third = _report(tmp_path)
    assert third["verdict"] == REGRESSION and third["baseline_run_id"] == second["run_id"]
    assert third["git_sha"] == sha and third["source"]["kind"] == "git"
    assert (tmp_path / "w" / "rebench" / "src" / sha / "kernels" / "cpu" / "gemm" / "gemm.cpp").exists()
    assert {k["kernel"]: k["verdict"] for k in third["kernels"]} == {k: REGRESSION for k in kernels}
    # eight times the work; a busy machine (the baseline measured in a slow spell) narrows
    # single pairs, so the figures are checked over the run, the verdicts per kernel
    ratios = [p["ratio"] for p in third["pairs"]]
    regressed = [p for p in third["pairs"] if p["verdict"] == REGRESSION]
    assert len(ratios) == 12 and float(np.median(ratios)) > 2, ratios
    assert len(regressed) >= 6 and all(p["ratio"] >= 1.05 for p in regressed)
    assert json.loads((history / "latest.json").read_text())["git_sha"] == sha
    markdown = (tmp_path / "w" / "report" / "rebench.md").read_text()
    assert "## gemm: REGRESSION" in markdown
    assert f"### Regressed pairs ({len(regressed)})" in markdown

    # 4. a baseline from other hardware is not compared: exit 3 (one problem keeps it short)
    pointer = json.loads((history / "latest.json").read_text())
    (history / "latest.json").write_text(json.dumps({**pointer, "hardware": "0123456789ab"}))
    assert _cli(tmp_path, "--problems", "m=64,n=64,k=64") == 3
    fourth = _report(tmp_path)
    assert fourth["verdict"] == NOT_COMPARABLE and "0123456789ab" in fourth["message"]
    assert fourth["problems"] == ["m=64,n=64,k=64,dtype=fp32,layout_a=row,layout_b=row"]


def _rounds_run(run_id, round_medians, within=0.002, seed=0, per_round=6):
    """Records whose samples are tight around each round's median (samples of one process)."""
    rng = np.random.default_rng(seed)
    records = []
    for (kernel, problem), medians in round_medians.items():
        samples = [m * x for m in medians for x in rng.lognormal(0.0, within, per_round)]
        records.append({"run_id": run_id, "kernel": kernel, "dims_key": problem,
                        "role": "candidate", "phase": "screen", "status": "ok", "reason": "",
                        "samples_s": samples, "round_medians_s": list(medians)})
    return RunRecords(run_id, HW, "sha-" + run_id, records)


def test_pairs_are_tested_on_round_medians_not_on_samples():
    # two runs of one binary: each process lands a few % apart, its samples within 0.2 %;
    # over samples the 7 % gap would be "significant", over processes it is noise
    old = _rounds_run("old", {("k0", "m=1"): [5.0e-6, 5.2e-6, 4.9e-6, 5.3e-6]}, seed=1)
    new = _rounds_run("new", {("k0", "m=1"): [5.6e-6, 5.25e-6, 5.8e-6, 5.35e-6]}, seed=2)
    samples_p = stats.mann_whitney_p(new.records[0]["samples_s"], old.records[0]["samples_s"])
    assert samples_p < 0.01
    result = compare(new, old, "gemm", 0.01, 0.05)
    pair = result.pairs[0]
    assert pair["test"] == "welch-log-rounds" and pair["n_old"] == pair["n_new"] == 4
    assert pair["p"] > 0.01 and pair["verdict"] == UNCHANGED and result.exit_status == 0

    # a real 2x slowdown stands far outside the processes' spread
    slow = _rounds_run("slow", {("k0", "m=1"): [10.1e-6, 10.6e-6, 9.9e-6, 10.4e-6]}, seed=3)
    result = compare(slow, old, "gemm", 0.01, 0.05)
    assert result.pairs[0]["verdict"] == REGRESSION and result.exit_status == 1


def test_welch_log_p_edges():
    assert stats.welch_log_p([1.0, 1.0], [1.0, 1.0]) == 1.0
    assert stats.welch_log_p([1.0, 1.0], [2.0, 2.0]) == 0.0
    assert 0.0 < stats.welch_log_p([1.0, 1.1, 0.9], [1.05, 1.0, 1.1]) <= 1.0
    with pytest.raises(ValueError, match="at least 2"):
        stats.welch_log_p([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        stats.welch_log_p([1.0, -1.0], [1.0, 2.0])


def test_a_kernel_slower_everywhere_regresses_though_a_disturbed_round_hides_each_pair():
    # every problem: four tight baseline rounds; the new run 10x slower, one round of each
    # problem disturbed 10x more: each pair's Welch test alone stays above alpha ...
    old_rounds = [1.00e-5, 1.02e-5, 0.99e-5, 1.01e-5]
    new_rounds = [10.0e-5, 10.3e-5, 9.9e-5, 100e-5]
    problems = [f"m={i}" for i in range(1, 4)]
    old = _rounds_run("old", {("k0", p): old_rounds for p in problems}, seed=1)
    new = _rounds_run("new", {("k0", p): new_rounds for p in problems}, seed=2)
    result = compare(new, old, "gemm", 0.01, 0.05)
    assert all(p["test"] == "welch-log-rounds" and p["q"] > 0.01 for p in result.pairs)
    assert all(p["verdict"] == UNCHANGED and p["ratio"] > 9 for p in result.pairs)
    # ... the kernel's test over all three problems' rounds does not
    [kernel] = result.kernels
    assert kernel["test"] == "welch-log-rounds-by-problem" and kernel["q"] < 1e-3
    assert kernel["verdict"] == REGRESSION and "geomean" in kernel["reason"]
    assert result.exit_status == 1
    # the same rounds without the shift: nothing to see
    same = _rounds_run("same", {("k0", p): old_rounds[::-1] for p in problems}, seed=3)
    assert compare(same, old, "gemm", 0.01, 0.05).kernels[0]["verdict"] == UNCHANGED


def test_stratified_welch_log_p_known_answers_and_calibration():
    first, second = [1.0, 1.3, 0.9, 1.1], [1.4, 1.2, 1.6]
    # one stratum is Welch's test itself
    assert stats.stratified_welch_log_p([(first, second)]) == pytest.approx(
        stats.welch_log_p(first, second), rel=1e-9)
    # strata with fewer than 2 values a side are left out; none left: no test
    assert stats.stratified_welch_log_p([(first, second), ([1.0], [2.0, 3.0])]) == pytest.approx(
        stats.welch_log_p(first, second), rel=1e-9)
    assert stats.stratified_welch_log_p([([1.0], [2.0])]) is None
    assert stats.stratified_welch_log_p([([2.0, 2.0], [2.0, 2.0])]) == 1.0
    assert stats.stratified_welch_log_p([([2.0, 2.0], [1.0, 1.0])]) == 0.0
    with pytest.raises(ValueError, match="positive"):
        stats.stratified_welch_log_p([([1.0, 0.0], [1.0, 2.0])])
    # under the null (each problem its own level, rounds lognormal) about 5 % fall under 0.05
    rng = np.random.default_rng(5)
    p_values = []
    for _ in range(2000):
        strata = []
        for level in rng.uniform(-3, 3, 3):
            strata.append((np.exp(level + rng.normal(0, 0.05, 4)),
                           np.exp(level + rng.normal(0, 0.05, 4))))
        p_values.append(stats.stratified_welch_log_p(strata))
    assert 0.03 < np.mean(np.asarray(p_values) < 0.05) < 0.07
