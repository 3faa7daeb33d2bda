"""The FMA probe's peak beside torch's sgemm on the same threads, measured in the same rounds.

    .venv/bin/python benchmarks/fma_probe.py                     # a few seconds
    .venv/bin/python benchmarks/fma_probe.py --rounds 3 --shapes 96x256x512

Each round reads the probe (tilecast.measurement.probe.fma_peak_gflops) and then times every GEMM
shape, so a machine that changes speed mid-run moves both alike. A GEMM does the probe's FMAs
plus loads, so its rate should stay under the probe's: the last column is the GEMM's median
over the highest probe of the run, and a figure above 1 points at a wrong flop count in the
probe (or a probe starved by a neighbour that round). Figures, not a test: two timings side
by side flake on a shared machine, which is why this is not in tests/test_probe.py.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.core import hardware
from tilecast.measurement import probe  # noqa: E402

#: a cache-resident panel (the old test's), a square one past L2, and a skinny one
DEFAULT_SHAPES = ("96x256x512", "512x512x512", "16x1024x1024")


def parse_shape(text: str) -> tuple[int, int, int]:
    """'MxKxN' -> (m, k, n), each a positive int."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"shape {text!r} is not MxKxN with positive ints, "
                                         f"e.g. 96x256x512")
    m, k, n = (int(p) for p in parts)
    return m, k, n


class Gemm:
    """One sgemm shape, out= preallocated, timed for about `seconds` per sample."""

    def __init__(self, shape: tuple[int, int, int], seconds: float):
        m, k, n = shape
        self.label = f"{m}x{k}x{n}"
        self.a, self.b, self.out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
        self.flops = 2.0 * m * k * n
        self.calls = self._calls_for(seconds)

    def _calls_for(self, seconds: float) -> int:
        for _ in range(3):  # warm up threads and caches before sizing the sample
            torch.mm(self.a, self.b, out=self.out)
        start = time.perf_counter()
        torch.mm(self.a, self.b, out=self.out)
        one_call = max(time.perf_counter() - start, 1e-7)
        return max(1, math.ceil(seconds / one_call))

    def gflops(self) -> float:
        """GFLOP/s of `calls` back-to-back multiplications."""
        start = time.perf_counter()
        for _ in range(self.calls):
            torch.mm(self.a, self.b, out=self.out)
        return self.calls * self.flops / (time.perf_counter() - start) / 1e9


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="probe + every GEMM, this many times")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads of the probe and of torch (default: torch's)")
    parser.add_argument("--iterations", type=int, default=16_000_000,
                        help="probe rounds of 10 FMAs per thread (16M: ~30 ms at 2.8 GHz)")
    parser.add_argument("--sample-seconds", type=float, default=0.05,
                        help="time one GEMM sample runs for")
    parser.add_argument("--shapes", nargs="+", type=parse_shape,
                        default=[parse_shape(s) for s in DEFAULT_SHAPES], metavar="MxKxN")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.threads < 1 or args.sample_seconds <= 0:
        parser.error(f"--rounds and --threads must be >= 1 and --sample-seconds > 0, got "
                     f"{args.rounds}, {args.threads}, {args.sample_seconds}")

    torch.set_num_threads(args.threads)
    machine = hardware.profile(args.threads)
    start = time.perf_counter()
    lanes = probe.lanes()  # builds the probe library on first use
    print(f"cpu: {machine['cpu_model']} ({machine['cores']} cores usable, "
          f"{machine['simd_bits']}-bit SIMD, {machine['clock_mhz']:.0f} MHz reported)")
    print(f"probe: {lanes} fp32 lanes, ready in {time.perf_counter() - start:.1f} s; "
          f"{args.threads} threads, torch {torch.__version__}, {args.rounds} rounds")

    gemms = [Gemm(shape, args.sample_seconds) for shape in args.shapes]
    peaks: list[float] = []
    rates: dict[str, list[float]] = {g.label: [] for g in gemms}
    for _ in range(args.rounds):
        peaks.append(probe.fma_peak_gflops(args.threads, args.iterations))
        for gemm in gemms:
            rates[gemm.label].append(gemm.gflops())

    peak = max(peaks)
    print(f"\n{'':18s} {'median':>9s} {'min':>9s} {'max':>9s}  {'median/peak':>11s}  (GFLOP/s)")
    print(f"{'FMA probe':18s} {statistics.median(peaks):9.1f} {min(peaks):9.1f} {peak:9.1f}  "
          f"{statistics.median(peaks) / peak:11.3f}")
    for label, samples in rates.items():
        median = statistics.median(samples)
        print(f"{'sgemm ' + label:18s} {median:9.1f} {min(samples):9.1f} {max(samples):9.1f}  "
              f"{median / peak:11.3f}")
    over = [label for label, samples in rates.items() if statistics.median(samples) > peak]
    if over:
        print(f"\nabove the probe's peak: {', '.join(over)} (a wrong probe flop count, or a "
              f"noisy round: rerun with more --rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
