"""Faults that hit benchmark records: a benchmark killed with SIGKILL and resumed loses and
duplicates nothing; a torn last line is expected and cut off, any other damage to a raw log is
an error naming the file and its lines; a raw log never becomes the output of `convert`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from faults import REPO_ROOT, cli, note_case, note_records
from tilecast.cli import user_errors
from tilecast.measurement.protocol import Protocol
from tilecast.measurement.rawlog import RawLogError, RawWriter, read_log, read_records
from tilecast.families import get_family
from tilecast.families.gemm import GemmConfig
from tilecast.stages.bench import BenchSettings, benchmark
from tilecast.core.build import build_candidates

GEMM = get_family("gemm")
PROTOCOL = {"warmup_ms": 1, "min_sample_ms": 1, "samples": 3, "threads": 2, "timeout_s": 10}
SETTINGS = {"finalists": 2, "confirm_samples": 2, "problems_per_batch": 2, "measure_peer": False}
RUN = {"run_id": "killed", "git_sha": "0" * 7, "hardware": "test"}
CONFIGS = [GemmConfig("fp32", "avx2", 6, 16, 96, 512, 128, "m", True, True),
           GemmConfig("fp32", "avx2", 4, 24, 96, 504, 256, "k", False, False)]
SHAPES = [{"m": m, "n": n, "k": k} for m, n, k in
          ((16, 32, 64), (5, 7, 9), (100, 3, 40), (8, 8, 8), (9, 10, 11), (30, 31, 32))]

# The benchmark a test kills: the same kernels, problems and settings as the resumed run.
VICTIM = """
import json, sys
from pathlib import Path
from tilecast.measurement.protocol import Protocol
from tilecast.families import get_family
from tilecast.stages.bench import BenchSettings, benchmark
from tilecast.core.build import build_candidates

spec = json.loads(sys.argv[1])
family = get_family("gemm")
configs = [family.parse_name(name) for name in spec["kernels"]]
builts = build_candidates(family, configs, Path(spec["cache"]), jobs=1)
problems = [("train", family.problem(shape)) for shape in spec["shapes"]]
settings = BenchSettings(protocol=Protocol(**spec["protocol"]), **spec["settings"])
benchmark(family, builts, problems, Path(spec["raw"]), Path(spec["scratch"]), spec["run"], settings)
"""


def _slot(record: dict) -> tuple:
    return record["dims_key"], record["kernel"], record["phase"]


def _complete_lines(raw: Path) -> int:
    return raw.read_bytes().count(b"\n") if raw.exists() else 0


@pytest.fixture(scope="module")
def builts(build_cache):
    return build_candidates(GEMM, CONFIGS, build_cache, jobs=2)


@pytest.mark.parametrize("kill_after, torn", [(1, False), (5, True), (10, False)])
def test_a_killed_benchmark_resumes_with_nothing_lost_or_duplicated(tmp_path, builts, build_cache,
                                                                    kill_after, torn):
    """SIGKILL after `kill_after` records (and, once, a record torn mid-write on top): the
    resumed run keeps every record the killed one wrote, byte for byte, measures each
    missing pair once, and completes the run (every problem confirmed)."""
    raw = tmp_path / "gemm.jsonl"
    spec = {"kernels": [b.kernel for b in builts], "cache": str(build_cache), "shapes": SHAPES,
            "protocol": PROTOCOL, "settings": SETTINGS, "raw": str(raw),
            "scratch": str(tmp_path / "victim"), "run": RUN}
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, json.dumps(spec)], cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                              stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 180
    try:
        while _complete_lines(raw) < kill_after:
            assert victim.poll() is None, victim.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the benchmark wrote nothing in 3 minutes"
            time.sleep(0.01)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        victim.stderr.close()
    assert victim.returncode == -signal.SIGKILL, "the benchmark ended before it was killed"
    if torn:   # a kill in the middle of writing a record
        with open(raw, "ab") as handle:
            handle.write(b'{"schema_version": 3, "kernel": "gemm_fp32_avx2_')
    survived = raw.read_bytes()[:raw.read_bytes().rfind(b"\n") + 1]
    before = read_log(raw)
    assert len(before.records) >= kill_after and (before.torn_line is not None or not torn)

    problems = [("train", GEMM.problem(shape)) for shape in SHAPES]
    settings = BenchSettings(protocol=Protocol(**PROTOCOL), **SETTINGS)
    summary = benchmark(GEMM, builts, problems, raw, tmp_path / "resumed", RUN, settings)
    after = read_records(raw)
    assert raw.read_bytes().startswith(survived), "the resumed run rewrote earlier records"
    counts = Counter(_slot(r) for r in after)
    screens = {(GEMM.dims_key(p), b.kernel, "screen") for _, p in problems for b in builts}
    lost = len({_slot(r) for r in before.records} - set(counts)) + len(screens - set(counts))
    duplicated = sum(count - 1 for count in counts.values())
    note_records(lost, duplicated)
    assert lost == 0 and duplicated == 0, counts
    assert summary.skipped_existing == sum(_slot(r) in screens for r in before.records)
    assert {dims for dims, _, phase in counts if phase == "confirm"} == \
        {GEMM.dims_key(p) for _, p in problems}


def test_a_torn_last_line_is_dropped_with_a_note_and_cut_off_by_the_next_writer(tmp_path, caplog):
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"a": 1}\n{"b": 2}\n{"c": 3, "sampl')
    with caplog.at_level("INFO", logger="tilecast.measurement.rawlog"):
        log = read_log(raw)
    assert log.records == [{"a": 1}, {"b": 2}] and log.torn_line == 3 and not log.skipped_lines
    assert "dropped the torn last line 3" in caplog.text
    with RawWriter(raw) as writer:
        writer.append({"d": 4})
    assert raw.read_text() == '{"a": 1}\n{"b": 2}\n{"d":4}\n'
    # a last record that only lacks its newline is a record: kept, and given its newline
    raw.write_text('{"a": 1}\n{"b": 2}')
    with RawWriter(raw) as writer:
        writer.append({"c": 3})
    assert read_records(raw) == [{"a": 1}, {"b": 2}, {"c": 3}]


def test_corrupt_lines_in_the_middle_are_an_error_unless_skipped(tmp_path):
    """A kill cannot put garbage before the last line: such a file is an error naming it and
    the lines, for the benchmark (nothing measured over it) as for any reader; a reader that
    asks to skip them is told which."""
    raw = tmp_path / "gemm.jsonl"
    raw.write_bytes(b'{"a": 1}\n\xff\xfe garbage\n{"b": 2}\n["not", "a", "record"]\n{"c": 3}\n'
                    b'{"d": 4')
    with pytest.raises(RawLogError, match=r"gemm.jsonl: 2 corrupt line\(s\) before the end "
                                          r"\(line\(s\) 2, 4\)") as err:
        read_records(raw)
    assert isinstance(err.value, user_errors())
    note_case("clear")
    log = read_log(raw, skip_corrupt=True)
    assert [sorted(r) for r in log.records] == [["a"], ["b"], ["c"]]
    assert log.skipped_lines == [2, 4] and log.torn_line == 6
    size = raw.stat().st_size
    settings = BenchSettings(protocol=Protocol(**PROTOCOL), **SETTINGS)
    with pytest.raises(RawLogError, match="line\\(s\\) 2, 4"):
        benchmark(GEMM, [], [], raw, tmp_path / "scratch", RUN, settings)
    note_case("clear")
    assert raw.stat().st_size == size   # the benchmark neither measured nor cut anything
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(RawLogError, match="is a directory"):
        read_records(tmp_path / "dir.jsonl")
    note_case("clear")


def test_the_cli_refuses_a_raw_log_as_convert_output_and_a_corrupt_log(tmp_path):
    """What a user types: one clear line and exit 2, the raw log untouched."""
    raw = tmp_path / "W" / "bench" / "gemm.jsonl"
    raw.parent.mkdir(parents=True)
    raw.write_text('{"a": 1}\n')
    cli("convert", str(raw), "--out", str(raw), needles=("gemm.jsonl",))
    assert raw.read_text() == '{"a": 1}\n'
    raw.write_text('{"a": 1}\n{oops\n{"b": 2}\n')
    cli("convert", str(raw), "--out", str(tmp_path / "out.parquet"),
        needles=("gemm.jsonl", "corrupt line(s)", "line(s) 2"))
    assert not (tmp_path / "out.parquet").exists()


def test_a_dataset_that_is_not_parquet_is_a_dataset_error(tmp_path):
    from tilecast.core.dataset import DatasetError, load

    for name, content in [("short.parquet", b"garbage"), ("text.parquet", b"m,n,k\n1,2,3\n" * 50)]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DatasetError, match=f"{name} is not a readable parquet file"):
            load(tmp_path / name)
        note_case("clear")
