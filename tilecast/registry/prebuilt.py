"""Prebuilt kernel libraries carried by a registry version, so that a host serves its chosen
kernels without a compiler and the first call of a process compiles nothing.

A version's `kernels/` folder holds, for each build (one CPU target), the in-process library of
every candidate (tilecast.runtime.kernel_library's shared libraries, copied from the build
cache) and tilecast's own process libraries that serving the version loads (the dispatcher's
native scorer, tilecast.runtime.native; DISCO's kernels, tilecast.disco.native), and
`kernels/manifest.json` describes them; all are in the version's checksums.json like every
other file:

    {"format": 1, "builds": {"<tag>": {
        "isa": "avx512", "target": "-march=znver4,...", "cpu_model": "...",
        "cpu_flags": [the instruction-set flags of the CPU it was built on],
        "compiler": "g++ (...) 12.2.0", "flags": [...], "origin": "publish" | "prebuild ...",
        "kernels": {"<kernel>": {"family", "file": "kernels/<tag>/<kernel>.so",
                                 "build_key", "sha256", "bytes"}},
        "libraries": {"<library>": {"source", "file": "kernels/<tag>/libraries/<library>.so",
                                    "flags", "build_key", "sha256", "bytes",
                                    "sources": {"<file it was compiled from>": sha256}}}}}}

"libraries" is optional (a version published before tilecast carried them has none; a
DISCO version's "kernels" is empty: its kernels are one library per source), and a reader of
format 1 that predates it ignores it, so the format stays 1. A process library is
tilecast's code rather than the model's, so it is used only where the installed tilecast's
sources are the ones it was built from (`sources`: every file the compiler read, relative to
the library's source tree); elsewhere it is compiled as before.

The libraries are built with -march=native (the very machine code the benchmark timed), so
a build runs only on a CPU with every instruction-set flag of the CPU it was built on:
`cpu_flags`. A Dispatcher that loads a version offers its kernels and libraries here
(`offer`, `offer_libraries`); a loader then takes a kernel or library from the first build
this CPU can run, checked against its sha256 and size (`verify`), before it looks in its
cache, and never calls the compiler for it. A version without a build for this CPU, or
without prebuilt kernels, compiles as before where there is a compiler; without one, the
loader's error says in one line what the version has, what this host is, and to run
`tilecast prebuild` (tilecast.runtime.prebuild makes the folder; `not_here`, `no_compiler`).
Offering reads the manifest only; `verify` and `process_library` read the files they check;
nothing here compiles (`built` runs the loader's own compile).
"""
from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tilecast.core import compile as compiling
from tilecast.core import hardware
from tilecast.core.settings import COMPILER_ENV
from tilecast.registry.base import RegistryError, relative_name
from tilecast.registry.integrity import digest_file

logger = logging.getLogger(__name__)

FOLDER = "kernels"
MANIFEST_FILE = f"{FOLDER}/manifest.json"
FORMAT = 1
#: the offers' namespace of process libraries (kernels are offered under their family's name)
LIBRARIES = "libraries"
#: where a build's process libraries lie in its folder
LIBRARY_FOLDER = "libraries"
# /proc/cpuinfo flags naming instructions a -march=native build may use; a build's cpu_flags
# are its CPU's flags of these families, and a host must have all of them to run it
ISA_FLAG_PREFIXES = ("sse", "ssse3", "avx", "fma", "f16c", "bmi", "abm", "lzcnt", "movbe",
                     "popcnt", "adx", "aes", "pclmulqdq", "vaes", "vpclmulqdq", "gfni",
                     "sha_ni", "amx", "cx16", "xsave")
SHOWN_FLAGS = 6   # CPU flags a message lists before "and N more"
_KERNEL_FIELDS = {"family": str, "file": str, "build_key": str, "sha256": str, "bytes": int}
_LIBRARY_FIELDS = {"source": str, "file": str, "flags": list, "build_key": str, "sha256": str,
                   "bytes": int, "sources": dict}
_BUILD_FIELDS = {"isa": str, "target": str, "cpu_model": str, "cpu_flags": list,
                 "compiler": str, "flags": list, "origin": str, "kernels": dict}


class PrebuiltError(RuntimeError):
    """A prebuilt library cannot be used: unreadable, or not the file the manifest records.
    Each loader raises it again as its own error class."""


def isa_flags(flags) -> tuple[str, ...]:
    """The instruction-set flags among a CPU's /proc/cpuinfo `flags`, sorted."""
    return tuple(sorted(flag for flag in flags if flag.startswith(ISA_FLAG_PREFIXES)))


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (/proc/cpuinfo); empty where they cannot be read."""
    return frozenset(hardware.profile(1).get("flags", ()))


@dataclass(frozen=True)
class ProcessLibrary:
    """One of tilecast's own libraries that serving loads once per process (the native
    scorer's, DISCO's): its `name` in a manifest, its `source`, the `root` of the source tree
    the files it reads are named relative to, and its compile `flags`. The loader that owns
    it declares it; tilecast.runtime.prebuild builds it."""
    name: str
    source: Path
    root: Path
    flags: tuple[str, ...]

    def __str__(self) -> str:
        return f"library {self.name!r} ({self.source.name})"


@dataclass(frozen=True)
class Library:
    """One prebuilt library: its file, checksum, size, and the build it belongs to
    (`tag`, `isa`, `cpu_flags` its CPU had, `cpu_model` it was built on); for a process
    library, `sources`: (file, sha256) of every source file it was compiled from."""
    family: str
    path: Path
    sha256: str
    size: int
    build_key: str
    tag: str
    isa: str
    cpu_flags: frozenset[str]
    cpu_model: str
    sources: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Offer:
    """What one loaded registry version offers for a kernel or library: its prebuilt
    `libraries` (one per build; empty when the version carries none), `where` the version is
    ("version 4 of model 'gemm@...'") and the `prebuild` command that adds libraries for
    this host."""
    where: str
    prebuild: str
    libraries: tuple[Library, ...]


def read_manifest(directory: Path) -> dict | None:
    """A version directory's kernels/manifest.json, checked; None when it has none (a
    version published before tilecast carried kernels, or of a family without in-process
    kernels). RegistryError naming the file and field when it is malformed."""
    path = Path(directory) / MANIFEST_FILE
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise RegistryError(f"cannot read {path}: {err}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT or \
            not isinstance(document.get("builds"), dict):
        raise RegistryError(f"{path} is not a kernels manifest of format {FORMAT} "
                            '({"format": 1, "builds": {tag: {...}}}); this tilecast reads '
                            f"format {FORMAT} only")
    for tag, build in document["builds"].items():
        _check_fields(build, _BUILD_FIELDS, f"{path} build {tag!r}")
        sections = (("kernels", "kernel", _KERNEL_FIELDS),
                    ("libraries", "library", _LIBRARY_FIELDS))
        for section, noun, fields in sections:
            if section not in build:
                continue
            _check_fields(build, {section: dict}, f"{path} build {tag!r}")
            for name, entry in build[section].items():
                _check_fields(entry, fields, f"{path} {noun} {name!r}")
                relative_name(entry["file"])   # never a path outside the version
    return document


def _check_fields(entry, fields: dict, where: str) -> None:
    if not isinstance(entry, dict):
        raise RegistryError(f"{where} is a {type(entry).__name__}, expected an object")
    for field, kind in fields.items():
        if not isinstance(entry.get(field), kind) or isinstance(entry.get(field), bool):
            raise RegistryError(f"{where} field {field!r} is {entry.get(field)!r}, expected "
                                f"a {kind.__name__}")


def libraries(directory: Path, manifest: dict,
              section: str = "kernels") -> dict[str, tuple[Library, ...]]:
    """name -> its prebuilt libraries in `manifest` (of the version at `directory`), one per
    build, in the manifest's order: the candidates' kernels, or with section="libraries"
    the process libraries."""
    found: dict[str, list[Library]] = {}
    for tag, build in manifest["builds"].items():
        for name, entry in build.get(section, {}).items():
            found.setdefault(name, []).append(Library(
                entry.get("family", LIBRARIES), Path(directory) / entry["file"],
                entry["sha256"], entry["bytes"], entry["build_key"], tag, build["isa"],
                frozenset(build["cpu_flags"]), build["cpu_model"],
                tuple(sorted(entry.get("sources", {}).items()))))
    return {name: tuple(found_libraries) for name, found_libraries in found.items()}


def prebuild_command(model: str, version: int | None, registry=None) -> str:
    """The command that adds this host's build of a version's kernels."""
    command = f"tilecast prebuild --model {model}"
    if version is not None:
        command += f" --version {version}"
    if registry is not None:
        command += f" --registry {registry}"
    return command


# (family name or LIBRARIES, name) -> the Offer of the version loaded last that lists it
_offers: dict[tuple[str, str], Offer] = {}
_lock = threading.Lock()


def _whereabouts(directory: Path, model: str, version: int | None, registry) -> tuple[str, str]:
    if model:
        return (f"version {version} of model {model!r}",
                prebuild_command(model, version, registry))
    # an artifact directory loaded by path: the registry's names are not known here
    return (f"the model at {directory}",
            "tilecast prebuild --model <its model> --version <its version>")


def offer(directory: Path, family: str, kernels, *, model: str, version: int | None,
          registry=None) -> None:
    """Offer the prebuilt libraries of the version at `directory` (already verified against
    its checksums) for its `kernels` of `family` to tilecast.runtime.kernel_library. A kernel
    a version offers no library for keeps a library another loaded version offers, and
    otherwise remembers this version, so that a host without a compiler is told to prebuild
    it. RegistryError when the manifest is malformed or names a kernel the version lacks."""
    manifest = read_manifest(directory)
    found = libraries(directory, manifest) if manifest is not None else {}
    strangers = sorted(set(found) - set(kernels))
    if strangers:
        raise RegistryError(f"{Path(directory) / MANIFEST_FILE} lists kernel(s) {strangers[:3]} "
                            f"that are not candidates of the version")
    where, command = _whereabouts(directory, model, version, registry)
    with _lock:
        for name in kernels:
            held = _offers.get((family, name))
            if name in found or held is None or not held.libraries:
                _offers[(family, name)] = Offer(where, command, found.get(name, ()))


def offer_libraries(directory: Path, *, model: str, version: int | None, registry=None,
                    needed=()) -> None:
    """Offer the process libraries of the version at `directory` (already verified against
    its checksums) to their loaders (`process_library`): call it before the version's model
    is built, whose scorer loads them. A library of `needed` (those serving the version
    loads) that it does not carry keeps one another loaded version offers, and otherwise
    remembers this version, so that a host without a compiler is told to prebuild it.
    RegistryError when the manifest is malformed."""
    manifest = read_manifest(directory)
    found = libraries(directory, manifest, LIBRARIES) if manifest is not None else {}
    where, command = _whereabouts(directory, model, version, registry)
    with _lock:
        for name in dict.fromkeys([*found, *needed]):
            held = _offers.get((LIBRARIES, name))
            if name in found or held is None or not held.libraries:
                _offers[(LIBRARIES, name)] = Offer(where, command, found.get(name, ()))


def offered(family: str, name: str) -> Offer | None:
    """The Offer for a kernel (or, with family LIBRARIES, a process library), or None when
    no loaded version lists it."""
    return _offers.get((family, name))


@functools.lru_cache(maxsize=256)
def _installed_digest(root: Path, name: str) -> str:
    # the installed tree does not change under a running process
    return digest_file(root / name)[0] if (root / name).is_file() else "absent"


def _other_sources(library: Library, root: Path | None) -> list[str]:
    """The source files of a process library that differ in the installed tree at `root`."""
    if root is None:
        return []
    return [name for name, sha256 in library.sources if _installed_digest(root, name) != sha256]


def runnable(offer: Offer | None, have: frozenset[str],
             root: Path | None = None) -> Library | None:
    """The first prebuilt library of `offer` whose build's CPU flags are among `have` (the
    first one where they are unknown: empty) and, for a process library (`root`: its
    installed source tree), that was built from the installed sources; None when none is."""
    if offer is None:
        return None
    for library in offer.libraries:
        if (not have or library.cpu_flags <= have) and not _other_sources(library, root):
            return library
    return None


def verify(library: Library, offer: Offer, what: str) -> Path:
    """`library`'s path after its size and sha256 are checked against the manifest;
    PrebuiltError naming the file, `what` it is ("kernel 'x'") and what to do otherwise."""
    try:
        sha256, size = digest_file(library.path)
    except OSError as err:
        raise PrebuiltError(f"cannot read the prebuilt library {library.path} of {what} "
                            f"({offer.where}): {err}") from None
    if (sha256, size) != (library.sha256, library.size):
        raise PrebuiltError(
            f"prebuilt library {library.path} of {what} ({offer.where}) does not match "
            f"{MANIFEST_FILE} ({size} bytes, sha256 {sha256[:12]}...; recorded {library.size} "
            f"bytes, sha256 {library.sha256[:12]}...): the file is damaged; publish the model "
            "again or roll back to an intact version")
    return library.path


def process_library(spec: ProcessLibrary) -> Path | None:
    """The verified prebuilt file of `spec` that a loaded version offers for this CPU and
    this tilecast's sources; None when no loaded version offers one this host runs (the
    loader compiles it then, or says why it cannot: `no_compiler`). PrebuiltError when the
    offered file is damaged."""
    offer = offered(LIBRARIES, spec.name)
    library = runnable(offer, cpu_flags(), spec.root)
    return verify(library, offer, str(spec)) if library is not None else None


def built(spec: ProcessLibrary, cxx: str, build: Callable[[], Path]) -> Path:
    """`build()` (the loader's compile of `spec` with `cxx`, unless cached) for a process
    library that no loaded version offers for this host (`process_library` found none).
    Where a loaded version offers it, a warning names the builds it carries, or where `cxx`
    does not run, PrebuiltError says in one line what they are and which prebuild to run;
    where none does, build() answers as before."""
    offer = offered(LIBRARIES, spec.name)
    if offer is None:
        return build()
    try:
        compiling.compiler_identity(cxx)
    except compiling.CompilerUnavailable:
        raise PrebuiltError(no_compiler(str(spec), offer, cxx, cpu_flags(), "libraries",
                                        spec.root)) from None
    path = build()
    if offer.libraries:
        logger.warning("%s; built it with %s instead", not_here(
            str(spec), offer, cpu_flags(), "libraries", spec.root), cxx)
    return path


def host() -> str:
    """This machine in a few words, for messages: its widest ISA and CPU model."""
    profile = hardware.profile(1)
    return f"{hardware.isa_level(profile)}, {profile['cpu_model']}"


def not_here(what: str, offer: Offer, have: frozenset[str], noun: str = "kernels",
             root: Path | None = None) -> str:
    """What the version offering `what` carries, and why this host runs none of it (the CPU
    flags it lacks; for a process library, the source files that differ here)."""
    def lacking(library: Library) -> str:
        missing = sorted(library.cpu_flags - have)
        shown = ", ".join(missing[:SHOWN_FLAGS]) or "nothing"
        reason = "this host lacks " + shown + (
            f" and {len(missing) - SHOWN_FLAGS} more" if len(missing) > SHOWN_FLAGS else "")
        other = _other_sources(library, root)
        if other:
            reason += (f"; it was built from other sources of tilecast than this one's "
                       f"({', '.join(other[:3])} differ)")
        return reason

    builds = "; ".join(f"{library.tag} (built on {library.cpu_model}; {lacking(library)})"
                       for library in offer.libraries)
    return (f"{what}: {offer.where} carries prebuilt {noun} for {builds}, not for this host "
            f"({host()})")


def no_compiler(what: str, offer: Offer | None, cxx: str, have: frozenset[str],
                noun: str = "kernels", root: Path | None = None) -> str:
    """The one line for `what` (a kernel or process library) that must be compiled on a host
    without a compiler: what the version offering it carries, and which prebuild to run."""
    missing = f"there is no compiler here ({cxx!r} does not run; set {COMPILER_ENV} or install g++)"
    if offer is None:
        return (f"{what} is prebuilt by no registry version loaded in this process, and "
                f"{missing}: load it through a Dispatcher of a version that carries it "
                "(`tilecast prebuild --model M` adds them to a model)")
    if offer.libraries:
        return (f"{not_here(what, offer, have, noun, root)}, and {missing}: run "
                f"`{offer.prebuild}` on a host with this host's CPU flags and a compiler, and "
                "serve the version it publishes")
    return (f"{what}: {offer.where} carries no prebuilt {noun}, and {missing}: run "
            f"`{offer.prebuild}` on a host with a compiler and this host's CPU flags, and serve "
            "the version it publishes")


def source_digests(spec: ProcessLibrary, files) -> dict[str, str]:
    """file -> sha256 of the installed `files` (named relative to spec.root): a process
    library's `sources` entry."""
    return {name: _installed_digest(spec.root, name) for name in sorted(files)}

