"""Build stage: content-hash cache reuse, cache keys that follow the inputs (every header the
compiler reports, however it joined the include chain), compile errors recorded as events and
cached with their log, while timed-out or killed compiles are not; concurrent builders of one
key; one compile-and-cache for the build stage, the in-process kernels and the native
libraries; build events read back whatever failed, and a family none of whose candidates built
is one clear error naming the failures."""
from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from faults import note_case
from tilecast.cli import user_errors
from tilecast.core import compile as compiling, hardware
from tilecast.core.build import (SHARED_FLAGS, BuildError, build_candidates, cache_key,
                                   first_error_line, read_events, rebase_spec, require_some_built,
                                   source_root, write_events)
from tilecast.families import get_family
from tilecast.core.family import KERNELS_DIR, BuildSpec
from tilecast.families.gemm import GemmConfig

GEMM = get_family("gemm")
CFG = GemmConfig("fp32", "avx2", 6, 16, 96, 512, 128, "m", True, True)


def test_second_build_reuses_the_cache(tmp_path):
    steps = []

    def progress(done, total, message):
        steps.append((done, total, message))

    first = build_candidates(GEMM, [CFG], tmp_path, jobs=1, progress=progress)
    second = build_candidates(GEMM, [CFG], tmp_path, jobs=1, progress=progress)
    assert first[0].event.status == "ok" and not first[0].cached
    assert second[0].cached and second[0].binary == first[0].binary
    kernel = GEMM.kernel_name(CFG)
    assert steps == [(1, 1, f"build 1/1 {kernel} {first[0].event.seconds:.1f}s"),
                     (1, 1, f"build 1/1 {kernel} cached")]
    assert first[0].event.binary_bytes == first[0].binary.stat().st_size > 0
    assert not list(tmp_path.glob(".*.tmp")), "a temp file was left behind"


def test_cache_key_follows_defines_flags_and_source(tmp_path):
    spec = GEMM.build_spec(CFG)
    base = cache_key(spec.source, spec.defines, ["-O3"], "g++")
    assert base == cache_key(spec.source, dict(spec.defines), ["-O3"], "g++")
    assert base != cache_key(spec.source, {**spec.defines, "TC_KC": 64}, ["-O3"], "g++")
    assert base != cache_key(spec.source, spec.defines, ["-O2"], "g++")
    other = tmp_path / "gemm.cpp"
    other.write_text(spec.source.read_text() + "\n// changed\n")
    assert base != cache_key(other, spec.defines, ["-O3"], "g++")


class _SourceFamily:
    """The GEMM family's names and defines over another source (one that does not compile,
    or a tiny program)."""

    def __init__(self, source):
        self.source = source

    def kernel_name(self, cfg):
        return GEMM.kernel_name(cfg)

    def build_spec(self, cfg):
        return replace(GEMM.build_spec(cfg), source=self.source, unit=None)


def test_compile_error_is_a_recorded_event(tmp_path, monkeypatch):
    """A genuine compile error is cached with the compiler's log: the same inputs fail from
    the cache, with the same reason, and no compiler runs."""
    source = tmp_path / "broken.cpp"
    source.write_text("int main() { return undefined_symbol; }\n")
    [built] = build_candidates(_SourceFamily(source), [CFG], tmp_path / "cache", jobs=1)
    assert built.event.status == "failed" and built.binary is None
    assert built.outcome == "compile_error" and built.failure_cached and not built.cached
    assert "undefined_symbol" in built.event.reason
    [record] = (tmp_path / "cache").glob("*.failed")
    assert record.name == f"{built.kernel}-{built.cache_key}.failed"
    assert re.search(r"error: .undefined_symbol. was not declared", record.read_text())
    _forbid_compiler_runs(monkeypatch)
    [again] = build_candidates(_SourceFamily(source), [CFG], tmp_path / "cache", jobs=1)
    assert again.cached and again.event.status == "failed" and again.failure_cached
    assert again.event.reason == built.event.reason and again.cache_key == built.cache_key
    assert isinstance(BuildSpec(source, {}), BuildSpec)


def test_cache_key_covers_included_headers_only(tmp_path):
    (tmp_path / "used.hpp").write_text("#pragma once\n#include \"nested.hpp\"\n")
    (tmp_path / "nested.hpp").write_text("int nested = 1;\n")
    (tmp_path / "unrelated.hpp").write_text("int other = 1;\n")
    source = tmp_path / "k.cpp"
    source.write_text('#include "used.hpp"\n#include <vector>\nint main() {}\n')
    base = cache_key(source, {}, ["-O3"], "g++")
    (tmp_path / "unrelated.hpp").write_text("int other = 2;\n")
    assert cache_key(source, {}, ["-O3"], "g++") == base
    (tmp_path / "nested.hpp").write_text("int nested = 2;\n")
    assert cache_key(source, {}, ["-O3"], "g++") != base


def test_shared_mode_keys_differ_and_an_older_tree_builds_executables_only(tmp_path):
    spec = GEMM.build_spec(CFG)
    assert spec.library_source.name == "gemm_lib.cpp"
    executable = cache_key(spec.source, spec.defines, ["-O3"], "g++")
    assert executable != cache_key(spec.library_source, spec.defines, ["-O3", *SHARED_FLAGS], "g++")
    tree = tmp_path / "kernels"
    shutil.copytree(KERNELS_DIR / "cpu", tree / "cpu")
    assert rebase_spec(spec, tree).library_source == tree / "cpu" / "gemm" / "gemm_lib.cpp"
    assert rebase_spec(spec, tree).unit == tree / "cpu" / "gemm" / "gemm_variant.cpp"
    (tree / "cpu" / "gemm" / "gemm_lib.cpp").unlink()  # a revision before the in-process entry
    (tree / "cpu" / "gemm" / "gemm_variant.cpp").unlink()   # ... and the one unit of both
    rebased = rebase_spec(spec, tree)
    assert rebased.library_source is None and rebased.source == tree / "cpu" / "gemm" / "gemm.cpp"
    assert rebased.unit is None


def test_a_tree_from_before_the_family_folders_rebases_to_its_flat_files(tmp_path):
    """A revision from before kernels/cpu/<family>/ (tilecast rebench --base): its sources
    and include directory are the flat kernels/cpu/ files of the same names."""
    spec = GEMM.build_spec(CFG)
    flat = tmp_path / "kernels" / "cpu"
    flat.mkdir(parents=True)
    for path in (KERNELS_DIR / "cpu").glob("*/*"):
        shutil.copy(path, flat / path.name)
    spec = replace(spec, include_dirs=(KERNELS_DIR / "cpu" / "gemm",))
    rebased = rebase_spec(spec, tmp_path / "kernels")
    assert rebased.source == flat / spec.source.name
    assert rebased.library_source == flat / spec.library_source.name
    assert rebased.include_dirs == (flat,)


def _count_compiler_runs(monkeypatch, hold_s: float = 0.0) -> list:
    """The command lines of every compiler and linker run from now on (each held `hold_s`
    first), in the list returned."""
    calls, real_run = [], compiling._run

    def counting(command, *args, **kwargs):
        calls.append(command)
        time.sleep(hold_s)
        return real_run(command, *args, **kwargs)

    monkeypatch.setattr(compiling, "_run", counting)
    return calls


def test_executable_and_library_are_linked_from_one_compile_of_the_variant(tmp_path,
                                                                         monkeypatch):
    """A GEMM variant's unit (gemm_variant.cpp: its job runner and its in-process entry) is
    compiled once; the executable and the shared library are links of that object, each
    with its own key, and the library after the executable runs no compiler but the linker.
    Both are the variant: the executable describes its parameters, the library reports them."""
    spec = GEMM.build_spec(CFG)
    assert spec.unit.name == "gemm_variant.cpp" and spec.unit.exists()
    real_run = compiling._run
    calls = _count_compiler_runs(monkeypatch)
    cache = tmp_path / "cache"
    [executable] = build_candidates(GEMM, [CFG], cache, jobs=1)
    compiles = [c for c in calls if str(spec.unit) in c]
    assert len(compiles) == 1 and "-c" in compiles[0] and "-fPIC" in compiles[0]
    calls.clear()
    [library] = build_candidates(GEMM, [CFG], cache, jobs=1, shared=True)
    assert len(calls) == 1 and not any(str(arg).endswith(".cpp") for arg in calls[0])
    assert "-shared" in calls[0] and executable.event.status == library.event.status == "ok"
    assert library.binary.suffix == ".so" and executable.cache_key != library.cache_key
    objects = sorted(path.name for path in cache.glob("*.o"))
    assert len(objects) == 2 and objects[0].startswith(executable.kernel)
    assert objects[1].startswith("gemm_skinny_")   # the GEMV-class path's own object
    described = subprocess.run([str(executable.binary), "--describe"], capture_output=True,
                               text=True, check=True).stdout
    assert f"PARAM MR {CFG.mr}" in described and f"PARAM KC {CFG.kc}" in described
    value = ctypes.c_longlong()
    lib = ctypes.CDLL(str(library.binary))
    assert lib.tilecast_kernel_param(b"NR", ctypes.byref(value)) == 0 and value.value == CFG.nr
    # cached: nothing runs, the same files and keys
    monkeypatch.setattr(compiling, "_run", real_run)
    _forbid_compiler_runs(monkeypatch)
    [again] = build_candidates(GEMM, [CFG], cache, jobs=1)
    [library_again] = build_candidates(GEMM, [CFG], cache, jobs=1, shared=True)
    assert again.cached and library_again.cached
    assert (again.binary, again.cache_key) == (executable.binary, executable.cache_key)
    assert (library_again.binary, library_again.cache_key) == (library.binary, library.cache_key)


def test_variants_share_the_gemv_class_object_of_their_dtype_isa_scheme_and_prefetch(
        tmp_path, monkeypatch):
    """The GEMV-class path (gemm_skinny.cpp) is compiled once for the variants that differ
    only in their tile and cache blocks, and once more for another parallel scheme; each
    library linked with it is still its own variant (tests/test_gemm_kernels.py checks the
    GEMV-class shapes' results against torch)."""
    same = replace(CFG, kc=CFG.kc * 2)
    other = replace(CFG, parallel="k" if CFG.parallel != "k" else "m")
    calls = _count_compiler_runs(monkeypatch)
    cache = tmp_path / "cache"
    builts = build_candidates(GEMM, [CFG, same, other], cache, jobs=1, shared=True)
    assert [b.event.status for b in builts] == ["ok"] * 3
    skinny = GEMM.skinny_source
    assert sum(str(skinny) in command for command in calls) == 2
    assert sorted(p.name.split("-")[0] for p in cache.glob("gemm_skinny_*.o")) == sorted(
        {f"gemm_skinny_fp32_{CFG.isa}_par{CFG.parallel}_pf1",
         f"gemm_skinny_fp32_{other.isa}_par{other.parallel}_pf1"})
    for built in builts:
        lib = ctypes.CDLL(str(built.binary))
        lib.tilecast_kernel_param.argtypes = (ctypes.c_char_p, ctypes.POINTER(ctypes.c_longlong))
        value = ctypes.c_longlong()
        assert lib.tilecast_kernel_param(b"KC", ctypes.byref(value)) == 0
        assert value.value == built.config.kc


def test_a_link_key_follows_its_objects_keys_and_flags(tmp_path):
    """A link's key is its objects' keys, the compiler and the flags: another object key (the
    variant's sources changed) or another flag is another linked file, the same ones the same."""
    obj = tmp_path / "a.o"
    subprocess.run(["g++", "-c", "-fPIC", "-x", "c++", "-", "-o", str(obj)],
                   input="int main() { return 3; }\n", text=True, check=True)
    job = compiling.LinkJob(((obj, "k1"),), "g++", ("-O2",), "prog")
    first = compiling.cached_link(job, tmp_path / "cache", 60)
    assert first.ok and not first.cached and subprocess.run([str(first.artifact)]).returncode == 3
    again = compiling.cached_link(job, tmp_path / "cache", 60)
    assert again.cached and again.artifact == first.artifact
    assert compiling.LinkJob(((obj, "k2"),), "g++", ("-O2",), "prog").key() != job.key()
    assert compiling.LinkJob(((obj, "k1"),), "g++", ("-O3",), "prog").key() != job.key()
    broken = compiling.cached_link(compiling.LinkJob(((tmp_path / "missing.o", "k3"),), "g++",
                                                     (), "prog"), tmp_path / "cache", 60)
    assert not broken.ok and broken.key == "" and "missing.o" in broken.log
    assert not _staging_left(tmp_path / "cache")

OTHER = GemmConfig("fp32", "avx2", 4, 24, 96, 504, 256, "k", False, False)


def test_build_events_read_back_with_a_failed_candidate(tmp_path, build_cache):
    """One failed variant among good ones: its event (binary None) reads back, which once was
    a TypeError (`unexpected keyword argument 'binary'`); it then becomes a build_failed
    record, and the family is fine."""
    source = tmp_path / "broken.cpp"
    source.write_text("int main() { return undefined_symbol; }\n")
    [good] = build_candidates(GEMM, [CFG], build_cache, jobs=1)
    [bad] = build_candidates(_SourceFamily(source), [OTHER], tmp_path / "cache", jobs=1)
    events = tmp_path / "build" / "gemm" / "events.json"
    write_events(events, [good, bad])
    back = read_events(events, GEMM)
    assert [(b.kernel, b.binary, b.cache_key, b.event.status, b.outcome) for b in back] == \
        [(good.kernel, good.binary, good.cache_key, "ok", "ok"),
         (bad.kernel, None, bad.cache_key, "failed", "compile_error")]
    assert back[1].config == OTHER and "undefined_symbol" in back[1].event.reason
    require_some_built("gemm", back)            # one good build is enough
    assert "undefined_symbol" in first_error_line(bad.event.reason)
    assert "error" in first_error_line(bad.event.reason)
    # events written before compiles had an outcome still load
    entries = json.loads(events.read_text())
    events.write_text(json.dumps([{k: v for k, v in e.items() if k != "outcome"} for e in entries]))
    older = read_events(events, GEMM)
    assert [(b.event, b.outcome) for b in older] == [(good.event, ""), (bad.event, "")]


def test_unreadable_build_events_are_a_clear_error(tmp_path):
    events = tmp_path / "events.json"
    with pytest.raises(FileNotFoundError, match="run the build stage first"):
        read_events(events, GEMM)
    for text in ("{not json", json.dumps([{"candidate_id": "gemm_nonsense", "status": "ok"}]),
                 json.dumps({"candidate_id": "x"})):
        events.write_text(text)
        with pytest.raises(BuildError, match="re-run the build stage") as err:
            read_events(events, GEMM)
        assert isinstance(err.value, user_errors())
        note_case("clear")


def test_every_build_failing_is_one_error_naming_the_failures(tmp_path):
    """Kernel sources missing (an installation without kernels/): every candidate fails
    without running the compiler or caching the failure, and the family is one BuildError
    naming each kernel and why, which the CLI prints as a message (exit 2)."""
    missing = tmp_path / "gone" / "gemm.cpp"
    builts = build_candidates(_SourceFamily(missing), [CFG, OTHER], tmp_path / "cache", jobs=1)
    assert all(b.binary is None and b.event.status == "failed" for b in builts)
    assert all(f"kernel source {missing} does not exist" in b.event.reason for b in builts)
    assert not list((tmp_path / "cache").iterdir())  # nothing cached: not a compile result
    with pytest.raises(BuildError) as err:
        require_some_built("gemm", builts, tmp_path / "events.json")
    message = str(err.value)
    assert "all 2 candidates failed to build" in message and "events.json" in message
    assert all(f"{b.kernel}: kernel source {missing} does not exist" in message for b in builts)
    assert isinstance(err.value, user_errors())
    note_case("clear")


def test_a_compile_error_of_every_candidate_names_its_first_error_line(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("// the error is on line 2, in a function: gcc names the function first\n"
                      "int main() { return undefined_symbol; }\n")
    builts = build_candidates(_SourceFamily(source), [CFG], tmp_path / "cache", jobs=1)
    with pytest.raises(BuildError, match=r"broken\.cpp:2:\d+: error: .undefined_symbol. was not "
                                         r"declared"):
        require_some_built("gemm", builts)
    note_case("clear")


def test_a_run_whose_builds_all_fail_stops_with_the_failures(tmp_path, hw, monkeypatch):
    """The pipeline's build stage and the stages after it (which read the events back) both
    end in the BuildError, never in a TypeError inside load_builds."""
    from tilecast.config import load_config
    from tilecast.workflows import pipeline

    if not {"avx2", "fma"} <= set(hw["flags"]):
        pytest.skip("the tiny config's variants need AVX2 and FMA, which this CPU lacks")
    monkeypatch.setattr(GEMM, "source", tmp_path / "gone" / "gemm.cpp")
    ctx = pipeline.RunContext(config=load_config(Path(__file__).parent / "configs" / "tiny.yaml"),
                              workdir=tmp_path / "w", registry=tmp_path / "registry",
                              run_id="all-failed", hardware=hw, git_sha="0" * 7)
    with pytest.raises(BuildError, match="all 4 candidates failed to build") as built:
        pipeline.build_stage(ctx, "gemm")
    assert ctx.layout.build_events("gemm").exists()
    with pytest.raises(BuildError, match="all 4 candidates failed to build") as loaded:
        pipeline.load_builds(ctx, "gemm")
    for err in (built, loaded):
        assert "does not exist" in str(err.value)
        note_case("clear")


# ---------------------------------------------------------------- the compile cache (core.compile)

QUICK = ("-std=c++17", "-O0")   # tiny programs: no -march=native, no OpenMP


def _forbid_compiler_runs(monkeypatch) -> None:
    """Fail on any process started from now on (subprocess.run starts its own through Popen)."""
    def refuse(command, *args, **kwargs):
        raise AssertionError(f"ran {command!r}: expected a cache hit")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def _compiler(directory: Path, before_compiling: str) -> Path:
    """A C++ compiler that runs the shell code `before_compiling` first when it compiles (a
    command with -o), and is g++ otherwise (--version, dependency listings)."""
    script = directory / "cxx"
    script.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) {before_compiling} ;; esac\n'
                      'exec g++ "$@"\n')
    script.chmod(0o755)
    return script


def _program(directory: Path, headers: dict[str, str]) -> Path:
    """k.cpp in `directory`, whose exit code is `value` from a.hpp's include chain."""
    for name, text in headers.items():
        (directory / name).write_text(text)
    source = directory / "k.cpp"
    source.write_text('#include "a.hpp"\n#include <cstdio>\nint main() { return value; }\n')
    return source


def _build(source: Path, cache: Path, **options):
    [built] = build_candidates(_SourceFamily(source), [CFG], cache, jobs=1, flags=QUICK,
                               **options)
    return built


def _exit_code(built) -> int:
    return subprocess.run([str(built.binary)], timeout=60).returncode


def _staging_left(cache: Path) -> list[str]:
    return [p.name for p in cache.iterdir() if p.name.startswith(".") and p.name != ".deps"]


def test_a_header_change_anywhere_in_the_include_chain_is_a_new_build(tmp_path):
    """The compiler reports the headers it read; a hit rehashes them without running it, and
    a change to any of them, also to one that joined the chain later, is a new build."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    src.mkdir()
    source = _program(src, {"a.hpp": '#include "b.hpp"\n', "b.hpp": "constexpr int value = 3;\n",
                            "unrelated.hpp": "int other = 1;\n"})
    first = _build(source, cache)
    assert first.outcome == "ok" and not first.cached and _exit_code(first) == 3
    (src / "unrelated.hpp").write_text("int other = 2;\n")
    with pytest.MonkeyPatch.context() as patch:
        _forbid_compiler_runs(patch)
        hit = _build(source, cache)
    assert hit.cached and hit.binary == first.binary and hit.cache_key == first.cache_key

    (src / "b.hpp").write_text("constexpr int value = 4;\n")   # two levels down
    second = _build(source, cache)
    assert not second.cached and second.cache_key != first.cache_key and _exit_code(second) == 4

    (src / "c.hpp").write_text("constexpr int value = 5;\n")   # a header joins the chain...
    (src / "a.hpp").write_text('#include "c.hpp"\n')
    third = _build(source, cache)
    assert not third.cached and _exit_code(third) == 5
    (src / "c.hpp").write_text("constexpr int value = 6;\n")   # ...and its edits count
    fourth = _build(source, cache)
    assert not fourth.cached and _exit_code(fourth) == 6
    assert len({b.cache_key for b in (first, second, third, fourth)}) == 4

    (src / "b.hpp").write_text("constexpr int value = 7;\n")   # no longer included
    (src / "c.hpp").write_text("constexpr int value = 5;\n")   # the third build's contents
    with pytest.MonkeyPatch.context() as patch:
        _forbid_compiler_runs(patch)
        back = _build(source, cache)
    assert back.cached and back.binary == third.binary
    assert cache_key(source, GEMM.build_spec(CFG).defines, QUICK, "g++") == back.cache_key
    # files beside the source are keyed by name and contents: a copy of the tree shares it
    shutil.copytree(src, tmp_path / "copy")
    assert _build(tmp_path / "copy" / "k.cpp", cache).binary == third.binary
    assert not _staging_left(cache)


def test_a_family_source_keys_the_same_in_any_copy_of_the_kernels_tree(tmp_path):
    """A family's source includes common/ and other families' headers (../common/harness.hpp):
    labelled relative to the tree's cpu/, a copy elsewhere keys the same, and an edit of a
    header outside the family's directory is a new key."""
    tree = tmp_path / "kernels"
    shutil.copytree(KERNELS_DIR / "cpu", tree / "cpu")
    spec = GEMM.build_spec(CFG)

    def key(kernels_dir: Path) -> str:
        source = rebase_spec(spec, kernels_dir).source
        return compiling.current_key(compiling.CompileJob(
            source, "g++", QUICK, spec.defines, root=source_root(source, kernels_dir)))

    original = key(KERNELS_DIR)
    labels = compiling.list_dependencies(compiling.CompileJob(
        spec.source, "g++", QUICK, spec.defines, root=source_root(spec.source)))
    assert "common/harness.hpp" in labels and "gemm/gemm_config.hpp" in labels
    assert not any(name.startswith("/") and "kernels" in name for name in labels), labels
    assert key(tree) == original
    harness = tree / "cpu" / "common" / "harness.hpp"
    harness.write_text(harness.read_text() + "\n// edited\n")
    assert key(tree) != original

def test_a_failure_for_a_missing_header_ends_when_the_header_appears(tmp_path):
    """The cached failure's key lists the header it lacked (as absent): creating it is a
    change, so the next build compiles instead of failing from the cache."""
    cache = tmp_path / "cache"
    source = _program(tmp_path, {"a.hpp": '#include "later.hpp"\n'})
    failed = _build(source, cache)
    assert failed.outcome == "compile_error" and failed.failure_cached
    assert "later.hpp: No such file or directory" in failed.event.reason
    assert _build(source, cache).cached
    (tmp_path / "later.hpp").write_text("constexpr int value = 9;\n")
    built = _build(source, cache)
    assert built.outcome == "ok" and not built.cached and _exit_code(built) == 9


def test_a_compile_killed_by_its_timeout_is_not_cached_and_builds_next_time(tmp_path):
    slow = tmp_path / "slow"
    slow.touch()
    cxx = _compiler(tmp_path, f'if [ -e "{slow}" ]; then sleep 60; fi')
    cache = tmp_path / "cache"
    source = _program(tmp_path, {"a.hpp": "constexpr int value = 3;\n"})
    start = time.monotonic()
    timed_out = _build(source, cache, compiler=str(cxx), timeout_s=1.0)
    assert time.monotonic() - start < 30, "the compiler's children outlived its timeout"
    assert timed_out.outcome == "timeout" and timed_out.event.status == "failed"
    assert timed_out.event.reason.startswith("compile timed out after 1 s and was killed "
                                             "(not cached: the next build tries again)")
    assert timed_out.binary is None and not timed_out.failure_cached
    assert not list(cache.glob("*.failed")) and not _staging_left(cache)
    slow.unlink()   # the next run has the time it needs
    built = _build(source, cache, compiler=str(cxx), timeout_s=120.0)
    assert built.outcome == "ok" and not built.cached and _exit_code(built) == 3


@pytest.mark.parametrize("dies, reported", [
    ("kill -9 $$", "the compiler was killed by SIGKILL"),
    ('echo "g++: fatal error: Killed signal terminated program cc1plus" >&2; exit 1',
     "a program the compiler ran was killed or ran out of memory"),
], ids=["SIGKILL", "cc1plus-killed"])
def test_a_killed_compiler_is_reported_and_not_cached(tmp_path, dies, reported):
    """The compiler's own death (the OOM killer's SIGKILL, to it or to cc1plus under it) says
    nothing about the source: reported as such, and g++ builds the same key next time."""
    cache = tmp_path / "cache"
    source = _program(tmp_path, {"a.hpp": "constexpr int value = 3;\n"})
    killed = _build(source, cache, compiler=str(_compiler(tmp_path, dies)))
    assert killed.outcome == "killed" and killed.event.status == "failed"
    assert killed.event.reason.startswith(f"{reported} (not cached: the next build tries again)")
    assert not killed.failure_cached and not list(cache.glob("*.failed"))
    built = _build(source, cache)   # same compiler identity, so the same key
    assert built.outcome == "ok" and not built.cached and _exit_code(built) == 3


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "rename-wins"])
def test_two_concurrent_builds_of_one_key_leave_one_whole_artifact(tmp_path, monkeypatch,
                                                                   flock):
    """Two builders of one key at once: one artifact, whole and runnable, both pointing at
    it; with flock the second waits and finds the first's, without it both publish by
    rename and the last one wins."""
    if not flock:
        def no_flock(*args):
            raise OSError("flock is not supported on this filesystem")
        monkeypatch.setattr(compiling.fcntl, "flock", no_flock)
    cxx = _compiler(tmp_path, "sleep 1")   # so that both compiles overlap
    cache = tmp_path / "cache"
    source = _program(tmp_path, {"a.hpp": "constexpr int value = 3;\n"})
    results = [None, None]
    barrier = threading.Barrier(2)

    def build(index: int) -> None:
        barrier.wait()
        results[index] = _build(source, cache, compiler=str(cxx))

    threads = [threading.Thread(target=build, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.outcome for r in results] == ["ok", "ok"]
    assert results[0].binary == results[1].binary
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == \
        [results[0].binary.name]
    assert not _staging_left(cache) and _exit_code(results[0]) == 3
    if flock:
        assert sorted(r.cached for r in results) == [False, True]


def test_in_process_kernels_and_native_libraries_compile_through_one_cached_compile(
        tmp_path, monkeypatch, hw):
    """The in-process kernel library, the native dispatcher's libraries and the DISCO
    libraries all build through core.compile.cached_compile: a killed compiler is an error
    of each and is not cached, and the next call builds into the same cache layout."""
    from tilecast.disco import native as disco_native
    from tilecast.runtime import kernel_library
    from tilecast.runtime.native import library

    if not {"avx2", "fma"} <= set(hw["flags"]):
        pytest.skip("the in-process GEMM variant needs AVX2 and FMA, which this CPU lacks")
    seen, real = [], compiling.cached_compile

    def spy(job, *args, **kwargs):
        seen.append(job.source.name)
        return real(job, *args, **kwargs)

    monkeypatch.setattr(compiling, "cached_compile", spy)
    monkeypatch.setattr(kernel_library, "_loaded", {})   # as in a new process
    monkeypatch.setattr(library, "_loaded", {})
    monkeypatch.setenv(library.CACHE_ENV, str(tmp_path / "root"))
    tiny = tmp_path / "tiny.cpp"
    tiny.write_text('extern "C" int tiny() { return 7; }\n')
    entry_points = {
        kernel_library.KernelBuildError: lambda: kernel_library.load(
            GEMM, GEMM.kernel_name(CFG), cache_dir=tmp_path / "build").path,
        library.NativeBuildError: lambda: Path(library.load("forest.cpp")._name),
        disco_native.DiscoBuildError:
            lambda: disco_native.compile_library(tiny, directory=tmp_path / "disco"),
    }
    # the in-process GEMM library is linked from its variant's one compiled unit
    sources = [GEMM.build_spec(CFG).unit.name, "forest.cpp", "tiny.cpp"]
    assert sources[0] == "gemm_variant.cpp"
    stems = [GEMM.kernel_name(CFG), "forest", "tiny"]

    monkeypatch.setenv(library.COMPILER_ENV, str(_compiler(tmp_path, "kill -9 $$")))
    for error, load in entry_points.items():
        with pytest.raises(error, match="killed by SIGKILL"):
            load()
    assert seen == sources
    assert not list(tmp_path.rglob("*.failed"))

    monkeypatch.delenv(library.COMPILER_ENV)
    paths = [load() for load in entry_points.values()]
    # the GEMM library links its GEMV-class object too (the killed unit stopped before it)
    assert seen == sources + [sources[0], GEMM.skinny_source.name, *sources[1:]]
    for path, stem in zip(paths, stems):   # one naming, one layout
        assert re.fullmatch(rf"{re.escape(stem)}-[0-9a-f]{{24}}\.so", path.name), path
        assert path.is_file() and (path.parent / ".deps").is_dir()


def test_dependency_files_parse_as_gcc_and_nvcc_write_them():
    gcc = "/c/.x/out.so: /src/k.cpp /src/a\\ b.hpp \\\n /src/c$$d.hpp\n"
    assert compiling.parse_depfile(gcc) == ["/src/k.cpp", "/src/a b.hpp", "/src/c$d.hpp"]
    nvcc = "k.o : k.cu \\\n    k.cuh\n\n"
    assert compiling.parse_depfile(nvcc) == ["k.cu", "k.cuh"]
    assert compiling.parse_depfile("") == []


def test_an_early_build_and_the_build_stage_compile_each_candidate_once(tmp_path, monkeypatch):
    """`tilecast run` starts compiling while its server boots (pipeline.EarlyBuild): the build
    stage beside it compiles nothing twice (it waits on the compile in flight, then finds the
    artifact), records every candidate built, and wait_early_build returns with none left."""
    from tilecast.workflows import pipeline

    monkeypatch.setenv("TILECAST_BUILD_CACHE", str(tmp_path / "build"))
    # each compile held a little, so the two builders overlap
    calls = _count_compiler_runs(monkeypatch, hold_s=0.2)
    config = Path(__file__).parent / "configs" / "tiny.yaml"
    ctx = pipeline.RunContext.create(config, tmp_path / "w", tmp_path / "r")
    early = pipeline.start_early_build(ctx)
    summary = pipeline.build_stage(ctx, "gemm")
    pipeline.wait_early_build()
    assert not early.thread.is_alive() and not pipeline._EARLY_BUILDS
    assert summary["ok"] == summary["candidates"] == len(pipeline.select_candidates(ctx, "gemm"))
    unit = str(GEMM.unit)
    variants = [c for c in calls if unit in c]
    defines = [tuple(a for a in c if a.startswith("-DTC_")) for c in variants]
    assert len(defines) == len(set(defines)) == summary["candidates"]   # each compiled once


def test_the_gemm_pipelines_of_grouped_conv_link_the_gemm_familys_gemv_class_object(tmp_path):
    """A grouped-conv variant of the gemm pipeline runs its GEMMs on the GEMM library: it
    links the GEMM family's GEMV-class object of the same parameters (one file in the cache
    for both families) instead of compiling that path again; a direct variant links none."""
    conv = get_family("grouped_conv_forward")
    [gemm_pipe] = [c for c in conv.candidate_space({"pipeline": ["gemm"], "tiles": ["192x512x256"],
                                                   "ndim": [2]}, hardware.profile(2))
                   if c.wave_mode == "interwave" and not c.has_si]
    direct = replace(gemm_pipe, pipeline="direct")
    [unit] = conv.build_spec(gemm_pipe).shared_units
    assert conv.build_spec(direct).shared_units == ()
    isa = "avx512" if unit.defines["TC_ISA"] == 1 else "avx2"
    gemm_cfg = GemmConfig("fp32", isa, *(8, 32) if isa == "avx512" else (6, 16), 96, 512, 128,
                          "m", True, True)
    assert GEMM.build_spec(gemm_cfg).shared_units == (unit,)
    cache = tmp_path / "cache"
    builts = build_candidates(GEMM, [gemm_cfg], cache, jobs=1)
    builts += build_candidates(conv, [gemm_pipe], cache, jobs=1, shared=True)
    assert [b.event.status for b in builts] == ["ok", "ok"]
    assert len(list(cache.glob("gemm_skinny_*.o"))) == 1
