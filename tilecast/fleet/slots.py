"""A machine's CPUs as measuring slots: how several workers of one host each become a machine.

A worker that measures needs CPUs no other measurement touches. On a host with more cores
than one measurement uses, workers take slots: slot i is the i-th run of `cpus` CPUs of the
host's allowed set. A worker claims the first free slot by holding an exclusive lock on
`<slots>/slot-<i>.lock` for its whole life (the lock goes with the process, however it ends),
pins itself to the slot's CPUs and names its device after them, so its lock and its Prefect
device tag are its own: N workers on N slots measure at once without sharing a core. This is
what `tilecast worker` does before it becomes `prefect worker start`; docker/compose.yaml
runs it in every replica of the shard worker, with the slots directory on the host.
"""
from __future__ import annotations

import fcntl
import os
import socket
from dataclasses import dataclass
from pathlib import Path


class SlotError(RuntimeError):
    """No slot can be claimed, in one line."""


@dataclass(frozen=True)
class Slot:
    index: int
    cpus: tuple[int, ...]
    fd: int              # the held lock; inherited by the worker this process becomes

    def device(self, host: str | None = None) -> str:
        """The slot's device name: the host and its CPUs, e.g. `cpu@node7:4-7`."""
        first, last = self.cpus[0], self.cpus[-1]
        span = str(first) if first == last else f"{first}-{last}"
        return f"cpu@{host or socket.gethostname()}:{span}"


def layout(allowed: set[int], cpus: int) -> list[tuple[int, ...]]:
    """The host's slots: consecutive runs of `cpus` of the allowed CPUs, in order (a remainder
    too small for a slot is left unused)."""
    if cpus < 1:
        raise SlotError(f"cpus per worker must be at least 1, got {cpus}")
    ordered = sorted(allowed)
    if cpus > len(ordered):
        raise SlotError(f"{cpus} CPUs per worker, but this process may use {len(ordered)}")
    return [tuple(ordered[i:i + cpus]) for i in range(0, len(ordered) - cpus + 1, cpus)]


def claim(slots: str | Path, cpus: int, allowed: set[int] | None = None) -> Slot:
    """The first free slot of this host, locked by this process (see the module docstring)."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    runs = layout(allowed, cpus)
    folder = Path(slots)
    folder.mkdir(parents=True, exist_ok=True)
    for index, run in enumerate(runs):
        fd = os.open(folder / f"slot-{index}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {','.join(map(str, run))}\n".encode())
        return Slot(index, run, fd)
    raise SlotError(f"all {len(runs)} slots of {cpus} CPUs in {folder} are taken: this host "
                    f"holds {len(runs)} workers of {cpus} CPUs (fewer CPUs per worker, or "
                    "fewer workers)")


def enter(slot: Slot, host: str | None = None) -> dict[str, str]:
    """This process pinned to the slot's CPUs, its lock kept across exec; the environment
    a worker on it runs with (its device)."""
    os.sched_setaffinity(0, set(slot.cpus))
    os.set_inheritable(slot.fd, True)
    return {"TILECAST_DEVICE": slot.device(host)}
