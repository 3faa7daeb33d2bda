"""Build stage: content-hash cache reuse, cache keys that follow the inputs, compile errors
recorded as events."""
from __future__ import annotations

import shutil
from dataclasses import replace

from tilecast.stages.build import SHARED_FLAGS, build_candidates, cache_key, rebase_spec
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
