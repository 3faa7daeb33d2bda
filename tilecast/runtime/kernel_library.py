"""In-process kernels: a GEMM or grouped-conv variant compiled as a shared library and called
through ctypes, so that tilecast.runtime.ops runs the very kernel the benchmark timed.

A variant's library is its family's in-process entry (the BuildSpec's `library_source`,
kernels/cpu/<family>/*_lib.cpp: the benchmark's kernel code and -D defines behind a C entry)
built by tilecast.core.build in shared mode, through tilecast.core.compile like every
compile of tilecast (linked from the variant's one compiled object where the family has one
unit for both, as gemm and grouped_conv do), into the build cache: `cache_dir` when given,
else build.default_cache_dir() ($TILECAST_BUILD_CACHE, else $TILECAST_CACHE/build, else
~/.cache/tilecast/build). The
compiler is $TILECAST_CXX, else g++ (as for tilecast.runtime.native). `load` compiles on
first use, checks that the library reports the variant's compiled parameters, and keeps it
for the process: one library per (kernel name, cache directory, compiler), thread-safe, and
two threads asking for one kernel compile it once. A variant needing CPU features this
machine lacks (an AVX-512 kernel on an AVX2 CPU) is refused by name before anything is
compiled. Nothing is compiled at import time.

A kernel that a loaded registry version carries prebuilt (tilecast.registry.prebuilt: the
Dispatcher offers its version's `kernels/` folder) is loaded from there first, from the
first build whose CPU flags this machine has, after its sha256 and size are checked against
the version's kernels manifest and with the same parameter check: no compiler is run. Only
a kernel without a prebuilt library this CPU runs goes to the build cache and the compiler;
where there is none, KernelBuildError says in one line what the version carries, what this
host is, and which `tilecast prebuild` command makes its libraries (the lines are
tilecast.registry.prebuilt's, shared with the process libraries' loaders).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tilecast.core.settings import BUILD_CACHE_ENV, CACHE_ENV, COMPILER_ENV
from tilecast.spaces.gemm import DTYPES, ISAS
from tilecast.spaces.grouped_conv import REQUIRED_FLAGS
from tilecast.core import build
from tilecast.core.compile import CompilerUnavailable
from tilecast.registry import prebuilt
from tilecast.registry.prebuilt import cpu_flags   # tests replace kernel_library.cpu_flags
from tilecast.runtime.native.library import compiler

logger = logging.getLogger(__name__)

#: what a nonzero return of an entry means (enum entry::Status in kernels/cpu/common/inprocess_entry.hpp)
STATUS_MESSAGES = {1: "bad argument", 2: "unsupported", 3: "out of memory", 4: "failed"}
MESSAGE_BYTES = 1024

_INDEX = ctypes.c_longlong
_PTR = ctypes.c_void_p


class KernelBuildError(RuntimeError):
    """A kernel's library did not compile, does not load, or is not the variant its name says."""


class CpuFeatureError(KernelBuildError):
    """A kernel needs CPU features (as /proc/cpuinfo names them) that this machine lacks."""


class KernelCallError(ValueError):
    """A kernel refused a call (bad argument, unsupported shape, out of memory); the message
    is the kernel's."""


@dataclass(frozen=True)
class _Entry:
    """The C entry of one library source: the symbol, its arguments before the message buffer,
    the CPU features a variant needs (its config -> /proc/cpuinfo flags, from the family's own
    tables), the symbol reporting the readable floats needed past each tensor (None: none),
    and the entry with the same arguments that takes the tensors in torch's layouts (None:
    none)."""
    symbol: str
    argtypes: tuple
    cpu_flags: Callable[[object], tuple[str, ...]]
    slack_symbol: str | None = None
    torch_symbol: str | None = None


def _gemm_flags(config) -> tuple[str, ...]:
    return ISAS[config.isa].flags + DTYPES[config.dtype].flags


# library source file name -> its entry (see the sources' header comments for the arguments)
ENTRIES = {
    "gemm_lib.cpp": _Entry("tilecast_gemm_run",
                           (_PTR, _INDEX, _INDEX, _PTR, _INDEX, _INDEX, _PTR, _INDEX,
                            _INDEX, _INDEX, _INDEX, ctypes.c_int), _gemm_flags),
    "grouped_conv_lib.cpp": _Entry("tilecast_grouped_conv_run",
                                   (ctypes.POINTER(_INDEX), _PTR, _PTR, _PTR, ctypes.c_int),
                                   lambda config: tuple(REQUIRED_FLAGS),
                                   "tilecast_grouped_conv_slack",
                                   "tilecast_grouped_conv_run_torch"),
}


def _check_cpu(name: str, needed: tuple[str, ...]) -> None:
    """CpuFeatureError naming the features `needed` by kernel `name` that this CPU lacks
    (nothing is checked where the CPU's flags are unknown: the compiler decides then)."""
    have = cpu_flags()
    missing = [flag for flag in needed if flag not in have]
    if have and missing:
        isa = sorted(flag for flag in have if flag.startswith(("avx", "fma")))
        raise CpuFeatureError(f"kernel {name!r} needs {', '.join(needed)}, and this CPU lacks "
                              f"{', '.join(missing)} (it has {', '.join(isa) or 'no AVX'}); "
                              "pick a variant of an ISA it has")


class InProcessKernel:
    """One loaded variant: `name`, `config`, `path` of its library and `slack` (floats that
    must be readable past the end of each tensor it reads or writes). Calling it runs the
    entry with the given arguments; KernelCallError when the kernel refuses."""

    def __init__(self, name: str, config, path: Path, library: ctypes.CDLL, entry: _Entry):
        self.name, self.config, self.path = name, config, path
        self._library = library
        self._run = self._function(library, entry.symbol, entry.argtypes)
        self._run_torch = (self._function(library, entry.torch_symbol, entry.argtypes)
                           if entry.torch_symbol is not None else None)
        library.tilecast_kernel_param.argtypes = [ctypes.c_char_p, ctypes.POINTER(_INDEX)]
        library.tilecast_kernel_param.restype = ctypes.c_int
        self.slack = 0
        if entry.slack_symbol is not None:
            slack = getattr(library, entry.slack_symbol)
            slack.restype = _INDEX
            self.slack = int(slack())

    def param(self, name: str) -> int | None:
        """The compiled parameter `name` (e.g. "MR", as `--describe` prints it), else None."""
        value = _INDEX()
        found = self._library.tilecast_kernel_param(name.encode(), ctypes.byref(value)) == 0
        return value.value if found else None

    @staticmethod
    def _function(library: ctypes.CDLL, symbol: str, argtypes: tuple):
        function = getattr(library, symbol)
        function.argtypes = [*argtypes, ctypes.c_char_p, _INDEX]
        function.restype = ctypes.c_int
        return function

    def __call__(self, *args) -> None:
        self._call(self._run, args)

    def run_torch_layouts(self, *args) -> None:
        """The entry on tensors in torch's layouts (the library's torch entry; the arguments
        as for a call): ValueError where the library has none."""
        if self._run_torch is None:
            raise ValueError(f"kernel {self.name!r} has no entry taking torch's layouts")
        self._call(self._run_torch, args)

    def _call(self, function, args) -> None:
        message = ctypes.create_string_buffer(MESSAGE_BYTES)
        status = function(*args, message, MESSAGE_BYTES)
        if status != 0:
            what = STATUS_MESSAGES.get(status, f"status {status}")
            raise KernelCallError(f"kernel {self.name!r} refused the call ({what}): "
                                  f"{message.value.decode(errors='replace')}")

    def __repr__(self) -> str:
        return f"InProcessKernel({self.name!r}, {str(self.path)!r})"


_loaded: dict[tuple, InProcessKernel] = {}
# what the build directory and the compiler follow (core.settings; HOME: the default root)
_KEY_VARIABLES = (CACHE_ENV, BUILD_CACHE_ENV, COMPILER_ENV, "HOME")
# (family, name, cache_dir, those variables' values) -> the key of _loaded they resolve to
_by_variables: dict[tuple, tuple] = {}
_key_locks: dict[tuple, threading.Lock] = {}
_lock = threading.Lock()


def load(family, name: str, *, cache_dir: Path | None = None) -> InProcessKernel:
    """The in-process kernel `name` of `family`, loaded once per process: from the prebuilt
    library a loaded registry version offers for this CPU (tilecast.registry.prebuilt), else
    from the build cache (`cache_dir`), compiled unless cached. FamilyError (a ValueError)
    for a name the family does not know; CpuFeatureError (a KernelBuildError) for a variant
    this CPU cannot run; KernelBuildError when it does not compile or load, when its
    prebuilt library is damaged, or when it must be compiled and there is no compiler."""
    # A product asks for its kernel on every call: first by the raw variables that decide the
    # directory and the compiler, with no paths built (that took most of a small call's time).
    quick_key = (family.name, name, None if cache_dir is None else str(cache_dir),
                 *(os.environ.get(variable) for variable in _KEY_VARIABLES))
    kernel = _loaded.get(_by_variables.get(quick_key))
    if kernel is not None:
        return kernel
    offer = prebuilt.offered(family.name, name)
    library = prebuilt.runnable(offer, cpu_flags())
    if library is not None:
        key = (family.name, name, "prebuilt", str(library.path))
        return _load_once(key, quick_key, lambda: _load_prebuilt(family, name, library, offer))
    directory = Path(cache_dir) if cache_dir is not None else build.default_cache_dir()
    cxx = compiler()
    key = (family.name, name, str(directory), cxx)
    return _load_once(key, quick_key, lambda: _build_and_load(family, name, directory, cxx))


def _load_once(key: tuple, quick_key: tuple,
               make: Callable[[], InProcessKernel]) -> InProcessKernel:
    """The kernel loaded under `key`, made by `make()` once per process (other kernels load
    meanwhile), and `quick_key` remembered as leading to it."""
    kernel = _loaded.get(key)
    if kernel is None:
        with _lock:
            key_lock = _key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one compile per kernel; other kernels load meanwhile
            kernel = _loaded.get(key)
            if kernel is None:
                kernel = make()
                _loaded[key] = kernel
    _by_variables[quick_key] = key
    return kernel


def _no_compiler(name: str, offer: prebuilt.Offer | None, cxx: str) -> str:
    """The one line for a kernel that must be compiled on a host without a compiler."""
    return prebuilt.no_compiler(f"kernel {name!r}", offer, cxx, cpu_flags())


def _checked(kernel: InProcessKernel, spec, where: Path, fix: str) -> InProcessKernel:
    """`kernel` after checking that its library reports the parameters its name says;
    KernelBuildError naming the file otherwise (`fix` says what to do)."""
    wrong = {define: (value, kernel.param(define.removeprefix("TC_")))
             for define, value in spec.defines.items()
             if kernel.param(define.removeprefix("TC_")) != value}
    if wrong:
        raise KernelBuildError(f"{where} is not kernel {kernel.name!r}: (wanted, compiled) "
                               f"parameters {wrong}; {fix}")
    return kernel


def _entry(family, name: str):
    """(config, build spec, in-process entry) of a kernel; KernelBuildError when the family
    has no in-process entry for it, CpuFeatureError when this CPU cannot run it."""
    config = family.parse_name(name)
    spec = family.build_spec(config)
    entry = ENTRIES.get(spec.library_source.name) if spec.library_source is not None else None
    if entry is None:
        raise KernelBuildError(f"family {family.name!r} has no in-process entry for {name!r}; "
                               f"in-process sources: {', '.join(ENTRIES)}")
    _check_cpu(name, entry.cpu_flags(config))
    return config, spec, entry


def _load_prebuilt(family, name: str, library: prebuilt.Library,
                   offer: prebuilt.Offer) -> InProcessKernel:
    """A kernel from a registry version's prebuilt library, after its checksum: no compiler."""
    config, spec, entry = _entry(family, name)
    try:
        prebuilt.verify(library, offer, f"kernel {name!r}")
    except prebuilt.PrebuiltError as err:
        raise KernelBuildError(str(err)) from None
    try:
        kernel = InProcessKernel(name, config, library.path, ctypes.CDLL(str(library.path)),
                                 entry)
    except (OSError, AttributeError) as err:
        raise KernelBuildError(f"cannot load the prebuilt library {library.path} of kernel "
                               f"{name!r} ({offer.where}): {err}") from None
    return _checked(kernel, spec, library.path, "the version's kernels are damaged")


def _build_and_load(family, name: str, directory: Path, cxx: str) -> InProcessKernel:
    """A kernel from the build cache, compiled unless cached."""
    config, spec, entry = _entry(family, name)
    offer = prebuilt.offered(family.name, name)   # for what the messages say
    try:
        built = build.build_library(family, config, directory, compiler=cxx)
    except CompilerUnavailable:
        raise KernelBuildError(_no_compiler(name, offer, cxx)) from None
    except (OSError, RuntimeError) as err:  # unwritable cache
        raise KernelBuildError(f"cannot build kernel {name!r} into {directory}: {err}") from None
    if built.event.status != "ok":
        reason = "\n".join(built.event.reason.strip().splitlines()[-12:])
        kept = (f"the failure is cached in {directory}" if built.failure_cached
                else "not cached: the next load compiles again")
        raise KernelBuildError(f"kernel {name!r} did not compile with {cxx!r} ({kept}):\n"
                               f"{reason}")
    if offer is not None and offer.libraries:
        logger.warning("%s; built it with %s into %s instead",
                       prebuilt.not_here(f"kernel {name!r}", offer, cpu_flags()), cxx, directory)
    try:
        library = ctypes.CDLL(str(built.binary))
        kernel = InProcessKernel(name, config, built.binary, library, entry)
    except (OSError, AttributeError) as err:
        raise KernelBuildError(f"cannot load kernel {name!r} from {built.binary}: {err}") from None
    return _checked(kernel, spec, built.binary, "delete the file to rebuild it")
