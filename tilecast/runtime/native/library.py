"""Compile a tilecast/runtime/native C++ source once into a shared library and load it with ctypes.

The library lands in a content-hash cache (`$TILECAST_CACHE/native`, default
`~/.cache/tilecast/native`), built by tilecast.core.compile.cached_compile like every other
compile of tilecast: the key covers the source and the headers the compiler reports it read,
the compiler's identity and the flags, so an edit or a new compiler builds a new file and
nothing is ever rebuilt in place; the library is staged and renamed into place, so a
concurrent or interrupted build never leaves a half-written one. Nothing is compiled at
import time.

A registry version carries these libraries prebuilt (tilecast.registry.prebuilt's process
libraries, LIBRARIES; the Dispatcher offers them before it builds its scorer): `load` takes
the one a loaded version offers for this CPU and this tilecast's sources, after its checksum,
and compiles nothing; otherwise it compiles as above. A damaged prebuilt file, or no
compiler, is a NativeBuildError saying so in one line, and the scorer keeps its numpy path.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from tilecast.core import compile as compiling
from tilecast.core.settings import COMPILER_ENV, settings  # noqa: F401 - re-exported
from tilecast.core import build
from tilecast.registry import prebuilt

NATIVE_DIR = Path(__file__).resolve().parent
CACHE_ENV = build.CACHE_ENV
# -ffp-contract=off: a fused multiply-add rounds once where numpy rounds twice, and the
# native features must equal the numpy engine's bit for bit. -fno-trapping-math changes no
# value (only whether a floating-point exception may be raised), and lets branch-free
# loops vectorize.
FLAGS = ("-std=c++17", "-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math",
         "-shared", "-fPIC", "-DNDEBUG")
COMPILE_TIMEOUT_S = 120.0
#: the libraries a version can carry prebuilt: name (the source's stem) -> what it is built from
LIBRARIES = {Path(source).stem: prebuilt.ProcessLibrary(Path(source).stem, NATIVE_DIR / source,
                                                        NATIVE_DIR, FLAGS)
             for source in ("forest.cpp", "gemm_features.cpp")}


class NativeBuildError(RuntimeError):
    """A native library could not be compiled or loaded (no compiler, compile error, bad
    library); callers fall back to their pure-Python path."""


_loaded: dict[tuple, ctypes.CDLL | NativeBuildError] = {}
_lock = threading.Lock()


def cache_dir() -> Path:
    """Where compiled libraries live: $TILECAST_CACHE/native, else ~/.cache/tilecast/native."""
    return build.cache_root() / "native"


def compiler() -> str:
    """The C++ compiler: $TILECAST_CXX, else g++."""
    return settings().compiler


def load(source_name: str) -> ctypes.CDLL:
    """The loaded library built from tilecast/runtime/native/<source_name>: the prebuilt one a
    loaded registry version offers for this host, else compiled on first use in this process
    (or found in the cache). NativeBuildError says why it is not available; a failure is
    remembered per (source, compiler), so it is tried once per process."""
    source = NATIVE_DIR / source_name
    spec = LIBRARIES.get(source.stem)
    try:
        found_prebuilt = prebuilt.process_library(spec) if spec is not None else None
    except prebuilt.PrebuiltError as err:
        raise NativeBuildError(str(err)) from None
    key = (("prebuilt", str(found_prebuilt)) if found_prebuilt is not None
           else (source, compiler(), FLAGS, str(cache_dir())))
    with _lock:
        found = _loaded.get(key)
        if found is None:
            try:
                path = found_prebuilt or _compiled_for_load(source, key[1], key[3])
                found = ctypes.CDLL(str(path))
            except NativeBuildError as err:
                found = err
            except OSError as err:  # the file exists but is no loadable library
                found = NativeBuildError(f"cannot load the native library for {source.name}: "
                                         f"{err}")
            _loaded[key] = found
    if isinstance(found, NativeBuildError):
        raise NativeBuildError(str(found))  # a fresh one: re-raising would grow its traceback
    return found


def build_library(name: str, cxx: str | None = None) -> Path:
    """The cached library LIBRARIES[name] (compiled unless cached, as `load` would), for
    tilecast.runtime.prebuild to carry in a version. NativeBuildError when it does not build."""
    return _compiled(LIBRARIES[name].source, cxx or compiler(), str(cache_dir()))


def _compiled(source: Path, cxx: str, directory: str) -> Path:
    job = compiling.CompileJob(source, cxx, FLAGS, suffix=".so")
    try:
        result = compiling.cached_compile(job, Path(directory), COMPILE_TIMEOUT_S)
    except RuntimeError as err:  # CompilerUnavailable: no such compiler
        raise NativeBuildError(str(err)) from None
    except OSError as err:
        raise NativeBuildError(f"cannot build {source.name} into {directory}: {err}; set "
                               f"{CACHE_ENV} to a writable directory") from None
    if not result.ok:
        raise NativeBuildError(f"compiling {source.name} with {cxx!r} failed "
                               f"({result.outcome.replace('_', ' ')}): {result.reason(1500)}")
    return result.artifact


def _compiled_for_load(source: Path, cxx: str, directory: str) -> Path:
    """_compiled, for a library no loaded version offers for this host: where a version
    offers it, a warning names the builds it carries, or without a compiler the error says in
    one line what they are and which prebuild to run (tilecast.registry.prebuilt.built)."""
    spec = LIBRARIES.get(source.stem)
    if spec is None:
        return _compiled(source, cxx, directory)
    try:
        return prebuilt.built(spec, cxx, lambda: _compiled(source, cxx, directory))
    except prebuilt.PrebuiltError as err:
        raise NativeBuildError(str(err)) from None
