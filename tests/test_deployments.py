"""The README's deployment steps against a real Prefect server on 127.0.0.1: create the
process pool, `prefect deploy --all` from prefect.yaml, start two workers, `prefect deployment
run` (tiny config). Runs complete, each nightly's registry gains a version, no two benchmark
tasks share the device (the tag's concurrency limit), every run leaves its artifacts, and the
rebenchmark's run fails when a commit made the kernels slower."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from tilecast.core.hardware import profile
from tilecast.store.nights import summary
from tilecast.store.store import Store

REPO = Path(__file__).resolve().parents[1]
TINY = Path(__file__).parent / "configs" / "tiny.yaml"
PREFECT = [sys.executable, "-m", "prefect"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """End a process group this test started (by its PID), politely first."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Prefect server on 127.0.0.1 with its own PREFECT_HOME (a new database)."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "TILECAST_HOME": str(home / "tilecast"),   # the workers' pull step runs flows there
           "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                if r.read().strip() == b"true":
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail("the Prefect server did not come up:\n" + (home / "server.log").read_text()[-3000:])
        time.sleep(0.5)
    yield env
    _stop(proc)
    log.close()


def _prefect(env, *args, timeout=300):
    proc = subprocess.run([*PREFECT, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)
    assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def worker(server, tmp_path_factory):
    """The README's steps: pool, deploy, then two workers of the pool taking one run each."""
    _prefect(server, "work-pool", "create", "tilecast", "--type", "process")
    _prefect(server, "work-pool", "create", "tilecast-shards", "--type", "process")
    _prefect(server, "--no-prompt", "deploy", "--all")
    logs, procs = tmp_path_factory.mktemp("workers"), []
    for name in ("w1", "w2"):
        procs.append(subprocess.Popen(
            [*PREFECT, "worker", "start", "--pool", "tilecast", "--limit", "1", "--name", name],
            stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT, env=server, cwd=REPO,
            start_new_session=True))
    yield SimpleNamespace(env=server, logs=logs)
    for proc in procs:
        _stop(proc)


def _api():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _overlap(a, b) -> bool:
    return a.start_time < b.end_time and b.start_time < a.end_time


@pytest.mark.slow
def test_deployments_run_on_workers_share_the_device_and_publish(worker, tmp_path, monkeypatch):
    """Two nightlies and a rebenchmark triggered at once: the nightlies one after the other
    (the deployment's concurrency limit), the rebenchmark beside them on the other worker,
    and no two of their benchmark tasks on the device at once (the device tag's limit)."""
    for key, value in worker.env.items():
        monkeypatch.setenv(key, value)
    with _api() as client:
        deployments = {d.name: d for d in client.read_deployments()}
    assert set(deployments) == {"nightly", "rebenchmark", "fleet-night", "shard"}
    assert deployments["shard"].work_pool_name == "tilecast-shards"
    assert deployments["nightly"].schedules[0].schedule.cron == "0 1 * * *"
    assert all(d.pull_steps == [{"tilecast.flows.steps.enter_home": {}}]
               for d in deployments.values())

    commands = [["tilecast-nightly/nightly", "-p", f"workdir={tmp_path / name / 'work'}",
                 "-p", f"registry={tmp_path / name / 'registry'}",
                 "-p", f"store={tmp_path / name / 'store'}"] for name in ("a", "b")]
    commands.append(["tilecast-rebenchmark/rebenchmark", "-p", f"workdir={tmp_path / 'rebench'}",
                     "-p", f"history={tmp_path / 'history'}"])
    runs = [subprocess.Popen([*PREFECT, "deployment", "run", *command, "--watch",
                              "-p", f"config={TINY}"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=worker.env, cwd=REPO)
            for command in commands]
    for proc in runs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "Completed" in out, out[-4000:]
    for name in ("a", "b"):
        model = f"gemm@{profile(2)['hardware_class']}"   # published under its class
        versions = tmp_path / name / "registry" / model / "versions"
        assert sorted(p.name for p in versions.iterdir()) == ["1"]
        assert (tmp_path / name / "work" / "report" / "evaluation.json").exists()
        [held] = summary(Store(str(tmp_path / name / "store")))   # the night kept, one class
        assert held["nights"] == 1 and held["records"] > 0
    assert (tmp_path / "rebench" / "report" / "rebench_gemm.json").exists()

    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterKey, TaskRunFilter,
                                                TaskRunFilterTags)

    tag = f"device:cpu@{socket.gethostname()}"
    with _api() as client:
        on_device = client.read_task_runs(task_run_filter=TaskRunFilter(
            tags=TaskRunFilterTags(all_=[tag])))
        flow_runs = {r.id: r for r in (client.read_flow_run(t.flow_run_id) for t in on_device)}
        limit = client.read_concurrency_limit_by_tag(tag)
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["tilecast-evaluation", "tilecast-registry"])))
    assert limit.concurrency_limit == 1
    assert sorted(t.name.rsplit("-", 1)[0] for t in on_device) == [
        "benchmark-candidates", "benchmark-candidates", "rebench-family"]
    assert all(t.state_name == "Completed" for t in on_device)
    for i, first in enumerate(on_device):
        for second in on_device[i + 1:]:
            assert not _overlap(first, second), f"{first.name} and {second.name} shared the device"
    nightlies = [flow_runs[t.flow_run_id] for t in on_device
                 if t.name.startswith("benchmark-candidates")]
    assert len(nightlies) == 2 and not _overlap(*nightlies)  # one nightly at a time
    for name in ("w1", "w2"):  # both workers of the pool took work
        assert f"Worker '{name}' submitting flow run" in (worker.logs / f"{name}.log").read_text()

    assert {a.key for a in artifacts} == {"tilecast-evaluation", "tilecast-registry"}
    assert len({a.flow_run_id for a in artifacts}) == 2
    evaluation = next(a for a in artifacts if a.key == "tilecast-evaluation")
    assert "mean_efficiency" in evaluation.data and "data:image/png;base64," in evaluation.data


@pytest.mark.slow
def test_rebenchmark_deployment_fails_on_a_real_regression(worker, tmp_path, monkeypatch,
                                                           slower_gemm_commit):
    """CI's use: the rebenchmark deployment, run with --watch, exits 0 when nothing regressed
    and non-zero when a commit made the kernels slower, with the table as an artifact."""
    for key, value in worker.env.items():
        monkeypatch.setenv(key, value)
    clone, sha = slower_gemm_commit
    common = ["-p", f"config={TINY}", "-p", f"history={tmp_path / 'history'}",
              "-p", "problems=[\"m=64,n=64,k=64\", \"m=96,n=80,k=160\"]"]

    def run(*extra):
        return subprocess.run([*PREFECT, "deployment", "run", "tilecast-rebenchmark/rebenchmark",
                               "--watch", *common, *extra], capture_output=True, text=True,
                              env=worker.env, cwd=REPO, timeout=600)

    baseline = run("-p", f"workdir={tmp_path / 'base'}")
    assert baseline.returncode == 0 and "Completed" in baseline.stdout, baseline.stdout[-3000:]
    slower = run("-p", f"workdir={tmp_path / 'slow'}", "-p", f"git_ref={sha}", "-p", f"repo={clone}")
    assert slower.returncode != 0 and "Failed" in slower.stdout, slower.stdout[-3000:]
    report = json.loads((tmp_path / "slow" / "report" / "rebench_gemm.json").read_text())
    assert report["verdict"] == "regression" and report["git_sha"] == sha
    assert "# Rebenchmark" in (tmp_path / "slow" / "report" / "report.md").read_text()

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with _api() as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["tilecast-rebench"])))
    assert len(artifacts) >= 2  # this test's two runs (and any of the module's earlier ones)
    latest = max(artifacts, key=lambda a: a.created)
    assert "## gemm: REGRESSION" in latest.data and "| kernel | problems |" in latest.data


def test_the_pull_step_enters_the_machines_tilecast_home(tmp_path, monkeypatch):
    from tilecast.flows.steps import enter_home

    monkeypatch.setenv("TILECAST_HOME", str(tmp_path / "home" / "tilecast"))
    assert enter_home() == {"directory": str((tmp_path / "home" / "tilecast").resolve())}
    assert (tmp_path / "home" / "tilecast").is_dir()
    monkeypatch.delenv("TILECAST_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert enter_home()["directory"] == str((tmp_path / "user" / "tilecast").resolve())
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TILECAST_HOME", str(tmp_path / "file" / "home"))
    with pytest.raises(RuntimeError, match=r"cannot be made on this worker"):
        enter_home()
