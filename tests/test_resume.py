"""A run killed in the middle of its benchmark and started again with the same run id
measures only what is missing: the flow's finished tasks come from Prefect's cache (inputs +
task source) and the benchmark resumes from its raw records."""
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

REPO = Path(__file__).resolve().parents[1]
CONFIG = Path(__file__).parent / "configs" / "resume.yaml"


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
    command = [sys.executable, "-m", "flows.cli", "run", "--config", str(CONFIG), "--workdir",
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
