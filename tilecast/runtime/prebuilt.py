"""Prebuilt kernel libraries carried by a registry version, so that a host serves its chosen
kernels without a compiler and the first call of a process compiles nothing.

A version's `kernels/` folder holds, for each build (one CPU target), the in-process library of
every candidate (tilecast.runtime.kernel_library's shared libraries, copied from the build
cache), and `kernels/manifest.json` describes them; both are in the version's checksums.json
like every other file:

    {"format": 1, "builds": {"<tag>": {
        "isa": "avx512", "target": "-march=znver4,...", "cpu_model": "...",
        "cpu_flags": [the instruction-set flags of the CPU it was built on],
        "compiler": "g++ (...) 12.2.0", "flags": [...], "origin": "publish" | "prebuild ...",
        "kernels": {"<kernel>": {"family", "file": "kernels/<tag>/<kernel>.so",
                                 "build_key", "sha256", "bytes"}}}}}

The libraries are built with -march=native (the very machine code the benchmark timed), so
a build runs only on a CPU with every instruction-set flag of the CPU it was built on:
`cpu_flags`. A Dispatcher that loads a version offers its kernels here (`offer`); the
kernel library then loads a kernel from the first build this CPU can run, checked against
its sha256 and size, before it looks in the build cache, and never calls the compiler for
it. A version without a build for this CPU, or without prebuilt kernels, compiles as before
where there is a compiler; without one, `KernelBuildError` says in one line what the version
has, what this host is, and to run `tilecast prebuild` (tilecast.runtime.prebuild makes the
folder). Reading and offering do no I/O beyond the manifest; nothing here compiles.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from tilecast.registry.base import RegistryError, relative_name

FOLDER = "kernels"
MANIFEST_FILE = f"{FOLDER}/manifest.json"
FORMAT = 1
# /proc/cpuinfo flags naming instructions a -march=native build may use; a build's cpu_flags
# are its CPU's flags of these families, and a host must have all of them to run it
ISA_FLAG_PREFIXES = ("sse", "ssse3", "avx", "fma", "f16c", "bmi", "abm", "lzcnt", "movbe",
                     "popcnt", "adx", "aes", "pclmulqdq", "vaes", "vpclmulqdq", "gfni",
                     "sha_ni", "amx", "cx16", "xsave")
_KERNEL_FIELDS = {"family": str, "file": str, "build_key": str, "sha256": str, "bytes": int}
_BUILD_FIELDS = {"isa": str, "target": str, "cpu_model": str, "cpu_flags": list,
                 "compiler": str, "flags": list, "origin": str, "kernels": dict}


def isa_flags(flags) -> tuple[str, ...]:
    """The instruction-set flags among a CPU's /proc/cpuinfo `flags`, sorted."""
    return tuple(sorted(flag for flag in flags if flag.startswith(ISA_FLAG_PREFIXES)))


@dataclass(frozen=True)
class Library:
    """One prebuilt kernel library: its file, checksum, size, and the build it belongs to
    (`tag`, `isa`, `cpu_flags` its CPU had, `cpu_model` it was built on)."""
    family: str
    path: Path
    sha256: str
    size: int
    build_key: str
    tag: str
    isa: str
    cpu_flags: frozenset[str]
    cpu_model: str


@dataclass(frozen=True)
class Offer:
    """What one loaded registry version offers for a kernel: its prebuilt `libraries` (one per
    build; empty when the version carries none), `where` the version is ("version 4 of model
    'gemm@...'") and the `prebuild` command that adds libraries for this host."""
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
        for name, kernel in build["kernels"].items():
            _check_fields(kernel, _KERNEL_FIELDS, f"{path} kernel {name!r}")
            relative_name(kernel["file"])   # never a path outside the version
    return document


def _check_fields(entry, fields: dict, where: str) -> None:
    if not isinstance(entry, dict):
        raise RegistryError(f"{where} is a {type(entry).__name__}, expected an object")
    for field, kind in fields.items():
        if not isinstance(entry.get(field), kind) or isinstance(entry.get(field), bool):
            raise RegistryError(f"{where} field {field!r} is {entry.get(field)!r}, expected "
                                f"a {kind.__name__}")


def libraries(directory: Path, manifest: dict) -> dict[str, tuple[Library, ...]]:
    """kernel name -> its prebuilt libraries in `manifest` (of the version at `directory`),
    one per build, in the manifest's order."""
    found: dict[str, list[Library]] = {}
    for tag, build in manifest["builds"].items():
        for name, kernel in build["kernels"].items():
            found.setdefault(name, []).append(Library(
                kernel["family"], Path(directory) / kernel["file"], kernel["sha256"],
                kernel["bytes"], kernel["build_key"], tag, build["isa"],
                frozenset(build["cpu_flags"]), build["cpu_model"]))
    return {name: tuple(found_libraries) for name, found_libraries in found.items()}


def prebuild_command(model: str, version: int | None, registry=None) -> str:
    """The command that adds this host's build of a version's kernels."""
    command = f"tilecast prebuild --model {model}"
    if version is not None:
        command += f" --version {version}"
    if registry is not None:
        command += f" --registry {registry}"
    return command


# (family name, kernel name) -> the Offer of the version loaded last that lists it
_offers: dict[tuple[str, str], Offer] = {}
_lock = threading.Lock()


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
    if model:
        where, command = f"version {version} of model {model!r}", prebuild_command(
            model, version, registry)
    else:   # an artifact directory loaded by path: the registry's names are not known here
        where = f"the model at {directory}"
        command = "tilecast prebuild --model <its model> --version <its version>"
    with _lock:
        for name in kernels:
            held = _offers.get((family, name))
            if name in found or held is None or not held.libraries:
                _offers[(family, name)] = Offer(where, command, found.get(name, ()))


def offered(family: str, name: str) -> Offer | None:
    """The Offer for a kernel, or None when no loaded version lists it."""
    return _offers.get((family, name))
