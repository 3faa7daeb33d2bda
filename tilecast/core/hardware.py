"""The hardware profile read from this machine: cores, SIMD width, caches, clock, ISA flags."""
from __future__ import annotations

import hashlib
import os
import platform
import re
from pathlib import Path

CPU_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")


def _size_bytes(text: str) -> int:
    text = text.strip().upper()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def _caches() -> dict[str, int]:
    """Per-instance data/unified cache sizes by level from sysfs (0 when unknown)."""
    sizes = {"l1d_bytes": 0, "l2_bytes": 0, "l3_bytes": 0}
    if not CPU_SYSFS.exists():
        return sizes
    for index in sorted(CPU_SYSFS.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = _size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        key = {"1": "l1d_bytes", "2": "l2_bytes", "3": "l3_bytes"}.get(level)
        if key:
            sizes[key] = size
    return sizes


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor block is enough
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


def cpu_count() -> int:
    """CPUs this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def profile(threads: int | None = None) -> dict:
    """The machine's profile; `threads` is the thread count kernels are measured with."""
    info = _cpuinfo()
    flags = sorted(info.get("flags", "").split())
    simd_bits = 512 if "avx512f" in flags else 256 if "avx2" in flags else 128
    cores = cpu_count()
    prof = {
        "cpu_model": info.get("model name", platform.processor() or "unknown"),
        "machine": platform.machine(),
        "cores": cores,
        "threads": int(threads or cores),
        "simd_bits": simd_bits,
        "clock_mhz": float(info.get("cpu MHz", 0.0) or 0.0),
        "flags": flags,
        **_caches(),
    }
    prof["fingerprint"] = fingerprint(prof)
    prof["hardware_class"] = hardware_class(prof)
    return prof


def fingerprint(prof: dict) -> str:
    """A short stable id of what changes kernel speed: model, cores, threads, caches, ISA."""
    isa = [f for f in prof.get("flags", ()) if f.startswith(("avx", "fma", "amx", "sse4"))]
    parts = [prof.get("cpu_model", ""), prof.get("cores"), prof.get("threads"),
             prof.get("l1d_bytes"), prof.get("l2_bytes"), prof.get("l3_bytes"), ",".join(isa)]
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:12]


# A class id is a path segment (a store's partition, a registry's folder): these characters only.
CLASS_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{0,95}$")
# words of a CPU's model name that say nothing about it
_NOISE = {"processor", "cpu", "core", "with", "radeon", "graphics"}


def isa_level(prof: dict) -> str:
    """The widest vector ISA the profile's flags allow: avx512, avx2 or sse."""
    flags = set(prof.get("flags", ()))
    return "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "sse"


def hardware_class(prof: dict) -> str:
    """The profile's hardware class: what changes kernel speed (the fingerprint's CPU model,
    cores, thread count, caches and ISA) as a readable, path-safe id, e.g.
    `amd-epyc-avx512-2c-2t-1a2b3c4d`. Two machines of one class share labels and models."""
    name = re.sub(r"\((r|tm)\)", " ", str(prof.get("cpu_model", "")).lower()).split("@")[0]
    words = [w for w in re.split(r"[^a-z0-9]+", name) if w and w not in _NOISE]
    model = "-".join(w for w in words if w)[:40].strip("-") or "cpu"
    return (f"{model}-{isa_level(prof)}-{prof.get('cores', 0)}c-{prof.get('threads', 0)}t-"
            f"{fingerprint(prof)[:8]}")
