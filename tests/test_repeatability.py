"""`tilecast repeatability`: one run's winners scored on another, known answers per bin."""
from __future__ import annotations

import json
import re

import pytest

from tilecast.core import dataset
from tilecast.workflows import repeatability
from tilecast.cli import main
from tilecast.stages.convert import convert_raw
from tilecast.core.dataset import RECORD_COLUMNS


def _record(key, kernel, seconds, problem_set="train", rounds=(), apart=()):
    base = {c: None for c in RECORD_COLUMNS}
    median = sorted(seconds)[len(seconds) // 2]
    base.update(schema_version=dataset.SCHEMA_VERSION, timing="interleaved", run_id="r",
                time="2026-12-01T00:00:00", git_sha="x", hardware="h", family="gemm",
                problem_set=problem_set, dims_key=key, kernel=kernel, role="candidate",
                phase="screen", status="ok", reason="", samples_s=list(seconds),
                disturbed_samples_s=list(apart), round_medians_s=list(rounds),
                reps_per_sample=1, median_s=median, mad_s=0.0, tflops=1e-6 / median, gbps=1.0,
                max_error=0.0, threads=2, binary_bytes=100)
    return base


def _write(tmp_path, name, records):
    raw = tmp_path / f"{name}.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / name / "data" / "gemm.parquet"
    convert_raw([raw], out)
    return tmp_path / name


# three problems: a 10 us one (bin < 20 us), a 100 us one, a 2 ms one (held out)
TIMES_A = {"p_small": {"k1": 10e-6, "k2": 12e-6}, "p_mid": {"k1": 100e-6, "k2": 90e-6},
           "p_big": {"k1": 2e-3, "k2": 2.5e-3}}
# run B agrees on p_small and p_big, and reverses p_mid (k1 now 10 % faster than k2)
TIMES_B = {"p_small": {"k1": 11e-6, "k2": 13e-6}, "p_mid": {"k1": 90e-6, "k2": 99e-6},
           "p_big": {"k1": 2.1e-3, "k2": 2.6e-3}}


def _run(times):
    return [_record(key, kernel, [t, t], "holdout" if key == "p_big" else "train",
                    rounds=[t, t * 1.1])
            for key, kernels in times.items() for kernel, t in kernels.items()]


def test_one_runs_winners_scored_on_the_other_per_bin(tmp_path):
    a, b = _write(tmp_path, "a", _run(TIMES_A)), _write(tmp_path, "b", _run(TIMES_B))
    table = repeatability.per_problem(repeatability.final_rows(a / "data" / "gemm.parquet"),
                                      repeatability.final_rows(b / "data" / "gemm.parquet"))
    table = table.set_index("dims_key")
    # A picks k2 on p_mid, which B measured at 99 us against its best 90 us
    assert table.loc["p_mid", "efficiency"] == pytest.approx(90 / 99)
    assert not table.loc["p_mid", "in_tie"] and not table.loc["p_mid", "within"]
    assert table.loc["p_small", "efficiency"] == 1.0 and table.loc["p_big", "in_tie"]
    summary = repeatability.summarize(table.reset_index())
    assert summary.n_problems == 3
    assert summary.mean == pytest.approx((2 + 90 / 99) / 3)
    assert summary.within_2pct == pytest.approx(2 / 3)
    text = repeatability.report(a, b)
    assert "A's winners scored on B" in text and "B's winners scored on A" in text
    a_on_b = text.split("B's winners scored on A")[0]
    assert re.search(r"< 20 us +1 problems  mean 1\.0000", a_on_b)
    assert re.search(rf"20 us - 1 ms +1 problems  mean {90 / 99:.4f}", a_on_b)
    assert re.search(r"holdout +1 problems  mean 1\.0000", a_on_b)
    # the other way, B's pick on p_mid (k1) ran at 100 us in A, whose best was 90 us
    assert re.search(r"20 us - 1 ms +1 problems  mean 0\.9000", text.split("B's winners scored on A")[1])


def test_run_noise_reports_spread_ties_and_samples_kept_apart(tmp_path):
    records = _run(TIMES_A)
    records[0]["disturbed_samples_s"] = [5e-5, 6e-5]         # 2 of 14 samples kept apart
    records.append(_record("p_small", "k3", [10.05e-6] * 2))   # within 1 % of k1: a tie
    frame = dataset.load(_write(tmp_path, "a", records) / "data" / "gemm.parquet")
    noise = repeatability.run_noise(frame)
    assert noise["n_problems"] == 3
    assert noise["round_spread_median"] == pytest.approx(1.1)
    assert noise["tie_share"] == pytest.approx(1 / 3)
    assert noise["samples_kept_apart_share"] == pytest.approx(2 / 16)
    assert noise["timing"] == {"interleaved": 1.0}


def test_the_command_prints_both_directions_and_refuses_a_missing_run(tmp_path, capsys):
    a, b = _write(tmp_path, "a", _run(TIMES_A)), _write(tmp_path, "b", _run(TIMES_B))
    assert main(["repeatability", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.count("problems  mean") >= 8
    assert main(["repeatability", str(a), str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_problems_measured_in_one_run_only_are_left_out(tmp_path):
    times_b = {key: value for key, value in TIMES_B.items() if key != "p_big"}
    a, b = _write(tmp_path, "a", _run(TIMES_A)), _write(tmp_path, "b", _run(times_b))
    table = repeatability.per_problem(repeatability.final_rows(a / "data" / "gemm.parquet"),
                                      repeatability.final_rows(b / "data" / "gemm.parquet"))
    assert set(table["dims_key"]) == {"p_small", "p_mid"}
