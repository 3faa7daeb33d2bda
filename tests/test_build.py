"""Build stage: content-hash cache reuse, cache keys that follow the inputs, compile errors
recorded as events; build events read back whatever failed, and a family none of whose
candidates built is one clear error naming the failures."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from faults import note_case
from tilecast.cli import user_errors
from tilecast.stages.build import (SHARED_FLAGS, BuildError, build_candidates, cache_key,
                                   first_error_line, read_events, rebase_spec, require_some_built,
                                   write_events)
from tilecast.families import get_family
from tilecast.families.base import KERNELS_DIR, BuildSpec
from tilecast.families.gemm import GemmConfig

GEMM = get_family("gemm")
CFG = GemmConfig("fp32", "avx2", 6, 16, 96, 512, 128, "m", True, True)


def test_second_build_reuses_the_cache(tmp_path):
    first = build_candidates(GEMM, [CFG], tmp_path, jobs=1)
    second = build_candidates(GEMM, [CFG], tmp_path, jobs=1)
    assert first[0].event.status == "ok" and not first[0].cached
    assert second[0].cached and second[0].binary == first[0].binary
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


class _BrokenFamily:
    """The GEMM family with a source that does not compile."""

    def __init__(self, source):
        self.source = source

    def kernel_name(self, cfg):
        return GEMM.kernel_name(cfg)

    def build_spec(self, cfg):
        return replace(GEMM.build_spec(cfg), source=self.source)


def test_compile_error_is_a_recorded_event(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("int main() { return undefined_symbol; }\n")
    [built] = build_candidates(_BrokenFamily(source), [CFG], tmp_path / "cache", jobs=1)
    assert built.event.status == "failed" and built.binary is None
    assert "undefined_symbol" in built.event.reason
    [again] = build_candidates(_BrokenFamily(source), [CFG], tmp_path / "cache", jobs=1)
    assert again.cached and again.event.status == "failed"
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
    assert rebase_spec(spec, tree).library_source == tree / "cpu" / "gemm_lib.cpp"
    (tree / "cpu" / "gemm_lib.cpp").unlink()  # a revision before the in-process entry
    rebased = rebase_spec(spec, tree)
    assert rebased.library_source is None and rebased.source == tree / "cpu" / "gemm.cpp"


OTHER = GemmConfig("fp32", "avx2", 4, 24, 96, 504, 256, "k", False, False)


def test_build_events_read_back_with_a_failed_candidate(tmp_path, build_cache):
    """One failed variant among good ones: its event (binary None) reads back, which once was
    a TypeError (`unexpected keyword argument 'binary'`); it then becomes a build_failed
    record, and the family is fine."""
    source = tmp_path / "broken.cpp"
    source.write_text("int main() { return undefined_symbol; }\n")
    [good] = build_candidates(GEMM, [CFG], build_cache, jobs=1)
    [bad] = build_candidates(_BrokenFamily(source), [OTHER], tmp_path / "cache", jobs=1)
    events = tmp_path / "build" / "gemm" / "events.json"
    write_events(events, [good, bad])
    back = read_events(events, GEMM)
    assert [(b.kernel, b.binary, b.cache_key, b.event.status) for b in back] == \
        [(good.kernel, good.binary, good.cache_key, "ok"), (bad.kernel, None, bad.cache_key, "failed")]
    assert back[1].config == OTHER and "undefined_symbol" in back[1].event.reason
    require_some_built("gemm", back)            # one good build is enough
    assert "undefined_symbol" in first_error_line(bad.event.reason)
    assert "error" in first_error_line(bad.event.reason)


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
    builts = build_candidates(_BrokenFamily(missing), [CFG, OTHER], tmp_path / "cache", jobs=1)
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
    builts = build_candidates(_BrokenFamily(source), [CFG], tmp_path / "cache", jobs=1)
    with pytest.raises(BuildError, match=r"broken\.cpp:2:\d+: error: .undefined_symbol. was not "
                                         r"declared"):
        require_some_built("gemm", builts)
    note_case("clear")


def test_a_run_whose_builds_all_fail_stops_with_the_failures(tmp_path, hw, monkeypatch):
    """The pipeline's build stage and the stages after it (which read the events back) both
    end in the BuildError, never in a TypeError inside load_builds."""
    from tilecast.core.config import load_config
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
