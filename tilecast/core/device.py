"""Exclusive use of a benchmark device on this host.

Two benchmarks on one device at once corrupt each other's samples. Prefect's tag concurrency
limit keeps benchmark tasks of one server's flow runs apart; this lock keeps apart every
benchmark on the host, whatever started it (two `tilecast run`s with their own embedded
servers, a `--plain` run, a rebenchmark). It is an advisory `flock` on a file, so the kernel
releases it when its holder dies: a killed run never leaves the device locked."""
from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tilecast.core.settings import settings

log = logging.getLogger("tilecast.core.device")

#: a benchmark task's Prefect tag is this and the device's name; the tag's concurrency limit
#: of 1 keeps benchmark tasks of every flow run on one server apart (tasks.orchestration)
TAG_PREFIX = "device:"


def default_device() -> str:
    """The device a benchmark here runs on: $TILECAST_DEVICE, else this host's CPU. Workers in
    containers of one machine set the same TILECAST_DEVICE (and share the lock directory), so
    they take turns on the CPU they share."""
    return settings().device or f"cpu@{socket.gethostname()}"


def device_tag(device: str | None = None) -> str:
    """The Prefect tag of `device` (default: default_device()), e.g. `device:cpu@host1`."""
    return TAG_PREFIX + (device or default_device())


def lock_dir() -> Path:
    """$TILECAST_LOCKS, else `devices/` in tilecast's cache ($TILECAST_CACHE or ~/.cache/tilecast)."""
    return settings().lock_dir


@contextmanager
def exclusive(device: str, *, poll_s: float = 5.0) -> Iterator[None]:
    """Hold `device` for the block; waits (saying who holds it) while another process does."""
    directory = lock_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (re.sub(r"[^A-Za-z0-9_.@-]", "_", device) + ".lock")
    with open(path, "a+") as handle:
        waited = 0.0
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                if waited == 0.0 or waited % 60 < poll_s:
                    log.info("device %s is busy (%s); waiting %.0fs so far", device, holder, waited)
                time.sleep(poll_s)
                waited += poll_s
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)
