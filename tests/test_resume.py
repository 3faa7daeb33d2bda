"""A run killed in the middle of its benchmark and started again with the same run id
measures only what is missing: the flow's finished tasks come from Prefect's cache (inputs +
task source) and the benchmark resumes from its raw records. A resumed benchmark reuses only
records of its own protocol, binary and problem, and never one the harness refused to run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from tilecast.core import dataset
from tilecast.measurement.protocol import Protocol, is_usage_error, protocol_hash
from tilecast.measurement.rawlog import read_records
from tilecast.families import get_family
from tilecast.families.gemm import GemmConfig
from tilecast.stages.bench import BenchSettings, benchmark
from tilecast.core.build import build_candidates
from tilecast.stages.convert import convert_raw

REPO = Path(__file__).resolve().parents[1]
CONFIG = Path(__file__).parent / "configs" / "resume.yaml"
GEMM = get_family("gemm")
PROTOCOL = Protocol(warmup_ms=1, min_sample_ms=1, samples=3, threads=2, timeout_s=10)
SETTINGS = BenchSettings(protocol=PROTOCOL, finalists=2, confirm_samples=2,
                         problems_per_batch=4, measure_peer=False)
RUN = {"run_id": "resume-test", "git_sha": "0" * 7, "hardware": "test"}
CONFIGS = [GemmConfig("fp32", "avx2", 6, 16, 96, 512, 128, "m", True, True),
           GemmConfig("fp32", "avx2", 4, 24, 96, 504, 256, "k", False, False)]
PROBLEMS = [("train", GEMM.problem({"m": m, "n": n, "k": k}))
            for m, n, k in ((16, 32, 64), (5, 7, 9))]


def _key(record: dict) -> tuple:
    return (record["dims_key"], "peer" if record["role"] == "peer" else record["kernel"],
            record["phase"])


def _records(path: Path) -> list[dict]:
    """Complete lines only: a line cut by the kill is not a record."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


@pytest.mark.slow
def test_killed_run_resumes_without_measuring_anything_twice(tmp_path):
    work, registry = tmp_path / "work", tmp_path / "registry"
    command = [sys.executable, "-m", "tilecast.flows.cli", "run", "--config", str(CONFIG), "--workdir",
               str(work), "--registry", str(registry), "--run-id", "night-1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    raw = work / "bench" / "gemm.jsonl"
    victim = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (raw.exists() and len(_records(raw)) >= 25):
        assert victim.poll() is None, f"the run ended before it could be killed:\n{victim.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "the benchmark did not start"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)  # the run and the embedded server it started
    victim.wait()
    before = Counter(_key(r) for r in _records(raw))

    resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    summary = json.loads(resumed.stdout)
    bench = summary["stages"]["gemm"]["bench"]
    after = Counter(_key(r) for r in _records(raw))

    remeasured = sum(after[k] - 1 for k in before)
    print(f"killed after {sum(before.values())} records; the resumed run measured "
          f"{bench['new_records']} new, re-measured {remeasured} already measured")
    assert remeasured == 0 and max(after.values()) == 1
    assert bench["new_records"] == sum(after.values()) - sum(before.values()) > 0
    assert bench["already_measured"] > 0
    assert "Finished in state Cached" in resumed.stderr  # the build task, from Prefect's cache
    assert summary["published"]["gemm"]["version"] == 1


@pytest.fixture(scope="module")
def builts(build_cache):
    return build_candidates(GEMM, CONFIGS, build_cache, jobs=2)


def _bench(tmp_path, builts, settings=SETTINGS):
    return benchmark(GEMM, builts, PROBLEMS, tmp_path / "gemm.jsonl", tmp_path / "scratch", RUN,
                     settings)


def _screens(raw: Path) -> list[dict]:
    return [r for r in read_records(raw) if r["phase"] == "screen"]


def test_a_run_resumed_after_a_protocol_change_measures_again(tmp_path, builts, caplog):
    """A typo fixed in the protocol must not leave the old protocol's records standing: the
    resumed run measures every pair again, says how many, and the dataset's final table uses
    only the new protocol's records although the raw file holds both."""
    raw = tmp_path / "gemm.jsonl"
    _bench(tmp_path, builts)
    first = read_records(raw)
    assert {r["protocol_hash"] for r in first} == {protocol_hash(PROTOCOL)}
    assert {r["build_key"] for r in first} == {b.cache_key for b in builts}
    assert _bench(tmp_path, builts).measured == 0          # same protocol: all reused

    changed = replace(SETTINGS, protocol=replace(PROTOCOL, min_sample_ms=2))
    with caplog.at_level("WARNING", logger="tilecast.stages.bench"):
        resumed = _bench(tmp_path, builts, changed)
    assert f"{len(first)} records of another protocol re-measured" in caplog.text
    assert resumed.skipped_existing == 0 and resumed.set_aside == {"protocol": len(first)}
    new = read_records(raw)[len(first):]
    assert {r["protocol_hash"] for r in new} == {protocol_hash(changed.protocol)}
    assert {(r["dims_key"], r["kernel"]) for r in new if r["phase"] == "screen"} == \
        {(r["dims_key"], r["kernel"]) for r in first if r["phase"] == "screen"}
    assert _bench(tmp_path, builts, changed).measured == 0  # the new protocol's are reused

    convert_raw([raw], tmp_path / "gemm.parquet")
    records = dataset.load(tmp_path / "gemm.parquet")
    assert set(records["protocol_hash"]) == {protocol_hash(PROTOCOL),
                                             protocol_hash(changed.protocol)}
    final = dataset.final_table(records)
    assert set(final["protocol_hash"]) == {protocol_hash(changed.protocol)}
    only_new = records[records["protocol_hash"] == protocol_hash(changed.protocol)]
    pd.testing.assert_frame_equal(final, dataset.final_table(only_new))


def test_usage_error_records_are_never_reused(tmp_path, builts, refused_samples, monkeypatch,
                                              caplog):
    """The harness refusing its command line (`--samples 2.5`) measured nothing: those
    records are marked, said so at the end of the run, and measured by the next run even
    under the same protocol hash."""
    with caplog.at_level("WARNING", logger="tilecast.stages.bench"):
        refused = _bench(tmp_path, builts)
    screens = _screens(tmp_path / "gemm.jsonl")
    assert len(screens) == 4 and refused.usage_errors == 4
    assert all(r["status"] == "crashed" and is_usage_error(r["reason"]) for r in screens)
    assert "the harness refused 4 job(s)" in caplog.text
    monkeypatch.setattr(Protocol, "argv", refused_samples)   # the typo fixed
    caplog.clear()
    with caplog.at_level("WARNING", logger="tilecast.stages.bench"):
        fixed = _bench(tmp_path, builts)
    assert "4 records of harness usage errors re-measured" in caplog.text
    assert fixed.skipped_existing == 0 and fixed.statuses["ok"] >= 4 and fixed.usage_errors == 0
    convert_raw([tmp_path / "gemm.jsonl"], tmp_path / "gemm.parquet")
    final = dataset.final_table(dataset.load(tmp_path / "gemm.parquet"))
    assert len(final) == 4 and set(final["status"]) == {"ok"}


def test_records_without_a_protocol_hash_are_measured_again(tmp_path, builts, caplog):
    """Records of schema version 2 (before records knew their protocol) still convert, with a
    warning, but a new run does not take them as its own measurements."""
    raw = tmp_path / "gemm.jsonl"
    _bench(tmp_path, builts)
    old = [{**{k: v for k, v in r.items() if k not in ("protocol_hash", "build_key")},
            "schema_version": 2} for r in read_records(raw)]
    raw.write_text("".join(json.dumps(r) + "\n" for r in old))
    with caplog.at_level("WARNING"):
        resumed = _bench(tmp_path, builts)
        convert_raw([raw], tmp_path / "gemm.parquet")
    assert f"{len(old)} records of another protocol re-measured" in caplog.text
    assert f"{len(old)} record(s) of schema version(s) [2] upgraded" in caplog.text
    assert resumed.skipped_existing == 0 and resumed.measured >= 4
    final = dataset.final_table(dataset.load(tmp_path / "gemm.parquet"))
    assert set(final["protocol_hash"]) == {protocol_hash(PROTOCOL)}


def test_a_rebuilt_binary_is_measured_again(tmp_path, builts, caplog):
    """A kernel whose build key changed (its source or flags did) is measured again; the
    other kernel's records stand."""
    _bench(tmp_path, builts)
    before = _screens(tmp_path / "gemm.jsonl")
    mine = [r for r in read_records(tmp_path / "gemm.jsonl") if r["kernel"] == builts[0].kernel]
    rebuilt = [replace(builts[0], cache_key="f" * 24), builts[1]]
    with caplog.at_level("WARNING", logger="tilecast.stages.bench"):
        resumed = _bench(tmp_path, rebuilt)
    assert resumed.set_aside == {"binary": len(mine)} and resumed.skipped_existing == 2
    assert "records of another binary re-measured" in caplog.text
    again = _screens(tmp_path / "gemm.jsonl")[len(before):]
    assert {r["kernel"] for r in again} == {builts[0].kernel}
    assert {r["build_key"] for r in again} == {"f" * 24}
