"""Making a version's prebuilt kernels (tilecast.runtime.prebuilt): at publish, and later with
`tilecast prebuild`.

`kernel_files` gives the files of a version's `kernels/` folder for one build, this host's:
the in-process library of every candidate, and the manifest. A run's libraries are in its
build cache already (with the interleaved benchmark, the build stage links them from the
objects its executables were linked from; otherwise publishing links them from those cached
objects), so publishing copies them; only a missing one is compiled. `publish_kernels` is the publish stage's
all-or-nothing wrapper: a version carries every candidate's library or none.

`prebuild` adds this host's build to a published version. A version is immutable (created
exclusively, never rewritten; a remote registry's versions are cached by number on every
host that loaded them), so it publishes a new version: the source version's files
unchanged, its kernels, and this host's build beside them, with checksums like any version.
Every alias that held the source version moves to the new one (it is the same model: the
gate is not asked, and promotion.json says so); one whose kernels this host runs already
publishes nothing.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tilecast.core import build, hardware
from tilecast.core import compile as compiling
from tilecast.core.artifact import CANDIDATES_FILE
from tilecast.families import get_family
from tilecast.registry import api as registry, integrity
from tilecast.registry.base import RESERVED_FILES, RegistryError
from tilecast.runtime import kernel_library, prebuilt

log = logging.getLogger(__name__)


class PrebuildError(RegistryError):
    """A version's kernels could not be built (a compile failed, no compiler)."""


@dataclass(frozen=True)
class PrebuildResult:
    """What `prebuild` did: the version that now serves this host's build (`version`; the
    source itself when it had one), whether it is new, the build's tag, how many libraries
    and bytes it holds, how many came from the build cache, and the aliases that moved."""
    source_version: int
    version: int
    published: bool
    tag: str
    libraries: int
    bytes: int
    cached: int
    aliases: tuple[str, ...] = ()


def this_build(compiler: str) -> dict:
    """This host's build description (without kernels): its tag, ISA, -march=native target,
    CPU model and instruction-set flags, the compiler and flags. CompilerUnavailable when the
    compiler does not run."""
    profile = hardware.profile(1)
    flags = prebuilt.isa_flags(profile.get("flags", ()))
    target = compiling.native_target(compiler)
    march = re.search(r"-march=([A-Za-z0-9_.-]+)", target)
    digest = integrity.digest_bytes(" ".join(flags).encode())[0][:8]
    isa = hardware.isa_level(profile)
    return {"tag": f"{isa}-{march.group(1) if march else 'native'}-{digest}", "isa": isa,
            "target": target, "cpu_model": str(profile.get("cpu_model", "unknown")),
            "cpu_flags": list(flags), "compiler": compiling.compiler_version(compiler),
            "flags": list(build.DEFAULT_FLAGS)}


def runs_in_process(family, names: Sequence[str]) -> bool:
    """Whether `names` are kernels of `family` that run in process, from a library each
    (tilecast.runtime.kernel_library.ENTRIES): those a version can carry prebuilt."""
    sources = {family.build_spec(family.parse_name(name)).library_source for name in names}
    return bool(names) and all(source is not None and source.name in kernel_library.ENTRIES
                               for source in sources)


def kernel_files(family, names: Sequence[str], cache_dir: Path | None = None, *,
                 compiler: str = "g++", jobs: int = 2, origin: str = "publish",
                 manifest: dict | None = None) -> tuple[dict, dict]:
    """(files, build) for a version carrying this host's build of `names`' libraries:
    files maps `kernels/<tag>/<kernel>.so` to the library in the build cache (`cache_dir`,
    default build.default_cache_dir()) and kernels/manifest.json to its text, which keeps
    the builds of `manifest` (the version's own, when it has one) and adds this one; build
    is this build's manifest entry with "tag" and "cached" (libraries found built). {} and
    {} for a family whose kernels do not run in process. PrebuildError naming the kernels
    that did not build, or when there is no compiler."""
    if not runs_in_process(family, names):
        return {}, {}
    configs = [family.parse_name(name) for name in names]
    cache_dir = Path(cache_dir) if cache_dir is not None else build.default_cache_dir()
    try:
        described = this_build(compiler)
        builts = build.build_candidates(family, configs, cache_dir, jobs=jobs,
                                        compiler=compiler, shared=True)
    except compiling.CompilerUnavailable as err:
        raise PrebuildError(f"cannot build the kernel libraries of {family.name}: {err}") from None
    failed = [b for b in builts if b.binary is None]
    if failed:
        shown = "; ".join(f"{b.kernel}: {build.first_error_line(b.event.reason)}"
                          for b in failed[:build.SHOWN_FAILURES])
        raise PrebuildError(f"{len(failed)} of {len(builts)} kernel libraries of "
                            f"{family.name} did not build with {compiler!r}: {shown}")
    tag = described.pop("tag")
    files, kernels = {}, {}
    for built in builts:
        name = f"{prebuilt.FOLDER}/{tag}/{built.kernel}.so"
        sha256, size = integrity.digest_file(built.binary)
        files[name] = built.binary
        kernels[built.kernel] = {"family": family.name, "file": name,
                                 "build_key": built.cache_key, "sha256": sha256, "bytes": size}
    entry = {**described, "origin": origin, "kernels": kernels}
    builds = {**(manifest or {}).get("builds", {}), tag: entry}
    files[prebuilt.MANIFEST_FILE] = json.dumps({"format": prebuilt.FORMAT, "builds": builds},
                                               indent=2, sort_keys=True) + "\n"
    return files, {**entry, "tag": tag, "cached": sum(b.cached for b in builts)}


def _candidates(directory: Path) -> tuple[object, list[str]]:
    """(family, kernel names incl. the static best) of a model directory's candidates.json."""
    path = Path(directory) / CANDIDATES_FILE
    try:
        document = json.loads(path.read_text())
        names = list(dict.fromkeys([*document["kernels"], document["static_best"]]))
        return get_family(document["family"]), names
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RegistryError(f"cannot read the candidates of {directory} ({path}): "
                            f"{type(err).__name__}: {err}") from None


def publish_kernels(model_dir: Path, cache_dir: Path, *, jobs: int = 2) -> dict:
    """The publish stage's kernels/ files for the model in `model_dir` (this host's build of
    every candidate's library, copied from the run's build cache), or {} with a warning when
    any of them is not there or cannot be built: a version then carries none, and serving
    compiles them (or `tilecast prebuild` adds them). Publishing compiles nothing: a
    candidate neither linked nor compiled in `cache_dir` (a fleet's parent, whose shards
    built on their own machines) leaves the version without kernels."""
    family, names = _candidates(model_dir)
    if not runs_in_process(family, names):
        return {}
    absent = [name for name in names if not any(Path(cache_dir).glob(f"{name}-*.so"))
              and not any(Path(cache_dir).glob(f"{name}-*.o"))]
    if absent:
        log.warning("publish without prebuilt kernels: %d of %d candidates were not built in "
                    "%s (e.g. %s); `tilecast prebuild` on a machine of the model's class adds "
                    "them", len(absent), len(names), cache_dir, absent[0])
        return {}
    try:
        files, entry = kernel_files(family, names, cache_dir, jobs=jobs)
    except (PrebuildError, OSError) as err:   # OSError: an unreadable or unwritable cache
        log.warning("publish without prebuilt kernels (serving compiles them, or `tilecast "
                    "prebuild` adds them): %s", err)
        return {}
    if entry:
        log.info("publish: %d kernel libraries for %s (%d from the build cache), %.1f MiB",
                 len(entry["kernels"]), entry["tag"], entry["cached"],
                 sum(k["bytes"] for k in entry["kernels"].values()) / 2**20)
    return files


def version_files(directory: Path) -> dict[str, Path]:
    """A version's files as publish takes them: everything but what publish writes itself
    and the kernels manifest (which the new build rewrites)."""
    listed = integrity.read_manifest(directory)
    names = (sorted(listed) if listed is not None else
             sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                    if p.is_file()))
    return {name: directory / name for name in names
            if name not in RESERVED_FILES and name != prebuilt.MANIFEST_FILE}


def prebuild(root, model: str, alias_or_version: str | int = registry.PRODUCTION, *,
             cache_dir: Path | None = None, compiler: str = "g++",
             jobs: int = 2) -> PrebuildResult:
    """Publish version `alias_or_version` of `model` again with this host's build of its
    kernels added (see the module's docstring); nothing is published when the version
    carries a build this host runs. RegistryError (PrebuildError) says what failed."""
    number = registry.resolve_version(root, model, alias_or_version)
    source = registry.local_copy(root, model, number)
    manifest = prebuilt.read_manifest(source)
    family, names = _candidates(source)
    have = kernel_library.cpu_flags()
    for tag, existing in (manifest or {"builds": {}})["builds"].items():
        if set(existing["cpu_flags"]) <= have:
            kernels = existing["kernels"].values()
            return PrebuildResult(number, number, False, tag, len(kernels),
                                  sum(k["bytes"] for k in kernels), 0)
    kernels, entry = kernel_files(family, names, cache_dir, compiler=compiler, jobs=jobs,
                                  origin=f"prebuild of version {number}", manifest=manifest)
    if not entry:
        raise PrebuildError(f"version {number} of model {model!r} is a {family.name} model, "
                            "whose kernels do not run in process: there is nothing to prebuild")
    aliases = tuple(alias for alias, held in registry.list_aliases(root, model).items()
                    if held == number)
    size = sum(k["bytes"] for k in entry["kernels"].values())
    reason = (f"prebuild: version {number}'s files unchanged, with prebuilt kernels for "
              f"{entry['tag']} added ({len(entry['kernels'])} libraries, {size} bytes); the "
              f"same model, so the gate was not asked, and the aliases that held version "
              f"{number} move: {', '.join(aliases) or 'none'}")
    result = registry.publish(root, model, {**version_files(source), **kernels},
                              metrics=registry.read_metrics(root, model, number),
                              aliases_if_promoted=aliases,
                              gate=lambda production, new: (True, reason))
    return PrebuildResult(number, result.version, True, entry["tag"], len(entry["kernels"]),
                          size, entry["cached"], tuple(result.aliases))
