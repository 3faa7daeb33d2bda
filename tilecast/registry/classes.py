"""Models per hardware class: which registered model serves this host.

A model measured on one hardware class (tilecast.core.hardware.hardware_class) is published
as `<model>@<class>`: its own numbered versions, aliases, history and promotion gate, so two
machines of different classes sharing a registry never overwrite each other's production,
and the gate only ever compares versions of one class. A plain `<model>` is a model
published without a class (by a tilecast before classes).

`serving_model` picks, for a name a user gives (`gemm`), what this host serves: its own
class's model; else the nearest class's (same vector ISA first, then CPU model, then thread
and core counts), with one warning naming both classes; else a classless model, with a
warning; else a RegistryError saying how to get a model for this host. A name that already
carries a class is served as it is.
"""
from __future__ import annotations

import logging
import math
import os
import re
import sys

from tilecast.registry.base import RegistryError

log = logging.getLogger("tilecast.registry")

SEPARATOR = "@"
CLASS_PARTS = re.compile(r"^(?P<cpu>.+)-(?P<isa>avx512|avx2|sse)-(?P<cores>\d+)c-(?P<threads>\d+)t-"
                         r"(?P<fingerprint>[0-9a-f]{8})$")
ISA_RANK = {"sse": 0, "avx2": 1, "avx512": 2}
_warned: set[tuple] = set()


def class_model(model: str, hardware_class: str) -> str:
    """The registered name of `model` measured on `hardware_class`."""
    return f"{model}{SEPARATOR}{hardware_class}"


def split(name: str) -> tuple[str, str | None]:
    """(model, hardware class or None) of a registered name."""
    model, _, hardware_class = name.partition(SEPARATOR)
    return model, hardware_class or None


def classes(names: list[str], model: str) -> list[str]:
    """The hardware classes `model` is registered for among registered `names`."""
    return sorted(c for m, c in map(split, names) if m == model and c)


def host_threads() -> int:
    """The thread count this process's kernels will run with: torch's when torch is loaded
    (its ops run the kernels), else OMP_NUM_THREADS, else the CPUs this process may use."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    from tilecast.core.hardware import cpu_count
    return cpu_count()


def host_class(threads: int | None = None) -> str:
    """This host's hardware class at `threads` (default host_threads())."""
    from tilecast.core.hardware import profile
    return profile(threads or host_threads())["hardware_class"]


def distance(served: str, host: str) -> tuple:
    """How far class `served` is from class `host`, as a sort key: a class whose ISA the host
    lacks last, then a different ISA, CPU model, thread count and core count (log ratios)."""
    a, b = CLASS_PARTS.match(served), CLASS_PARTS.match(host)
    if a is None or b is None:
        return (2, 1, 1, math.inf, math.inf, served)
    beyond = ISA_RANK[a["isa"]] > ISA_RANK[b["isa"]]
    return (int(beyond), int(a["isa"] != b["isa"]), int(a["cpu"] != b["cpu"]),
            abs(math.log(int(a["threads"]) / int(b["threads"]))),
            abs(math.log(int(a["cores"]) / int(b["cores"]))), served)


def serving_model(names: list[str], model: str, host: str, where: str) -> str:
    """The registered name that serves `model` on class `host` (see the module docstring);
    `names` are the registry's models, `where` names the registry in messages."""
    if split(model)[1] is not None:
        return model
    own = class_model(model, host)
    if own in names:
        return own
    registered = classes(names, model)
    if registered:
        nearest = min(registered, key=lambda c: distance(c, host))
        _warn_once((where, model, nearest, host),
                   f"registry {where} has no {model!r} model for this host's hardware class "
                   f"{host}; serving the nearest class's, {nearest} (its kernels were ranked "
                   f"there; `tilecast run --registry {where}` on this host publishes one of "
                   "its own)")
        return class_model(model, nearest)
    if model in names:
        _warn_once((where, model, "", host),
                   f"registry {where}: model {model!r} was published without a hardware "
                   f"class; serving it on {host} (a run on this host publishes "
                   f"{class_model(model, host)!r})")
        return model
    raise RegistryError(f"registry {where} has no {model!r} model for any hardware class "
                        f"(this host is {host}): run `tilecast run --config nightly --registry "
                        f"{where}` on this host to measure and publish one")


def _warn_once(key: tuple, message: str) -> None:
    """Log `message` once per process for `key` (registry, model, served class, host):
    a service choosing per request warns once, not per call."""
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)
