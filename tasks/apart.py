"""Stages that compute in Python run the families side by side, each in a process of its own.

The flow's trainings fan out once the device's benchmarks are done, but on the task runner's
threads they ran one after another: LightGBM aside, learning a model is Python (the shortlist's
thousands of predictions, the features), which one interpreter runs one thread at a time, and
the OpenMP runtime slows down on a second thread (tilecast.tasks.stages._COMPUTE). Here a
stage runs in a worker process of a pool (spawned, as many as the CPUs, at most MAX_WORKERS),
made when the first such stage starts, so nothing starts beside a benchmark. A worker makes
the run's context from the same arguments as the task and calls the same stage function;
its `tilecast` log records come back to the task's thread and are logged there, so they reach
the console and the task run's logs as before. Where the task itself runs in a worker process
of its own (the Dask task runner) the stage runs there, as before.
"""
from __future__ import annotations

import atexit
import importlib
import itertools
import logging
import logging.handlers
import multiprocessing
import os
import queue
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

MAX_WORKERS = 4
LOGGER = "tilecast"

_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None
_records = None                     # the workers' log records, (job, record)
_inboxes: dict[int, queue.Queue] = {}
_jobs = itertools.count()
_job = None                         # in a worker: the job whose records it sends


def _worker_init(records) -> None:
    """A worker's `tilecast` logger sends its records, tagged with the job, to the parent."""
    global _records
    _records = records
    logger = logging.getLogger(LOGGER)
    logger.handlers[:] = [_Forward()]
    logger.propagate = False


class _Forward(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None
            record.exc_info = record.exc_text = None
            _records.put((_job, record))
        except Exception:   # a record that cannot travel is not worth a failed stage
            self.handleError(record)


def _run(job: int, level: int, stage: str, ctx_args: tuple, ctx_options: dict, family: str):
    global _job
    _job = job
    logging.getLogger(LOGGER).setLevel(level)   # the asking task's, as its lines would be
    from tilecast.workflows.pipeline import RunContext

    try:
        module, name = stage.split(":")
        function = getattr(importlib.import_module(module), name)
        return function(RunContext.create(*ctx_args, **ctx_options), family)
    finally:
        _records.put((job, None))   # the job's last record: its end
        _job = None


def _route() -> None:
    """The parent's side: each record to the inbox of the task that asked for its job."""
    while True:
        try:
            job, record = _records.get()
        except (EOFError, OSError):
            return
        inbox = _inboxes.get(job)
        if inbox is not None:
            inbox.put(record)


def _shutdown() -> None:
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)


def _start() -> ProcessPoolExecutor:
    global _pool, _records
    with _lock:
        if _pool is None:
            context = multiprocessing.get_context("spawn")
            _records = context.SimpleQueue()
            workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1))
            _pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init,
                                        initargs=(_records,))
            threading.Thread(target=_route, name="tilecast-apart-logs", daemon=True).start()
            atexit.register(_shutdown)
        return _pool


def usable() -> bool:
    """Whether stages may run apart here: not inside a daemonic worker (Dask's), which may
    not start processes of its own."""
    return not multiprocessing.current_process().daemon


def run(stage: str, ctx_args: tuple, ctx_options: dict, family: str):
    """`stage` ("module:function", e.g. "tilecast.workflows.pipeline:train_stage") called as
    function(RunContext.create(*ctx_args, **ctx_options), family) in a worker process; its
    log records are logged on this thread as they come, its result returned and its
    exception raised here."""
    pool = _start()
    job = next(_jobs)
    inbox: queue.Queue = queue.Queue()
    _inboxes[job] = inbox
    try:
        level = logging.getLogger(LOGGER).getEffectiveLevel()
        future = pool.submit(_run, job, level, stage, ctx_args, ctx_options, family)
        waited = 0   # polls since the job ended without its end marker (it never ran, or
        while True:  # its worker died): the marker of one that ran is on its way
            try:
                record = inbox.get(timeout=0.1)
            except queue.Empty:
                if future.done():
                    waited += 1
                    if isinstance(future.exception(), BrokenProcessPool) or waited > 50:
                        break
                continue
            if record is None:
                break
            logging.getLogger(record.name).handle(record)
        return future.result()
    finally:
        _inboxes.pop(job, None)
