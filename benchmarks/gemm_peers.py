"""tilecast's GEMM variants against OpenBLAS, torch and the machine's ceilings, in one run.

    .venv/bin/python benchmarks/gemm_peers.py                      # squares, rectangles, GEMV
    .venv/bin/python benchmarks/gemm_peers.py --shapes 1x4096x4096 --rounds 5
    .venv/bin/python benchmarks/gemm_peers.py --holdout             # the nightly's held-out shapes
    .venv/bin/python benchmarks/gemm_peers.py --past-llc --shapes   # GEMV-class shapes ~4x the LLC
    .venv/bin/python benchmarks/gemm_peers.py --dtype bf16          # bf16 against torch's bf16

The variants are a config's GEMM candidates (default: the nightly's 64, those this CPU runs),
built as in-process libraries like the benchmark stage builds them. Each round reads the
memory read bandwidth (tilecast.measurement.probe), then per shape the FMA peak and the timings of every
variant, numpy's OpenBLAS (threadpoolctl pins its threads) and torch.matmul (MKL or its own
BLAS), in a shuffled order, each on the same operands into its own output. Medians over the
rounds; per shape the best variant, then the ratios the issue asks for: best / OpenBLAS, best
/ the better peer, and either best / FMA peak read beside that shape (compute-bound shapes; a
warning when the peak reads of the run differ by more than 15 %) or its bytes per second
/ read bandwidth (GEMV-class shapes: min(m, n) <= 8, whose operands outgrow the last-level
cache, against the bandwidth read just before and after that shape's timings in each round;
"in LLC" otherwise). The bandwidth probe reads a buffer of several last-level caches
(tilecast.stages.roofline.buffer_mib), and --past-llc adds GEMV-class shapes whose large
operand is about four of this machine's last-level caches (1 x N x N, N x 1 x N, 8 x N x N).
A GEMV-class shape whose operands outgrow the last-level cache is timed over copies of them,
each call on the next, so no call finds the last one's operand in the cache.
--dtype bf16 (a CPU with AVX-512 BF16) times the same variants built for bf16 operands (A
packed, as bf16 needs) against torch.matmul on bf16 tensors, with OpenBLAS's sgemm on the same
values as fp32 beside them, and holds them against the bf16 dot-product peak
(probe.bf16_dot_peak_gflops) instead of the FMA peak.
Figures, not a test: a shared machine's timings are not a pass/fail matter.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_info, threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.core import hardware, tune
from tilecast.measurement import probe  # noqa: E402
from tilecast.config import load_config  # noqa: E402
from tilecast.families import get_family  # noqa: E402
from tilecast.core import build  # noqa: E402
from tilecast.stages import roofline  # noqa: E402

GEMM = get_family("gemm")
DEFAULT_SHAPES = ("512x512x512", "1024x1024x1024", "2048x2048x2048", "512x2048x1024",
                  "2048x512x1024", "1024x4096x512", "1x4096x4096", "4x8192x4096",
                  "8192x1x4096", "8x1024x1024", "1x1024x1024")
SKINNY = 8


def parse_shape(text: str) -> dict:
    """'MxNxK' or 'MxNxK:la:lb' (layouts row|col) -> problem fields."""
    dims, *layouts = text.split(":")
    m, n, k = (int(v) for v in dims.split("x"))
    la, lb = (layouts + ["row", "row"])[:2] if layouts else ("row", "row")
    return {"m": m, "n": n, "k": k, "layout_a": la, "layout_b": lb}


def past_llc_shapes(l3_bytes: int) -> list[str]:
    """GEMV-class shapes whose N x N fp32 operand is about four last-level caches (N a multiple
    of 1024; 16384 where the LLC size is unknown)."""
    n = 16384 if l3_bytes <= 0 else max(1024, round(math.sqrt(l3_bytes) / 1024) * 1024)
    return [f"1x{n}x{n}", f"{n}x1x{n}", f"8x{n}x{n}"]


def variants(config: str, machine: dict, dtype: str = "fp32") -> list:
    """The config's fp32 candidates; for bf16 the same ones built for bf16 operands (A packed)."""
    cfg = load_config(config)
    fc = cfg.families["gemm"]
    space = {GEMM.kernel_name(c): c for c in GEMM.candidate_space(fc.candidates, machine)}
    names = tune.seeded_order(list(space), fc.seed)[:fc.budget]
    fp32 = [space[n] for n in names if space[n].dtype == "fp32"]
    if dtype == "fp32":
        return fp32
    return list(dict.fromkeys(dataclasses.replace(c, dtype=dtype, pack_a=True) for c in fp32))


def shape_text(problem) -> str:
    return f"{problem.m}x{problem.n}x{problem.k}:{problem.layout_a}:{problem.layout_b}"


def operand_copies(problem, l3_bytes: int) -> int:
    """How many copies of a GEMV-class shape's operands the timings rotate over: enough that
    the others hold twice the last-level cache, where one copy outgrows it; else one."""
    size = GEMM.bytes_moved(problem)
    if min(problem.m, problem.n) > SKINNY or l3_bytes <= 0 or size <= l3_bytes:
        return 1
    return 1 + math.ceil(2 * l3_bytes / size)


def rotating(timers):
    """time(reps) -> seconds per call, each call on the next timer's operands in turn."""
    turn = itertools.count()

    def time_calls(reps: int) -> float:
        if len(timers) == 1:
            return timers[0](reps)
        return sum(timers[next(turn) % len(timers)](1) for _ in range(reps)) / reps

    return time_calls


def rotating_peer(matmul, lefts, rights, out):
    """A peer's call: matmul(left, right, out=out), each call on the next copy's operands."""
    turn = itertools.count()

    def call():
        copy = next(turn) % len(lefts)
        matmul(lefts[copy], rights[copy], out=out)

    return call


def sized(call, min_s: float) -> int:
    """Calls per sample so that one sample lasts about min_s."""
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, min(10_000, int(min_s / once)))


def timed(call, reps: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="nightly", help="whose GEMM candidates (default nightly)")
    parser.add_argument("--shapes", nargs="*", default=list(DEFAULT_SHAPES),
                        help="MxNxK[:layout_a:layout_b] (default: squares, rectangles, GEMV)")
    parser.add_argument("--holdout", action="store_true",
                        help="the config's held-out shapes instead of --shapes")
    parser.add_argument("--past-llc", action="store_true",
                        help="add GEMV-class shapes whose large operand is ~4 last-level caches")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sample-ms", type=float, default=30.0)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the operands' dtype (bf16: a CPU with AVX-512 BF16)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    machine = hardware.profile(args.threads)
    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    print(f"CPU: {machine['cpu_model']}; {args.threads} threads; numpy BLAS: "
          + ", ".join(f"{i['internal_api']} {i.get('version')} ({i.get('architecture')} kernels)"
                      for i in blas))
    if args.dtype == "bf16" and probe.bf16_dot_peak_gflops(1, 1000) is None:
        parser.error("--dtype bf16 needs a CPU with AVX-512 BF16, which this one lacks")
    # the ceiling each shape is held against: the FMA peak, or for bf16 the dot-product peak
    ceiling = probe.fma_peak_gflops if args.dtype == "fp32" else probe.bf16_dot_peak_gflops
    configs = variants(args.config, machine, args.dtype)
    builts = build.build_candidates(GEMM, configs, build.default_cache_dir(), jobs=2, shared=True)
    libraries = {b.kernel: b.binary for b in builts if b.binary is not None}
    print(f"{len(libraries)} of {len(configs)} {args.dtype} variants of config {args.config!r} built")
    if args.holdout:
        problems = [GEMM.problem(p) for p in load_config(args.config).families["gemm"].problems["holdout"]]
    else:
        shapes = args.shapes + (past_llc_shapes(machine["l3_bytes"]) if args.past_llc else [])
        problems = [GEMM.problem({**parse_shape(s), "dtype": args.dtype}) for s in shapes]
    buffer_mib = roofline.buffer_mib(machine["l3_bytes"])
    print(f"last-level cache {machine['l3_bytes'] / 2**20:.0f} MiB; the bandwidth probe reads "
          f"{buffer_mib} MiB")

    # operands, outputs and timers once: every round times the same buffers; a GEMV-class
    # shape past the LLC rotates over copies of its operands, so that each call reads them
    # cold, as a product that streams a large weight once between other work does (with one
    # copy, the part an AMD L3 keeps between calls read as 8-10 % more bandwidth)
    setups = []
    for number, problem in enumerate(problems):
        copies = operand_copies(problem, machine["l3_bytes"])
        prepared = [GEMM.prepare(problem, Path("/tmp") / "tilecast-gemm-peers" / f"p{number}c{copy}",
                                 seed=number + 1000 * copy) for copy in range(copies)]
        a = [p.tensors["a"] for p in prepared]
        b = [p.tensors["b"] for p in prepared]
        an, bn = [t.float().numpy() for t in a], [t.float().numpy() for t in b]  # bf16: as fp32
        outputs = {kernel: GEMM.output_tensor(prepared[0]) for kernel in libraries}
        firsts = {kernel: GEMM.timer(library, prepared[0], args.threads, outputs[kernel])
                  for kernel, library in libraries.items()}
        calls = {kernel: rotating([firsts[kernel]] + [GEMM.timer(library, p, args.threads, outputs[kernel])
                                                      for p in prepared[1:]])
                 for kernel, library in libraries.items()}
        c_np = np.empty((problem.m, problem.n), dtype=np.float32)
        c_torch = torch.empty(problem.m, problem.n, dtype=a[0].dtype)
        peers = {"OpenBLAS": rotating_peer(np.matmul, an, bn, c_np),
                 "torch": rotating_peer(torch.matmul, a, b, c_torch)}
        check = (lambda an=an[0], bn=bn[0], c=c_np: np.matmul(an, bn, out=c), firsts)
        setups.append((problem, outputs, calls, peers, c_np, check, copies > 1))
        if copies > 1:
            print(f"{shape_text(problem)}: {copies} copies of the operands, "
                  "each call reads the next (cold past the LLC)")

    rng = random.Random(0)
    samples: dict[tuple, list[float]] = {}
    # the FMA peak is read beside each shape's timings: a shared machine's speed moves within
    # a round, and a shape is held against the peak of the minutes it was timed in
    peaks: dict[int, list[float]] = {number: [] for number in range(len(setups))}
    bandwidths = []
    own_reads: dict[int, list[float]] = {number: [] for number in range(len(setups))}
    for round_index in range(args.rounds):
        bandwidths.append(probe.read_bandwidth_gbps(args.threads, buffer_mib))
        for number, (problem, outputs, calls, peers, c_np, check, cold) in enumerate(setups):
            peaks[number].append(ceiling(args.threads))
            if cold:   # the host's bandwidth moves within a round: read it beside the shape
                own_reads[number].append(probe.read_bandwidth_gbps(args.threads, buffer_mib))
            order = list(calls) + list(peers)
            rng.shuffle(order)
            with threadpool_limits(limits=args.threads, user_api="blas"):
                for name in order:
                    if name in calls:
                        reps = sized(lambda: calls[name](1), args.sample_ms / 1e3)
                        seconds = min(calls[name](reps) for _ in range(2))
                    else:
                        reps = sized(peers[name], args.sample_ms / 1e3)
                        seconds = min(timed(peers[name], reps) for _ in range(2))
                    samples.setdefault((number, name), []).append(seconds)
            if cold:
                own_reads[number].append(probe.read_bandwidth_gbps(args.threads, buffer_mib))
            numpy_first, firsts = check   # every output from the first copy's operands
            with threadpool_limits(limits=args.threads, user_api="blas"):
                numpy_first()
            reference = torch.from_numpy(c_np.copy())
            for kernel, out in outputs.items():
                firsts[kernel](1)
                error = float((out - reference).norm() / max(reference.norm(), 1e-30))
                if not error <= GEMM.tolerance(problem):
                    samples[number, kernel] = [math.inf]   # fast and wrong is never a winner
        reads = [p[-1] for p in peaks.values()]
        print(f"round {round_index + 1}/{args.rounds}: peak {min(reads):.0f}-{max(reads):.0f} "
              f"GFLOP/s, read {bandwidths[-1]:.1f} GB/s", flush=True)

    every_peak = [v for p in peaks.values() for v in p]
    peak, bandwidth = statistics.median(every_peak), statistics.median(bandwidths)
    print(f"\nmedians of {args.rounds} rounds; {'FMA' if args.dtype == 'fp32' else 'bf16 dot'} peak {peak:.0f} GFLOP/s (each shape against "
          f"the median of its own reads), read bandwidth {bandwidth:.1f} GB/s")
    if max(every_peak) > 1.15 * min(every_peak):
        print(f"the peak read {min(every_peak):.0f}-{max(every_peak):.0f} GFLOP/s: the machine's "
              f"speed moved during the run, so ratios to the peak are unreliable; rerun when quiet")
    print(f"{'shape':>22} {'best variant':>44} {'GFLOP/s':>8} {'OpenBLAS':>8} {'torch':>8} "
          f"{'/OpenBLAS':>9} {'/better':>8} {'ceiling':>14}")
    ratios, beside = [], []
    for number, problem in enumerate(problems):
        median = {name: statistics.median(v) for (n, name), v in samples.items() if n == number}
        best = min(libraries, key=lambda k: median.get(k, math.inf))
        flops = GEMM.flops(problem)
        rate = {name: flops / s / 1e9 for name, s in median.items()}
        better = max(rate["OpenBLAS"], rate["torch"])
        if min(problem.m, problem.n) <= SKINNY:
            gbps = GEMM.bytes_moved(problem) / median[best] / 1e9
            # the bandwidth ceiling holds for operands past the last-level cache only
            cached = GEMM.bytes_moved(problem) <= machine["l3_bytes"]
            own = statistics.median(own_reads[number]) if own_reads[number] else bandwidth
            ceiling = f"{gbps:5.1f} GB/s " + ("in LLC" if cached else f"{gbps / own:4.0%}")
            if own_reads[number]:
                # the roofline's ceiling: the bandwidth, or the FMA peak where the shape's
                # flops per byte put it past the ridge (8 rows: 4 flops a byte)
                peak_here = statistics.median(peaks[number])
                roof = min(peak_here, own * GEMM.flops(problem) / GEMM.bytes_moved(problem))
                beside.append(f"{shape_text(problem)}: read {min(own_reads[number]):.1f}-"
                              f"{max(own_reads[number]):.1f} GB/s beside it, median {own:.1f}; "
                              f"{rate[best]:.1f} GFLOP/s is {rate[best] / roof:.0%} of its roof, "
                              f"{roof:.0f} GFLOP/s ({'compute' if roof == peak_here else 'memory'}-bound)")
        else:
            ceiling = f"{rate[best] / statistics.median(peaks[number]):4.0%} of peak"
        ratios.append(rate[best] / better)
        shape = shape_text(problem)
        print(f"{shape:>22} {best[5:]:>44} {rate[best]:8.1f} {rate['OpenBLAS']:8.1f} "
              f"{rate['torch']:8.1f} {rate[best] / rate['OpenBLAS']:9.2f} "
              f"{rate[best] / better:8.2f} {ceiling:>14}")
    for line in beside:
        print(line)
    print(f"\ngeometric mean, best variant / the better peer: "
          f"{math.exp(statistics.fmean(math.log(r) for r in ratios)):.3f} over {len(ratios)} shapes")


if __name__ == "__main__":
    main()
