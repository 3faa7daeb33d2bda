"""The one compile-and-cache of tilecast: a C++ (or CUDA) source compiled into a
content-addressed cache. The build stage's variants (tilecast.core.build), the in-process
kernels (tilecast.runtime.kernel_library, through the build stage), the native dispatcher's
libraries (tilecast.runtime.native.library) and the DISCO libraries (tilecast.disco.native,
tilecast.disco.cuda, tilecast.measurement.probe) are all built by `cached_compile`.

Key. A compile's recipe is the source's name and contents, the compiler's identity (its
whole `--version`), the flags, the -D defines, the include directories, `toolchain` (what
changes the output that `--version` does not name: nvcc's host compiler) and, with
-march=native, the target that resolves to on this CPU. Its key hashes the recipe and the
contents of every file the compiler read outside the system directories, which the compiler
itself lists while it compiles (-MMD -MF). The list is kept per recipe, in
`.deps/<stem>-<recipe>/<list hash>.json`. A lookup hashes the listed files as they are now,
so a hit runs no compiler; an edited header, or a file appearing where a missing one was
listed, is a new key and a compile, which records its own list. A header added to an include
chain is caught because the file that now includes it changed. Files under the job's `root`
(the source tree it belongs to, e.g. kernels/: a family's directory and the common/ one
beside it; by default the source's own directory) are listed relative to it, so a copy of
the tree (a git revision's, an installed package's) is hashed where it is and keys the same;
any other file by its absolute path.

Publication. The compiler writes into a private staging directory in the cache; the
artifact `<stem>-<key><suffix>` is fsynced and moved into place with os.replace, so a reader
sees a whole file or none. Builders of one recipe hold an flock on `.deps/<stem>-<recipe>/lock`,
so a second builder waits and then finds the first one's artifact; where flock is not
available, rename-wins still leaves one whole artifact.

Links. A program or shared library linked from objects this cache compiled (a family's
variant object, compiled once for its benchmark executable and its in-process library) is a
`LinkJob`: its key hashes the objects' own keys, which cover every file they were compiled
from, the compiler's identity and the link flags, so it is as content-addressed as a compile;
it is published the same way, under a lock of its own. A link that fails is reported, never
cached: its inputs were compiled already, so it is the machine's trouble.

Failures. Only a compile error, where the compiler ran to completion and rejected the
source, is cached: `<stem>-<key>.failed` holds the compiler's log, and the same inputs then
fail from the cache. It is cached only when the compiler can list the files the source
reads (a -MM -MG pass, which names a missing header as well), so that fixing any of them,
or creating the missing header, is a new key. A compile past its timeout (its whole process
group is killed), a compiler ended by a signal (or whose driver reports that cc1plus or cicc
was: the OOM killer's SIGKILL), and a compiler that could not be started are reported as
such and never cached: the next build tries again.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from tilecast.core.atomic import atomic_write_json, atomic_write_text, make_temp_dir

log = logging.getLogger("tilecast.core.compile")

KEY_CHARS = 24
DEPS_DIR = ".deps"
FAILED_SUFFIX = ".failed"
LOG_CHARS = 200_000          # of a compiler's log kept in a .failed record
REASON_CHARS = 4000          # of a log quoted as a failure's reason (its head and its tail)
LISTING_TIMEOUT_S = 120.0    # a dependency listing preprocesses only
ABSENT = "absent"            # a listed file that does not exist: its appearance is a change

#: how a compile ended -> whether that is a property of its inputs, cached under its key
#: (True), or of this run only, reported and left for the next build to retry (False)
OUTCOMES = {"ok": True, "compile_error": True, "timeout": False, "killed": False,
            "not_run": False}
RETRIED = "not cached: the next build tries again"

#: compiler kind -> the flags of a dependency listing that compiles nothing (-MG lists a
#: header that does not exist instead of stopping there; nvcc has no -MG)
LISTING_FLAGS = {"gnu": ("-MM", "-MG"), "nvcc": ("-MM",)}
#: flags that only change linking, left out of a dependency listing
LINK_ONLY_FLAGS = frozenset({"-shared"})

# What a compiler driver prints, exiting 1 or 4, when a program it ran was ended by a signal
# or ran out of memory (gcc: "Killed signal terminated program cc1plus", older gcc "internal
# compiler error: Killed"; clang: "unable to execute command: Killed"; nvcc: "'cicc' died due
# to signal 9"): the machine's trouble, not the source's.
_KILLED_RE = re.compile(r"signal terminated program|internal compiler error: Killed|"
                        r"unable to execute command|failed due to signal|died due to signal|"
                        r"out of memory allocating|virtual memory exhausted")


class CompilerUnavailable(RuntimeError):
    """The compiler does not run (`<compiler> --version` fails): nothing can be built."""


@functools.lru_cache(maxsize=None)
def _version_output(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        raise CompilerUnavailable(f"C++ compiler {compiler!r} is not usable: {err}; install g++ "
                                  "or set build.compiler in the config") from None
    return out.stdout


def compiler_identity(compiler: str) -> str:
    """The whole `<compiler> --version`, whitespace-normalised: part of every key."""
    return " ".join(_version_output(compiler).split())


def compiler_version(compiler: str) -> str:
    """First line of `<compiler> --version` (for messages)."""
    lines = _version_output(compiler).strip().splitlines()
    return lines[0].strip() if lines else ""


@functools.lru_cache(maxsize=None)
def native_target(compiler: str) -> str:
    """The target -march=native resolves to for `compiler` on this CPU (e.g. "znver3"), and
    the AVX-512 flag it enables: part of the key of a -march=native build, so that a cache
    shared across machines (or moved to another CPU) never hands one CPU's binary to another
    (an AVX-512 binary on an AVX2 CPU dies of SIGILL). "" if the compiler does not say."""
    try:
        out = subprocess.run([compiler, "-march=native", "-Q", "--help=target"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    wanted = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("-march=", "-mavx512f", "-mavx2", "-mfma"):
            wanted[parts[0]] = parts[1]
    return ",".join(f"{key}{value}" for key, value in sorted(wanted.items()))


def compiler_kind(compiler: str) -> str:
    """"nvcc" for CUDA's compiler driver, else "gnu" (g++, clang++ and c++ take gcc's options);
    a key of LISTING_FLAGS."""
    return "nvcc" if Path(compiler).name.startswith("nvcc") else "gnu"


@dataclass(frozen=True)
class CompileJob:
    """One compile: `source` by `compiler` with `flags`, -D `defines` and -I `include_dirs`,
    into the artifact `<stem>-<key><suffix>` (stem: the source's unless given). `toolchain`
    joins the key: what changes the output that `compiler --version` does not name. `root`:
    the source tree the files it reads are labelled relative to (default: the source's
    directory; see the module's docstring)."""
    source: Path
    compiler: str
    flags: tuple[str, ...] = ()
    defines: Mapping[str, object] = field(default_factory=dict)
    include_dirs: tuple[Path, ...] = ()
    stem: str = ""
    suffix: str = ""
    toolchain: str = ""
    root: Path | None = None

    def __post_init__(self) -> None:
        # absolute paths: the compiler runs in the source's directory and names what it read
        # the way it was given
        object.__setattr__(self, "source", Path(os.path.abspath(self.source)))
        object.__setattr__(self, "flags", tuple(self.flags))
        object.__setattr__(self, "include_dirs",
                           tuple(Path(os.path.abspath(d)) for d in self.include_dirs))
        object.__setattr__(self, "stem", self.stem or self.source.stem)
        root = Path(os.path.abspath(self.root)) if self.root is not None else self.source.parent
        if not self.source.is_relative_to(root):
            raise ValueError(f"compile source {self.source} is not under its root {root}")
        object.__setattr__(self, "root", root)

    @property
    def base(self) -> Path:
        """What the labels of the files the compile reads are relative to: `root`."""
        return self.root

    @property
    def workdir(self) -> Path:
        """The source's directory: where the compiler runs (a relative name it prints is
        relative to it)."""
        return self.source.parent

    def inputs(self, flags: Iterable[str] | None = None) -> list[str]:
        """The compiler's arguments except its outputs: flags, defines, include dirs, source."""
        return [*(self.flags if flags is None else flags),
                *(f"-D{name}={value}" for name, value in self.defines.items()),
                *(f"-I{directory}" for directory in self.include_dirs), str(self.source)]

    def recipe(self) -> str:
        """Hash of everything that changes the output except the included files."""
        fields = {"source": self.source.name, "source_sha256": file_digest(self.source),
                  "compiler": compiler_identity(self.compiler), "flags": list(self.flags),
                  "defines": sorted((str(k), str(v)) for k, v in self.defines.items()),
                  "include_dirs": [label(d, self.base) for d in self.include_dirs],
                  "toolchain": self.toolchain}
        if "-march=native" in self.flags:
            fields["native"] = native_target(self.compiler)
        payload = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:KEY_CHARS]

    def recipe_dir(self, cache_dir: Path, recipe: str) -> Path:
        """Where the dependency lists (and the builders' lock) of `recipe` live."""
        return Path(cache_dir) / DEPS_DIR / f"{self.stem}-{recipe}"


@dataclass(frozen=True)
class CompileResult:
    """How one compile ended. `outcome` is a key of OUTCOMES; `artifact` the built file when
    it is "ok"; `key` its content key ("" when nothing about it is in the cache); `log` the
    compiler's output, led by what happened when that was not a compile error; `record` the
    cached failure's log file; `cached` whether it came from the cache (nothing ran)."""
    outcome: str
    artifact: Path | None = None
    key: str = ""
    log: str = ""
    seconds: float = 0.0
    cached: bool = False
    record: Path | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def reason(self, limit: int = REASON_CHARS) -> str:
        """The log, its head and tail kept when longer than `limit` (gcc names the first
        error first; a driver's summary comes last)."""
        return clip(self.log.strip(), limit)


def clip(text: str, limit: int) -> str:
    """`text`, or its first third and last two thirds of `limit` characters around a mark."""
    if len(text) <= limit:
        return text
    head = limit // 3
    return (f"{text[:head]}\n[... {len(text) - limit} characters of compiler output cut ...]\n"
            f"{text[len(text) - (limit - head):]}")


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes; ABSENT when it cannot be read (a missing header is part of
    the key too, so that creating it is a change)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return ABSENT


def label(path: str | Path, base: Path, workdir: Path | None = None) -> str:
    """How a file the compiler read appears in a key: relative to `base` (a job's root) when
    inside it, else its absolute path. A relative `path` is relative to `workdir` (where the
    compiler ran; default `base`)."""
    absolute = Path(os.path.normpath((workdir or base) / path))
    try:
        return absolute.relative_to(base).as_posix()
    except ValueError:
        return str(absolute)


def content_key(recipe: str, labels: Iterable[str], base: Path) -> str:
    """The key of `recipe` with the files `labels` name (relative ones under `base`) as they
    are now."""
    digest = hashlib.sha256(recipe.encode())
    for name in sorted(set(labels)):
        digest.update(f"{name}\0{file_digest(base / name)}\n".encode())
    return digest.hexdigest()[:KEY_CHARS]


def parse_depfile(text: str) -> list[str]:
    """The prerequisites of the first rule of a make dependency file as gcc and nvcc write
    it: `target: a.cpp b.hpp \\` with continued lines, a space in a name as `\\ `, `$` as `$$`."""
    joined = text.replace("\\\r\n", " ").replace("\\\n", " ")
    parts = re.split(r":(?:[ \t]|$)", joined, maxsplit=1, flags=re.MULTILINE)
    if len(parts) < 2:
        return []
    rule = parts[1].split("\n", 1)[0]
    return [re.sub(r"\\(.)", r"\1", token).replace("$$", "$")
            for token in re.findall(r"(?:\\.|[^\s\\])+", rule)]


@dataclass(frozen=True)
class _Ran:
    outcome: str     # a key of OUTCOMES
    stdout: str
    log: str         # what to report: stdout and stderr, led by what happened to the process
    seconds: float


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # the driver and cc1plus, as, ld under it
    except OSError:
        proc.kill()


def _run(command: list[str], timeout_s: float, cwd: Path) -> _Ran:
    """Run a compiler in its own process group, which all dies when it exceeds `timeout_s`
    (killing the driver alone would leave cc1plus running, holding our pipes)."""
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                encoding="utf-8", errors="replace", start_new_session=True)
    except OSError as err:
        return _Ran("not_run", "", f"could not run {command[0]!r}: {err} ({RETRIED})", 0.0)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        return _Ran("timeout", stdout,
                    f"compile timed out after {timeout_s:g} s and was killed ({RETRIED})\n"
                    f"{stdout}{stderr}", time.perf_counter() - start)
    except BaseException:           # KeyboardInterrupt: leave no compiler behind
        _kill_group(proc)
        proc.wait()
        raise
    seconds, output = time.perf_counter() - start, stdout + stderr
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return _Ran("killed", stdout, f"the compiler was killed by {name} ({RETRIED})\n{output}",
                    seconds)
    if proc.returncode > 0 and _KILLED_RE.search(stderr):
        return _Ran("killed", stdout, f"a program the compiler ran was killed or ran out of "
                                      f"memory ({RETRIED})\n{output}", seconds)
    return _Ran("ok" if proc.returncode == 0 else "compile_error", stdout, output, seconds)


def list_dependencies(job: CompileJob, *, complete_only: bool = False) -> list[str] | None:
    """The labels of the files `job`'s compile reads outside the system directories, from
    the compiler's dependency listing (-MM: it preprocesses, compiles nothing). None when it
    lists nothing, or, with `complete_only`, when it met an error on the way (its list may
    stop there)."""
    flags = [flag for flag in job.flags if flag not in LINK_ONLY_FLAGS]
    command = [job.compiler, *LISTING_FLAGS[compiler_kind(job.compiler)], *job.inputs(flags)]
    ran = _run(command, LISTING_TIMEOUT_S, job.workdir)
    if ran.outcome != "ok" and (complete_only or ran.outcome != "compile_error"):
        return None
    return sorted({label(path, job.base, job.workdir)
                   for path in parse_depfile(ran.stdout)}) or None


def current_key(job: CompileJob) -> str:
    """The key `job` has with the files as they are now (the compiler lists what the source
    includes; nothing is compiled). RuntimeError when it cannot list them."""
    labels = list_dependencies(job)
    if labels is None:
        raise RuntimeError(f"{job.compiler!r} could not list the files {job.source} includes; "
                           f"compile it to see why")
    return content_key(job.recipe(), labels, job.base)


def _recorded_lists(recipe_dir: Path) -> Iterator[list[str]]:
    for manifest in sorted(recipe_dir.glob("*.json")):
        try:
            labels = json.loads(manifest.read_text())["deps"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("ignoring unreadable dependency list %s (%s); the next compile of its "
                        "source writes a new one", manifest, err)
            continue
        if isinstance(labels, list) and all(isinstance(name, str) for name in labels):
            yield labels


def _lookup(job: CompileJob, cache_dir: Path, recipe: str) -> CompileResult | None:
    """The cached artifact or compile error of `job` under any recorded dependency list whose
    files are unchanged; None when there is none."""
    for labels in _recorded_lists(job.recipe_dir(cache_dir, recipe)):
        key = content_key(recipe, labels, job.base)
        artifact = cache_dir / f"{job.stem}-{key}{job.suffix}"
        if artifact.is_file():
            return CompileResult("ok", artifact, key, cached=True)
        record = cache_dir / f"{job.stem}-{key}{FAILED_SUFFIX}"
        if record.is_file():
            return CompileResult("compile_error", None, key, record.read_text(errors="replace"),
                                 cached=True, record=record)
    return None


def _record_list(job: CompileJob, cache_dir: Path, recipe: str, labels: list[str]) -> None:
    # named by its contents: written once, identical from any writer
    name = hashlib.sha256("\n".join(labels).encode()).hexdigest()[:16]
    path = job.recipe_dir(cache_dir, recipe) / f"{name}.json"
    if not path.exists():
        atomic_write_json(path, {"source": job.source.name, "deps": labels})


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:    # "a": create without truncating
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:   # no flock on this filesystem: rename-wins still keeps artifacts whole
            log.debug("no flock on %s; concurrent builders may compile twice", lock_path)
        yield             # closing the file releases the lock


def _publish(output: Path, artifact: Path) -> None:
    with open(output, "rb") as handle:
        os.fsync(handle.fileno())   # whole on disk before its name says it is there
    os.replace(output, artifact)


def _compile(job: CompileJob, cache_dir: Path, recipe: str, timeout_s: float) -> CompileResult:
    staging = make_temp_dir(cache_dir, f".{job.stem}.")
    try:
        output, depfile = staging / f"{job.stem}{job.suffix}", staging / "deps.d"
        command = [job.compiler, "-MMD", "-MF", str(depfile), *job.inputs(), "-o", str(output)]
        ran = _run(command, timeout_s, job.workdir)
        if ran.outcome == "ok" and not output.is_file():
            return CompileResult("not_run", log=f"{job.compiler!r} exited 0 but wrote no "
                                                f"{output.name} ({RETRIED})\n{ran.log}",
                                 seconds=ran.seconds)
        if ran.outcome == "ok":
            listed = parse_depfile(depfile.read_text()) if depfile.is_file() else []
            labels = (sorted({label(path, job.base, job.workdir) for path in listed})
                      or list_dependencies(job, complete_only=True))
            # without a list the artifact is still right, but no later lookup can vouch for it
            key = content_key(recipe, labels or [label(job.source, job.base)], job.base)
            artifact = cache_dir / f"{job.stem}-{key}{job.suffix}"
            _publish(output, artifact)
            if labels:
                _record_list(job, cache_dir, recipe, labels)
            return CompileResult("ok", artifact, key, ran.log, ran.seconds)
        if ran.outcome == "compile_error":
            # gcc drops the list at a missing header; -MG lists the header it lacked
            labels = list_dependencies(job, complete_only=True)
            if labels is None:
                return CompileResult("compile_error", log=f"{ran.log}\n(the compiler could not "
                                     f"list the files the source reads, so the failure is "
                                     f"{RETRIED})", seconds=ran.seconds)
            key = content_key(recipe, labels, job.base)
            record = cache_dir / f"{job.stem}-{key}{FAILED_SUFFIX}"
            atomic_write_text(record, clip(ran.log, LOG_CHARS) or "the compiler failed without "
                                                                  "a message")
            _record_list(job, cache_dir, recipe, labels)
            return CompileResult("compile_error", None, key, ran.log, ran.seconds, record=record)
        return CompileResult(ran.outcome, log=ran.log, seconds=ran.seconds)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def cached_compile(job: CompileJob, cache_dir: Path, timeout_s: float) -> CompileResult:
    """`job`'s artifact from `cache_dir`, compiled unless cached; see the module's docstring
    for the key, the publication and which failures are cached. A failure is a result, never
    an exception: CompilerUnavailable only when the compiler does not run at all, OSError
    when the cache cannot be written."""
    cache_dir = Path(cache_dir)
    recipe = job.recipe()
    found = _lookup(job, cache_dir, recipe)
    if found is not None:
        return found
    recipe_dir = job.recipe_dir(cache_dir, recipe)
    recipe_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(recipe_dir / "lock"):
        found = _lookup(job, cache_dir, recipe)   # a concurrent builder may have finished it
        return found if found is not None else _compile(job, cache_dir, recipe, timeout_s)


@dataclass(frozen=True)
class LinkJob:
    """`objects` ((file, its cache key) pairs, as cached_compile returned them) linked by
    `compiler` with `flags` into the artifact `<stem>-<key><suffix>`."""
    objects: tuple[tuple[Path, str], ...]
    compiler: str
    flags: tuple[str, ...]
    stem: str
    suffix: str = ""

    def key(self) -> str:
        """Hash of the objects' keys, the compiler's identity and the flags: what the linked
        file is made of (an object's key covers every file it was compiled from)."""
        payload = json.dumps({"link": [key for _, key in self.objects],
                              "compiler": compiler_identity(self.compiler),
                              "flags": list(self.flags)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:KEY_CHARS]


def cached_link(job: LinkJob, cache_dir: Path, timeout_s: float) -> CompileResult:
    """`job`'s linked file from `cache_dir`, linked unless cached (see the module's
    docstring). A failed link is a result with the linker's log, never cached; OSError when
    the cache cannot be written."""
    cache_dir = Path(cache_dir)
    key = job.key()
    artifact = cache_dir / f"{job.stem}-{key}{job.suffix}"
    if artifact.is_file():
        return CompileResult("ok", artifact, key, cached=True)
    lock_dir = cache_dir / DEPS_DIR / f"{job.stem}-{key}.link"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(lock_dir / "lock"):
        if artifact.is_file():
            return CompileResult("ok", artifact, key, cached=True)
        staging = make_temp_dir(cache_dir, f".{job.stem}.")
        try:
            output = staging / f"{job.stem}{job.suffix}"
            command = [job.compiler, *job.flags, *(str(path) for path, _ in job.objects),
                       "-o", str(output)]
            ran = _run(command, timeout_s, staging)
            if ran.outcome == "ok" and output.is_file():
                _publish(output, artifact)
                return CompileResult("ok", artifact, key, ran.log, ran.seconds)
            outcome = ran.outcome if ran.outcome != "ok" else "not_run"
            return CompileResult(outcome, log=f"linking {job.stem}{job.suffix} failed "
                                              f"({RETRIED})\n{ran.log}", seconds=ran.seconds)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
