"""Progress of the build and benchmark tasks while they run: a Prefect progress artifact per
stage and family (in a flow or task run, so under a server), and a rich progress bar when
stderr is a terminal.

The stages know nothing of either: they call `progress(done, total, message)`, and a
StageProgress is the callback a task passes in. It still writes every message as the stage's
own log line (STAGES), so the logs, on the console and on the server, read as without it. On
a terminal the bars sit below the log lines: while they show, the logging handlers that write
to that terminal write through rich's console (its FileProxy), which prints their lines above
the bars. The bars are redrawn only when a stage reports, never by a timer thread (one would
wake on the cores the benchmarks measure).
"""
from __future__ import annotations

import functools
import logging
import multiprocessing
import re
import threading
from dataclasses import dataclass
from typing import Callable

import httpx
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import PrefectConsoleHandler
from rich.console import Console
from rich.file_proxy import FileProxy
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn

from tilecast.core import build
from tilecast.stages import bench

log = logging.getLogger("tilecast.progress")

#: stage -> (what its steps are, the log line it writes for each without a reporter)
STAGES: dict[str, tuple[str, Callable[[int, int, str], None]]] = {
    "build": ("candidates compiled", build.log_progress),
    "bench": ("batches and race rounds measured", bench.log_progress),
}


def artifact_key(stage: str, family: str) -> str:
    """`tilecast-<stage>-<family>` in the characters Prefect allows in a key (lowercase
    letters, digits, dashes): the UI groups one family's stage over the runs by it."""
    return re.sub(r"[^a-z0-9-]+", "-", f"tilecast-{stage}-{family}".lower())


class StageProgress:
    """The progress callback of one stage of one family, used as a context manager around
    the stage: its artifact (and bar) ends at 100 % when the stage returns, and stays where
    it was when the stage raises. `console` is for tests; by default the bar goes to the
    console Prefect logs to, when that is a terminal."""

    def __init__(self, stage: str, family: str, console: Console | None = None):
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r} for progress; valid: {', '.join(STAGES)}")
        self.stage, self.family = stage, family
        self._steps, self._log_line = STAGES[stage]
        self._console = console
        self._artifact = None
        self._bar: _Bar | None = None
        self._total = 1

    def __enter__(self) -> "StageProgress":
        if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
            self._artifact = self._send(create_progress_artifact, 0.0,
                                        key=artifact_key(self.stage, self.family),
                                        description=f"{self.stage} {self.family}: {self._steps}")
        console = self._console or _log_console()
        if console is not None and console.is_terminal:
            self._bar = _Bar(console, f"{self.stage} {self.family}")
        return self

    def __call__(self, done: int, total: int, message: str) -> None:
        self._log_line(done, total, message)
        self._show(done, total)

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:  # every step done, also those a stage may skip (a race not run)
            self._show(self._total, self._total)
        if self._bar is not None:
            self._bar.close()

    def _show(self, done: int, total: int) -> None:
        self._total = total
        if self._artifact is not None:
            percent = 100.0 * min(done, total) / total if total > 0 else 100.0
            self._send(update_progress_artifact, self._artifact, percent)
        if self._bar is not None:
            self._bar.show(done, total)

    def _send(self, call, *args, **kwargs):
        """A call to the Prefect API; when it fails, the artifact stops following the stage
        (a warning says so) rather than the stage failing."""
        try:
            return call(*args, **kwargs)
        except httpx.HTTPError as err:
            log.warning("%s %s: progress artifact not updated any more (%s: %s)", self.stage,
                        self.family, type(err).__name__, err)
            self._artifact = None
            return None


def _log_console() -> Console | None:
    """The console of Prefect's console handler when it has one (its lines then print above
    the bars by themselves), else one on stderr; None in a Dask worker process, which shares
    the command's terminal (bars of several processes would draw over each other)."""
    if multiprocessing.parent_process() is not None:
        return None
    for logger in (logging.getLogger("prefect"), logging.getLogger()):
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler):
                return handler.console
    return _stderr_console()


@functools.cache
def _stderr_console() -> Console:
    return Console(stderr=True, soft_wrap=True)  # a long log line wraps as it would without bars


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(logging.getLogger(name)
                                      for name in list(logging.Logger.manager.loggerDict))]
    return [handler for logger in loggers for handler in logger.handlers
            if isinstance(handler, logging.StreamHandler)
            and not isinstance(handler, PrefectConsoleHandler)]


def _route_log_lines(console: Console) -> list[tuple[logging.StreamHandler, object]]:
    """Point the logging handlers that write to `console`'s file (`tilecast run`'s
    basicConfig handler on stderr) at the console, so that their lines print above the bars
    instead of through them; returns each handler with the stream to give back."""
    return [(handler, handler.setStream(FileProxy(console, handler.stream)))
            for handler in _stream_handlers() if handler.stream is console.file]


@dataclass
class _Display:
    """The bars shown on one console: its Progress, how many stages show a bar in it, and
    the logging handlers routed to it (with the streams to give back)."""
    progress: Progress
    routed: list[tuple[logging.StreamHandler, object]]
    stages: int = 0


_LOCK = threading.Lock()
#: id(console) -> its display: rich allows one live display per console, and the builds of
#: several families run at once
_DISPLAYS: dict[int, _Display] = {}


class _Bar:
    """One stage's bar in the display of its console, shown while any stage reports to it."""

    def __init__(self, console: Console, description: str):
        self._console_id = id(console)
        with _LOCK:
            display = _DISPLAYS.get(self._console_id)
            if display is None:
                progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                    MofNCompleteColumn(), TaskProgressColumn(), console=console,
                                    auto_refresh=False, redirect_stdout=False)
                progress.start()
                display = _DISPLAYS[self._console_id] = _Display(progress,
                                                                 _route_log_lines(console))
            display.stages += 1
            self._progress = display.progress
            self._task = self._progress.add_task(description, total=None)
            self._progress.refresh()

    def show(self, done: int, total: int) -> None:
        with _LOCK:
            self._progress.update(self._task, completed=min(done, total), total=total)
            self._progress.refresh()

    def close(self) -> None:
        with _LOCK:
            display = _DISPLAYS[self._console_id]
            display.stages -= 1
            if display.stages == 0:
                display.progress.stop()
                for handler, stream in display.routed:
                    handler.setStream(stream)
                del _DISPLAYS[self._console_id]
