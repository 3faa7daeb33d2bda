"""The machine's ceilings, measured now (kernels/cpu/common/fma_peak.cpp): the CPU's float32 FMA
throughput (register-only chains of vector FMAs on each thread, the rate no GEMM on this
machine can pass at that moment) and the memory read bandwidth (each thread streaming its share
of a buffer larger than the caches: the rate no GEMV can pass). The shared machines tilecast
is measured on change speed within minutes, so a benchmark that quotes a GEMM bound reads the
probe in the same rounds as what it bounds.

The library is built on first use into the shared libraries' cache
(tilecast.core.build.shared_library: content-hash key, atomic rename).
"""
from __future__ import annotations

import ctypes
import threading

from tilecast.core import build, resources

SOURCE = resources.kernels_dir() / "cpu" / "common" / "fma_peak.cpp"

_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _library
    with _lock:
        if _library is None:
            path = build.shared_library(SOURCE)
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as err:
                raise build.LibraryBuildError(f"cannot load the FMA probe {path}: {err}") from None
            lib.tc_fma_peak.argtypes = [ctypes.c_int, ctypes.c_int64,
                                        ctypes.POINTER(ctypes.c_double),
                                        ctypes.POINTER(ctypes.c_float)]
            lib.tc_fma_peak.restype = ctypes.c_double
            lib.tc_read_gbps.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                         ctypes.POINTER(ctypes.c_double),
                                         ctypes.POINTER(ctypes.c_float)]
            lib.tc_read_gbps.restype = ctypes.c_double
            lib.tc_bf16_dot_peak.argtypes = lib.tc_fma_peak.argtypes
            lib.tc_bf16_dot_peak.restype = ctypes.c_double
            lib.tc_fma_lanes.argtypes = []
            lib.tc_fma_lanes.restype = ctypes.c_int
            _library = lib
        return _library


def lanes() -> int:
    """float32 lanes of the probe's vector FMA (8 AVX2, 16 AVX-512)."""
    return int(_lib().tc_fma_lanes())


def _check_chains(threads: int, iterations: int) -> None:
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, got {iterations}")


def fma_peak_gflops(threads: int, iterations: int = 16_000_000) -> float:
    """GFLOP/s of `threads` threads running independent FMA chains for `iterations` rounds
    of 10 FMAs each (16M rounds: ~30 ms on a 2.8 GHz AVX2 core)."""
    _check_chains(threads, iterations)
    seconds, sink = ctypes.c_double(), ctypes.c_float()
    flops = _lib().tc_fma_peak(threads, iterations, ctypes.byref(seconds), ctypes.byref(sink))
    if flops < 0 or seconds.value <= 0:
        raise RuntimeError(f"the FMA probe failed (flops {flops}, {seconds.value} s)")
    return flops / seconds.value / 1e9


def bf16_dot_peak_gflops(threads: int, iterations: int = 8_000_000) -> float | None:
    """GFLOP/s of `threads` threads running independent chains of AVX-512 BF16 dot products
    (vdpbf16ps: two multiply-adds a lane), the ceiling of a bf16 GEMM; None where the CPU (the
    probe is built for this one) has no AVX-512 BF16."""
    _check_chains(threads, iterations)
    seconds, sink = ctypes.c_double(), ctypes.c_float()
    flops = _lib().tc_bf16_dot_peak(threads, iterations, ctypes.byref(seconds), ctypes.byref(sink))
    if flops < 0:
        return None
    if seconds.value <= 0:
        raise RuntimeError(f"the bf16 dot probe failed ({seconds.value} s)")
    return flops / seconds.value / 1e9


def read_bandwidth_gbps(threads: int, mib: int = 256, passes: int = 4) -> float:
    """GB/s (1e9 bytes) at which `threads` threads read a `mib` MiB buffer, each its own
    share, `passes` times in each of two ways (8 streams a thread on the hardware's
    prefetchers, and the same asking for lines 4 KiB ahead), the faster way's rate (256 MiB,
    well past any last-level cache here: ~0.1 s a pass)."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if mib < 1 or passes < 1:
        raise ValueError(f"mib and passes must be at least 1, got {mib} and {passes}")
    seconds, sink = ctypes.c_double(), ctypes.c_float()
    moved = _lib().tc_read_gbps(threads, mib << 20, passes, ctypes.byref(seconds), ctypes.byref(sink))
    if moved < 0 or seconds.value <= 0:
        raise RuntimeError(f"the bandwidth probe failed ({moved} bytes, {seconds.value} s): "
                           f"out of memory for {mib} MiB?")
    return moved / seconds.value / 1e9
