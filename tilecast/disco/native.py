"""The CPU DISCO kernels (kernels/cpu/disco_csr.cpp): compiled once into a shared library,
called through ctypes on contiguous float32, bfloat16 or float16 tensors (computed in float32).

The library lands in a content-hash cache ($TILECAST_CACHE/disco, default
~/.cache/tilecast/disco) keyed by tilecast.build.cache_key: the source and its local
headers, the compiler's version and the flags. The compiler writes a temp file beside the
target that is then renamed, so a concurrent or interrupted build never leaves a
half-written library. Nothing is compiled at import time: the first kernel call builds.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from pathlib import Path

import torch

from .. import build

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "cpu" / "disco_csr.cpp"
CACHE_ENV = "TILECAST_CACHE"
COMPILER_ENV = "TILECAST_CXX"
FLAGS = (*build.DEFAULT_FLAGS, "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 300.0
_STDERR_LINES = 12

#: kernel return codes (enum Status in disco_csr.cpp) -> what was wrong
STATUS_MESSAGES = {
    1: "bad shape: every size must be positive and nlon_in a multiple of nlon_out",
    2: "bad row offsets: they must start at 0, never decrease and end at nnz",
    3: "a psi column lies outside the grid (psi was built for other shapes)",
    4: "unsupported storage type",
}

#: tensor dtype -> the kernels' storage code (enum Storage in disco_csr.cpp)
STORAGE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class DiscoBuildError(RuntimeError):
    """The DISCO kernel library could not be compiled or loaded."""


_lock = threading.Lock()
_library: ctypes.CDLL | None = None

_INDEX = ctypes.c_int64
_PTR = ctypes.c_void_p
_KERNEL_ARGS = [_PTR, _PTR, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX, _PTR, _PTR, _PTR,
                _INDEX, ctypes.c_int, ctypes.c_int]


def cache_dir() -> Path:
    """Where the compiled library lives: $TILECAST_CACHE/disco, else ~/.cache/tilecast/disco."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "tilecast") / "disco"


def compiler() -> str:
    """The C++ compiler: $TILECAST_CXX, else g++."""
    return os.environ.get(COMPILER_ENV) or "g++"


def compile_library(source: Path = SOURCE, cxx: str | None = None,
                    directory: Path | None = None, flags: tuple[str, ...] = FLAGS,
                    toolchain: str = "") -> Path:
    """Path of the shared library built from `source`, compiling it unless cached.
    `toolchain` joins the cache key: what else changes the binary that the first line of
    `cxx --version` does not name (nvcc's names no release; tilecast/disco/cuda.py passes it).
    DiscoBuildError names the compiler and quotes the first lines of its error output."""
    cxx = cxx or compiler()
    directory = Path(directory) if directory is not None else cache_dir()
    try:
        key = build.cache_key(source, {"toolchain": toolchain} if toolchain else {}, flags, cxx)
    except RuntimeError as err:  # compiler_version: no such compiler
        raise DiscoBuildError(str(err)) from None
    target = directory / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    command = [cxx, *flags, str(source), "-o", str(temp)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        temp.unlink(missing_ok=True)
        raise DiscoBuildError(f"compiling {source.name} with {cxx!r} failed: {err}") from None
    if proc.returncode != 0:
        temp.unlink(missing_ok=True)
        first_lines = "\n".join(proc.stderr.strip().splitlines()[:_STDERR_LINES])
        raise DiscoBuildError(f"compiling {source.name} with {cxx!r} "
                              f"({build.compiler_version(cxx)}) failed (exit {proc.returncode}):\n"
                              f"{first_lines}")
    os.replace(temp, target)
    return target


def load_library(path: Path) -> ctypes.CDLL:
    """The kernel library at `path`, its entry points typed for ctypes."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise DiscoBuildError(f"cannot load the DISCO kernel library {path}: {err}") from None
    for name in ("tc_disco_contraction", "tc_disco_transpose_contraction"):
        getattr(lib, name).argtypes = _KERNEL_ARGS
        getattr(lib, name).restype = ctypes.c_int
    lib.tc_disco_forward_tile_width.argtypes = [_INDEX]
    lib.tc_disco_transpose_tile.argtypes = [_INDEX, _INDEX]
    lib.tc_disco_forward_tile_width.restype = lib.tc_disco_transpose_tile.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL:
    """The loaded kernel library, compiled on first use in this process."""
    global _library
    with _lock:
        if _library is None:
            _library = load_library(compile_library())
        return _library


def _check_status(status: int, kernel: str, shape: tuple) -> None:
    if status != 0:
        reason = STATUS_MESSAGES.get(status, f"unknown status {status}")
        raise ValueError(f"{kernel} rejected input of shape {shape}: {reason}")


def _storage(tensor: torch.Tensor) -> int:
    if tensor.dtype not in STORAGE:
        raise ValueError(f"the DISCO kernels store {', '.join(map(str, STORAGE))}, got {tensor.dtype}")
    return STORAGE[tensor.dtype]


def contraction(x: torch.Tensor, roff: torch.Tensor, col: torch.Tensor, vals: torch.Tensor,
                kernel_size: int, nlat_out: int, nlon_out: int) -> torch.Tensor:
    """y (B, C, K, nlat_out, nlon_out) in x's dtype from x (B, C, nlat_in, nlon_in), with the
    forward CSR of psi (roff, col int64, vals float32). All contiguous, on the CPU."""
    batch, channels, nlat_in, nlon_in = x.shape
    y = torch.empty(batch, channels, kernel_size, nlat_out, nlon_out, dtype=x.dtype)
    status = library().tc_disco_contraction(
        x.data_ptr(), y.data_ptr(), batch * channels, nlat_in, nlon_in, kernel_size, nlat_out,
        nlon_out, roff.data_ptr(), col.data_ptr(), vals.data_ptr(), col.numel(), _storage(x),
        torch.get_num_threads())
    _check_status(status, "disco contraction", tuple(x.shape))
    return y


def transpose_contraction(y: torch.Tensor, troff: torch.Tensor, tcol: torch.Tensor,
                          tvals: torch.Tensor, nlat_in: int, nlon_in: int) -> torch.Tensor:
    """x (B, C, nlat_in, nlon_in) in y's dtype from y (B, C, K, nlat_out, nlon_out), with the
    transposed CSR of psi (troff, tcol int64, tvals float32). All contiguous, on the CPU."""
    batch, channels, kernel_size, nlat_out, nlon_out = y.shape
    x = torch.empty(batch, channels, nlat_in, nlon_in, dtype=y.dtype)
    status = library().tc_disco_transpose_contraction(
        y.data_ptr(), x.data_ptr(), batch * channels, nlat_in, nlon_in, kernel_size, nlat_out,
        nlon_out, troff.data_ptr(), tcol.data_ptr(), tvals.data_ptr(), tcol.numel(), _storage(y),
        torch.get_num_threads())
    _check_status(status, "disco transpose contraction", tuple(y.shape))
    return x


def forward_tile_width(nlon_out: int) -> int:
    """Output longitudes the forward kernel keeps in registers per tile for this nlon_out."""
    return int(library().tc_disco_forward_tile_width(nlon_out))


def transpose_tile(channels: int, nlon_out: int) -> tuple[int, int]:
    """(channels, longitudes) of the transpose kernel's register tile for B * C = channels."""
    packed = int(library().tc_disco_transpose_tile(channels, nlon_out))
    return packed >> 16, packed & 0xFFFF
