"""The CPU DISCO kernels (kernels/cpu/disco/disco_csr.cpp, and disco_kpacked.cpp): each source
compiled once into a shared library, called through ctypes on contiguous float32, bfloat16 or
float16 tensors (computed in float32).

A registry version of a DISCO model carries both libraries prebuilt (tilecast.registry.prebuilt's
process libraries, LIBRARIES; its Dispatcher, e.g. tilecast.runtime.disco.selector's, offers
them when it loads): the first kernel call of a process loads the one a loaded version offers
for this CPU and this tilecast's sources, after its checksum, and compiles nothing. Otherwise
the library lands in a content-hash cache ($TILECAST_CACHE/disco, default
~/.cache/tilecast/disco), built by tilecast.core.compile.cached_compile like every other
compile of tilecast: the key covers the source and the headers the compiler reports it read,
the compiler's identity and the flags; the library is staged and renamed into place, so a
concurrent or interrupted build never leaves a half-written one. A damaged prebuilt file, or
no compiler where nothing prebuilt runs here, is a DiscoBuildError saying so in one line.
Nothing is compiled at import time: the first kernel call builds.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from tilecast.core.settings import CACHE_ENV, COMPILER_ENV, settings  # noqa: F401 - re-exported
from tilecast.core.family import KERNELS_DIR
from tilecast.core import build
from tilecast.registry import prebuilt

SOURCE = KERNELS_DIR / "cpu" / "disco" / "disco_csr.cpp"
KPACKED_SOURCE = SOURCE.with_name("disco_kpacked.cpp")
FLAGS = build.LIBRARY_FLAGS
COMPILE_TIMEOUT_S = build.LIBRARY_TIMEOUT_S
#: the libraries a version can carry prebuilt: name (the source's stem) -> what it is built from
LIBRARIES = {source.stem: prebuilt.ProcessLibrary(source.stem, source, build.source_root(source),
                                                  FLAGS)
             for source in (SOURCE, KPACKED_SOURCE)}

#: kernel return codes (enum Status in disco_csr.cpp) -> what was wrong
STATUS_MESSAGES = {
    1: "bad shape: every size must be positive and nlon_in a multiple of nlon_out",
    2: "bad row offsets: they must start at 0, never decrease and end at nnz",
    3: "a psi column lies outside the grid (psi was built for other shapes)",
    4: "unsupported storage type",
    5: "no such register tile in the kernel library (variant_tiles lists them), or lat_block < 1",
}

#: tensor dtype -> the kernels' storage code (enum Storage in disco_csr.cpp)
STORAGE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class DiscoBuildError(build.LibraryBuildError):
    """The DISCO kernel library could not be compiled or loaded."""


_lock = threading.Lock()
_library: ctypes.CDLL | None = None

_INDEX = ctypes.c_int64
_PTR = ctypes.c_void_p
_KERNEL_ARGS = [_PTR, _PTR, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX, _PTR, _PTR, _PTR,
                _INDEX, ctypes.c_int, ctypes.c_int]
#: the *_variant entries add the tile and the latitude block: (nv, lat_block) forward,
#: (bt, nv, lat_block) transpose
_VARIANT_ARGS = {"tc_disco_contraction_variant": [*_KERNEL_ARGS, ctypes.c_int, _INDEX],
                 "tc_disco_transpose_contraction_variant": [*_KERNEL_ARGS, ctypes.c_int,
                                                            ctypes.c_int, _INDEX]}
#: direction -> its code in tc_disco_variant_tiles
TILE_DIRECTIONS = {"forward": 0, "transpose": 1}


def cache_dir() -> Path:
    """Where the compiled library lives: $TILECAST_CACHE/disco, else ~/.cache/tilecast/disco."""
    return settings().cache_root / "disco"


def compiler() -> str:
    """The C++ compiler: $TILECAST_CXX, else g++."""
    return settings().compiler


def compile_library(source: Path = SOURCE, cxx: str | None = None,
                    directory: Path | None = None, flags: tuple[str, ...] = FLAGS,
                    toolchain: str = "") -> Path:
    """Path of the shared library built from `source`, compiling it unless cached
    (tilecast.core.build.shared_library; default directory cache_dir()). `toolchain` joins the
    cache key (tilecast/disco/cuda.py passes nvcc's host compiler). DiscoBuildError names the
    compiler and quotes its first error lines, or says the compile timed out or was killed."""
    return build.shared_library(source, cxx or compiler(), directory or cache_dir(), flags,
                                toolchain, error=DiscoBuildError)


def build_library(name: str, cxx: str | None = None) -> Path:
    """The cached library LIBRARIES[name] (compiled unless cached, as a first call would), for
    tilecast.runtime.prebuild to carry in a version."""
    return compile_library(LIBRARIES[name].source, cxx)


def _library_path(spec: prebuilt.ProcessLibrary) -> Path:
    """The library `spec` names: the prebuilt one a loaded registry version offers for this
    host, else compiled unless cached. DiscoBuildError in one line for a damaged prebuilt
    file, or where there is no compiler (naming what the versions carry and the prebuild)."""
    cxx = compiler()
    try:
        return prebuilt.process_library(spec) or prebuilt.built(
            spec, cxx, lambda: compile_library(spec.source, cxx))
    except prebuilt.PrebuiltError as err:
        raise DiscoBuildError(str(err)) from None


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
    for name, argtypes in _VARIANT_ARGS.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    lib.tc_disco_variant_tiles.argtypes = [ctypes.c_int, _PTR, _PTR, ctypes.c_int]
    lib.tc_disco_variant_tiles.restype = lib.tc_disco_lanes.restype = ctypes.c_int
    lib.tc_disco_lanes.argtypes = []
    lib.tc_disco_transpose_lines.argtypes = _KERNEL_ARGS
    lib.tc_disco_transpose_lines.restype = lib.tc_disco_line_block.restype = ctypes.c_int
    lib.tc_disco_line_block.argtypes = []
    return lib


def library() -> ctypes.CDLL:
    """The loaded kernel library: prebuilt, or compiled on first use in this process."""
    global _library
    with _lock:
        if _library is None:
            _library = load_library(_library_path(LIBRARIES[SOURCE.stem]))
        return _library


def _check_status(status: int, kernel: str, shape: tuple) -> None:
    if status != 0:
        reason = STATUS_MESSAGES.get(status, f"unknown status {status}")
        raise ValueError(f"{kernel} rejected input of shape {shape}: {reason}")


def _storage(tensor: torch.Tensor) -> int:
    if tensor.dtype not in STORAGE:
        raise ValueError(f"the DISCO kernels store {', '.join(map(str, STORAGE))}, got {tensor.dtype}")
    return STORAGE[tensor.dtype]


def _tile_args(tile, names: tuple[str, ...], kernel: str) -> tuple[int, ...]:
    """A tile given as a sequence or a mapping (e.g. a disco family config) -> its ints in
    `names` order; ValueError names what was expected."""
    if isinstance(tile, dict):
        missing = [n for n in names if n not in tile]
        if missing:
            raise ValueError(f"{kernel} tile {tile!r} lacks {missing}; expected keys {names}")
        tile = [tile[n] for n in names]
    values = tuple(tile)
    if len(values) != len(names) or not all(isinstance(v, int) and v >= 1 for v in values):
        raise ValueError(f"{kernel} tile must be positive integers {names}, got {tile!r}")
    return values


def contraction(x: torch.Tensor, roff: torch.Tensor, col: torch.Tensor, vals: torch.Tensor,
                kernel_size: int, nlat_out: int, nlon_out: int, tile=None) -> torch.Tensor:
    """y (B, C, K, nlat_out, nlon_out) in x's dtype from x (B, C, nlat_in, nlon_in), with the
    forward CSR of psi (roff, col int64, vals float32). All contiguous, on the CPU.

    tile None: the library picks the register tile per call. Else (nv, lat_block), or a
    mapping with those keys (tilecast.runtime.disco.selector.choose_variant's result): run that tile
    with lat_block output latitudes per work item; ValueError if the library lacks the tile."""
    batch, channels, nlat_in, nlon_in = x.shape
    y = torch.empty(batch, channels, kernel_size, nlat_out, nlon_out, dtype=x.dtype)
    args = (x.data_ptr(), y.data_ptr(), batch * channels, nlat_in, nlon_in, kernel_size, nlat_out,
            nlon_out, roff.data_ptr(), col.data_ptr(), vals.data_ptr(), col.numel(), _storage(x),
            torch.get_num_threads())
    if tile is None:
        status = library().tc_disco_contraction(*args)
    else:
        status = library().tc_disco_contraction_variant(
            *args, *_tile_args(tile, ("nv", "lat_block"), "disco contraction"))
    _check_status(status, "disco contraction", tuple(x.shape))
    return y


def transpose_contraction(y: torch.Tensor, troff: torch.Tensor, tcol: torch.Tensor,
                          tvals: torch.Tensor, nlat_in: int, nlon_in: int, tile=None) -> torch.Tensor:
    """x (B, C, nlat_in, nlon_in) in y's dtype from y (B, C, K, nlat_out, nlon_out), with the
    transposed CSR of psi (troff, tcol int64, tvals float32). All contiguous, on the CPU.

    tile None: the library picks the register tile per call. Else (bt, nv, lat_block), or a
    mapping with those keys: run that tile with lat_block input latitudes per work item;
    ValueError if the library lacks the tile."""
    batch, channels, kernel_size, nlat_out, nlon_out = y.shape
    x = torch.empty(batch, channels, nlat_in, nlon_in, dtype=y.dtype)
    args = (y.data_ptr(), x.data_ptr(), batch * channels, nlat_in, nlon_in, kernel_size, nlat_out,
            nlon_out, troff.data_ptr(), tcol.data_ptr(), tvals.data_ptr(), tcol.numel(),
            _storage(y), torch.get_num_threads())
    if tile is None:
        status = library().tc_disco_transpose_contraction(*args)
    else:
        status = library().tc_disco_transpose_contraction_variant(
            *args, *_tile_args(tile, ("bt", "nv", "lat_block"), "disco transpose contraction"))
    _check_status(status, "disco transpose contraction", tuple(y.shape))
    return x


def transpose_lines(y: torch.Tensor, boff: torch.Tensor, bcol: torch.Tensor,
                    bvals: torch.Tensor, nlat_in: int, nlon_in: int) -> torch.Tensor:
    """transpose_contraction's result, bit for bit (gy finite), computed from psi's transpose
    in the line-blocked layout of tilecast.disco.lines (boff, bcol int64, bvals float32
    [keys, line_block()]). All contiguous, on the CPU."""
    batch, channels, kernel_size, nlat_out, nlon_out = y.shape
    if bvals.dim() != 2 or bvals.shape != (bcol.numel(), line_block()):
        raise ValueError(f"disco line-blocked transpose: bvals must be [keys={bcol.numel()}, "
                         f"{line_block()}], got {tuple(bvals.shape)}")
    x = torch.empty(batch, channels, nlat_in, nlon_in, dtype=y.dtype)
    status = library().tc_disco_transpose_lines(
        y.data_ptr(), x.data_ptr(), batch * channels, nlat_in, nlon_in, kernel_size, nlat_out,
        nlon_out, boff.data_ptr(), bcol.data_ptr(), bvals.data_ptr(), bcol.numel(), _storage(y),
        torch.get_num_threads())
    _check_status(status, "disco line-blocked transpose", tuple(y.shape))
    return x


def line_block() -> int:
    """Input lines per block of the line-blocked layout the library's kernel reads."""
    return int(library().tc_disco_line_block())


def forward_tile_width(nlon_out: int) -> int:
    """Output longitudes the forward kernel keeps in registers per tile for this nlon_out."""
    return int(library().tc_disco_forward_tile_width(nlon_out))


def transpose_tile(channels: int, nlon_out: int) -> tuple[int, int]:
    """(channels, longitudes) of the transpose kernel's register tile for B * C = channels."""
    packed = int(library().tc_disco_transpose_tile(channels, nlon_out))
    return packed >> 16, packed & 0xFFFF


def variant_tiles(direction: str) -> tuple[tuple[int, int], ...]:
    """The (BT, NV) register tiles the library instantiates for `direction` ('forward' or
    'transpose'), in its table order: what a `tile` argument may name."""
    if direction not in TILE_DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; valid: {', '.join(TILE_DIRECTIONS)}")
    capacity = 64
    bt, nv = (ctypes.c_int * capacity)(), (ctypes.c_int * capacity)()
    count = library().tc_disco_variant_tiles(TILE_DIRECTIONS[direction], bt, nv, capacity)
    return tuple((bt[i], nv[i]) for i in range(min(count, capacity)))


def lanes() -> int:
    """float32 lanes per vector of the ISA the library was compiled for (16 AVX-512, 8 AVX2)."""
    return int(library().tc_disco_lanes())


# ------------------------------------------------------------------ the kpacked forward
#: extra statuses of the kpacked entry points (enum Status in disco_kpacked.cpp)
KPACKED_STATUS = {5: "K_PAD must be 8 or 16 and at least kernel_size",
                  6: "no such (kreg, nv) register tile in the kpacked library "
                     "(kpacked_variant_tiles lists them), or lat_block < 1"}
_kpacked_library: ctypes.CDLL | None = None
_KPACKED_ARGS = [_PTR, _PTR, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX, _INDEX,
                 _PTR, _PTR, _PTR, _INDEX, ctypes.c_int, ctypes.c_int, ctypes.c_int]
#: the variant entry adds the tile and the latitude block: (kreg, nv, lat_block)
_KPACKED_VARIANT_ARGS = [*_KPACKED_ARGS, ctypes.c_int, ctypes.c_int, _INDEX]
KPACKED_TILE_FIELDS = ("kreg", "nv", "lat_block")
_KPACKED_MIX_ARGS = [_PTR, _PTR, _PTR, *[_INDEX] * 10, _PTR, _PTR, _PTR, _INDEX, ctypes.c_int,
                     ctypes.c_int]


def _kpacked_reason(status: int) -> str:
    """What a kpacked entry point's non-zero status means."""
    return KPACKED_STATUS.get(status) or STATUS_MESSAGES.get(status, f"unknown status {status}")


def kpacked_library() -> ctypes.CDLL:
    """The kpacked kernel library (kernels/cpu/disco/disco_kpacked.cpp): prebuilt, or compiled on
    first use."""
    global _kpacked_library
    with _lock:
        if _kpacked_library is None:
            path = _library_path(LIBRARIES[KPACKED_SOURCE.stem])
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as err:
                raise DiscoBuildError(f"cannot load the DISCO kernel library {path}: {err}") from None
            lib.tc_disco_kpacked_contraction.argtypes = _KPACKED_ARGS
            lib.tc_disco_kpacked_contraction_variant.argtypes = _KPACKED_VARIANT_ARGS
            lib.tc_disco_kpacked_variant_tiles.argtypes = [_PTR, _PTR, ctypes.c_int]
            lib.tc_disco_kpacked_tile.argtypes = [_INDEX]
            lib.tc_disco_kpacked_mix.argtypes = _KPACKED_MIX_ARGS
            for name in ("tc_disco_kpacked_contraction", "tc_disco_kpacked_contraction_variant",
                         "tc_disco_kpacked_variant_tiles", "tc_disco_kpacked_tile",
                         "tc_disco_kpacked_mix"):
                getattr(lib, name).restype = ctypes.c_int
            _kpacked_library = lib
        return _kpacked_library


def kpacked_contraction(x: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor,
                        offset: torch.Tensor, kernel_size: int, nlat_out: int, nlon_out: int,
                        ho_begin: int = 0, ho_count: int | None = None, tile=None) -> torch.Tensor:
    """y (B, C, K, ho_count, nlon_out) in x's dtype: output latitudes [ho_begin, ho_begin +
    ho_count) (default all) of the contraction with psi in the kpacked layout (idx int64
    [nbr, 2], vals float32 [nbr, K_PAD], offset int64 [nlat_out + 1]). All contiguous, CPU.

    tile None: the library picks the register tile per call. Else (kreg, nv, lat_block), or a
    mapping with those keys (tilecast.runtime.disco.selector.choose_variant's result for a kpacked
    kernel): run that tile with lat_block output latitudes per work item (kreg < kernel_size
    runs the basis functions in passes of kreg); ValueError if the library lacks the tile.
    The result is the same bit for bit."""
    batch, channels, nlat_in, nlon_in = x.shape
    ho_count = nlat_out - ho_begin if ho_count is None else ho_count
    y = torch.empty(batch, channels, kernel_size, ho_count, nlon_out, dtype=x.dtype)
    args = (x.data_ptr(), y.data_ptr(), batch * channels, nlat_in, nlon_in, kernel_size, nlat_out,
            nlon_out, ho_begin, ho_count, offset.data_ptr(), idx.data_ptr(), vals.data_ptr(),
            idx.shape[0], vals.shape[1], _storage(x), torch.get_num_threads())
    if tile is None:
        status = kpacked_library().tc_disco_kpacked_contraction(*args)
    else:
        kreg, nv, lat_block = _tile_args(tile, KPACKED_TILE_FIELDS, "disco kpacked contraction")
        status = kpacked_library().tc_disco_kpacked_contraction_variant(
            *args, kreg, nv, lat_block)
    if status != 0:
        raise ValueError(f"disco kpacked contraction rejected input of shape {tuple(x.shape)} "
                         f"(K={kernel_size}, K_PAD={vals.shape[1]}, rows {ho_begin}+{ho_count} "
                         f"of {nlat_out}, tile {tile!r}): {_kpacked_reason(status)}")
    return y


def kpacked_variant_tiles() -> tuple[tuple[int, int], ...]:
    """The (KREG, NV) register tiles the kpacked library instantiates, in its table order:
    what kpacked_contraction's `tile` may name."""
    capacity = 64
    kreg, nv = (ctypes.c_int * capacity)(), (ctypes.c_int * capacity)()
    count = kpacked_library().tc_disco_kpacked_variant_tiles(kreg, nv, capacity)
    return tuple((kreg[i], nv[i]) for i in range(min(count, capacity)))


def kpacked_tile(kernel_size: int) -> tuple[int, int]:
    """(basis functions per pass, output longitudes) of the register tile the kpacked kernel
    runs for kernel_size basis functions when given none; (0, 0) if none."""
    packed = int(kpacked_library().tc_disco_kpacked_tile(kernel_size))
    return packed >> 16, packed & 0xFFFF


def kpacked_mix(x: torch.Tensor, weight: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor,
                offset: torch.Tensor, kernel_size: int, nlat_out: int, nlon_out: int,
                ho_begin: int = 0, ho_count: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """out (B, C_out, nlat_out, nlon_out) = the kpacked contraction of x (B, C, nlat_in,
    nlon_in) mixed by weight (C_out, C * kernel_size): the convolution without bias on one
    group, as one kernel that never writes the contraction (kernels/cpu/disco/disco_kpacked_mix.hpp).
    Only output latitudes [ho_begin, ho_begin + ho_count) (default all) are computed, into
    `out` when given (the others left as they are). float32 on the CPU (x and weight made
    contiguous; out must be); any nlon_out (the kernel's GEMM panels are 16 longitudes on
    AVX2, 32 on AVX-512; a partial last panel is computed whole and cut)."""
    batch, channels, nlat_in, nlon_in = x.shape
    out_channels = weight.shape[0]
    ho_count = nlat_out - ho_begin if ho_count is None else ho_count
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"kpacked_mix runs on the CPU, got x on {x.device}, weight on "
                         f"{weight.device}")
    x, weight = x.contiguous(), weight.contiguous()
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"kpacked_mix is float32 only, got x {x.dtype}, weight {weight.dtype}")
    if weight.shape != (out_channels, channels * kernel_size):
        raise ValueError(f"weight must be (C_out, C * K) = (C_out, {channels * kernel_size}), "
                         f"got {tuple(weight.shape)}")
    shape = (batch, out_channels, nlat_out, nlon_out)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {shape}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    status = kpacked_library().tc_disco_kpacked_mix(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), batch, channels, nlat_in, nlon_in,
        kernel_size, nlat_out, nlon_out, ho_begin, ho_count, out_channels, offset.data_ptr(),
        idx.data_ptr(), vals.data_ptr(), idx.shape[0], vals.shape[1], torch.get_num_threads())
    if status != 0:
        raise ValueError(f"disco kpacked mix rejected input of shape {tuple(x.shape)} (K="
                         f"{kernel_size}, K_PAD={vals.shape[1]}, rows {ho_begin}+{ho_count} of "
                         f"{nlat_out}x{nlon_out}): {_kpacked_reason(status)}")
    return out
