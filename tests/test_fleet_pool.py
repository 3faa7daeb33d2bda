"""A night over a fleet, for real: a Prefect server on 127.0.0.1, the tilecast-shards process
pool with two workers each pinned to one core (`taskset`) as two machines of one class, the
tiny config cut in two shards, and one worker killed (with its shard's process) while it
measures. The parent gives the dead shard to the other worker after its lease; the night
completes with every problem measured once, and publishes once for the class."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_deployments import PREFECT, REPO, _prefect, _stop, server  # noqa: F401

TINY = Path(__file__).parent / "configs" / "tiny.yaml"
TINY_NIGHT = Path(__file__).parent / "configs" / "tiny_night.yaml"   # tiny's, with a night:

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2,
                                 reason="needs taskset and two cores")]


def _worker(env, tmp_path, core: int) -> subprocess.Popen:
    """A worker of the shards pool as its own machine: `tilecast worker --cpus 1` on a slot of
    one core of this host (its own device, cpu@fleet-test:<core>), its own build cache and
    tilecast home (the deployments' pull step runs its flows there)."""
    own = {**env, "TILECAST_BUILD_CACHE": str(tmp_path / f"cache-{core}"),
           "TILECAST_HOME": str(tmp_path / f"home-{core}")}
    return subprocess.Popen([sys.executable, "-m", "tilecast.flows.cli", "worker", "--pool",
                             "tilecast-shards", "--cpus", "1", "--slots", str(tmp_path / "slots"),
                             "--host", "fleet-test"],
                            stdout=open(tmp_path / f"worker{core}.log", "a"),
                            stderr=subprocess.STDOUT, env=own, cwd=tmp_path,
                            start_new_session=True)


def _kill_machine(worker: subprocess.Popen, shard_pid: int) -> None:
    """The machine dies: its worker and the shard it runs, at once."""
    for kill in (lambda: os.killpg(worker.pid, signal.SIGKILL),
                 lambda: os.kill(shard_pid, signal.SIGKILL)):
        try:
            kill()
        except ProcessLookupError:
            pass
    worker.wait()


def test_a_night_over_two_workers_survives_one_killed_mid_shard(server, tmp_path):  # noqa: F811
    import pandas as pd
    from tilecast.store.nights import read_frame
    from tilecast.store.store import Store

    _prefect(server, "work-pool", "create", "tilecast", "--type", "process")
    _prefect(server, "work-pool", "create", "tilecast-shards", "--type", "process")
    _prefect(server, "--no-prompt", "deploy", "--all")
    workers = {core: _worker(server, tmp_path, core) for core in (0, 1)}
    store, registry, work = tmp_path / "store", tmp_path / "registry", tmp_path / "fleet"
    parent_log = open(tmp_path / "parent.log", "w")
    parent = subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-m", "tilecast.flows.cli", "fleet",
         "--config", str(TINY), "--store", str(store), "--registry", str(registry),
         "--workdir", str(work), "--shards", "2", "--lease-s", "15", "--poll-s", "1",
         "--grace-s", "60"],
        stdout=subprocess.PIPE, stderr=parent_log, text=True, env=server, cwd=REPO,
        start_new_session=True)
    second = None
    try:
        # the first shard seen measuring: its machine dies
        killed = None
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and parent.poll() is None:
            for doc in (store / "fleet").glob("*/*/*/attempt-1.json"):
                lease = json.loads(doc.read_text())
                if lease["state"] == "running":
                    ppid = int(Path(f"/proc/{lease['pid']}/stat").read_text().split()[3])
                    [core] = [c for c, w in workers.items() if w.pid in (ppid, lease["pid"])
                              or _ancestor(w.pid, lease["pid"])]
                    _kill_machine(workers[core], lease["pid"])
                    killed = lease["shard"]
                    break
            time.sleep(0.2)
        assert killed, "no shard was seen running"
        out, _ = parent.communicate(timeout=400)
        # the machine comes back; a second night plans two machines' worth of its budget
        workers[core] = _worker(server, tmp_path, core)
        second = subprocess.run(
            ["taskset", "-c", "0", sys.executable, "-m", "tilecast.flows.cli", "fleet",
             "--config", str(TINY_NIGHT), "--store", str(store), "--registry", str(registry),
             "--workdir", str(tmp_path / "fleet2"), "--shards", "2", "--budget-minutes", "0.3",
             "--shard-workdir", str(tmp_path / "shards"), "--poll-s", "1"],
            capture_output=True, text=True, env=server, cwd=REPO, timeout=300)
    finally:
        _stop(parent)
        for w in workers.values():
            _stop(w)
        parent_log.close()
    log = (tmp_path / "parent.log").read_text()
    assert parent.returncode == 0, log[-4000:]
    summary = json.loads(out)
    [(cls, tonight)] = summary["classes"].items()
    assert summary["failed"] == {} and tonight["missing"] == []
    shards = {s["shard"]: s for s in tonight["families"]["gemm"]["shards"]}
    assert set(shards) == {"gemm-1-of-2", "gemm-2-of-2"}
    assert shards[killed]["attempt"] == 2 and shards[killed]["state"] == "done"
    [other] = set(shards) - {killed}
    assert shards[other]["attempt"] == 1 and shards[other]["state"] == "done"
    assert f"{killed} attempt 2 submitted (attempt 1 silent for more than 15 s (host" in log
    # each machine worked in its own tilecast home (the pull step), under the relative
    # default shard workdir: the killed shard's second attempt on the machine that lived
    night_id = summary["run_id"]
    homes = {core: {p.name for p in (tmp_path / f"home-{core}" / "work" / "shards" / night_id)
                    .iterdir()} for core in (0, 1)
             if (tmp_path / f"home-{core}" / "work" / "shards" / night_id).is_dir()}
    assert set().union(*homes.values()) == set(shards)
    # each worker on a slot of its own core, measuring as its own device
    claims = "".join((tmp_path / f"worker{c}.log").read_text() for c in (0, 1))
    assert "device cpu@fleet-test:0" in claims and "device cpu@fleet-test:1" in claims
    # every problem of the night measured, each candidate's screen once: none lost, none twice
    records = read_frame(Store(str(store)), cls, "gemm", summary["run_id"])
    assert records["dims_key"].nunique() == 15          # 12 grid + 3 held out
    screens = records[(records["role"] == "candidate") & (records["phase"] == "screen")]
    assert not screens.duplicated(["dims_key", "kernel"]).any()
    assert screens.groupby("dims_key")["kernel"].nunique().eq(4).all()
    # trained, evaluated, reported and published once, for the class
    assert (registry / f"gemm@{cls}" / "versions" / "1").is_dir()
    report = (work / "report" / "report.md").read_text()
    assert "### The fleet tonight" in report
    assert pd.read_parquet(work / "data" / "gemm.parquet")["dims_key"].nunique() == 15

    assert second.returncode == 0, second.stderr[-4000:]
    night2 = json.loads(second.stdout)
    plan = json.loads((tmp_path / "fleet2" / "plan" / "gemm.json").read_text())
    assert plan["budget_s"] == pytest.approx(2 * 0.3 * 60)     # two machines' worth
    cut = json.loads((tmp_path / "fleet2" / "fleet" / "gemm.json").read_text())["shards"]
    assert len(cut) == 2 and sum(len(s["items"]) for s in cut) == len(plan["chosen"])
    assert all(s["state"] == "done" for s in night2["classes"][cls]["families"]["gemm"]["shards"])
    measured = read_frame(Store(str(store)), cls, "gemm", night2["run_id"])
    assert set(measured["dims_key"]) == {c["dims_key"] for c in plan["chosen"]}
    assert (registry / f"gemm@{cls}" / "versions" / "2").is_dir()
    report2 = (tmp_path / "fleet2" / "report" / "report.md").read_text()
    assert "### Tonight's plan" in report2 and "### The fleet tonight" in report2


def _ancestor(ancestor: int, pid: int) -> bool:
    """Whether `ancestor` is a parent of `pid` (by /proc)."""
    for _ in range(8):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().split()[3])
        except (OSError, ValueError):
            return False
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False
