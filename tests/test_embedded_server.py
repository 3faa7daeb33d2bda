"""The embedded Prefect server of `tilecast run` (tilecast.flows.embedded_server): it answers on
loopback once ready, and it never outlives the command that started it, even a killed one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# a command that starts the server, waits for it, reports, then dies without cleaning up
CHILD = """
import json, os, signal, sys, urllib.request
from pathlib import Path
from tilecast.flows.cli import prefect_env
from tilecast.flows.embedded_server import EmbeddedServer
workdir = Path(sys.argv[1])
prefect_env(workdir)
server = EmbeddedServer(workdir / "server.log")
server.wait_ready()
with urllib.request.urlopen(server.api_url + "/health", timeout=5) as response:
    healthy = response.status == 200
print(json.dumps({"pid": server.process.pid, "url": server.api_url, "healthy": healthy}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_server_answers_then_dies_with_a_killed_command(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_HOME", None)
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "work")], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=180)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["healthy"] and report["url"].startswith("http://127.0.0.1:")
    pid = report["pid"]
    deadline = time.monotonic() + 15
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)  # the server this test started, by its PID
        pytest.fail("the embedded server outlived the command that started it")


def test_a_server_that_cannot_start_is_a_message_with_its_log(tmp_path, monkeypatch):
    from tilecast.flows import embedded_server

    monkeypatch.setattr(embedded_server.sys, "executable", "/bin/false")
    server = embedded_server.EmbeddedServer(tmp_path / "server.log")
    with pytest.raises(RuntimeError, match="exited with status 1"):
        server.wait_ready(timeout_s=30)
    server.stop()
