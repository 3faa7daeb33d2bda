"""The CUDA DISCO kernels (kernels/cuda/disco_csr.cu): compiled with nvcc into a shared
library, loaded with ctypes on the first call with CUDA tensors, called with raw device
pointers on the tensors' current stream.

Nothing CUDA happens at import: ops.py registers the tilecast:: ops for CUDA tensors (a Python
function in the dispatcher), and without a GPU no CUDA tensor reaches these functions, so the
library is never built or loaded. It is built by native.compile_library into
$TILECAST_CACHE/disco/cuda (default ~/.cache/tilecast/disco/cuda), keyed like the CPU library
plus nvcc's full version and the host compiler's. nvcc is $TILECAST_NVCC, else `nvcc` on
PATH, else $CUDA_HOME/bin/nvcc. It compiles machine code for each architecture of
$TILECAST_CUDA_ARCH (e.g. "90", "80,90a", "sm_90"; default: the device's compute capability,
90 without one) and PTX for the last, which newer GPUs compile at load.

psi's offsets and columns are checked on the device once per psi (a sync), not per call:
see _CheckedPsi. The kernels themselves only clamp them, so that bad ones read no memory
outside psi and the planes.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
import threading
import weakref
from pathlib import Path

import torch

from tilecast.core import resources
from tilecast.core import build
from tilecast.disco import native
from tilecast.disco.native import DiscoBuildError

KERNELS = resources.kernels_dir() / "cuda"
SOURCE = KERNELS / "disco_csr.cu"
#: the same entry points over host memory, CTAs run thread by thread on the CPU (tests)
EMULATOR = KERNELS / "disco_csr_emulate.cu"
NVCC_ENV = "TILECAST_NVCC"
ARCH_ENV = "TILECAST_CUDA_ARCH"
DEFAULT_ARCH = "90"
HOST_COMPILER = "g++"  # nvcc's default host compiler; its version joins the cache key
COMMON_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "-lineinfo", "--compiler-options", "-fPIC",
                "-shared")
ENTRY_POINTS = ("tc_disco_cuda_contraction", "tc_disco_cuda_transpose_contraction",
                "tc_disco_cuda_channel_tile", "tc_disco_cuda_error_string")

#: kernel return codes (enum Status in disco_csr.cuh) -> what was wrong
STATUS_MESSAGES = {
    **native.STATUS_MESSAGES,
    5: "too large for the CUDA kernels: a channel plane needs 2**31 elements or more, or the "
       "grid exceeds CUDA's launch limits",
}
CUDA_ERROR_BASE = 1000  # a status >= this is CUDA_ERROR_BASE + the launch's cudaError_t

_ARCH_RE = re.compile(r"^(?:sm_|compute_)?(\d+)\.?(\d*[a-z]?)$")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None

_INDEX = ctypes.c_int64
_PTR = ctypes.c_void_p
_KERNEL_ARGS = [_PTR, _PTR, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX, _PTR, _PTR, _PTR,
                _INDEX, ctypes.c_int, ctypes.c_int, _PTR]


def cache_dir() -> Path:
    """Where the compiled libraries live: the CPU library's directory, /cuda."""
    return native.cache_dir() / "cuda"


def nvcc() -> str:
    """Path of CUDA's compiler; DiscoBuildError says how to provide it when there is none."""
    named = os.environ.get(NVCC_ENV)
    candidates = [named] if named else ["nvcc"]
    if not named and os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"))
    for candidate in candidates:
        found = shutil.which(candidate)
        if found:
            return found
    raise DiscoBuildError(
        f"nvcc {'(' + NVCC_ENV + '=' + named + ') ' if named else ''}was not found: the DISCO "
        "CUDA kernels are compiled with it on first use. Install the CUDA toolkit and put its "
        f"bin/ on PATH, set CUDA_HOME, or set {NVCC_ENV} to nvcc's path")


def parse_architectures(text: str) -> tuple[str, ...]:
    """'80, sm_90a;9.0' -> ('80', '90a', '90'): compute capabilities, as nvcc spells them."""
    archs = []
    for token in filter(None, re.split(r"[\s,;]+", text)):
        match = _ARCH_RE.match(token.strip())
        if not match:
            raise ValueError(f"bad CUDA architecture {token!r} in {ARCH_ENV}={text!r}; write "
                             "compute capabilities like 90, 90a, sm_80 or 8.6, comma-separated")
        archs.append(match.group(1) + match.group(2))
    if not archs:
        raise ValueError(f"{ARCH_ENV}={text!r} names no CUDA architecture; e.g. 90 or 80,90")
    return tuple(archs)


def architectures(device: torch.device | None = None) -> tuple[str, ...]:
    """$TILECAST_CUDA_ARCH, else `device`'s compute capability (if given), else 90."""
    if os.environ.get(ARCH_ENV):
        return parse_architectures(os.environ[ARCH_ENV])
    if device is not None:
        major, minor = torch.cuda.get_device_capability(device)
        return (f"{major}{minor}",)
    return (DEFAULT_ARCH,)


def nvcc_flags(archs: tuple[str, ...]) -> tuple[str, ...]:
    """nvcc's flags: machine code for every arch, PTX for the last."""
    gencode = []
    for arch in archs:
        gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return (*COMMON_FLAGS, *gencode)


@functools.lru_cache(maxsize=None)
def toolchain(nvcc_path: str) -> str:
    """nvcc's whole `--version` (its first line names no release) and the host compiler's."""
    try:
        out = subprocess.run([nvcc_path, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        raise DiscoBuildError(f"nvcc {nvcc_path!r} is not usable: {err}") from None
    try:
        host = build.compiler_version(HOST_COMPILER)
    except RuntimeError as err:
        raise DiscoBuildError(f"nvcc needs a host C++ compiler: {err}") from None
    return f"{' '.join(out.stdout.split())} | host {host}"


def compile_library(source: Path = SOURCE, archs: tuple[str, ...] | None = None,
                    directory: Path | None = None) -> Path:
    """Path of the shared library nvcc builds from `source` for `archs` (default:
    architectures()), compiling it unless cached; DiscoBuildError quotes nvcc's errors."""
    compiler = nvcc()
    return native.compile_library(source, compiler,
                                  Path(directory) if directory is not None else cache_dir(),
                                  nvcc_flags(archs or architectures()), toolchain=toolchain(compiler))


def load_library(path: Path) -> ctypes.CDLL:
    """The library at `path` (SOURCE's or EMULATOR's), its entry points typed for ctypes."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise DiscoBuildError(f"cannot load the DISCO CUDA library {path}: {err}") from None
    for name in ("tc_disco_cuda_contraction", "tc_disco_cuda_transpose_contraction"):
        getattr(lib, name).argtypes = _KERNEL_ARGS
        getattr(lib, name).restype = ctypes.c_int
    lib.tc_disco_cuda_channel_tile.argtypes = [_INDEX]
    lib.tc_disco_cuda_channel_tile.restype = ctypes.c_int
    lib.tc_disco_cuda_error_string.argtypes = [ctypes.c_int]
    lib.tc_disco_cuda_error_string.restype = ctypes.c_char_p
    return lib


def library(device: torch.device | None = None) -> ctypes.CDLL:
    """The loaded CUDA library, compiled on first use in this process (for `device`'s
    architecture unless $TILECAST_CUDA_ARCH names others)."""
    global _library
    with _lock:
        if _library is None:
            _library = load_library(compile_library(archs=architectures(device)))
        return _library


class _CheckedPsi:
    """psi tensors already checked on their device. A check is a device sync, so it runs
    once per psi rather than per call; a tensor changed in place (its _version moved) or a
    new tensor at a recycled id is checked again."""

    def __init__(self):
        self._seen: dict[tuple, tuple] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _versions(*tensors: torch.Tensor) -> tuple:
        try:
            return tuple(t._version for t in tensors)
        except RuntimeError:  # inference tensors keep no version counter
            return (None,) * len(tensors)

    def check(self, offsets: torch.Tensor, columns: torch.Tensor, bound: int, kernel: str,
              shape: tuple) -> None:
        """ValueError unless offsets start at 0, never decrease and end at nnz, and every
        column lies in [0, bound)."""
        key = (id(offsets), id(columns), bound)
        versions = self._versions(offsets, columns)
        with self._lock:
            seen = self._seen.get(key)
        if seen and seen[0]() is offsets and seen[1]() is columns and seen[2] == versions:
            return
        _check_status(psi_status(offsets, columns, bound), kernel, shape)
        with self._lock:
            self._seen = {k: v for k, v in self._seen.items()
                          if v[0]() is not None and v[1]() is not None}
            self._seen[key] = (weakref.ref(offsets), weakref.ref(columns), versions)


_checked = _CheckedPsi()


def psi_status(offsets: torch.Tensor, columns: torch.Tensor, bound: int) -> int:
    """The status the CPU kernel gives this CSR: 0, 2 (bad offsets) or 3 (a column outside
    [0, bound)), computed where the tensors are, with one sync."""
    offsets_ok = (offsets[0] == 0) & (offsets[-1] == columns.numel()) \
        & (offsets[1:] >= offsets[:-1]).all()
    columns_ok = ((columns >= 0) & (columns < bound)).all()
    offsets_ok, columns_ok = torch.stack([offsets_ok, columns_ok]).tolist()
    return 0 if offsets_ok and columns_ok else 2 if not offsets_ok else 3


def _check_status(status: int, kernel: str, shape: tuple, lib: ctypes.CDLL | None = None) -> None:
    if status == 0:
        return
    if status >= CUDA_ERROR_BASE:
        described = lib.tc_disco_cuda_error_string(status) if lib is not None else None
        reason = f"CUDA error {status - CUDA_ERROR_BASE}" + (f" ({described.decode()})" if described else "")
        raise RuntimeError(f"{kernel} failed to launch for input of shape {shape}: {reason}")
    reason = STATUS_MESSAGES.get(status, f"unknown status {status}")
    raise ValueError(f"{kernel} rejected input of shape {shape}: {reason}")


def _launch_args(tensor: torch.Tensor) -> tuple[int, int | None]:
    """(device index, stream handle) for a call on `tensor`; (-1, None) on the host (the
    emulator)."""
    if tensor.device.type != "cuda":
        return -1, None
    return tensor.device.index, torch.cuda.current_stream(tensor.device).cuda_stream


def _storage(tensor: torch.Tensor) -> int:
    if tensor.dtype not in native.STORAGE:
        raise ValueError(f"the DISCO CUDA kernels store {', '.join(map(str, native.STORAGE))}, "
                         f"got {tensor.dtype}")
    return native.STORAGE[tensor.dtype]


def _library_for(tensor: torch.Tensor, lib: ctypes.CDLL | None) -> ctypes.CDLL:
    return lib if lib is not None else library(tensor.device)


def contraction(x: torch.Tensor, roff: torch.Tensor, col: torch.Tensor, vals: torch.Tensor,
                kernel_size: int, nlat_out: int, nlon_out: int,
                lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """y (B, C, K, nlat_out, nlon_out) in x's dtype from x (B, C, nlat_in, nlon_in), with the
    forward CSR of psi (roff, col int64, vals float32). All contiguous, on one CUDA device
    (on the host with `lib` the emulator)."""
    batch, channels, nlat_in, nlon_in = x.shape
    _checked.check(roff, col, nlat_in * nlon_in, "disco contraction", tuple(x.shape))
    lib = _library_for(x, lib)
    y = torch.empty(batch, channels, kernel_size, nlat_out, nlon_out, dtype=x.dtype, device=x.device)
    status = lib.tc_disco_cuda_contraction(
        x.data_ptr(), y.data_ptr(), batch * channels, nlat_in, nlon_in, kernel_size, nlat_out,
        nlon_out, roff.data_ptr(), col.data_ptr(), vals.data_ptr(), col.numel(),
        _storage(x), *_launch_args(x))
    _check_status(status, "disco contraction", tuple(x.shape), lib)
    return y


def transpose_contraction(y: torch.Tensor, troff: torch.Tensor, tcol: torch.Tensor,
                          tvals: torch.Tensor, nlat_in: int, nlon_in: int,
                          lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x (B, C, nlat_in, nlon_in) in y's dtype from y (B, C, K, nlat_out, nlon_out), with the
    transposed CSR of psi (troff, tcol int64, tvals float32). All contiguous, on one CUDA
    device (on the host with `lib` the emulator)."""
    batch, channels, kernel_size, nlat_out, nlon_out = y.shape
    _checked.check(troff, tcol, kernel_size * nlat_out * nlon_out, "disco transpose contraction",
                   tuple(y.shape))
    lib = _library_for(y, lib)
    x = torch.empty(batch, channels, nlat_in, nlon_in, dtype=y.dtype, device=y.device)
    status = lib.tc_disco_cuda_transpose_contraction(
        y.data_ptr(), x.data_ptr(), batch * channels, nlat_in, nlon_in, kernel_size, nlat_out,
        nlon_out, troff.data_ptr(), tcol.data_ptr(), tvals.data_ptr(), tcol.numel(),
        _storage(y), *_launch_args(y))
    _check_status(status, "disco transpose contraction", tuple(y.shape), lib)
    return x


def channel_tile(channels: int, lib: ctypes.CDLL | None = None) -> int:
    """Channels per CTA (BC_TILE: 8, 4 or 1) of both kernels for B * C = channels."""
    return int((lib if lib is not None else library()).tc_disco_cuda_channel_tile(channels))
