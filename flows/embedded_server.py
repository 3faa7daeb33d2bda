"""`tilecast run`'s embedded Prefect server, started as the command's first step.

Prefect starts its ephemeral server at a flow's first API call, after the command has
imported Prefect and the flows, and the server's own boot (a second Python process importing
Prefect and opening the database, about 4 s on 2 cores) then holds the run up. Started here
first, the server boots while the command imports. It is the server Prefect would start (the
launch of prefect.server.api.server.SubprocessASGIServer: uvicorn serving `create_app` in
ephemeral mode on 127.0.0.1, no UI), reached through PREFECT_API_URL; it ends with the
command: `stop()`, and the kernel's parent-death signal when the command is killed.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

#: uvicorn's exit status when the port is taken (another process bound it first)
PORT_IN_USE = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PR_SET_PDEATHSIG = 1
try:  # resolved here: the forked child only calls it (the command may have threads by then)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def _die_with_parent() -> None:
    """Runs in the server's process before uvicorn: SIGTERM when its parent dies (Linux's
    PR_SET_PDEATHSIG), so a killed run leaves no server behind. Elsewhere a no-op."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedServer:
    """One Prefect server process on a free loopback port; `log_path` gets its output."""

    def __init__(self, log_path: Path):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        spec = importlib.util.find_spec("prefect")
        if spec is None or spec.origin is None:
            raise RuntimeError("prefect is not installed; run the README's set-up command")
        self._app_dir = str(Path(spec.origin).parent.parent)
        self.process: subprocess.Popen | None = None
        self.port = 0
        self._launch()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _launch(self) -> None:
        self.port = _free_port()
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}
        env.pop("PREFECT_API_URL", None)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--app-dir", self._app_dir, "--factory",
                 "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port",
                 str(self.port), "--log-level", "error", "--lifespan", "on"],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Return once the server answers /health; RuntimeError with its log's tail when it
        exits or does not answer within timeout_s. A port taken meanwhile is retried."""
        deadline = time.monotonic() + timeout_s
        retries = 3
        while time.monotonic() < deadline:
            status = self.process.poll()
            if status == PORT_IN_USE and retries:
                retries -= 1
                self._launch()
                continue
            if status is not None:
                raise RuntimeError(f"the embedded Prefect server exited with status {status}:\n"
                                   f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the embedded Prefect server did not answer within {timeout_s:.0f} s:"
                           f"\n{self._log_tail()}")

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL after 5 s); safe to call twice."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no server log)"
