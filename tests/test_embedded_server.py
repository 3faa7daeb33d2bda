"""The embedded Prefect server of `tilecast run` (tilecast.flows.embedded_server): Prefect's own
`prefect server start`, it answers on loopback once ready, retries a port taken meanwhile,
stops on SIGTERM, and never outlives the command that started it, even a killed one."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _isolated_prefect(monkeypatch, home: Path) -> None:
    """The server's environment: its own PREFECT_HOME (a copy of the migrated template
    database `tilecast run` starts from, when there is one), offline."""
    from tilecast.flows.cli import _template_database

    home.mkdir(parents=True)
    template = _template_database()
    if template is not None:
        shutil.copy(template, home / "prefect.db")
    monkeypatch.setenv("PREFECT_HOME", str(home))
    monkeypatch.setenv("DO_NOT_TRACK", "1")
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def _health(api_url: str) -> bytes:
    with urllib.request.urlopen(api_url + "/health", timeout=5) as response:
        assert response.status == 200
        return response.read().strip()

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


def test_the_server_is_prefect_s_own_command_and_stops(tmp_path, monkeypatch):
    from tilecast.flows.embedded_server import EmbeddedServer

    _isolated_prefect(monkeypatch, tmp_path / "home")
    server = EmbeddedServer(tmp_path / "server.log")
    process = server.process
    try:
        server.wait_ready()
        argv = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode().split("\0")
        assert argv[1:8] == ["-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port"]
        assert argv[8] == str(server.port) and "--no-ui" in argv
        assert _health(server.api_url) == b"true"
    finally:
        server.stop()
    # ended by the SIGTERM (uvicorn re-raises it after its shutdown), not the SIGKILL after it
    assert process.returncode in (0, -signal.SIGTERM), server._log_tail()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    server.stop()  # a second stop is a no-op


def test_a_port_taken_before_the_server_binds_it_is_retried(tmp_path, monkeypatch):
    from tilecast.flows import embedded_server

    _isolated_prefect(monkeypatch, tmp_path / "home")
    free_port = embedded_server._free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        monkeypatch.setattr(embedded_server, "_free_port", lambda: next(ports, None) or free_port())
        server = embedded_server.EmbeddedServer(tmp_path / "server.log")
        try:
            server.wait_ready()
            assert server.port != busy and _health(server.api_url) == b"true"
        finally:
            server.stop()
    log = (tmp_path / "server.log").read_text()
    assert str(busy) in log and "already in use" in log  # the first launch's own message
