"""What a tilecast.ops GEMM call costs around its kernel: per-call time of `ops.gemm(a, b,
kernel=...)` (eager, no gradient to record), `ops.gemm_into` (an out= call) and, for scale,
`torch.mm(a, b, out=c)`, on small square products where the call's overhead shows.

    python benchmarks/ops_overhead.py [--kernel NAME] [--sizes 8 64 256] [--calls 3000]

The kernel defaults to a 6x16 (AVX2) or 14x32 (AVX-512) fp32 variant, compiled on first use
into the build cache. Medians of 5 rounds, each `--calls` calls of every path back to back;
2 threads. Figures, not a test.
"""
from __future__ import annotations

import argparse
import platform
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default=None, help="a GEMM kernel name (default: see above)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(2)
    kernel = args.kernel or default_kernel()
    print(f"CPU: {platform.processor() or platform.machine()}; kernel {kernel}; 2 threads")
    print(f"{'n':>6} {'ops.gemm us':>12} {'gemm_into us':>13} {'torch.mm us':>12}")
    for n in args.sizes:
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        paths = {"gemm": lambda: ops.gemm(a, b, kernel=kernel),
                 "into": lambda: ops.gemm_into(c, a, b, kernel),
                 "torch": lambda: torch.mm(a, b, out=c)}
        for call in paths.values():  # compile, load, warm up
            call()
        rounds = {name: [] for name in paths}
        for _ in range(5):
            for name, call in paths.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                rounds[name].append((time.perf_counter() - start) / args.calls * 1e6)
        us = {name: statistics.median(times) for name, times in rounds.items()}
        print(f"{n:>6} {us['gemm']:>12.1f} {us['into']:>13.1f} {us['torch']:>12.1f}")


if __name__ == "__main__":
    main()
