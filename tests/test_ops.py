"""tilecast.runtime.ops: real GEMM and grouped-conv variants, compiled as shared libraries and run in
process, against torch: outputs (norm-relative, the benchmark's tolerances), gradients,
opcheck of the custom ops, transposed operands, bad inputs, and one real tiny registry."""
from __future__ import annotations

import copy
import ctypes
import json
import mmap
import threading
from dataclasses import replace

import lightgbm
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tilecast.core import build
from tilecast.core import hardware
from tilecast.runtime import kernel_library, ops
from tilecast.registry import api as registry
from tilecast.runtime.dispatch import Dispatcher
from tilecast.runtime.disco.mix import Mixer
from tilecast.families import get_family
from tilecast.core.family import FamilyError
from tilecast.families.gemm import GemmConfig
from tilecast.spaces.grouped_conv import GroupedConvConfig

GEMM = get_family("gemm")
CPU_FLAGS = set(hardware.profile(1)["flags"])
# small cache blocks, so that the shapes below cross several MC, NC and KC blocks
ALL_GEMM_VARIANTS = [GemmConfig("fp32", "avx512", 14, 32, 28, 64, 48, "m", True, True),
                     GemmConfig("fp32", "avx512", 6, 48, 12, 96, 32, "k", False, False),
                     GemmConfig("fp32", "avx2", 6, 16, 12, 32, 40, "n", False, True),
                     GemmConfig("fp32", "avx2", 4, 24, 16, 48, 64, "m", True, False),
                     GemmConfig("bf16", "avx512", 14, 32, 28, 64, 48, "n", True, False)]
# the variants this CPU runs (AVX-512 and bf16 ones only where it has those)
GEMM_VARIANTS = [c for c in ALL_GEMM_VARIANTS if GEMM.candidate_space(
    {"dtype": [c.dtype], "isa": [c.isa], "tiles": [f"{c.mr}x{c.nr}"], "mc": [c.mc], "nc": [c.nc],
     "kc": [c.kc], "parallel": [c.parallel], "pack_a": [c.pack_a], "prefetch": [c.prefetch]},
    {"flags": sorted(CPU_FLAGS)})]
FP32_CONFIG = next(c for c in ALL_GEMM_VARIANTS if c in GEMM_VARIANTS and c.dtype == "fp32")
FP32_KERNEL = GEMM.kernel_name(FP32_CONFIG)
BF16_KERNEL = GEMM.kernel_name(ALL_GEMM_VARIANTS[-1])   # run only where the CPU has avx512_bf16
needs_bf16 = pytest.mark.skipif("avx512_bf16" not in CPU_FLAGS,
                                reason="the bf16 GEMM variant needs avx512_bf16, which this CPU lacks")
GEMM_SHAPES = [(1, 1, 1), (7, 13, 5), (33, 65, 100), (64, 130, 97)]

CONV_VARIANTS = {
    "forward_2d": GroupedConvConfig("forward", "fp32", 2, 16, 16, 16, "im2col", "interwave", True, True),
    "forward_3d": GroupedConvConfig("forward", "fp32", 3, 32, 16, 8, "direct", "intrawave", False, False),
    "forward_dw": GroupedConvConfig("forward", "fp32", 2, 16, 32, 16, "dw", "interwave", False, False),
    "bwd_data_2d": GroupedConvConfig("bwd_data", "fp32", 2, 32, 16, 16, "direct", "interwave", False, True),
    "bwd_weight_2d": GroupedConvConfig("bwd_weight", "fp32", 2, 16, 16, 8, "im2col", "intrawave", False, False),
}
CONV_KERNELS = {key: get_family(f"grouped_conv_{cfg.direction}").kernel_name(cfg)
                for key, cfg in CONV_VARIANTS.items()}
CONV_2D = {"forward": CONV_KERNELS["forward_2d"], "bwd_data": CONV_KERNELS["bwd_data_2d"],
           "bwd_weight": CONV_KERNELS["bwd_weight_2d"]}


def rel_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """||output - reference|| / ||reference|| in float64, as the benchmark validates."""
    output, reference = output.detach().double(), reference.detach().double()
    return float((output - reference).norm() / reference.norm())


@pytest.fixture(scope="module", autouse=True)
def libraries(build_cache, hw):
    """Every variant of this file compiled in shared mode (two compilers at once) into the
    session's build cache, which tilecast.runtime.ops then loads from."""
    if not {"avx2", "fma"} <= set(hw["flags"]):
        pytest.skip("the variants here need AVX2 and FMA, which this CPU lacks")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.BUILD_CACHE_ENV, str(build_cache))
        # one grouped-conv family builds every direction's variant (the config names it)
        built = [*build.build_candidates(GEMM, GEMM_VARIANTS, build_cache, jobs=2, shared=True),
                 *build.build_candidates(get_family("grouped_conv_forward"),
                                         list(CONV_VARIANTS.values()), build_cache, jobs=2,
                                         shared=True)]
        failed = [(b.kernel, b.event.reason[-300:]) for b in built if b.event.status != "ok"]
        assert not failed
        assert all(b.binary.suffix == ".so" for b in built)
        yield {b.kernel: b for b in built}


# -- GEMM ----------------------------------------------------------------------------------

@pytest.mark.parametrize("config", GEMM_VARIANTS, ids=GEMM.kernel_name)
def test_gemm_variants_match_torch_in_every_layout(config):
    name = GEMM.kernel_name(config)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[config.dtype]
    gen = torch.Generator().manual_seed(0)
    for m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, generator=gen).to(dtype)
        b = torch.randn(k, n, generator=gen).to(dtype)
        reference = a.double() @ b.double()
        tolerance = GEMM.tolerance(GEMM.problem({"m": m, "n": n, "k": k, "dtype": config.dtype}))
        # row-major, column-major (transposed views), and a row-major a with a wider
        # leading dimension (a slice of a wider matrix), all read in place
        wide = torch.zeros(m, k + 3, dtype=dtype)
        wide[:, :k] = a
        for left, right in ((a, b), (a.t().contiguous().t(), b), (a, b.t().contiguous().t()),
                            (a.t().contiguous().t(), b.t().contiguous().t()), (wide[:, :k], b)):
            c = ops.gemm(left, right, kernel=name)
            assert c.dtype == torch.float32 and c.shape == (m, n)
            assert rel_error(c, reference) < tolerance, (name, m, n, k, left.stride(), right.stride())


def test_other_strides_are_copied_and_empty_products_need_no_kernel():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(20, 60, generator=gen)[:, ::2]            # column stride 2: not row/col-major
    b = torch.randn(1, 9, generator=gen).expand(30, 9)        # row stride 0
    assert rel_error(ops.gemm(a, b, kernel=FP32_KERNEL), a.double() @ b.double()) < 1e-4
    assert ops.gemm(torch.empty(4, 0), torch.empty(0, 3), kernel=FP32_KERNEL).eq(0).all()
    assert ops.gemm(torch.empty(0, 5), torch.empty(5, 3), kernel=FP32_KERNEL).shape == (0, 3)


@pytest.mark.parametrize("transposed", [False, True])
def test_gemm_gradients_match_torch(transposed):
    gen = torch.Generator().manual_seed(2)
    a0, b0 = torch.randn(37, 50, generator=gen), torch.randn(50, 29, generator=gen)
    if transposed:  # leaves stored transposed: the op reads column-major views
        a0, b0 = a0.t().contiguous().t(), b0.t().contiguous().t()
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    weight = torch.randn(37, 29, generator=gen)
    (ops.gemm(a, b, kernel=FP32_KERNEL) * weight).sum().backward()
    a_ref, b_ref = a0.double().requires_grad_(), b0.double().requires_grad_()
    ((a_ref @ b_ref) * weight.double()).sum().backward()
    assert rel_error(a.grad, a_ref.grad) < 1e-4 and rel_error(b.grad, b_ref.grad) < 1e-4


@needs_bf16
def test_bf16_gradients_have_the_inputs_dtype():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(16, 24, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(24, 8, generator=gen).bfloat16().requires_grad_()
    ops.gemm(a, b, kernel=BF16_KERNEL).sum().backward()
    assert a.grad.dtype == b.grad.dtype == torch.bfloat16
    ones = torch.ones(16, 8, dtype=torch.float64)
    assert rel_error(a.grad, ones @ b.detach().double().t()) < 1e-2
    assert rel_error(b.grad, a.detach().double().t() @ ones) < 1e-2


def test_opcheck_gemm():
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(9, 17, generator=gen, requires_grad=True)
    b = torch.randn(17, 5, generator=gen, requires_grad=True)
    torch.library.opcheck(ops.gemm_op, (a, b, FP32_KERNEL, FP32_KERNEL, FP32_KERNEL))
    torch.library.opcheck(ops.gemm_op, (b.detach().t(), a.detach().t(), FP32_KERNEL, "", ""))


class RecordingDispatcher:
    """The Dispatcher query interface: records every problem, answers one kernel."""

    def __init__(self, kernel: str, family=GEMM):
        self.kernel, self.family, self.model, self.problems = kernel, family, "recording", []

    def select(self, problem) -> str:
        self.problems.append(problem)
        return self.kernel


def test_dispatcher_sees_transposed_views_as_column_major_and_the_gradient_problems():
    dispatcher = RecordingDispatcher(FP32_KERNEL)
    a = torch.randn(40, 30).t().requires_grad_()              # (30, 40), column-major
    b = torch.randn(40, 20, requires_grad=True)
    ops.gemm(a, b, dispatcher=dispatcher).sum().backward()
    forward, grad_a, grad_b = ((p.m, p.n, p.k, p.layout_a, p.layout_b) for p in dispatcher.problems)
    assert forward == (30, 20, 40, "col", "row")
    assert grad_a == (30, 40, 20, "row", "col")               # grad @ b^T
    assert grad_b == (40, 20, 30, "row", "row")               # a^T @ grad: a^T is row-major
    with torch.no_grad():
        ops.gemm(a, b, dispatcher=dispatcher)
    assert len(dispatcher.problems) == 4                      # no gradient problems without grad


@pytest.mark.parametrize("call, error, fragment", [
    (lambda: ops.gemm(torch.randn(3, 4).double(), torch.randn(4, 2).double(), kernel=FP32_KERNEL),
     ValueError, "has dtype torch.float64"),
    (lambda: ops.gemm(torch.randn(3, 4), torch.randn(5, 2), kernel=FP32_KERNEL),
     ValueError, "do not multiply: a has 4 columns, b has 5 rows"),
    (lambda: ops.gemm(torch.randn(3, 4), torch.randn(4, 2).bfloat16(), kernel=FP32_KERNEL),
     ValueError, "one dtype"),
    (lambda: ops.gemm(torch.randn(3), torch.randn(3, 2), kernel=FP32_KERNEL),
     ValueError, "must be a 2D matrix"),
    (lambda: ops.gemm(torch.randn(3, 4), torch.randn(4, 2), kernel="gemm_fp32_sse_4x4"),
     FamilyError, "not a GEMM kernel name"),
    (lambda: ops.gemm(torch.randn(3, 4), torch.randn(4, 2), kernel=BF16_KERNEL),
     ValueError, "kernel dtype bf16 != problem dtype fp32"),
    (lambda: ops.gemm(torch.randn(3, 4), torch.randn(4, 2)), ValueError, "pass kernel="),
    (lambda: ops.gemm(torch.randn(3, 4), torch.randn(4, 2),
                      dispatcher=RecordingDispatcher(CONV_2D["forward"],
                                                     get_family("grouped_conv_forward"))),
     ValueError, "picks grouped_conv_forward kernels"),
])
def test_bad_gemm_calls_are_clear_errors(call, error, fragment):
    with pytest.raises(error, match=fragment):
        call()


def test_libraries_are_built_once_loaded_once_and_report_their_parameters(libraries, monkeypatch,
                                                                         build_cache):
    built = libraries[FP32_KERNEL]
    again = build.build_library(GEMM, FP32_CONFIG, build_cache)
    assert again.cached and again.binary == built.binary and again.binary.name.endswith(".so")
    # four threads load a kernel not yet loaded in this process: one build call, one object
    key = (GEMM.name, FP32_KERNEL, str(build_cache), kernel_library.compiler())
    monkeypatch.delitem(kernel_library._loaded, key, raising=False)
    calls = []
    real = build.build_library
    monkeypatch.setattr(build, "build_library", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    loaded = [None] * 4

    def load(index):
        loaded[index] = kernel_library.load(GEMM, FP32_KERNEL)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and all(k is loaded[0] for k in loaded)
    cfg = FP32_CONFIG
    assert (loaded[0].param("MR"), loaded[0].param("NR"), loaded[0].param("KC")) == (cfg.mr, cfg.nr, cfg.kc)
    assert loaded[0].param("NO_SUCH") is None


def test_a_changed_cache_variable_is_followed_by_the_next_lookup(libraries, monkeypatch,
                                                                 tmp_path, build_cache):
    """The kernel lookup every product makes goes by the raw variables first; a changed
    TILECAST_BUILD_CACHE (or TILECAST_CXX) must still load from the new place."""
    monkeypatch.setattr(kernel_library, "_loaded", dict(kernel_library._loaded))
    monkeypatch.setattr(kernel_library, "_by_variables", dict(kernel_library._by_variables))
    monkeypatch.delenv("TILECAST_CXX", raising=False)
    first = kernel_library.load(GEMM, FP32_KERNEL)
    assert first.path.parent == build_cache
    asked = []
    monkeypatch.setattr(kernel_library, "_build_and_load",
                        lambda family, name, directory, cxx: asked.append((directory, cxx)) or first)
    monkeypatch.setenv(build.BUILD_CACHE_ENV, str(tmp_path / "elsewhere"))
    kernel_library.load(GEMM, FP32_KERNEL)
    monkeypatch.setenv("TILECAST_CXX", "clang++")
    kernel_library.load(GEMM, FP32_KERNEL)
    monkeypatch.setenv(build.BUILD_CACHE_ENV, str(build_cache))
    monkeypatch.delenv("TILECAST_CXX")
    assert kernel_library.load(GEMM, FP32_KERNEL) is first
    assert asked == [(tmp_path / "elsewhere", "g++"), (tmp_path / "elsewhere", "clang++")]


def test_a_product_with_no_gradient_to_record_runs_without_the_custom_op(libraries, monkeypatch):
    """In eager mode with nothing for autograd to record, ops.gemm runs the kernel directly
    (the custom op's dispatch costs more than a small product); with a gradient to record it
    goes through the op, and the backward runs on the kernel too."""
    from tilecast.runtime.ops import gemm_ops

    calls = []
    real = gemm_ops.gemm_op
    monkeypatch.setattr(gemm_ops, "gemm_op", lambda *args: calls.append(args[2:]) or real(*args))
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(9, 70, generator=gen), torch.randn(70, 33, generator=gen)
    reference = a.double() @ b.double()
    with torch.no_grad():
        assert rel_error(ops.gemm(a, b, kernel=FP32_KERNEL), reference) < 1e-5
    assert rel_error(ops.gemm(a, b, kernel=FP32_KERNEL), reference) < 1e-5
    assert calls == []
    a.requires_grad_(True)
    product = ops.gemm(a, b, kernel=FP32_KERNEL)
    assert rel_error(product, reference) < 1e-5 and product.requires_grad
    product.sum().backward()
    assert calls == [(FP32_KERNEL,) * 3] * 2   # the forward, then grad_a's product
    assert rel_error(a.grad, torch.ones(9, 33, dtype=torch.float64) @ b.double().t()) < 1e-5


class _UnbuildableGemm:
    """The GEMM family, but every variant compiled with a micro-tile too large for the
    registers, which the kernel's compile-time checks refuse."""
    name = "gemm"

    def parse_name(self, name):
        return GEMM.parse_name(name)

    def kernel_name(self, config):
        return GEMM.kernel_name(config)

    def build_spec(self, config):
        return replace(GEMM.build_spec(config), defines={**GEMM.build_spec(config).defines,
                                                         "TC_MR": 31})


def test_a_kernel_that_does_not_compile_is_a_build_error(tmp_path):
    with pytest.raises(kernel_library.KernelBuildError, match="micro-tile too large"):
        kernel_library.load(_UnbuildableGemm(), FP32_KERNEL, cache_dir=tmp_path)


AVX512_FP32_KERNEL = GEMM.kernel_name(ALL_GEMM_VARIANTS[0])


@pytest.mark.parametrize("flags, family, kernel, message", [
    ({"avx2", "fma", "sse4_2"}, GEMM, AVX512_FP32_KERNEL,
     rf"kernel '{AVX512_FP32_KERNEL}' needs avx512f, and this CPU lacks avx512f \(it has avx2, "
     r"fma\); pick a variant of an ISA it has"),
    ({"avx2", "fma", "avx512f"}, GEMM, BF16_KERNEL,
     r"needs avx512f, avx512_bf16, and this CPU lacks avx512_bf16 \(it has avx2, avx512f, fma\)"),
    ({"sse4_2"}, get_family("grouped_conv_forward"), CONV_2D["forward"],
     r"needs avx2, fma, and this CPU lacks avx2, fma \(it has no AVX\)"),
])
def test_a_kernel_this_cpu_cannot_run_is_named_before_anything_compiles(tmp_path, monkeypatch,
                                                                         flags, family, kernel,
                                                                         message):
    monkeypatch.setattr(kernel_library, "cpu_flags", lambda: frozenset(flags))
    with pytest.raises(kernel_library.CpuFeatureError, match=message):
        kernel_library.load(family, kernel, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was compiled


@pytest.mark.skipif("avx512f" in CPU_FLAGS, reason="this CPU runs the AVX-512 kernels")
def test_an_avx512_kernel_on_this_cpu_says_it_lacks_avx512f(tmp_path):
    with pytest.raises(kernel_library.CpuFeatureError, match="this CPU lacks avx512f"):
        ops.gemm(torch.randn(3, 4), torch.randn(4, 2), kernel=AVX512_FP32_KERNEL)
    with pytest.raises(kernel_library.CpuFeatureError, match="this CPU lacks avx512f"):
        kernel_library.load(GEMM, AVX512_FP32_KERNEL, cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def _guarded(rows: int, cols: int, values: torch.Tensor) -> torch.Tensor:
    """A (rows, cols) copy of `values` whose last byte is followed by an unreadable page."""
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    nbytes = rows * cols * values.element_size()
    pages = -(-nbytes // mmap.PAGESIZE) + 1
    memory = mmap.mmap(-1, pages * mmap.PAGESIZE)
    last_page = ctypes.addressof(ctypes.c_char.from_buffer(memory)) + (pages - 1) * mmap.PAGESIZE
    assert libc.mprotect(last_page, mmap.PAGESIZE, 0) == 0  # PROT_NONE
    start = (pages - 1) * mmap.PAGESIZE - nbytes
    tensor = torch.frombuffer(memory, dtype=torch.uint8)[start:start + nbytes]
    return tensor.view(values.dtype).view(rows, cols).copy_(values)


@pytest.mark.parametrize("config", GEMM_VARIANTS, ids=GEMM.kernel_name)
def test_gemm_kernels_read_nothing_past_their_operands(config):
    """The kernels read torch's memory in place: a read past an operand's end would fault."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[config.dtype]
    gen = torch.Generator().manual_seed(9)
    for m, n, k in [(7, 13, 5), (17, 3, 129)]:
        a, b = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
        row_major = (_guarded(m, k, a), _guarded(k, n, b))
        col_major = (_guarded(k, m, a.t()).t(), _guarded(n, k, b.t()).t())
        for left, right in ((row_major[0], col_major[1]), (col_major[0], row_major[1])):
            c = ops.gemm(left, right, kernel=GEMM.kernel_name(config))
            assert rel_error(c, a.double() @ b.double()) < GEMM.tolerance(
                GEMM.problem({"m": m, "n": n, "k": k, "dtype": config.dtype}))


def test_gemm_into_writes_rows_of_a_larger_tensor_and_nothing_else():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(9, 20, generator=gen), torch.randn(20, 7, generator=gen)
    big = torch.full((3, 9, 11), 5.0)
    target = big[1, :, 2:9]                                  # (9, 7) with row stride 11
    out = ops.gemm_into(target, a.t().contiguous().t(), b, FP32_KERNEL)   # a column-major
    assert out.data_ptr() == target.data_ptr()
    assert rel_error(big[1, :, 2:9], a.double() @ b.double()) < 1e-5
    big[1, :, 2:9] = 5.0
    assert big.eq(5.0).all()                                 # no write outside the rows
    assert ops.gemm_into(torch.full((4, 3), 2.0), torch.empty(4, 0), torch.empty(0, 3),
                         FP32_KERNEL).eq(0).all()


@pytest.mark.parametrize("out, fragment", [
    (torch.empty(9, 6), r"out has shape \(9, 6\)"),
    (torch.empty(9, 14)[:, ::2], "not rows of unit column stride"),
    (torch.empty(9, 7, dtype=torch.float64), "float32 CPU tensor"),
])
def test_gemm_into_names_a_bad_output(out, fragment):
    with pytest.raises(ValueError, match=fragment):
        ops.gemm_into(out, torch.randn(9, 5), torch.randn(5, 7), FP32_KERNEL)


@pytest.mark.parametrize("grid, channels, groups", [
    ("same", (6, 4), 1),     # the transposed backward: kpacked contraction of gy, then the mix
    ("down", (4, 6), 2),     # the blockwise backward: the mix's gradients per block
])
def test_disco_fused_mix_on_a_tilecast_gemm_matches_the_torch_mix(grid, channels, groups):
    shapes = {"same": ((12, 24), (12, 24)), "down": ((24, 48), (12, 24))}[grid]
    results, dispatcher = [], RecordingDispatcher(FP32_KERNEL)
    # None: torch; then the kernel on every product (race=False), and raced against torch
    for mix_gemm, race in ((None, True), (dispatcher, False), (FP32_KERNEL, False),
                           (FP32_KERNEL, True)):
        torch.manual_seed(0)
        conv = ops.DiscoConvS2(*channels, *shapes, (3, 3), groups=groups, fused=True,
                               mix_gemm=mix_gemm)
        conv.mixer = Mixer(mix_gemm, race=race)
        for _ in range(3 if race else 1):   # the raced module: races decided, then kept
            x = torch.randn(2, channels[0], *shapes[0],
                            generator=torch.Generator().manual_seed(1), requires_grad=True)
            conv.weight.grad = None
            out = conv(x)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        results.append((out.detach(), x.grad, conv.weight.grad))
        if mix_gemm is not None:
            assert set(conv.mixer.kernels.values()) == {FP32_KERNEL}
            assert bool(conv.mixer.races) == race
    for on_gemm in results[1:]:
        for got, want in zip(on_gemm, results[0]):
            assert rel_error(got, want) < 1e-5
    # the forward's product per block: (out_channels / groups) x (rows * nlon) x (C / groups * K)
    kernel_size = conv.kernel_size
    forward = [(p.m, p.k) for p in dispatcher.problems if p.layout_a == "row"]
    assert (channels[1] // groups, channels[0] // groups * kernel_size) in forward
    assert all(p.dtype == "fp32" for p in dispatcher.problems)


class RankingDispatcher(RecordingDispatcher):
    """A dispatcher whose ranking is a fixed list of kernels, best first."""

    def __init__(self, kernels: list[str]):
        super().__init__(kernels[0])
        self.ranked = kernels

    def rank(self, problem, k: int = 5) -> list[tuple[str, float]]:
        return [(name, 1.0) for name in self.ranked[:k]]


FP32_KERNELS = [GEMM.kernel_name(c) for c in GEMM_VARIANTS if c.dtype == "fp32"]


@pytest.mark.parametrize("choice, extra_s, winner", [
    ("name", {FP32_KERNEL: 1.0}, "torch"),
    ("name", {FP32_KERNEL: -0.4}, FP32_KERNEL),
    # a dispatcher's ranking: its first three race torch, and the second wins
    ("dispatcher", dict(zip(FP32_KERNELS, (1.0, -0.2, 0.5, -0.3))), FP32_KERNELS[1]),
    ("names", dict(zip(FP32_KERNELS[:2], (0.3, 0.1))), "torch"),
])
def test_disco_mix_race_keeps_the_fastest_contender_per_shape(monkeypatch, choice, extra_s,
                                                              winner):
    from tilecast.runtime.disco import mix
    from tilecast.runtime.ops import gemm_ops

    # every timed call lasts 0.25 s on the race's clock, each kernel extra_s[kernel] more
    now, kernel_calls, real_gemm_into = [0.0], [], gemm_ops.gemm_into

    def tick() -> float:
        now[0] += 0.25
        return now[0]

    def timed_gemm_into(out, a, b, kernel):
        kernel_calls.append(kernel)
        now[0] += extra_s[kernel]
        return real_gemm_into(out, a, b, kernel)

    monkeypatch.setattr(mix, "clock", tick)
    monkeypatch.setattr(gemm_ops, "gemm_into", timed_gemm_into)
    kernels = list(extra_s)[:mix.RACE_KERNELS] if choice == "dispatcher" else list(extra_s)
    mixer = mix.Mixer({"name": kernels[0], "names": kernels,
                       "dispatcher": RankingDispatcher(list(extra_s))}[choice])
    contenders = 1 + len(kernels)
    gen = torch.Generator().manual_seed(4)
    a, b, c = (torch.randn(9, 20, generator=gen), torch.randn(20, 7, generator=gen),
               torch.randn(20, 5, generator=gen))
    racing_calls, after = contenders * (1 + mix.RACE_SAMPLES), 4
    total = torch.zeros(9, 5)
    for call in range(racing_calls + after):
        out = torch.full((9, 7), float("nan"))
        mixer.mm(a, b, out)
        assert rel_error(out, a.double() @ b.double()) < 1e-5
        assert (mixer.races[(9, 7, 20, "row", "row")].winner is None) == (call < racing_calls - 1)
        if call < 2:                      # another shape, through the buffered addmm_
            mixer.addmm_(total, a, c)
    assert rel_error(total, 2 * (a.double() @ c.double())) < 1e-5
    race = mixer.races[(9, 7, 20, "row", "row")]
    assert race.contenders == ("torch", *kernels) and race.winner == winner
    assert {side: len(times) for side, times in race.seconds.items()} == dict.fromkeys(
        race.contenders, mix.RACE_SAMPLES)
    assert race.medians() == pytest.approx(
        {"torch": 0.25, **{name: 0.25 + extra_s[name] for name in kernels}})
    # each kernel ran 1 + RACE_SAMPLES times in the race (its first call untimed), the
    # addmm_ shape's two calls (torch, then the first kernel) once, and the winner after
    expected = {name: 1 + mix.RACE_SAMPLES + (name == kernels[0]) + after * (name == winner)
                for name in kernels}
    assert {name: kernel_calls.count(name) for name in kernels} == expected
    assert mixer.races[(9, 5, 20, "row", "row")].winner is None
    forced = mix.Mixer(kernels[0], race=False)
    for _ in range(3):
        forced.mm(a, b, torch.empty(9, 7))
    assert not forced.races and kernel_calls[-3:] == [kernels[0]] * 3
    # a module's copy keeps the choice and whether it races, not the races run so far
    copied = copy.deepcopy(mixer), copy.deepcopy(forced)
    assert [(c.gemm, c.race, c.races) for c in copied] == [(mixer.gemm, True, {}),
                                                          (kernels[0], False, {})]


def test_disco_mix_race_takes_turns_in_rotated_order_and_breaks_ties_to_torch():
    from tilecast.runtime.disco import mix

    race, sides = mix.Race(["a", "b", "a"]), []
    while race.winner is None:
        sides.append(race.side())
        race.record(sides[-1], 1.0)
    assert race.contenders == ("torch", "a", "b")
    turns = [["torch", "a", "b"], ["a", "b", "torch"], ["b", "torch", "a"]]
    assert sides == ["torch", "a", "b"] + [s for turn in turns[:mix.RACE_SAMPLES] for s in turn]
    assert race.winner == "torch"          # every median equal


def test_disco_mix_gemm_needs_the_fused_path_and_a_kernel_or_dispatcher():
    with pytest.raises(ValueError, match="pass fused=True"):
        ops.DiscoConvS2(4, 6, (12, 24), (6, 12), (3, 3), fused=False, mix_gemm=FP32_KERNEL)
    assert ops.DiscoConvS2(4, 6, (12, 24), (6, 12), (3, 3), mix_gemm=FP32_KERNEL).fused is True
    with pytest.raises(TypeError, match="mix_gemm must be None, a GEMM kernel name"):
        ops.DiscoConvS2(4, 6, (12, 24), (6, 12), (3, 3), fused=True, mix_gemm=3)
    with pytest.raises(ValueError, match="'fp32_avx2_6x16' is not a GEMM kernel name"):
        ops.DiscoConvS2(4, 6, (12, 24), (6, 12), (3, 3), fused=True,
                        mix_gemm=[FP32_KERNEL, "fp32_avx2_6x16"])
    with pytest.raises(TypeError, match="a list of them or a gemm dispatcher"):
        ops.DiscoConvS2(4, 6, (12, 24), (6, 12), (3, 3), fused=True, mix_gemm=[])
    with pytest.raises(ValueError, match="picks grouped_conv_forward kernels"):
        ops.DiscoConvS2(4, 6, (12, 24), (6, 12), (3, 3), fused=True,
                        mix_gemm=RecordingDispatcher(CONV_2D["forward"],
                                                     get_family("grouped_conv_forward")))


# -- grouped convolution -------------------------------------------------------------------

CONV_CASES = [  # (x shape, w shape, stride, padding, dilation, groups)
    ((2, 6, 9, 11), (8, 3, 3, 2), (2, 1), (1, 1), (1, 2), 2),
    ((1, 19, 7, 6), (33, 19, 1, 1), 1, 0, 1, 1),
    ((2, 12, 10, 7), (12, 1, 3, 3), (1, 2), 1, 1, 12),
    # whole 8 x 8 tiles of the library's layout conversion and cut ones, the input past the
    # size from which the conversion runs on every thread
    ((2, 40, 21, 23), (24, 20, 3, 3), 1, 1, 1, 2),
]


@pytest.mark.parametrize("case", CONV_CASES)
def test_grouped_conv_forward_and_gradients_match_torch(case):
    x_shape, w_shape, stride, padding, dilation, groups = case
    gen = torch.Generator().manual_seed(5)
    x0, w0 = torch.randn(x_shape, generator=gen), torch.randn(w_shape, generator=gen)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = ops.grouped_conv(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups,
                         kernel=CONV_2D)
    x_ref, w_ref = x0.double().requires_grad_(), w0.double().requires_grad_()
    y_ref = F.conv2d(x_ref, w_ref, None, stride, padding, dilation, groups)
    assert y.shape == y_ref.shape and rel_error(y, y_ref) < 1e-4
    grad = torch.randn(y.shape, generator=gen)
    y.backward(grad)
    y_ref.backward(grad.double())
    assert rel_error(x.grad, x_ref.grad) < 1e-4 and rel_error(w.grad, w_ref.grad) < 1e-4


def test_grouped_conv_takes_channels_last_and_strided_tensors():
    """The library's entry reads torch's contiguous layout: other layouts are made so first,
    and the result is torch's either way."""
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(2, 16, 12, 13, generator=gen), torch.randn(16, 8, 3, 3, generator=gen)
    reference = F.conv2d(x.double(), w.double(), None, 1, 1, 1, 2)
    views = {"channels_last": (x.to(memory_format=torch.channels_last), w),
             "weight channels_last": (x, w.to(memory_format=torch.channels_last)),
             "strided": (torch.randn(2, 16, 12, 26, generator=gen)[..., ::2], w)}
    views["strided"][0].copy_(x)
    for label, (x_in, w_in) in views.items():
        y = ops.grouped_conv(x_in, w_in, padding=1, groups=2, kernel=CONV_2D)
        assert y.is_contiguous() and rel_error(y, reference) < 1e-4, label


def test_a_convolution_with_no_gradient_to_record_runs_without_the_custom_op(monkeypatch):
    """As for GEMM: eager and nothing for autograd to record, the forward runs directly; with a
    weight that requires grad it goes through the op, and the gradient runs on its kernel."""
    from tilecast.runtime.ops import grouped_conv_ops

    calls = []
    real = grouped_conv_ops.grouped_conv_op
    monkeypatch.setattr(grouped_conv_ops, "grouped_conv_op",
                        lambda *args: calls.append(args[-3:]) or real(*args))
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(2, 6, 9, 11, generator=gen), torch.randn(8, 3, 3, 2, generator=gen)
    reference = F.conv2d(x.double(), w.double(), None, 1, 1, 1, 2)
    with torch.no_grad():
        assert rel_error(ops.grouped_conv(x, w, padding=1, groups=2, kernel=CONV_2D), reference) < 1e-4
    assert rel_error(ops.grouped_conv(x, w, padding=1, groups=2, kernel=CONV_2D), reference) < 1e-4
    assert calls == []
    w.requires_grad_(True)
    y = ops.grouped_conv(x, w, padding=1, groups=2, kernel=CONV_2D)
    assert rel_error(y, reference) < 1e-4 and y.requires_grad
    assert calls == [(CONV_2D["forward"], "", CONV_2D["bwd_weight"])]
    y.sum().backward()
    w_ref = w.detach().double().requires_grad_()
    F.conv2d(x.double(), w_ref, None, 1, 1, 1, 2).sum().backward()
    assert rel_error(w.grad, w_ref.grad) < 1e-4


def test_grouped_conv_3d_and_depthwise_kernels():
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(1, 6, 5, 6, 5, generator=gen), torch.randn(8, 3, 3, 2, 3, generator=gen)
    y = ops.grouped_conv(x, w, stride=(2, 1, 1), padding=(1, 0, 1), dilation=(1, 2, 1), groups=2,
                         kernel=CONV_KERNELS["forward_3d"])
    reference = F.conv3d(x.double(), w.double(), None, (2, 1, 1), (1, 0, 1), (1, 2, 1), 2)
    assert rel_error(y, reference) < 1e-4
    x, w = torch.randn(2, 12, 10, 7, generator=gen), torch.randn(12, 1, 3, 3, generator=gen)
    y = ops.grouped_conv(x, w, padding=1, groups=12, kernel=CONV_KERNELS["forward_dw"])
    assert rel_error(y, F.conv2d(x.double(), w.double(), None, 1, 1, 1, 12)) < 1e-4


def test_grouped_conv_dispatchers_per_direction():
    dispatchers = {direction: RecordingDispatcher(name, get_family(f"grouped_conv_{direction}"))
                   for direction, name in CONV_2D.items()}
    x = torch.randn(1, 4, 6, 6, requires_grad=True)
    w = torch.randn(4, 2, 3, 3)
    ops.grouped_conv(x, w, padding=1, groups=2, dispatcher=dispatchers).sum().backward()
    asked = {d: [p.direction for p in r.problems] for d, r in dispatchers.items()}
    assert asked == {"forward": ["forward"], "bwd_data": ["bwd_data"], "bwd_weight": []}
    x_ref = x.detach().double().requires_grad_()
    F.conv2d(x_ref, w.double(), None, 1, 1, 1, 2).sum().backward()
    assert rel_error(x.grad, x_ref.grad) < 1e-4


def test_opcheck_grouped_conv_ops():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 9, 8, generator=gen, requires_grad=True)
    w = torch.randn(8, 3, 3, 2, generator=gen, requires_grad=True)
    geometry = ([2, 1], [1, 1], [1, 2], 2)
    torch.library.opcheck(ops.grouped_conv_op, (x, w, *geometry, *CONV_2D.values()))
    dy = torch.randn(2, 8, 5, 8, generator=gen)
    torch.library.opcheck(ops.grouped_conv_bwd_data_op,
                          (dy, w.detach(), [2, 6, 9, 8], *geometry, CONV_2D["bwd_data"]))
    torch.library.opcheck(ops.grouped_conv_bwd_weight_op,
                          (x.detach(), dy, [8, 3, 3, 2], *geometry, CONV_2D["bwd_weight"]))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(x=torch.randn(1, 4, 5, 5).double()), "the grouped-conv kernels take torch.float32"),
    (dict(groups=3), "do not fit groups=3"),
    (dict(w=torch.randn(4, 2, 3)), "2D convolutions take 4D tensors"),
    (dict(stride=(1, 1, 1)), "stride must be an int or 2 ints"),
    (dict(padding=4), "pad_h=4 exceeds the filter extent 3"),
    (dict(kernel=CONV_KERNELS["forward_3d"]), "kernel ndim 3 != problem ndim 2"),
    (dict(kernel=CONV_KERNELS["forward_dw"]), "the dw pipeline needs a depthwise problem"),
    (dict(kernel={"forward": CONV_2D["forward"], "backward": "x"}), "unknown direction"),
    (dict(kernel=CONV_2D["bwd_data"]), "is a bwd_data kernel"),
    (dict(x=torch.randn(1, 4, 5, 5, requires_grad=True)), r"no bwd_data kernel \(x requires grad\)"),
    (dict(kernel=None), "no forward kernel"),
])
def test_bad_grouped_conv_calls_are_clear_errors(kwargs, fragment):
    args = {"x": torch.randn(1, 4, 5, 5), "w": torch.randn(4, 2, 3, 3), "groups": 2,
            "kernel": CONV_2D["forward"], **kwargs}
    with pytest.raises(ValueError, match=fragment):
        ops.grouped_conv(args.pop("x"), args.pop("w"), **args)


# -- one real tiny registry ----------------------------------------------------------------

METRICS = {"mean_efficiency": 0.9, "median_efficiency": 0.9, "p10_efficiency": 0.8,
           "min_efficiency": 0.7, "static_best": {"kernel": "?", "mean_efficiency": 0.8}}


def test_gemm_through_a_published_registry(tmp_path, hw):
    """A LightGBM model trained on a synthetic target over the fp32 variants built here,
    published, loaded with Dispatcher.from_registry, and used by ops.gemm."""
    configs = [c for c in GEMM_VARIANTS if c.dtype == "fp32"]
    names = [GEMM.kernel_name(c) for c in configs]
    engine = GEMM.feature_engine(hw)
    rows, target = [], []
    for m, n, k in [(m, n, k) for m in (8, 64, 512) for n in (16, 128, 1024) for k in (32, 256)]:
        features = engine.matrix(GEMM.problem({"m": m, "n": n, "k": k}), configs)
        rows.append(features)
        target.append(np.log1p(1.0 + features[:, engine.feature_names().index("mr")]
                               * np.log2(m * n * k) / 100))
    booster = lightgbm.train({"objective": "regression", "min_data_in_leaf": 2, "verbose": -1,
                              "num_threads": 1, "seed": 0},
                             lightgbm.Dataset(np.vstack(rows), np.concatenate(target)),
                             num_boost_round=10)
    spec = {"family": "gemm", "feature_names": engine.feature_names(), "engine": engine.name,
            "engine_version": engine.version, "target_transform": "log1p_tflops", "hardware": hw}
    registry.publish(tmp_path, "gemm", {
        "model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
        "candidates.json": json.dumps({"family": "gemm", "kernels": names, "static_best": names[0]}),
        "train_manifest.json": "{}"}, metrics=METRICS)
    dispatcher = Dispatcher.from_registry(tmp_path, "gemm")

    gen = torch.Generator().manual_seed(8)
    a, b = torch.randn(70, 90, generator=gen), torch.randn(90, 33, generator=gen)
    c = ops.gemm(a, b, dispatcher=dispatcher)
    chosen = dispatcher.select({"m": 70, "n": 33, "k": 90})
    assert chosen in names and rel_error(c, a.double() @ b.double()) < 1e-4
    assert torch.equal(c, ops.gemm(a, b, kernel=chosen))


# -- DISCO modules: channel counts and empty batches ---------------------------------------

@pytest.mark.parametrize("arguments, message", [
    ((0, 6), r"DiscoConvS2: in_channels=0 must be a positive integer"),
    ((4, 0), r"DiscoConvS2: out_channels=0 must be a positive integer"),
    ((4.5, 6), r"in_channels=4\.5 must be a positive integer"),
    ((4, 6, 0), r"groups=0 must be a positive integer"),
    ((4, 6, 4), r"in_channels \(4\) and out_channels \(6\) must be multiples of groups \(4\)"),
])
def test_disco_modules_name_a_bad_channel_count(arguments, message):
    in_channels, out_channels, *groups = arguments
    with pytest.raises(ValueError, match=message):
        ops.DiscoConvS2(in_channels, out_channels, (12, 24), (6, 12), (3, 3),
                        groups=groups[0] if groups else 1)
    with pytest.raises(ValueError, match=message.replace("DiscoConvS2", "DiscoConvTransposeS2")):
        ops.DiscoConvTransposeS2(in_channels, out_channels, (6, 12), (12, 24), (3, 3),
                                 groups=groups[0] if groups else 1)


@pytest.mark.parametrize("make", [
    lambda: ops.DiscoConvS2(4, 6, (12, 24), (6, 12), (3, 3)),
    lambda: ops.DiscoConvS2(4, 6, (12, 24), (6, 12), (3, 3), fused=True),
    lambda: ops.DiscoConvS2(4, 6, (12, 24), (6, 12), (3, 3), optimized_kernel=False),
    lambda: ops.DiscoConvTransposeS2(4, 6, (6, 12), (12, 24), (3, 3)),
], ids=["csr", "fused", "reference", "transpose"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_disco_modules_map_an_empty_batch_to_an_empty_output(make, dtype):
    module = make().to(dtype)
    x = torch.randn(0, 4, *module.in_shape, dtype=dtype, requires_grad=True)
    out = module(x)
    one = module(torch.randn(1, 4, *module.in_shape, dtype=dtype))
    assert out.shape == (0, *one.shape[1:]) and out.dtype == one.dtype
    out.sum().backward()
    assert x.grad.shape == x.shape
    assert not module.weight.grad.any() and not module.bias.grad.any()
