"""The CUDA DISCO kernels (kernels/cuda/, tilecast.disco.cuda).

Without a GPU (here, CI): every .cu compiles with nvcc for sm_90 into a shared library that
exports its entry points, the build is cached, and the emulator (disco_csr_emulate.cu: the
kernels' CTAs run thread by thread on the CPU) gives bit for bit what the CPU kernels give,
so the kernels' index arithmetic, channel tiles (1, 4, 8 and remainders), entry chunks,
longitude runs and 16-bit conversions are checked. Both sum the same entries in the same
order with fused multiply-adds, hence the exact comparisons.

With a CUDA device: the ops on CUDA tensors against the float64 reference and the CPU
kernels in float32, bfloat16 and float16, gradients, opcheck, autocast, side streams and the
modules.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tilecast.core import build
from tilecast.disco import compute_psi, csr_from_psi, cuda, ops, reference
from tilecast.runtime.disco import DiscoConvS2

NVCC = shutil.which(os.environ.get(cuda.NVCC_ENV) or "nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ARCHS = ("90",)
KERNEL_CHUNK = 512           # kChunk in disco_csr.cuh: entries staged per shared-memory pass
LONGITUDES_PER_CTA = 256     # kLonsPerCta in disco_csr.cuh

# (in_shape, out_shape, theta_cutoff): as tests/test_disco_ops.py, plus "chunked": rows and
# lines longer than KERNEL_CHUNK entries and nlon_out = 260, two longitude runs, stride 2
GRIDS = {
    "same": ((12, 24), (12, 24), None),
    "down": ((24, 48), (12, 24), None),
    "stride3": ((13, 36), (7, 12), None),
    "wide": ((8, 100), (8, 100), 0.6),
    "wide_down": ((16, 200), (8, 100), 0.5),
    "chunked": ((8, 520), (8, 260), 0.3),
}
# B * C across the channel tiles (1, 4, 8) and their remainders
BATCH_CHANNELS = [(1, 1), (2, 3), (1, 4), (1, 5), (1, 8), (2, 9), (1, 17)]
HALF_DTYPES = [torch.bfloat16, torch.float16]


def _psi(name):
    in_shape, out_shape, cutoff = GRIDS[name]
    return compute_psi(in_shape, out_shape, (3, 3), basis_type="harmonic", basis_norm_mode="mean",
                       grid_in="equiangular", grid_out="legendre-gauss", theta_cutoff=cutoff)


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    return float((actual - expected).norm() / expected.norm())


def _inputs(psi, batch, channels, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, *psi.in_shape, dtype=torch.float64, generator=generator)
    y = torch.randn(batch, channels, psi.kernel_size, *psi.out_shape, dtype=torch.float64,
                    generator=generator)
    return x, y


def _cpu_contract(x, psi, csr):
    return ops.disco_contraction(x, *csr.tensors(), psi.kernel_size, *psi.out_shape)


def _cpu_transpose(y, psi, csr):
    return ops.disco_transpose_contraction(y, *csr.tensors(), *psi.in_shape)


# ---------------------------------------------------------------- build (nvcc, no GPU)

@pytest.fixture(scope="module")
def cuda_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("disco-cuda")


@pytest.fixture(scope="module")
def built(cuda_cache):
    """Every .cu of kernels/cuda compiled for sm_90 into cuda_cache: {source: library}."""
    sources = sorted(cuda.KERNELS.glob("*.cu"))
    assert {cuda.SOURCE, cuda.EMULATOR} <= set(sources)
    return {source: cuda.compile_library(source, ARCHS, cuda_cache) for source in sources}


@pytest.fixture(scope="module")
def emulator(built):
    return cuda.load_library(built[cuda.EMULATOR])


def _exported(library) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                         text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


@needs_nvcc
def test_every_cuda_source_compiles_for_sm90_and_exports_the_entry_points(built):
    for source, library in built.items():
        assert library.is_file() and library.suffix == ".so", source
        missing = set(cuda.ENTRY_POINTS) - _exported(library)
        assert not missing, f"{library} ({source.name}) does not export {sorted(missing)}"


@needs_nvcc
def test_the_library_holds_every_kernel_variant_for_sm90(built):
    """2 directions x 3 channel tiles x 3 storage types, and sm_90 code (no cuobjdump here:
    the host stubs name the kernels, the embedded PTX its target)."""
    library = built[cuda.SOURCE]
    symbols = subprocess.run(["nm", str(library)], capture_output=True, text=True, check=True).stdout
    variants = set(re.findall(r"disco_csr_kernelINS0_\d+(Forward|Transpose)ELi(\d)E(f|6__half|13__nv_bfloat16)EEv",
                              symbols))
    assert variants == {(direction, tile, storage) for direction in ("Forward", "Transpose")
                        for tile in "148" for storage in ("f", "6__half", "13__nv_bfloat16")}
    assert b".target sm_90" in library.read_bytes()


@needs_nvcc
def test_entry_points_refuse_bad_sizes_before_any_cuda_call(built):
    """Status codes come back before the device is touched (null pointers are never read)."""
    lib = cuda.load_library(built[cuda.SOURCE])

    def statuses(bc=2, hi=4, wi=8, k=3, ho=4, wo=8, storage=0):
        sizes = (bc, hi, wi, k, ho, wo)
        return {lib.tc_disco_cuda_contraction(None, None, *sizes, None, None, None, 0, storage, 0, None),
                lib.tc_disco_cuda_transpose_contraction(None, None, *sizes, None, None, None, 0, storage, 0,
                                                        None)}

    assert statuses(wi=12) == {1}                      # nlon_in not a multiple of nlon_out
    assert statuses(bc=0) == statuses(ho=-1) == {1}
    assert statuses(storage=3) == statuses(storage=-1) == {4}
    assert statuses(hi=2**16, wi=2**15, wo=2**15) == {5}  # a plane of 2**31 elements
    assert statuses(bc=2**40) == {5}                      # more CTAs than a 1-D grid holds
    assert lib.tc_disco_cuda_error_string(0) is None
    with pytest.raises(RuntimeError, match=r"failed to launch .*CUDA error 2 \(out of memory\)"):
        cuda._check_status(cuda.CUDA_ERROR_BASE + 2, "disco contraction", (1, 2), lib)
    with pytest.raises(ValueError, match=r"rejected input of shape \(1, 2\): too large"):
        cuda._check_status(5, "disco contraction", (1, 2), lib)


@needs_nvcc
def test_a_second_build_is_served_from_the_cache(built, cuda_cache, monkeypatch):
    def no_subprocess(command, *args, **kwargs):
        raise AssertionError(f"ran {command!r}: the build was not served from the cache")

    monkeypatch.setattr(subprocess, "Popen", no_subprocess)   # under subprocess.run too
    for source, library in built.items():
        mtime = library.stat().st_mtime_ns
        assert cuda.compile_library(source, ARCHS, cuda_cache) == library
        assert library.stat().st_mtime_ns == mtime
    assert sorted(cuda_cache.glob("*.so")) == sorted(built.values())


@needs_nvcc
def test_cache_key_covers_headers_flags_and_nvcc_release(tmp_path):
    tree = tmp_path / "cuda"
    shutil.copytree(cuda.KERNELS, tree)
    source, flags = tree / "disco_csr.cu", cuda.nvcc_flags(ARCHS)
    toolchain = cuda.toolchain(NVCC)
    key = build.cache_key(source, {}, flags, NVCC, toolchain=toolchain)
    assert key == build.cache_key(source, {}, flags, NVCC, toolchain=toolchain)
    assert "release" in toolchain
    assert key != build.cache_key(source, {}, cuda.nvcc_flags(("80",)), NVCC, toolchain=toolchain)
    assert key != build.cache_key(source, {}, flags, NVCC, toolchain=toolchain + " other host")
    with open(tree / "disco_csr_forward.cuh", "a") as header:
        header.write("// changed\n")
    assert key != build.cache_key(source, {}, flags, NVCC, toolchain=toolchain)


@needs_nvcc
def test_nvcc_errors_are_quoted_and_leave_no_library(tmp_path):
    source = tmp_path / "broken.cu"
    source.write_text("__global__ void kernel() { undeclared_name = 1; }\n")
    with pytest.raises(cuda.DiscoBuildError, match=r"(?s)broken\.cu.*nvcc.*undeclared_name"):
        cuda.compile_library(source, ARCHS, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so")) and not list((tmp_path / "cache").glob(".*tmp"))


def test_missing_nvcc_says_how_to_provide_it(monkeypatch, tmp_path):
    monkeypatch.setenv(cuda.NVCC_ENV, str(tmp_path / "no-such-nvcc"))
    with pytest.raises(cuda.DiscoBuildError, match=r"no-such-nvcc.*was not found.*CUDA toolkit"):
        cuda.compile_library(directory=tmp_path)
    monkeypatch.delenv(cuda.NVCC_ENV)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(cuda.DiscoBuildError, match=r"nvcc was not found.*TILECAST_NVCC"):
        cuda.compile_library(directory=tmp_path)


def test_architectures_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(cuda.ARCH_ENV, "sm_80, 90a;8.6")
    assert cuda.architectures() == ("80", "90a", "86")
    flags = cuda.nvcc_flags(cuda.architectures())
    assert " ".join(flags).endswith("-gencode arch=compute_80,code=sm_80 -gencode "
                                    "arch=compute_90a,code=sm_90a -gencode arch=compute_86,code=sm_86 "
                                    "-gencode arch=compute_86,code=compute_86")
    monkeypatch.setenv(cuda.ARCH_ENV, "hopper")
    with pytest.raises(ValueError, match=r"bad CUDA architecture 'hopper'.*like 90"):
        cuda.architectures()
    monkeypatch.delenv(cuda.ARCH_ENV)
    assert cuda.architectures() == (cuda.DEFAULT_ARCH,)


def test_cpu_calls_load_nothing_cuda():
    """Without CUDA tensors the CUDA library is never built or loaded (a fresh process)."""
    script = ("import torch\n"
              "from tilecast.disco import compute_psi, csr_from_psi, cuda, ops\n"
              "psi = compute_psi((12, 24), (12, 24), (3, 3))\n"
              "csr = csr_from_psi(psi)\n"
              "y = ops.disco_contraction(torch.randn(1, 2, 12, 24), *csr.tensors(), psi.kernel_size, 12, 24)\n"
              "ops.disco_transpose_contraction(y, *csr.tensors(), 12, 24)\n"
              "maps = open('/proc/self/maps').read()\n"
              "print(cuda._library is None, 'disco/cuda' in maps)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


# ---------------------------------------------------------------- the emulator (no GPU)

@needs_nvcc
def test_channel_tile_is_8_4_or_1(emulator):
    tiles = [cuda.channel_tile(bc, emulator) for bc in range(1, 18)]
    assert tiles == [1, 1, 1, 4, 4, 4, 4] + [8] * 10


@needs_nvcc
def test_chunked_grid_exercises_entry_chunks_and_longitude_runs():
    csr = csr_from_psi(_psi("chunked"))
    assert int((csr.roff[1:] - csr.roff[:-1]).max()) > KERNEL_CHUNK
    assert int((csr.troff[1:] - csr.troff[:-1]).max()) > KERNEL_CHUNK
    assert LONGITUDES_PER_CTA < csr.out_shape[1] < 2 * LONGITUDES_PER_CTA


@needs_nvcc
@pytest.mark.parametrize("batch, channels", BATCH_CHANNELS)
@pytest.mark.parametrize("grid", list(GRIDS))
def test_emulated_kernels_equal_the_cpu_kernels(emulator, grid, batch, channels):
    psi = _psi(grid)
    csr = csr_from_psi(psi)
    x, y = _inputs(psi, batch, channels, seed=channels)
    x, y = x.float(), y.float()
    out = cuda.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, *psi.out_shape, lib=emulator)
    assert torch.equal(out, _cpu_contract(x, psi, csr))
    back = cuda.transpose_contraction(y, csr.troff, csr.tcol, csr.tvals, *psi.in_shape, lib=emulator)
    assert torch.equal(back, _cpu_transpose(y, psi, csr))


@needs_nvcc
@pytest.mark.parametrize("grid, channels", [("wide_down", 9), ("chunked", 5), ("stride3", 1)])
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_emulated_half_precision_equals_the_cpu_kernels(emulator, grid, channels, dtype):
    psi = _psi(grid)
    csr = csr_from_psi(psi)
    x, y = _inputs(psi, 1, channels)
    x, y = x.to(dtype), y.to(dtype)
    out = cuda.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, *psi.out_shape, lib=emulator)
    assert out.dtype == dtype and torch.equal(out, _cpu_contract(x, psi, csr))
    back = cuda.transpose_contraction(y, csr.troff, csr.tcol, csr.tvals, *psi.in_shape, lib=emulator)
    assert back.dtype == dtype and torch.equal(back, _cpu_transpose(y, psi, csr))


@needs_nvcc
def test_emulated_kernels_match_the_float64_reference(emulator):
    psi = _psi("chunked")
    csr = csr_from_psi(psi)
    x, y = _inputs(psi, 1, 9)
    out = cuda.contraction(x.float(), csr.roff, csr.col, csr.vals, psi.kernel_size, *psi.out_shape,
                           lib=emulator)
    assert _rel_error(out, reference.disco_contraction(x, psi, psi.out_shape[1])) < 1e-5
    back = cuda.transpose_contraction(y.float(), csr.troff, csr.tcol, csr.tvals, *psi.in_shape,
                                      lib=emulator)
    assert _rel_error(back, reference.disco_transpose_contraction(y, psi, psi.in_shape[1])) < 1e-5


@needs_nvcc
def test_bad_psi_is_refused_and_checked_once_per_psi(emulator, monkeypatch):
    psi = _psi("same")
    csr = csr_from_psi(psi)
    x = torch.randn(1, 2, *psi.in_shape)
    checks = []
    real_status = cuda.psi_status
    monkeypatch.setattr(cuda, "psi_status", lambda *args: checks.append(args) or real_status(*args))

    def contract(col):
        return cuda.contraction(x, csr.roff, col, csr.vals, psi.kernel_size, *psi.out_shape, lib=emulator)

    col = csr.col.clone()
    contract(col)
    contract(col)
    assert len(checks) == 1
    col[-1] = psi.in_shape[0] * psi.in_shape[1]  # in place: the version moves, checked again
    with pytest.raises(ValueError, match=r"disco contraction rejected .*outside the grid"):
        contract(col)
    assert len(checks) == 2
    roff = csr.roff.clone()
    roff[3] = roff[4] + 1
    with pytest.raises(ValueError, match="bad row offsets"):
        cuda.contraction(x, roff, csr.col, csr.vals, psi.kernel_size, *psi.out_shape, lib=emulator)
    tcol = csr.tcol.clone()
    tcol[0] = -1
    with pytest.raises(ValueError, match=r"disco transpose contraction rejected .*outside the grid"):
        cuda.transpose_contraction(torch.randn(1, 2, psi.kernel_size, *psi.out_shape), csr.troff,
                                   tcol, csr.tvals, *psi.in_shape, lib=emulator)


# ---------------------------------------------------------------- on a CUDA device

DEVICE = "cuda"


def _cuda_contract(x, psi, csr):
    return ops.disco_contraction(x.to(DEVICE), *csr.tensors(), psi.kernel_size, *psi.out_shape)


def _cuda_transpose(y, psi, csr):
    return ops.disco_transpose_contraction(y.to(DEVICE), *csr.tensors(), *psi.in_shape)


@needs_cuda
@pytest.mark.parametrize("batch, channels", BATCH_CHANNELS)
@pytest.mark.parametrize("grid", list(GRIDS))
def test_cuda_ops_match_the_reference_and_equal_the_cpu_kernels(grid, batch, channels):
    psi = _psi(grid)
    csr = csr_from_psi(psi)
    device_csr = csr.to(DEVICE)
    x, y = _inputs(psi, batch, channels, seed=channels)
    out = _cuda_contract(x.float(), psi, device_csr)
    assert out.device.type == torch.device(DEVICE).type and out.dtype == torch.float32
    assert out.shape == (batch, channels, psi.kernel_size, *psi.out_shape)
    assert _rel_error(out, reference.disco_contraction(x, psi, psi.out_shape[1])) < 1e-5
    assert torch.equal(out.cpu(), _cpu_contract(x.float(), psi, csr))
    back = _cuda_transpose(y.float(), psi, device_csr)
    assert back.shape == x.shape
    assert _rel_error(back, reference.disco_transpose_contraction(y, psi, psi.in_shape[1])) < 1e-5
    assert torch.equal(back.cpu(), _cpu_transpose(y.float(), psi, csr))


@needs_cuda
@pytest.mark.parametrize("grid, channels", [("wide_down", 9), ("chunked", 5), ("wide", 4), ("stride3", 1)])
@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 2**-6), (torch.float16, 2**-9)])
def test_cuda_half_precision_follows_float32(grid, channels, dtype, bound):
    psi = _psi(grid)
    csr = csr_from_psi(psi)
    device_csr = csr.to(DEVICE)
    x, y = _inputs(psi, 1, channels)
    out = _cuda_contract(x.to(dtype), psi, device_csr)
    assert out.dtype == dtype
    assert _rel_error(out, _cuda_contract(x.float(), psi, device_csr)) < bound
    assert torch.equal(out.cpu(), _cpu_contract(x.to(dtype), psi, csr))
    back = _cuda_transpose(y.to(dtype), psi, device_csr)
    assert back.dtype == dtype
    assert _rel_error(back, _cuda_transpose(y.float(), psi, device_csr)) < bound
    assert torch.equal(back.cpu(), _cpu_transpose(y.to(dtype), psi, csr))


@needs_cuda
@pytest.mark.parametrize("grid", ["same", "wide_down"])
def test_cuda_gradients_match_reference_autograd(grid):
    psi = _psi(grid)
    csr = csr_from_psi(psi).to(DEVICE)
    x, y = _inputs(psi, 2, 5)
    ours_x = x.float().to(DEVICE).requires_grad_()
    (_cuda_contract(ours_x, psi, csr) * y.float().to(DEVICE)).sum().backward()
    ref_x = x.clone().requires_grad_()
    (reference.disco_contraction(ref_x, psi, psi.out_shape[1]) * y).sum().backward()
    assert _rel_error(ours_x.grad, ref_x.grad) < 1e-5

    ours_y = y.float().to(DEVICE).requires_grad_()
    (_cuda_transpose(ours_y, psi, csr) * x.float().to(DEVICE)).sum().backward()
    ref_y = y.clone().requires_grad_()
    (reference.disco_transpose_contraction(ref_y, psi, psi.in_shape[1]) * x).sum().backward()
    assert _rel_error(ours_y.grad, ref_y.grad) < 1e-5


@needs_cuda
def test_cuda_opcheck_both_ops():
    psi = _psi("down")
    csr = csr_from_psi(psi).to(DEVICE)
    x = torch.randn(2, 9, *psi.in_shape, device=DEVICE, requires_grad=True)
    y = torch.randn(2, 9, psi.kernel_size, *psi.out_shape, device=DEVICE, requires_grad=True)
    torch.library.opcheck(ops.disco_contraction, (x, *csr.tensors(), psi.kernel_size, *psi.out_shape))
    torch.library.opcheck(ops.disco_transpose_contraction, (y, *csr.tensors(), *psi.in_shape))


@needs_cuda
def test_cuda_autocast_runs_the_ops_in_the_autocast_dtype():
    psi = _psi("same")
    csr = csr_from_psi(psi).to(DEVICE)
    x = torch.randn(1, 4, *psi.in_shape, device=DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = _cuda_contract(x, psi, csr)
        back = _cuda_transpose(out.float(), psi, csr)
    assert out.dtype == torch.bfloat16 and back.dtype == torch.bfloat16
    assert torch.equal(out, _cuda_contract(x.bfloat16(), psi, csr))


@needs_cuda
def test_cuda_ops_run_on_the_current_stream():
    psi = _psi("wide_down")
    csr = csr_from_psi(psi).to(DEVICE)
    x = torch.randn(2, 9, *psi.in_shape, device=DEVICE)
    expected = _cuda_contract(x, psi, csr)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = _cuda_contract(x, psi, csr)
        back = _cuda_transpose(out, psi, csr)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, expected)
    assert torch.equal(back, _cuda_transpose(expected, psi, csr))


@needs_cuda
def test_cuda_module_matches_the_cpu_module():
    torch.manual_seed(0)
    cpu = DiscoConvS2(6, 8, (24, 48), (12, 24), (3, 3), basis_type="harmonic", groups=2)
    gpu = DiscoConvS2(6, 8, (24, 48), (12, 24), (3, 3), basis_type="harmonic", groups=2)
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.to(DEVICE)
    x = torch.randn(2, 6, 24, 48)
    x_cpu, x_gpu = x.clone().requires_grad_(), x.to(DEVICE).requires_grad_()
    out_cpu, out_gpu = cpu(x_cpu), gpu(x_gpu)
    assert _rel_error(out_gpu, out_cpu) < 1e-5
    grad = torch.randn_like(out_cpu)
    out_cpu.backward(grad)
    out_gpu.backward(grad.to(DEVICE))
    assert _rel_error(x_gpu.grad, x_cpu.grad) < 1e-5
    assert _rel_error(gpu.weight.grad, cpu.weight.grad) < 1e-5


@needs_cuda
def test_cuda_bad_input_is_refused():
    psi = _psi("same")
    csr = csr_from_psi(psi)
    x = torch.randn(1, 2, *psi.in_shape, device=DEVICE)
    with pytest.raises(ValueError, match=r"psi's tensors are on cpu but x is on cuda:\d"):
        _cuda_contract(x, psi, csr)
    tensors = list(csr.to(DEVICE).tensors())
    tensors[1] = tensors[1].clone()
    tensors[1][-1] = psi.in_shape[0] * psi.in_shape[1]
    with pytest.raises(ValueError, match="outside the grid"):
        ops.disco_contraction(x, *tensors, psi.kernel_size, *psi.out_shape)
    with pytest.raises(ValueError, match="float64.*reference"):
        _cuda_contract(x.double(), psi, csr.to(DEVICE))
    empty = _cuda_contract(torch.randn(0, 2, *psi.in_shape), psi, csr.to(DEVICE))
    assert empty.shape == (0, 2, psi.kernel_size, *psi.out_shape) and empty.is_cuda
