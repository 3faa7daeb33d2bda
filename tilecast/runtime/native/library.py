"""Compile a tilecast/runtime/native C++ source once into a shared library and load it with ctypes.

The library lands in a content-hash cache (`$TILECAST_CACHE/native`, default
`~/.cache/tilecast/native`): the key covers the source and its local headers, the compiler's
version and the flags (tilecast.stages.build.cache_key), so an edit or a new compiler builds a new
file and nothing is ever rebuilt in place. The compiler writes a temp file in the cache
directory that is then renamed, so a concurrent or interrupted build never leaves a
half-written library. Nothing is compiled at import time.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from pathlib import Path

from tilecast.core.settings import COMPILER_ENV, settings  # noqa: F401 - re-exported
from tilecast.stages import build

NATIVE_DIR = Path(__file__).resolve().parent
CACHE_ENV = build.CACHE_ENV
# -ffp-contract=off: a fused multiply-add rounds once where numpy rounds twice, and the
# native features must equal the numpy engine's bit for bit. -fno-trapping-math changes no
# value (only whether a floating-point exception may be raised), and lets branch-free
# loops vectorize.
FLAGS = ("-std=c++17", "-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math",
         "-shared", "-fPIC", "-DNDEBUG")
COMPILE_TIMEOUT_S = 120.0


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
    """The loaded library built from tilecast/runtime/native/<source_name>, compiled on first use in
    this process (or found in the cache). NativeBuildError says why it is not available; a
    failure is remembered per (source, compiler), so it is tried once per process."""
    source = NATIVE_DIR / source_name
    key = (source, compiler(), FLAGS, str(cache_dir()))
    with _lock:
        found = _loaded.get(key)
        if found is None:
            try:
                found = ctypes.CDLL(str(_compiled(source, key[1], key[3])))
            except NativeBuildError as err:
                found = err
            except OSError as err:  # the file exists but is no loadable library
                found = NativeBuildError(f"cannot load the native library for {source.name}: "
                                         f"{err}")
            _loaded[key] = found
    if isinstance(found, NativeBuildError):
        raise NativeBuildError(str(found))  # a fresh one: re-raising would grow its traceback
    return found


def _compiled(source: Path, cxx: str, directory: str) -> Path:
    try:
        key = build.cache_key(source, {}, FLAGS, cxx)
    except RuntimeError as err:  # compiler_version: no such compiler
        raise NativeBuildError(str(err)) from None
    target = Path(directory) / f"{source.stem}-{key}.so"
    if target.is_file():
        return target
    temp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    command = [cxx, *FLAGS, str(source), "-o", str(temp)]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(command, capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise NativeBuildError(f"compiling {source.name} with {cxx!r} failed (exit "
                                   f"{proc.returncode}): {proc.stderr.strip()[-1500:]}")
        os.replace(temp, target)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise NativeBuildError(f"compiling {source.name} with {cxx!r} into {target.parent} "
                               f"failed: {err}; set {CACHE_ENV} to a writable directory") from None
    finally:
        temp.unlink(missing_ok=True)
    return target
