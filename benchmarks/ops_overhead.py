"""What a tilecast.ops call costs around its kernel: per-call time of `ops.gemm(a, b,
kernel=...)` (eager, no gradient to record), `ops.gemm_into` (an out= call) and, for scale,
`torch.mm(a, b, out=c)`, on small square products where the call's overhead shows; and of
`ops.grouped_conv` against torch's conv2d on small real-network layers (depthwise 3x3 of
MobileNet-like widths, a ResNeXt group layer, a dense 3x3), beside the kernel's library
entry alone (its torch-layout entry, which holds the layout conversions).

    python benchmarks/ops_overhead.py [--kernel NAME] [--sizes 8 64 256] [--calls 3000]
                                      [--conv-kernel NAME] [--conv-calls 500] [--only gemm|conv]

The GEMM kernel defaults to a 6x16 (AVX2) or 14x32 (AVX-512) fp32 variant, the conv kernel
to a gvec forward variant; each is compiled on first use into the build cache. Medians of 5
rounds, each `--calls` calls of every path back to back; 2 threads. Figures, not a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.core import hardware  # noqa: E402
from tilecast.families import get_family  # noqa: E402
from tilecast.families.gemm import GemmConfig  # noqa: E402
from tilecast.runtime import ops  # noqa: E402


def default_kernel() -> str:
    if "avx512f" in hardware.profile(2)["flags"]:
        config = GemmConfig("fp32", "avx512", 14, 32, 98, 512, 128, "m", True, True)
    else:
        config = GemmConfig("fp32", "avx2", 6, 16, 192, 2048, 256, "k", True, False)
    return get_family("gemm").kernel_name(config)


CONV_KERNEL = "grouped_conv_forward_fp32_2d_64x64x64_gvec_intrawave"
# (label, x shape, w shape, padding, groups): batch 1, stride 1
CONV_LAYERS = [
    ("depthwise 3x3, 96 ch 14x14", (1, 96, 14, 14), (96, 1, 3, 3), 1, 96),
    ("depthwise 3x3, 384 ch 7x7", (1, 384, 7, 7), (384, 1, 3, 3), 1, 384),
    ("depthwise 3x3, 32 ch 56x56", (1, 32, 56, 56), (32, 1, 3, 3), 1, 32),
    ("ResNeXt G32 C4 K4 3x3, 28x28", (1, 128, 28, 28), (128, 4, 3, 3), 1, 32),
    ("dense 3x3, 64 -> 64, 14x14", (1, 64, 14, 14), (64, 64, 3, 3), 1, 1),
]


def median_us(paths: dict, calls: int) -> dict[str, float]:
    """Each path's median microseconds a call over 5 rounds of `calls` calls, the paths in
    turn every round."""
    for call in paths.values():  # compile, load, warm up
        call()
    rounds = {name: [] for name in paths}
    for _ in range(5):
        for name, call in paths.items():
            start = time.perf_counter()
            for _ in range(calls):
                call()
            rounds[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(times) for name, times in rounds.items()}


def conv_overhead(kernel: str, calls: int) -> None:
    from tilecast.runtime.ops import grouped_conv_ops as conv_ops

    print(f"CPU: {hardware.profile(2)['cpu_model']}; conv kernel {kernel}; 2 threads")
    print(f"{'layer':>30} {'ops.grouped_conv us':>20} {'its entry us':>13} {'torch conv2d us':>16} "
          f"{'ops / torch':>12}")
    generator = torch.Generator().manual_seed(0)
    for label, x_shape, w_shape, padding, groups in CONV_LAYERS:
        x, w = torch.randn(x_shape, generator=generator), torch.randn(w_shape, generator=generator)
        problem = conv_ops._conv_problem("forward", x.shape, w.shape, [1, 1], [padding] * 2,
                                         [1, 1], groups)
        run = conv_ops.load_kernel(conv_ops.CONV["forward"], kernel, problem)
        out, shape = torch.empty(conv_ops._output_size(problem)), conv_ops._job_shape(problem)
        expected = torch.nn.functional.conv2d(x, w, None, 1, padding, 1, groups)
        got = ops.grouped_conv(x, w, padding=padding, groups=groups, kernel=kernel)
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
            raise SystemExit(f"{label}: the kernel's result differs from torch's")
        with torch.no_grad():
            us = median_us({
                "ops": lambda: ops.grouped_conv(x, w, padding=padding, groups=groups,
                                                kernel=kernel),
                "entry": lambda: run.run_torch_layouts(shape, x.data_ptr(), w.data_ptr(),
                                                       out.data_ptr(), 2),
                "torch": lambda: torch.nn.functional.conv2d(x, w, None, 1, padding, 1, groups),
            }, calls)
        print(f"{label:>30} {us['ops']:>20.1f} {us['entry']:>13.1f} {us['torch']:>16.1f} "
              f"{us['ops'] / us['torch']:>12.2f}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default=None, help="a GEMM kernel name (default: see above)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--conv-kernel", default=CONV_KERNEL, help="a grouped-conv forward kernel")
    parser.add_argument("--conv-calls", type=int, default=500)
    parser.add_argument("--only", choices=("gemm", "conv"), default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.only != "gemm":
        conv_overhead(args.conv_kernel, args.conv_calls)
    if args.only == "conv":
        return
    kernel = args.kernel or default_kernel()
    print(f"CPU: {hardware.profile(2)['cpu_model']}; kernel {kernel}; 2 threads")
    print(f"{'n':>6} {'ops.gemm us':>12} {'gemm_into us':>13} {'torch.mm us':>12}")
    for n in args.sizes:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        paths = {"gemm": lambda: ops.gemm(a, b, kernel=kernel),
                 "into": lambda: ops.gemm_into(c, a, b, kernel),
                 "torch": lambda: torch.mm(a, b, out=c)}
        us = median_us(paths, args.calls)
        print(f"{n:>6} {us['gemm']:>12.1f} {us['into']:>13.1f} {us['torch']:>12.1f}")


if __name__ == "__main__":
    main()
