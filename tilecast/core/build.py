"""Building kernels (the build stage's machinery, and the in-process libraries' too): compile a
family's candidate variants into a content-hash cache.

Every compile goes through tilecast.core.compile.cached_compile, which the in-process and
native libraries use too: the key covers the source and every header the compiler reports it
read (-MMD), the compiler's identity, the flags and the variant's -D defines; a binary is
staged and moved into place, so an interrupted or concurrent build never leaves a
half-written one. A compile error is a `failed` event, cached so that re-runs do not retry
it; a compile that timed out, was killed (out of memory) or could not start is a `failed`
event that is not cached, so the next build retries it. An event's `outcome` says which.

The build events (one per candidate, with its binary's path and cache key) are what the next
stages read (`write_events` / `read_events`); a family none of whose candidates built is a
BuildError naming the failures (`require_some_built`), since there is nothing to measure.

Shared mode compiles a variant's in-process entry (its BuildSpec's `library_source`: the same
kernel code and defines, a C entry instead of the job runner) into `<name>-<key>.so` in the
same cache, with the same key rules; tilecast.runtime.kernel_library loads it for tilecast.runtime.ops.

A family whose BuildSpec has a `unit` (gemm, grouped_conv: the job runner and the C entry in
one translation unit) compiles it once per variant, with -fPIC, into `<name>-<key>.o`; the
executable and the shared library are links of that object (core.compile.cached_link), so a
variant's kernel code is compiled once, not once for each, and the library runs the machine
code the executable was validated with. A candidate's key is then its link's, which hashes
the object's key (the unit, every header it read, the compiler, the flags, the defines).
`build_families` builds several families' candidates in one pool, so that the cores stay busy
from the first family's compiles to the last's.
"""
from __future__ import annotations

import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields as dataclass_fields, replace
from pathlib import Path
from typing import Callable, Sequence

from tilecast.core import compile as compiling
from tilecast.core.atomic import atomic_write_json
from tilecast.core.compile import compiler_version  # also tilecast.disco.cuda's
from tilecast.core.settings import BUILD_CACHE_ENV, CACHE_ENV, settings  # noqa: F401 - re-exported
from tilecast.core.tune import BuildEvent
from tilecast.core.family import KERNELS_DIR, BuildSpec, FamilyError

log = logging.getLogger("tilecast.core.build")

DEFAULT_FLAGS = ("-std=c++17", "-O3", "-march=native", "-fopenmp", "-DNDEBUG")
SHARED_FLAGS = ("-shared", "-fPIC")   # appended in shared mode
OBJECT_FLAGS = ("-fPIC", "-c")        # a unit's object, linked into an executable and a library


def cache_root() -> Path:
    """tilecast's cache directory: $TILECAST_CACHE, else ~/.cache/tilecast (core.settings)."""
    return settings().cache_root


def default_cache_dir() -> Path:
    """The build cache outside a workdir: $TILECAST_BUILD_CACHE, else `build/` in
    cache_root()."""
    found = settings()
    return found.build_cache or found.cache_root / "build"


# How many failed candidates a BuildError names (with their first error line) before "...".
SHOWN_FAILURES = 5


class BuildError(FamilyError):
    """No candidate of a family could be built (or its build events cannot be read back)."""


@dataclass(frozen=True)
class Built:
    """One candidate after the build stage: its event and, when ok, the binary's path."""
    kernel: str
    config: object
    event: BuildEvent
    binary: Path | None
    cache_key: str
    cached: bool
    outcome: str = ""   # how its compile ended (core.compile.OUTCOMES); "" in older events

    @property
    def failure_cached(self) -> bool:
        """A compile error kept in the cache: the same inputs fail from it, uncompiled."""
        return self.outcome == "compile_error" and bool(self.cache_key)


def cache_key(source: Path, defines: dict, flags: Sequence[str], compiler: str,
              include_dirs: Sequence[Path] = (), toolchain: str = "") -> str:
    """The key a build of `source` with these inputs gets now (tilecast.core.compile): the
    compiler lists the files it includes, nothing is compiled. Follows the source, every
    included header, the compiler's identity, the flags, the defines and `toolchain` (and,
    with -march=native, the target it resolves to here). A candidate built from its family's
    one unit is keyed by its link instead (`_compile_unit`), over the unit object's key."""
    return compiling.current_key(compiling.CompileJob(
        source, compiler, tuple(flags), defines, tuple(include_dirs), toolchain=toolchain,
        root=source_root(source)))


def source_root(source: Path, kernels_dir: Path | None = None) -> Path | None:
    """The tree the files a compile of `source` reads are labelled in (core.compile's job
    `root`): the CPU kernels' `cpu/` of `kernels_dir` (default: this tilecast's kernels/)
    when `source` lies in it, so that a family's sources and the common/ and other families'
    headers they include key the same in any copy of the tree; else None (its directory)."""
    tree = Path(os.path.abspath(Path(kernels_dir or KERNELS_DIR) / "cpu"))
    return tree if Path(os.path.abspath(source)).is_relative_to(tree) else None


def rebase_spec(spec: BuildSpec, kernels_dir: Path) -> BuildSpec:
    """`spec` with its source and include directories moved from the project's kernels/ to
    `kernels_dir`, another copy of that tree (e.g. a git revision's, see tilecast.workflows.rebench).
    The cache key hashes file contents, so a rebased source with other contents gets its own
    binary and an identical one shares the project's."""
    def moved(path: Path) -> Path:
        try:
            relative = Path(path).resolve().relative_to(KERNELS_DIR.resolve())
        except ValueError:
            raise ValueError(f"build source {path} is not under {KERNELS_DIR}: it cannot be "
                             f"taken from another kernels tree ({kernels_dir})") from None
        target = Path(kernels_dir) / relative
        directory = Path(path).is_dir()
        if not target.exists() and len(relative.parts) > (1 if directory else 2):
            # a tree from before kernels/cpu/<family>/: every CPU file in kernels/cpu itself
            flat = Path(kernels_dir) / relative.parts[0]
            flat = flat if directory else flat / relative.name
            return flat if flat.exists() else target
        return target

    source = moved(spec.source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist: the kernels tree {kernels_dir} has no "
                                f"{Path(spec.source).name}")
    # an older tree may predate the in-process entry: it then builds executables only; or
    # the one-unit build of both: it then compiles each from its own source
    library = moved(spec.library_source) if spec.library_source is not None else None
    unit = moved(spec.unit) if spec.unit is not None else None
    unit = unit if unit is not None and unit.exists() else None
    # a tree from before a shared unit compiles its code in the variant's own unit
    shared = tuple(replace(part, source=moved(part.source)) for part in spec.shared_units)
    shared = shared if unit is not None and all(p.source.exists() for p in shared) else ()
    return BuildSpec(source=source, defines=spec.defines,
                     include_dirs=tuple(moved(d) for d in spec.include_dirs),
                     library_source=library if library is not None and library.exists() else None,
                     unit=unit, shared_units=shared)


def _event(name: str, result: compiling.CompileResult, seconds: float | None = None) -> BuildEvent:
    seconds = result.seconds if seconds is None else seconds
    if result.ok:
        return BuildEvent(name, "ok", "", seconds, result.artifact.stat().st_size)
    return BuildEvent(name, "failed", result.reason() or f"compile {result.outcome}", seconds, 0)


def _compile_unit(name: str, config, spec: BuildSpec, cache_dir: Path, compiler: str,
                  flags: Sequence[str], timeout_s: float, kernels_dir: Path | None,
                  shared: bool) -> Built:
    """A candidate whose executable and library share one unit: the unit compiled once
    (cached) into an object, and each of its shared units into one that every variant with
    the same defines reuses; then the executable, or in shared mode the library, linked from
    them. Its key is the link's, which covers the objects' (core.compile.LinkJob)."""
    jobs = [compiling.CompileJob(spec.unit, compiler, (*flags, *OBJECT_FLAGS), spec.defines,
                                 spec.include_dirs, stem=name, suffix=".o",
                                 root=source_root(spec.unit, kernels_dir))]
    jobs += [compiling.CompileJob(part.source, compiler, (*flags, *OBJECT_FLAGS), part.defines,
                                  spec.include_dirs, stem=part.stem, suffix=".o",
                                  root=source_root(part.source, kernels_dir))
             for part in spec.shared_units]
    objects, seconds, cached = [], 0.0, True
    for job in jobs:
        compiled = compiling.cached_compile(job, cache_dir, timeout_s)
        if not compiled.ok:
            return Built(name, config, _event(name, compiled), None, compiled.key,
                         compiled.cached, compiled.outcome)
        objects.append((compiled.artifact, compiled.key))
        seconds += 0.0 if compiled.cached else compiled.seconds
        cached = cached and compiled.cached
    link_flags = (*flags, *SHARED_FLAGS) if shared else tuple(flags)
    linked = compiling.cached_link(
        compiling.LinkJob(tuple(objects), compiler, link_flags, name,
                          ".so" if shared else ""), cache_dir, timeout_s)
    return Built(name, config, _event(name, linked, seconds + linked.seconds), linked.artifact,
                 linked.key, cached and linked.cached, linked.outcome)


def _compile(family, config, cache_dir: Path, compiler: str, flags: Sequence[str],
             timeout_s: float, kernels_dir: Path | None = None, shared: bool = False) -> Built:
    name = family.kernel_name(config)
    spec = family.build_spec(config)
    if kernels_dir is not None:
        spec = rebase_spec(spec, kernels_dir)
    source = spec.source
    if (spec.unit is not None and spec.unit.exists() and Path(source).exists()
            and (not shared or spec.library_source is not None)):
        return _compile_unit(name, config, spec, cache_dir, compiler, flags, timeout_s,
                             kernels_dir, shared)
    if shared:
        if spec.library_source is None:
            raise ValueError(f"kernel {name!r} has no in-process entry (its build spec has no "
                             f"library_source); only the benchmark executable can be built")
        source, flags = spec.library_source, (*flags, *SHARED_FLAGS)
    if not Path(source).exists():
        # not a compile result (an installation without kernels/, a moved tree): not cached
        reason = (f"kernel source {source} does not exist (is tilecast installed without its "
                  f"kernels/ tree?)")
        return Built(name, config, BuildEvent(name, "failed", reason, 0.0, 0), None, "", False,
                     "not_run")
    job = compiling.CompileJob(source, compiler, tuple(flags), spec.defines, spec.include_dirs,
                               stem=name, suffix=".so" if shared else "",
                               root=source_root(source, kernels_dir))
    result = compiling.cached_compile(job, cache_dir, timeout_s)
    return Built(name, config, _event(name, result), result.artifact, result.key, result.cached,
                 result.outcome)


def build_candidates(family, configs: Sequence, cache_dir: Path, *, jobs: int = 2,
                     compiler: str = "g++", flags: Sequence[str] = DEFAULT_FLAGS,
                     timeout_s: float = 300.0,
                     progress: Callable[[int, int, str], None] | None = None,
                     kernels_dir: Path | None = None, shared: bool = False) -> list[Built]:
    """Compile every config in parallel (`jobs` compilers at once); one Built per config,
    in the order given. Cached binaries are reused; failures are events, never exceptions.
    `progress(done, total, message)` follows the candidates in order (e.g. log_progress);
    `kernels_dir` compiles from another copy of the kernels/ tree (see `rebase_spec`);
    `shared` builds the in-process shared libraries instead of the benchmark executables."""
    return build_families([(family, configs)], cache_dir, jobs=jobs, compiler=compiler,
                          flags=flags, timeout_s=timeout_s, progress=progress,
                          kernels_dir=kernels_dir, shared=shared)[0]


def build_families(requests: Sequence[tuple[object, Sequence]], cache_dir: Path, *,
                   jobs: int = 2, compiler: str = "g++", flags: Sequence[str] = DEFAULT_FLAGS,
                   timeout_s: float = 300.0,
                   progress: Callable[[int, int, str], None] | None = None,
                   kernels_dir: Path | None = None, shared: bool = False) -> list[list[Built]]:
    """build_candidates of several (family, configs) requests in one pool of `jobs`
    compilers, so that no core waits at the end of one family while another has compiles
    left; one list of Built per request, in the order given. `progress` counts over all."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    compiler_version(compiler)  # fail early, with a clear message, if there is no compiler
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [[pool.submit(_compile, family, cfg, cache_dir, compiler, tuple(flags),
                                timeout_s, kernels_dir, shared) for cfg in configs]
                   for family, configs in requests]
        total, done, results = sum(map(len, futures)), 0, []
        for request in futures:
            results.append([])
            for future in request:
                built = future.result()
                results[-1].append(built)
                done += 1
                if progress:
                    progress(done, total, progress_line(done, total, built))
    return results


def build_library(family, config, cache_dir: Path | None = None, *, compiler: str = "g++",
                  flags: Sequence[str] = DEFAULT_FLAGS, timeout_s: float = 300.0) -> Built:
    """One variant's in-process shared library (shared mode), compiled unless cached in
    `cache_dir` (default: default_cache_dir()). A compile error is a `failed` event, as in
    build_candidates; a family without an in-process entry is a ValueError."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    compiler_version(compiler)
    return _compile(family, config, cache_dir, compiler, tuple(flags), timeout_s, shared=True)


class LibraryBuildError(RuntimeError):
    """A shared library called through ctypes (DISCO's kernels, the machine's probe) could not
    be compiled."""


#: a shared library's flags, its compile's time limit, and the compiler output an error quotes
LIBRARY_FLAGS = (*DEFAULT_FLAGS, *SHARED_FLAGS)
LIBRARY_TIMEOUT_S = 300.0
LIBRARY_STDERR_LINES = 12


def shared_library(source: Path, cxx: str | None = None, directory: Path | None = None,
                   flags: tuple[str, ...] = LIBRARY_FLAGS, toolchain: str = "",
                   error: type[Exception] = LibraryBuildError) -> Path:
    """Path of the shared library built from `source`, compiling it unless cached (in
    `directory`, default $TILECAST_CACHE/disco). `toolchain` joins the cache key: what else
    changes the binary that `cxx --version` does not name. `error` (LibraryBuildError by
    default) names the compiler and quotes the first lines of its error output, or says that
    the compile timed out or was killed (not cached: the next call compiles again)."""
    cxx = cxx or settings().compiler
    directory = Path(directory) if directory is not None else settings().cache_root / "disco"
    job = compiling.CompileJob(source, cxx, tuple(flags), suffix=".so", toolchain=toolchain,
                               root=source_root(source))
    try:
        result = compiling.cached_compile(job, directory, LIBRARY_TIMEOUT_S)
    except RuntimeError as err:  # CompilerUnavailable: no such compiler
        raise error(str(err)) from None
    except OSError as err:
        raise error(f"cannot build {source.name} into {directory}: {err}; set "
                    f"{CACHE_ENV} to a writable directory") from None
    if result.ok:
        return result.artifact
    first_lines = "\n".join(result.log.strip().splitlines()[:LIBRARY_STDERR_LINES])
    what = ("failed" if result.outcome == "compile_error"
            else f"did not finish ({result.outcome.replace('_', ' ')})")
    raise error(f"compiling {source.name} with {cxx!r} "
                f"({compiling.compiler_version(cxx)}) {what}:\n{first_lines}")


def progress_line(index: int, total: int, built: Built) -> str:
    """A candidate's progress message: `build 3/40 <kernel> 1.2s`, `... cached` or
    `... FAILED (<first line of the reason>)`."""
    state = "cached" if built.cached else f"{built.event.seconds:.1f}s"
    if built.event.status != "ok":
        state = f"FAILED ({built.event.reason.splitlines()[0][:120] if built.event.reason else ''})"
    return f"build {index}/{total} {built.kernel} {state}"


def log_progress(done: int, total: int, message: str) -> None:
    """Default progress: one log line per candidate (cached, compiled or failed)."""
    log.info(message)


def first_error_line(reason: str) -> str:
    """The line of a compiler's output that says what went wrong: the first one naming an
    error, else the first line; "" for no output."""
    lines = [line.strip() for line in (reason or "").splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"\berror\b", line)]
    return (named or lines or [""])[0]


def write_events(path: Path, builts: Sequence[Built]) -> None:
    """The build stage's result, one entry per candidate: its BuildEvent, binary path (None
    when it failed), cache key, whether it came from the cache and its compile's outcome."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, [{**asdict(b.event), "binary": str(b.binary) if b.binary else None,
                              "cache_key": b.cache_key, "cached": b.cached,
                              "outcome": b.outcome} for b in builts])


def read_events(path: Path, family) -> list[Built]:
    """`write_events`' entries back as Built (a failed candidate with binary None); a missing
    events file or binary is a FileNotFoundError, an unreadable file a BuildError."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run the build stage first")
    event_fields = {f.name for f in dataclass_fields(BuildEvent)}
    try:
        entries = json.loads(path.read_text())
        builts = []
        for entry in entries:
            event = BuildEvent(**{k: v for k, v in entry.items() if k in event_fields})
            binary = Path(entry["binary"]) if entry.get("binary") else None
            builts.append(Built(event.candidate_id, family.parse_name(event.candidate_id), event,
                                binary, entry.get("cache_key", ""), bool(entry.get("cached")),
                                str(entry.get("outcome", ""))))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        # json's, UTF-8's, BuildEvent's and the family's name parser's errors are ValueErrors;
        # an entry of the wrong shape is a TypeError, KeyError or AttributeError
        raise BuildError(f"{path}: unreadable build events ({type(err).__name__}: {err}); "
                         f"re-run the build stage") from None
    for built in builts:
        if built.binary is not None and not built.binary.exists():
            raise FileNotFoundError(f"binary {built.binary} listed in {path} is gone: re-run the "
                                    f"build stage")
    return builts


def require_some_built(family_name: str, builts: Sequence[Built],
                       events: Path | None = None) -> None:
    """A BuildError naming the failures (kernel and first compiler error line) when no
    candidate has a binary: nothing could be measured. One failure among good builds is
    not an error: it becomes a `build_failed` record."""
    if any(b.binary is not None for b in builts):
        return
    if not builts:
        raise BuildError(f"family {family_name}: no candidate to build")
    shown = "; ".join(f"{b.kernel}: {first_error_line(b.event.reason) or b.event.status}"
                      for b in builts[:SHOWN_FAILURES])
    more = f"; ... ({len(builts)} in all)" if len(builts) > SHOWN_FAILURES else ""
    where = f" (full compiler output in {events})" if events is not None else ""
    raise BuildError(f"family {family_name}: all {len(builts)} candidates failed to build, so "
                     f"nothing can be measured: {shown}{more}{where}")
