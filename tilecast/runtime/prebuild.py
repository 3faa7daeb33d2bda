"""Making a version's prebuilt kernels (tilecast.registry.prebuilt): at publish, and later with
`tilecast prebuild`.

`kernel_files` gives the files of a version's `kernels/` folder for one build, this host's:
the in-process library of every candidate, the process libraries serving the version loads
(`process_libraries`: the dispatcher's native scorer, tilecast.runtime.native, for every
model; DISCO's two kernel libraries, tilecast.disco.native, for a DISCO model), and the
manifest. A run's libraries are in its caches already (with the interleaved benchmark, the
build stage links the candidates' from the objects its executables were linked from,
otherwise publishing links them from those cached objects; the process libraries are
compiled beside the candidates, build_serving_libraries), so publishing copies them; only a
missing one is compiled (a version published from a workdir whose build ran elsewhere). `publish_kernels` is
the publish stage's all-or-nothing wrapper: a version carries every candidate's and process
library or none, and none where the candidates were not built on this host.

`prebuild` adds this host's build to a published version. A version is immutable (created
exclusively, never rewritten; a remote registry's versions are cached by number on every
host that loaded them), so it publishes a new version: the source version's files
unchanged, its kernels, and this host's build beside them, with checksums like any version.
Every alias that held the source version moves to the new one (it is the same model: the
gate is not asked, and promotion.json says so); one whose kernels this host runs already
publishes nothing.
"""
from __future__ import annotations

import importlib
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tilecast.core import build, hardware
from tilecast.core import compile as compiling
from tilecast.core.artifact import CANDIDATES_FILE, FEATURE_SPEC_FILE
from tilecast.families import get_family
from tilecast.registry import api as registry, integrity
from tilecast.registry.base import RESERVED_FILES, RegistryError
from tilecast.runtime import kernel_library
from tilecast.registry import prebuilt
from tilecast.runtime.native import FEATURE_FILLERS
from tilecast.runtime.native.forest import NativeForest
from tilecast.runtime.native.library import NativeBuildError

log = logging.getLogger(__name__)

# The modules that load tilecast's process libraries, each with LIBRARIES (name ->
# prebuilt.ProcessLibrary) and build_library(name, compiler) -> the cached library's path;
# named, not imported: a DISCO dispatcher's loading must not import torch.
SCORER_MODULE = "tilecast.runtime.native.library"
DISCO_MODULE = "tilecast.disco.native"
#: family -> the process libraries its served calls load besides the scorer's, and their
#: module (its LIBRARIES' names: tests/test_prebuilt_disco.py checks they agree)
FAMILY_LIBRARIES = {"disco_forward": (DISCO_MODULE, ("disco_csr", "disco_kpacked")),
                    "disco_backward": (DISCO_MODULE, ("disco_csr", "disco_kpacked"))}


class PrebuildError(RegistryError):
    """A version's kernels could not be built (a compile failed, no compiler)."""


@dataclass(frozen=True)
class PrebuildResult:
    """What `prebuild` did: the version that now serves this host's build (`version`; the
    source itself when it had one), whether it is new, the build's tag, how many libraries
    and bytes it holds, how many came from the caches, and the aliases that moved."""
    source_version: int
    version: int
    published: bool
    tag: str
    libraries: int      # kernel and process libraries together
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


def process_libraries(directory: Path, family) -> dict[str, str]:
    """name -> the module that loads and builds it, for the process libraries serving the
    model in `directory` (of `family`) loads: the native scorer's forest, its feature
    filler where the installed engine has one (tilecast.runtime.native.FEATURE_FILLERS),
    and the family's own (FAMILY_LIBRARIES)."""
    spec = json.loads((Path(directory) / FEATURE_SPEC_FILE).read_text())
    return serving_libraries(family, spec["hardware"])


def serving_libraries(family, hardware_profile) -> dict[str, str]:
    """process_libraries of a model of `family` trained on `hardware_profile` (a feature
    spec's "hardware", or a run's hardware.profile before there is a model)."""
    wanted = {NativeForest.LIBRARY: SCORER_MODULE}
    engine = family.feature_engine(hardware_profile)
    filler = FEATURE_FILLERS.get((engine.name, engine.version))
    if filler is not None:
        wanted[filler.LIBRARY] = SCORER_MODULE
    module, names = FAMILY_LIBRARIES.get(family.name, ("", ()))
    return {**wanted, **dict.fromkeys(names, module)}


def build_serving_libraries(families, hardware_profile, compiler: str) -> list[Path]:
    """Compile (unless cached) the process libraries that the served models of `families`
    will load, so that the run's evaluate and publish stages find them in the caches: the
    build stage calls this beside the kernels' compiles. One that does not build is left to
    the stage that needs it to report (the scorer falls back to numpy, publishing names it)."""
    wanted: dict[str, str] = {}
    for family in families:
        wanted.update(serving_libraries(family, hardware_profile))
    paths = []
    for name, module in wanted.items():
        try:
            paths.append(importlib.import_module(module).build_library(name, compiler))
        except (RuntimeError, OSError) as err:   # each module's build error is a RuntimeError
            log.debug("process library %s not built ahead: %s", name, err)
    return paths


def library_spec(name: str, module: str) -> prebuilt.ProcessLibrary:
    """The declaration of process library `name` by the module that loads it."""
    return importlib.import_module(module).LIBRARIES[name]


def _library_entry(name: str, module_name: str, compiler: str,
                   tag: str) -> tuple[Path, dict, bool]:
    """(cached library, manifest entry, whether it was cached) of process library `name`;
    PrebuildError when it does not build or its sources cannot be listed."""
    module = importlib.import_module(module_name)
    spec = module.LIBRARIES[name]
    started = time.time()
    try:
        path = module.build_library(name, compiler)
        files = compiling.list_dependencies(compiling.CompileJob(spec.source, compiler,
                                                                 spec.flags, root=spec.root))
    except (build.LibraryBuildError, NativeBuildError, compiling.CompilerUnavailable) as err:
        raise PrebuildError(f"{spec} did not build with {compiler!r}: "
                            f"{build.first_error_line(str(err))}") from None
    if files is None:
        raise PrebuildError(f"{compiler!r} could not list the files {spec.source} includes")
    sha256, size = integrity.digest_file(path)
    entry = {"source": spec.source.name,
             "file": f"{prebuilt.FOLDER}/{tag}/{prebuilt.LIBRARY_FOLDER}/{name}.so",
             "flags": list(spec.flags), "build_key": path.stem.rsplit("-", 1)[-1],
             "sha256": sha256, "bytes": size, "sources": prebuilt.source_digests(spec, files)}
    return path, entry, path.stat().st_mtime < started


def kernel_files(family, names: Sequence[str], cache_dir: Path | None = None, *,
                 compiler: str = "g++", jobs: int = 2, origin: str = "publish",
                 manifest: dict | None = None,
                 libraries: dict | None = None) -> tuple[dict, dict]:
    """(files, build) for a version carrying this host's build of `names`' libraries and of
    the process `libraries` (process_libraries' mapping): files maps
    `kernels/<tag>/<kernel>.so` to the library in the build cache (`cache_dir`, default
    build.default_cache_dir()), `kernels/<tag>/libraries/<name>.so` to the process library
    in its loader's cache, and kernels/manifest.json to its text, which keeps the builds of
    `manifest` (the version's own, when it has one) and adds this one; build is this build's
    manifest entry with "tag" and "cached" (libraries found built). {} and {} when there is
    nothing to carry: a family whose kernels do not run in process, and no process
    libraries. PrebuildError naming the kernels that did not build, or when there is no
    compiler."""
    names = list(names) if runs_in_process(family, names) else []
    libraries = libraries or {}
    if not names and not libraries:
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
    files, kernels, process = {}, {}, {}
    for built in builts:
        name = f"{prebuilt.FOLDER}/{tag}/{built.kernel}.so"
        sha256, size = integrity.digest_file(built.binary)
        files[name] = built.binary
        kernels[built.kernel] = {"family": family.name, "file": name,
                                 "build_key": built.cache_key, "sha256": sha256, "bytes": size}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        made = dict(zip(libraries, pool.map(
            lambda item: _library_entry(item[0], item[1], compiler, tag), libraries.items())))
    for name, (path, entry, _) in made.items():
        files[entry["file"]] = path
        process[name] = entry
    entry = {**described, "origin": origin, "kernels": kernels, "libraries": process}
    builds = {**(manifest or {}).get("builds", {}), tag: entry}
    files[prebuilt.MANIFEST_FILE] = json.dumps({"format": prebuilt.FORMAT, "builds": builds},
                                               indent=2, sort_keys=True) + "\n"
    cached = sum(b.cached for b in builts) + sum(was_cached for *_, was_cached in made.values())
    return files, {**entry, "tag": tag, "cached": cached}


def _built_here(cache_dir: Path, name: str, in_process: bool) -> bool:
    """Whether candidate `name` was built in `cache_dir`: its library or object (a family
    whose kernels run in process), else any artifact of it (its benchmark executable)."""
    artifacts = [path.suffix for path in Path(cache_dir).glob(f"{name}-*")
                 if path.suffix != compiling.FAILED_SUFFIX]
    return any(suffix in (".so", ".o") for suffix in artifacts) if in_process else bool(artifacts)


def files_bytes(entry: dict) -> int:
    """The bytes of a build entry's kernel and process libraries."""
    return sum(item["bytes"] for section in ("kernels", "libraries")
               for item in entry.get(section, {}).values())


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
    every candidate's library and of the process libraries, copied from the run's caches),
    or {} with a warning when any of them is not there or cannot be built: a version then
    carries none, and serving compiles them (or `tilecast prebuild` adds them). A candidate
    not built in `cache_dir` (a fleet's parent, whose shards built on their own machines)
    leaves the version without kernels and compiles nothing: this host is not the one the
    model was measured on."""
    family, names = _candidates(model_dir)
    in_process = runs_in_process(family, names)
    absent = [name for name in names if not _built_here(cache_dir, name, in_process)]
    if absent:
        log.warning("publish without prebuilt kernels: %d of %d candidates were not built in "
                    "%s (e.g. %s); `tilecast prebuild` on a machine of the model's class adds "
                    "them", len(absent), len(names), cache_dir, absent[0])
        return {}
    try:
        libraries = process_libraries(model_dir, family)
        files, entry = kernel_files(family, names, cache_dir, jobs=jobs, libraries=libraries)
    except (PrebuildError, OSError) as err:   # OSError: an unreadable or unwritable cache
        log.warning("publish without prebuilt kernels (serving compiles them, or `tilecast "
                    "prebuild` adds them): %s", err)
        return {}
    if entry:
        log.info("publish: %d kernel and %d process libraries for %s (%d from the caches), "
                 "%.1f MiB", len(entry["kernels"]), len(entry["libraries"]), entry["tag"],
                 entry["cached"], files_bytes(entry) / 2**20)
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
    libraries = process_libraries(source, family)
    needed = set(names) if runs_in_process(family, names) else set()
    for tag, existing in (manifest or {"builds": {}})["builds"].items():
        if _serves_here(existing, needed, libraries):
            return PrebuildResult(number, number, False, tag, len(existing["kernels"]) +
                                  len(existing.get("libraries", {})), files_bytes(existing), 0)
    kernels, entry = kernel_files(family, names, cache_dir, compiler=compiler, jobs=jobs,
                                  origin=f"prebuild of version {number}", manifest=manifest,
                                  libraries=libraries)
    if not entry:
        raise PrebuildError(f"version {number} of model {model!r} is a {family.name} model, "
                            "whose kernels do not run in process: there is nothing to prebuild")
    aliases = tuple(alias for alias, held in registry.list_aliases(root, model).items()
                    if held == number)
    size, count = files_bytes(entry), len(entry["kernels"]) + len(entry["libraries"])
    reason = (f"prebuild: version {number}'s files unchanged, with prebuilt kernels for "
              f"{entry['tag']} added ({count} libraries, {size} bytes); the "
              f"same model, so the gate was not asked, and the aliases that held version "
              f"{number} move: {', '.join(aliases) or 'none'}")
    result = registry.publish(root, model, {**version_files(source), **kernels},
                              metrics=registry.read_metrics(root, model, number),
                              aliases_if_promoted=aliases,
                              gate=lambda production, new: (True, reason))
    return PrebuildResult(number, result.version, True, entry["tag"], count, size,
                          entry["cached"], tuple(result.aliases))


def _serves_here(existing: dict, kernels: set, libraries: dict) -> bool:
    """Whether a version's build runs on this CPU with every candidate's kernel and every
    process library, each built from this tilecast's sources."""
    if not set(existing["cpu_flags"]) <= prebuilt.cpu_flags() or \
            not kernels <= set(existing["kernels"]):
        return False
    carried = existing.get("libraries", {})
    return all(name in carried and prebuilt.source_digests(
        library_spec(name, module), carried[name]["sources"]) == carried[name]["sources"]
        for name, module in libraries.items())
