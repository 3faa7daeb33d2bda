"""The DISCO CUDA kernels on a GPU machine, in one run: the CUDA tests, then timings.

    PYTHONUNBUFFERED=1 python3 benchmarks/disco_cuda_device.py            # tests + self_256x360x720
    python3 benchmarks/disco_cuda_device.py --skip-tests --configs down_73x721x1440 --reps 20

Made for a lent machine whose python3 has torch (and CUDA) but not this repository installed:
it puts the repository on sys.path (and PYTHONPATH for the tests) and needs no package
beyond torch, numpy and pytest. Steps:

1. the environment (torch, GPU, nvcc) and `pytest tests/test_disco_cuda.py` (nvcc builds the
   kernels into $TILECAST_CACHE, default ~/.cache/tilecast);
2. per config (DISCO_KERNEL_DEV.md's, batch 1) and precision (fp32, bf16, fp16): the
   contraction (forward) and transpose contraction (backward) alone, median of --reps
   timings with CUDA events after a warm-up: ms, GFLOP/s (2 * B * C * nnz * nlon_out) and
   GB/s (activations read once and written once), and the error against a float64
   reference on the first --check-channels channels (fp32 data; so 16-bit rows include the
   rounding of their inputs) and against our fp32 kernel;
3. DiscoConvS2 forward and forward+backward (the contraction plus the channel mix);
4. torch-harmonics' CUDA contraction ops on the same data, if torch_harmonics and its CUDA
   extension import ("not available" otherwise).

Figures, not a test; exit status 1 if the tests failed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tilecast.disco import cuda, ops, reference  # noqa: E402
from tilecast.runtime.disco import DiscoConvS2  # noqa: E402

from tilecast.disco.seed_configs import CONFIGS, PRECISIONS  # noqa: E402


def environment() -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}  python {sys.version.split()[0]}  torch "
          f"{torch.__version__} (CUDA {torch.version.cuda})")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"GPU {props.name}, compute capability {props.major}.{props.minor}, "
              f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    nvcc = shutil.which(os.environ.get(cuda.NVCC_ENV) or "nvcc")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
    release = next((line.strip() for line in version.splitlines() if "release" in line), "")
    print(f"nvcc {nvcc or 'NOT FOUND'} {release}".rstrip())


def run_tests() -> int:
    """pytest tests/test_disco_cuda.py with the repository on PYTHONPATH; its exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5",
               "tests/test_disco_cuda.py"]
    print(f"\n$ {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    status = subprocess.run(command, cwd=REPO, env=env).returncode
    print(f"tests: exit {status} in {time.perf_counter() - started:.0f} s", flush=True)
    return status


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """Median of `reps` single-call timings with CUDA events, after two warm-up calls."""
    fn()
    fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


def peer_ops(config: dict):
    """torch-harmonics' CUDA contraction ops bound to its psi, or None with the reason."""
    try:
        import torch_harmonics as th
        from torch_harmonics.disco.optimized.disco_optimized import (
            _disco_s2_contraction_optimized, _disco_s2_transpose_contraction_optimized)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peer = th.DiscreteContinuousConvS2(**config).cuda()
    except Exception as err:  # any import or build failure of the optional peer
        return None, f"{type(err).__name__}: {err}"
    psi = (peer.psi_roff_idx, peer.psi_ker_idx, peer.psi_row_idx, peer.psi_col_idx, peer.psi_vals.float())
    (nlat_in, nlon_in), (nlat_out, nlon_out) = config["in_shape"], config["out_shape"]
    return (lambda x: _disco_s2_contraction_optimized(x, *psi, peer.kernel_size, nlat_out, nlon_out),
            lambda y: _disco_s2_transpose_contraction_optimized(y, *psi, peer.kernel_size, nlat_in, nlon_in)), ""


def bench_config(name: str, config: dict, reps: int, check_channels: int) -> None:
    started = time.perf_counter()
    cuda.library(torch.device("cuda", 0))  # built for this GPU's architecture
    module = DiscoConvS2(**config).cuda()
    psi, csr = module.psi, module._psi_tensors()
    (nlat_in, nlon_in), (nlat_out, nlon_out) = config["in_shape"], config["out_shape"]
    channels, kernel_size = config["in_channels"], module.kernel_size
    flops = 2.0 * channels * psi.nnz * nlon_out
    print(f"\n{name}: C {channels} in {config['in_shape']} out {config['out_shape']} K {kernel_size} "
          f"nnz {psi.nnz}  channel tile {cuda.channel_tile(channels)}  "
          f"(setup {time.perf_counter() - started:.1f} s)", flush=True)

    generator = torch.Generator().manual_seed(0)
    x32 = torch.randn(1, channels, nlat_in, nlon_in, generator=generator).cuda()
    y32 = torch.randn(1, channels, kernel_size, nlat_out, nlon_out, generator=generator).cuda()
    few = slice(0, min(check_channels, channels))
    started = time.perf_counter()
    forward_ref = reference.disco_contraction(x32[:, few].double(), psi, nlon_out)
    transpose_ref = reference.disco_transpose_contraction(y32[:, few].double(), psi, nlon_in)
    print(f"  float64 reference on {few.stop} channels: {time.perf_counter() - started:.1f} s")

    forward = lambda x: ops.disco_contraction(x, *csr, kernel_size, nlat_out, nlon_out)  # noqa: E731
    transpose = lambda y: ops.disco_transpose_contraction(y, *csr, nlat_in, nlon_in)  # noqa: E731
    peer, why_not = peer_ops(config)
    fp32_out = {}
    for precision, dtype in PRECISIONS.items():
        x, y = x32.to(dtype), y32.to(dtype)
        with torch.no_grad():
            out, back = forward(x), transpose(y)
            if dtype == torch.float32:
                fp32_out = {"forward": out, "transpose": back}
            rows = [("tilecast", forward, transpose, out[:, few], back[:, few])]
            if peer is not None:
                rows.append(("th", peer[0], peer[1], peer[0](x[:, few]), peer[1](y[:, few])))
            for label, fwd, bwd, out_few, back_few in rows:
                fwd_ms, bwd_ms = median_ms(lambda: fwd(x), reps), median_ms(lambda: bwd(y), reps)
                moved = x.element_size() * (x.numel() + y.numel()) / 1e9
                print(f"  {precision:5s} {label:9s} forward {fwd_ms:8.3f} ms {flops / fwd_ms / 1e6:8.1f} GFLOP/s "
                      f"{moved / fwd_ms * 1e3:7.1f} GB/s  err vs fp64 {rel_error(out_few, forward_ref):.2e}  |  "
                      f"backward {bwd_ms:8.3f} ms {flops / bwd_ms / 1e6:8.1f} GFLOP/s "
                      f"{moved / bwd_ms * 1e3:7.1f} GB/s  err vs fp64 {rel_error(back_few, transpose_ref):.2e}",
                      flush=True)
            print(f"  {precision:5s} vs our fp32: forward {rel_error(out, fp32_out['forward'].double()):.2e}, "
                  f"backward {rel_error(back, fp32_out['transpose'].double()):.2e}")
            del out, back, x, y
    if peer is None:
        print(f"  torch-harmonics: not available ({why_not[:160]})")
    bench_module(module, x32, reps)
    del module, x32, y32
    torch.cuda.empty_cache()


def bench_module(module: DiscoConvS2, x32: torch.Tensor, reps: int) -> None:
    """DiscoConvS2 forward and forward+backward in fp32 and bf16 (autocast)."""
    for precision, autocast in (("fp32", False), ("bf16 autocast", True)):
        x = x32.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                forward_ms = median_ms(lambda: module(x), reps)
            grad = torch.randn_like(module(x))

            def forward_backward():
                module.zero_grad(set_to_none=True)
                x.grad = None
                module(x).backward(grad)

            both_ms = median_ms(forward_backward, reps)
        print(f"  module {precision:13s} forward {forward_ms:8.3f} ms   forward+backward {both_ms:8.3f} ms")
        del x, grad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="self_256x360x720", help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--check-channels", type=int, default=4,
                        help="channels compared with the float64 reference")
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown config {unknown}; valid: {', '.join(CONFIGS)}")
    environment()
    status = 0 if args.skip_tests else run_tests()
    if not torch.cuda.is_available():
        print("no CUDA device: no timings")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in names:
        bench_config(name, CONFIGS[name], args.reps, args.check_channels)
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
