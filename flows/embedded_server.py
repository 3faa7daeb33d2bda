"""`tilecast run`'s embedded Prefect server, started as the command's first step.

Prefect starts its ephemeral server at a flow's first API call, after the command has
imported Prefect and the flows, and the server's own boot (a second Python process importing
Prefect and opening the database, about 4 s on 2 cores) then holds the run up. Started here
first, the server boots while the command imports. It is Prefect's own command line,
`prefect server start` (SERVER_COMMAND) on a free loopback port, without the UI, the
scheduler, late-run marking and analytics; the other services a single run never needs are
off through their public settings (tilecast.flows.cli.prefect_env). Only that public command
is used, so a Prefect release within the range pyproject.toml pins cannot break the launch.
The command reaches it through PREFECT_API_URL; it ends with the command: `stop()`, and the
kernel's parent-death signal when the command is killed.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

#: the server's command line after `--port N` (Prefect's CLI, see `prefect server start --help`)
SERVER_COMMAND = ("-m", "prefect", "server", "start", "--host", "127.0.0.1")
SERVER_FLAGS = ("--no-ui", "--no-scheduler", "--no-late-runs", "--analytics-off",
                "--log-level", "WARNING")

#: what Prefect's pre-start check and uvicorn both say when the port is taken (another
#: process bound it between _free_port and the server's bind)
PORT_TAKEN = b"already in use"


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
    """Runs in the server's process before Prefect: SIGTERM when its parent dies (Linux's
    PR_SET_PDEATHSIG), so a killed run leaves no server behind. Elsewhere a no-op.
    `prefect server start` serves in its own process (one worker), so the signal reaches
    the server itself."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedServer:
    """One Prefect server process on a free loopback port; `log_path` gets its output."""

    def __init__(self, log_path: Path):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None
        self.port = 0
        self._log_start = 0   # where this launch's output begins in the log
        self._launch()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def command(self) -> list[str]:
        """The server's command line."""
        return [sys.executable, *SERVER_COMMAND, "--port", str(self.port), *SERVER_FLAGS]

    def _launch(self) -> None:
        self.port = _free_port()
        env = dict(os.environ)
        env.pop("PREFECT_API_URL", None)   # the server's own URL is this launch's port
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self.process = subprocess.Popen(
                self.command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def _port_was_taken(self) -> bool:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return PORT_TAKEN in log.read().lower()
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Return once the server answers /health; RuntimeError with its log's tail when it
        exits or does not answer within timeout_s. A port taken meanwhile is retried."""
        deadline = time.monotonic() + timeout_s
        retries = 3
        while time.monotonic() < deadline:
            status = self.process.poll()
            if status is not None and retries and self._port_was_taken():
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
