"""The fault-injection suite's ledger: every case a test inflicts (bad input, a kill, a
damaged file, a race) is counted here by how it ended, and the session's figures are printed
at the end of the run (`conftest.pytest_terminal_summary`), as issue 19 asks:

    cases tried, cases that ended in a clear message, processes killed by a signal (goal 0),
    records lost or duplicated (goal 0), alias/history disagreements over concurrent promotes.

A test calls `cli(...)` (or `expect_clear` on a result it ran itself) for a command a user
could type, and `note_records` / `note_promotes` for what a kill or a race left behind; each
still asserts its own expectation, the ledger only adds the figures up.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LEDGER: Counter = Counter()


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PYTHONPATH": str(REPO_ROOT)})
    env.update(extra or {})
    return env


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None,
            stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`tilecast ARGS` in a subprocess (the console script's entry point), text output."""
    code = "import sys; from tilecast.flows.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd,
                          env=_env(env), input=stdin, capture_output=True, timeout=timeout)


def classify(result: subprocess.CompletedProcess) -> str:
    """How a command ended: 'signal' (killed by one), 'traceback', 'clear' (exit 2, the
    last stderr line one 'error:' message, no traceback), 'ok' (exit 0) or 'other'."""
    err = result.stderr.decode(errors="replace") if isinstance(result.stderr, bytes) \
        else result.stderr
    if result.returncode < 0 or result.returncode in (134, 139):
        return "signal"
    if "Traceback (most recent call last)" in err:
        return "traceback"
    if result.returncode == 2 and "error:" in (err.strip().splitlines() or [""])[-1]:
        return "clear"
    return "ok" if result.returncode == 0 else "other"


def expect_clear(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Count a bad-input case and assert it ended in one clear message (exit 2) that names
    each of `needles` (the key path, the bad value, ...); returns the message."""
    kind = classify(result)
    LEDGER["cases"] += 1
    LEDGER[kind] += 1
    err = result.stderr.decode(errors="replace") if isinstance(result.stderr, bytes) \
        else result.stderr
    assert kind == "clear", f"expected a clear error (exit 2), got {kind} " \
                            f"(exit {result.returncode}):\n{err[-3000:]}"
    message = err.strip().splitlines()[-1]
    for needle in needles:
        assert needle in message, f"{needle!r} not in the message: {message}"
    return message


def cli(*args: str, needles: tuple = (), **kwargs) -> str:
    """Run a command that must fail with a clear message; see `expect_clear`."""
    return expect_clear(run_cli(*args, **kwargs), *needles)


def note_case(kind: str) -> None:
    """Count a case checked in-process: kind is 'clear', 'signal', 'traceback' or 'ok'."""
    LEDGER["cases"] += 1
    LEDGER[kind] += 1


def note_records(lost: int, duplicated: int) -> None:
    """What a kill (or a repeated input) did to the records: both should be 0."""
    LEDGER["record_checks"] += 1
    LEDGER["records_lost"] += lost
    LEDGER["records_duplicated"] += duplicated


def note_promotes(trials: int, disagreements: int) -> None:
    """Concurrent promote trials and the states where alias and history disagreed after."""
    LEDGER["promote_trials"] += trials
    LEDGER["alias_history_disagreements"] += disagreements


def summary() -> str | None:
    """The figures line, or None when no fault case ran."""
    if not LEDGER:
        return None
    return ("fault injection: {cases} cases tried, {clear} ended in a clear message, "
            "{traceback} in a traceback, {signal} killed by a signal; records lost {records_lost}, "
            "duplicated {records_duplicated} over {record_checks} kill/repeat checks; alias and "
            "history disagreed {alias_history_disagreements} times over {promote_trials} "
            "concurrent promote trials").format_map(_Zero(LEDGER))


class _Zero(dict):
    def __missing__(self, key):
        return 0
