"""What the machines of a fleet night say about their shards, kept in the shared store.

For hardware class C, night R and shard N (tilecast.fleet.shards.Shard.name), under the
night's key K = `night_key(C, R)` (a mixed fleet's classes share the night, not the shards):

    fleet/K/N/current.json       written by the parent: which attempt is the shard's now
    fleet/K/N/attempt-<a>.json   written by the machine running attempt a: its state
                                 (running, done, refused, failed), host, last heartbeat

A running attempt rewrites its document every HEARTBEAT_S seconds; the parent reads a
document older than its lease as a machine that is gone, and gives the shard to another
attempt. An attempt that is no longer current (the parent gave up on it, or closed the night)
appends nothing: a machine thought dead that comes back cannot duplicate the records of the
attempt that replaced it.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Iterator

from tilecast.store.store import Store, StoreError

log = logging.getLogger("tilecast.fleet")

FLEET_DIR = "fleet"
HEARTBEAT_S = 10.0
STATES = ("running", "done", "refused", "failed")


def night_key(hardware_class: str, night: str) -> str:
    """Where the leases of one class's shards of `night` live (the `night` argument below)."""
    return f"{hardware_class}/{night}"


def now() -> datetime:
    return datetime.now(timezone.utc)


def age_s(document: dict | None, at: datetime | None = None) -> float:
    """Seconds since the document's heartbeat (inf with none)."""
    if not document or not document.get("heartbeat"):
        return float("inf")
    beat = datetime.fromisoformat(str(document["heartbeat"]))
    return ((at or now()) - beat).total_seconds()


def current(store: Store, night: str, shard: str) -> dict | None:
    """The parent's word on the shard: {"attempt", "flow_run", "closed"}, or None before it
    was ever submitted."""
    return store.get_json(f"{FLEET_DIR}/{night}/{shard}/current.json")


def set_current(store: Store, night: str, shard: str, attempt: int,
                flow_run: str | None = None, closed: bool = False) -> None:
    store.put_json(f"{FLEET_DIR}/{night}/{shard}/current.json",
                   {"attempt": int(attempt), "flow_run": flow_run, "closed": bool(closed),
                    "time": now().isoformat()})


def attempt_doc(store: Store, night: str, shard: str, attempt: int) -> dict | None:
    return store.get_json(f"{FLEET_DIR}/{night}/{shard}/attempt-{int(attempt)}.json")


@dataclass
class Lease:
    """One machine's attempt at one shard."""
    store: Store
    night: str
    shard: str
    attempt: int
    clock: Callable[[], datetime] = now

    @property
    def relative(self) -> str:
        return f"{FLEET_DIR}/{self.night}/{self.shard}/attempt-{self.attempt}.json"

    def write(self, state: str, **extra) -> None:
        if state not in STATES:
            raise ValueError(f"lease state {state!r}; valid: {', '.join(STATES)}")
        document = {"shard": self.shard, "attempt": self.attempt, "state": state,
                    "host": socket.gethostname(), "pid": os.getpid(),
                    "heartbeat": self.clock().isoformat(), **extra}
        self._last = document
        self.store.put_json(self.relative, document)

    def superseded(self) -> str | None:
        """Why this attempt may no longer append (None while it may)."""
        word = current(self.store, self.night, self.shard)
        if word is None:
            return None
        if word.get("closed"):
            return "the parent closed the night (its deadline passed)"
        if int(word.get("attempt", 0)) != self.attempt:
            return (f"attempt {word.get('attempt')} replaced this attempt ({self.attempt}): "
                    "the parent saw it as gone")
        return None

    @contextmanager
    def beating(self, every_s: float = HEARTBEAT_S, **extra) -> Iterator["Lease"]:
        """Running, with a heartbeat every `every_s` seconds, until the block ends."""
        self.write("running", **extra)
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every_s):
                try:
                    self.write("running", **extra)
                except StoreError as err:   # the store is away a moment: say so, go on
                    log.warning("fleet %s: heartbeat not written: %s", self.shard, err)

        thread = threading.Thread(target=beat, name=f"lease-{self.shard}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()


def machines(store: Store, night: str) -> int:
    """How many shards of `night` (a night_key) finished on some machine (0: not a fleet
    night): a night's span over its measuring, times this, is its machines' time
    (tilecast.store.plan's calibration)."""
    done = 0
    for shard in store.list_names(f"{FLEET_DIR}/{night}"):
        word = current(store, night, shard)
        document = word and attempt_doc(store, night, shard, int(word.get("attempt", 0)))
        done += bool(document and document.get("state") == "done")
    return done
