"""Every ISA's kernel code compiles on any machine, not only on one that runs it.

The kernels pick their SIMD at compile time (`#ifdef __AVX512F__`, `__AVX512BW__ &&
__AVX512VL__`, `__AVX512BF16__`), and the build stage compiles with -march=native, so a test
run on an AVX2-only machine never compiles the AVX-512 code, and one on an AVX-512 machine
never compiles the AVX2 code. Here every source the pipeline or the runtime compiles is
compiled for four targets whatever this CPU is: AVX2 with FMA, AVX-512F alone, AVX-512 with
BW/VL/DQ (Skylake-SP), and that with BF16 (Cooper Lake). Each object must hold the target's
registers (zmm iff AVX-512), and the bf16 GEMM its dot product (vdpbf16ps) iff the target has
BF16, the DISCO library its bf16 conversion with BF16: a build whose preprocessor fell back to
another path fails as a compile error would.

Only compiling: the AVX-512 kernels are checked against torch where a CPU runs them
(test_gemm_kernels, test_disco_ops, test_grouped_conv_*). -O0 keeps this cheap; template and
intrinsic errors (an intrinsic outside its target is an always_inline error) show at -O0 too.
"""
from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tilecast.core.settings import settings
from tilecast.disco import native as disco_native
from tilecast.families import get_family
from tilecast.core.family import KERNELS_DIR
from tilecast.families.gemm import GemmConfig
from tilecast.spaces.disco import DiscoConfig
from tilecast.spaces.grouped_conv import GroupedConvConfig
from tilecast.runtime.native import library as runtime_native
from tilecast.core.build import DEFAULT_FLAGS

# target -> (flags in place of -march=native, the ISA the kernels' configs name)
TARGETS = {
    "avx2": (("-march=haswell",), "avx2"),
    "avx512f": (("-march=haswell", "-mavx512f"), "avx512"),
    "avx512": (("-march=skylake-avx512",), "avx512"),
    "avx512_bf16": (("-march=skylake-avx512", "-mavx512bf16"), "avx512"),
}
ZMM = re.compile(r"%zmm\d+|\bzmm\d+")
# the DISCO kernels' fp32 -> bf16 store (kernels/cpu/disco/disco_csr_simd.hpp) with AVX512_BF16
BF16_CONVERT = "vcvtneps2bf16"
# the bf16 GEMM's micro-kernel with AVX512_BF16 (kernels/cpu/gemm/gemm_simd.hpp's VecAvx512Bf16Dot)
BF16_DOT = "vdpbf16ps"
BF16_GEMM = GemmConfig("bf16", "avx512", 6, 48, 96, 480, 256, "k", True, False)


def _without_march(flags) -> list[str]:
    return [f for f in flags if not f.startswith("-march=")]


def _gemm(isa: str) -> list[tuple[str, object]]:
    """GEMM: a micro-tile of each register file, the three parallel schemes, A packed or read
    in place, prefetch on and off; bf16 on AVX-512 (widened while packing, or with BF16 on
    vdpbf16ps)."""
    if isa == "avx2":
        configs = [GemmConfig("fp32", "avx2", 6, 16, 96, 512, 128, "n", False, True),
                   GemmConfig("fp32", "avx2", 4, 24, 96, 504, 128, "k", True, False)]
    else:
        configs = [GemmConfig("fp32", "avx512", 14, 32, 98, 512, 128, "m", False, True), BF16_GEMM]
    return [("gemm", c) for c in configs]


def _grouped_conv() -> list[tuple[str, object]]:
    """Grouped conv: the pipelines with SIMD code of their own (the grouped-vector, depthwise,
    Winograd and GEMM ones, direct and im2col on the shared micro-kernel), each direction, 2D
    and 3D. ISA-independent configs: the kernels read the target from the compiler."""
    def cfg(direction, ndim, pipeline, tiles=(32, 32, 32)):
        return (f"grouped_conv_{direction}",
                GroupedConvConfig(direction, "fp32", ndim, *tiles, pipeline, "interwave",
                                  False, False))
    big = (192, 512, 256)
    return [cfg("forward", 2, "gvec"), cfg("forward", 2, "winograd", big),
            cfg("forward", 3, "direct"), cfg("bwd_data", 2, "im2col"),
            cfg("bwd_weight", 2, "dw"), cfg("bwd_weight", 2, "gemm", big)]


def _disco(isa: str) -> list[tuple[str, object]]:
    """DISCO's benchmark kernels: each direction's variants at one tile of this ISA."""
    tiles = {"avx2": [("forward", "csr", 1, 0, 0, 8, 4), ("forward", "kpacked", 1, 6, 0, 2, 4),
                      ("backward", "csr", 4, 0, 0, 3, 2), ("backward", "lines", 1, 0, 4, 3, 1)],
             "avx512": [("forward", "csr", 1, 0, 0, 4, 4), ("forward", "kpacked", 1, 9, 0, 3, 4),
                        ("backward", "csr", 8, 0, 0, 2, 2), ("backward", "lines", 1, 0, 4, 6, 1)]}
    return [(f"disco_{direction}",
             DiscoConfig(direction, variant, isa, bt=bt, nv=nv, lat_block=lat, kreg=kreg, lb=lb))
            for direction, variant, bt, kreg, lb, nv, lat in tiles[isa]]


def _jobs(target: str) -> list[tuple[str, Path, list[str]]]:
    """(what, source, compiler arguments but the output) of every compile for `target`: each
    family's benchmark source per config and its in-process entry once, the runtime's
    libraries. BF16 changes only the bf16 GEMM's and the DISCO kernels' code (their bf16
    stores), so that target compiles those alone."""
    march, isa = TARGETS[target]
    disco_only = target == "avx512_bf16"
    kernels = [("gemm", BF16_GEMM)] if disco_only else [*_gemm(isa), *_grouped_conv()]
    jobs, entries = [], set()
    for family_name, config in [*kernels, *_disco(isa)]:
        family = get_family(family_name)
        spec = family.build_spec(config)
        defines = [f"-D{k}={v}" for k, v in spec.defines.items()]
        includes = [f"-I{d}" for d in spec.include_dirs]
        # what the build compiles: the one unit of executable and library where the family
        # has one (both sources, with this config's defines), else the executable's source and
        # the library's once
        sources = [spec.unit] if spec.unit is not None else [spec.source]
        if spec.unit is None and spec.library_source is not None \
                and spec.library_source not in entries:
            entries.add(spec.library_source)
            sources.append(spec.library_source)
        for source in sources:
            jobs.append((f"{family.kernel_name(config)} ({Path(source).name})", Path(source),
                         [*_without_march(DEFAULT_FLAGS), *march, *defines, *includes]))
    libraries = [(disco_native.SOURCE, disco_native.FLAGS),
                 (disco_native.KPACKED_SOURCE, disco_native.FLAGS)]
    if not disco_only:
        libraries += [(KERNELS_DIR / "cpu" / "common" / "fma_peak.cpp", DEFAULT_FLAGS),
                      (runtime_native.NATIVE_DIR / "forest.cpp", runtime_native.FLAGS)]
    for source, flags in libraries:
        args = [f for f in _without_march(flags) if f != "-shared"]
        jobs.append((Path(source).name, Path(source), [*args, *march]))
    return jobs


def _compile(job, directory: Path) -> tuple[str, int, str, str]:
    """(what, return code, compiler errors, disassembly) of one compile at -O0."""
    what, source, args = job
    out = directory / (re.sub(r"\W+", "_", what) + ".o")
    args = [a for a in args if not re.fullmatch(r"-O\d", a)] + ["-O0"]
    done = subprocess.run([settings().compiler, *args, "-c", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return what, done.returncode, done.stderr, ""
    dump = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True,
                          check=True).stdout
    return what, 0, "", dump


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_kernel_source_compiles_for_each_isa(target, tmp_path):
    jobs = _jobs(target)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda job: _compile(job, tmp_path), jobs))
    failed = [f"{what}: exit {rc}\n{err[:1500]}" for what, rc, err, _ in results if rc]
    assert not failed, "\n\n".join(failed)
    avx512 = target != "avx2"
    wrong = [what for what, _, _, dump in results if bool(ZMM.search(dump)) != avx512]
    assert not wrong, (f"zmm registers {'missing from' if avx512 else 'in'} the {target} build "
                       f"of: {', '.join(wrong)} (its SIMD path does not follow the target)")
    if target == "avx512_bf16":
        converts = [what for what, _, _, dump in results if BF16_CONVERT in dump]
        assert any("disco_csr.cpp" == what for what in converts), \
            f"the DISCO library's bf16 store does not use {BF16_CONVERT} with AVX512_BF16"
    bf16_gemm = get_family("gemm").kernel_name(BF16_GEMM)
    dots = {what: BF16_DOT in dump for what, _, _, dump in results if what.startswith(bf16_gemm)}
    assert dots or target == "avx2", f"no bf16 GEMM was compiled for {target}"
    wrong = [what for what, dot in dots.items() if dot != (target == "avx512_bf16")]
    assert not wrong, (f"{BF16_DOT} {'missing from' if target == 'avx512_bf16' else 'in'} the "
                       f"{target} build of: {', '.join(wrong)}")
