"""Does a kernel's time relative to its rivals depend on the process that times it? (issue 17)

    .venv/bin/python benchmarks/process_bias.py                       # nightly's held-out shapes
    .venv/bin/python benchmarks/process_bias.py --rounds 8 --cycles 3 --contenders 4

The race times a problem's contenders side by side in one worker process. If a process gives
a kernel a bias of its own (where its operands, packing buffers and code happen to sit), every
round in that process carries it, and two runs disagree by more than their samples explain.
This measures it directly, in one run, on the nightly's GEMM candidates:

1. a screen (one plan, 2 cycles of every variant on every problem) picks each problem's
   `--contenders` fastest;
2. then `--rounds` rounds of each of three arms, the arms taken in turn (so a slow stretch of
   the machine falls on all three): "keep A" and "keep B", two long-lived workers that time
   every round in the same process with the operands where the family put them (today's
   race), and "fresh", a new worker each round with the operands at random offsets
   (`bench.race_fresh_process`).

A label here is a contender's log time relative to its problem's median contender, per round
(the round's median over its cycles). Printed, robust sd over all contenders:
- round to round within each arm: the scatter one round's label has, in one process
  (keep A, keep B) or in a fresh one each round (fresh);
- keep A's mean label against keep B's (two processes' labels, each averaged over the same
  number of rounds) next to what the keep arms' round-to-round scatter predicts for it:
  the excess is the per-process bias that more rounds in one process never average away;
- fresh's first half of rounds against its second half, the same comparison for the design
  in which every round has its own process.
Figures, not a test: a shared machine's timings are not a pass/fail matter.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_peers import variants  # noqa: E402  the same candidates as the peers benchmark

from tilecast.core import hardware, stats
from tilecast.measurement import interleave  # noqa: E402
from tilecast.config import load_config  # noqa: E402
from tilecast.measurement.protocol import Protocol  # noqa: E402
from tilecast.families import get_family  # noqa: E402
from tilecast.core import build  # noqa: E402

GEMM = get_family("gemm")
ROBUST = 1.4826   # MAD to sd for normal data
ARMS = ("keep A", "keep B", "fresh")


def plan(libraries: dict, problems: list, pairs: list, cycles: int, protocol: Protocol,
         seed: int, placement_seed: int | None = None) -> interleave.Plan:
    return interleave.Plan(
        family="gemm", libraries={k: str(v) for k, v in libraries.items()},
        problems=[(GEMM.dims_key(p), GEMM.problem_dict(p), 1000 + i) for i, p in enumerate(problems)],
        pairs=pairs, cycles=cycles, protocol=asdict(protocol), seed=seed,
        placement_seed=placement_seed)


def relative_labels(timings: dict, racing: dict) -> dict:
    """(kernel, key) -> log(round median) minus the median of its problem's contenders."""
    labels = {}
    for key, kernels in racing.items():
        logs = {k: math.log(stats.median(timings[k, key].samples_s)) for k in kernels
                if timings[k, key].status == "ok" and timings[k, key].samples_s}
        if len(logs) < 3:
            continue
        centre = float(np.median(list(logs.values())))
        labels.update({(k, key): value - centre for k, value in logs.items()})
    return labels


def robust_sd(values) -> float:
    values = np.asarray(list(values), dtype=float)
    return float(stats.mad(values, scale=ROBUST)) if len(values) else math.nan


def round_scatter(rounds: list[dict]) -> float:
    """Robust sd of one round's label around the pair's mean over the arm's rounds, corrected
    for the mean's own share (n / (n - 1))."""
    pairs = set.intersection(*(set(r) for r in rounds))
    n = len(rounds)
    deviations = [r[p] - np.mean([q[p] for q in rounds]) for p in pairs for r in rounds]
    return robust_sd(deviations) * math.sqrt(n / (n - 1))


def mean_difference(first: list[dict], second: list[dict]) -> float:
    """Robust sd of (mean label over `first`) - (mean label over `second`), over the pairs."""
    pairs = set.intersection(*(set(r) for r in first + second))
    return robust_sd(np.mean([r[p] for r in first]) - np.mean([r[p] for r in second])
                     for p in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="nightly", help="whose GEMM candidates and protocol")
    parser.add_argument("--set", default="holdout", help="the config's problem set (default holdout)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per arm")
    parser.add_argument("--cycles", type=int, default=3, help="samples per pair and round")
    parser.add_argument("--contenders", type=int, default=4)
    parser.add_argument("--scratch", default="work/process_bias")
    args = parser.parse_args()
    if args.rounds < 4 or args.rounds % 2:
        parser.error("--rounds must be even and at least 4 (fresh's halves are compared)")

    config = load_config(args.config)
    protocol = config.protocol
    machine = hardware.profile(protocol.threads)
    problems = [GEMM.problem(p) for p in config.families["gemm"].problems[args.set]]
    builts = build.build_candidates(GEMM, variants(args.config, machine), build.default_cache_dir(),
                                    jobs=2, shared=True)
    libraries = {b.kernel: b.binary for b in builts if b.binary is not None}
    print(f"CPU: {machine['cpu_model']}; {protocol.threads} threads; "
          f"{len(libraries)} variants, {len(problems)} problems of '{args.set}'", flush=True)
    scratch = Path(args.scratch)
    keys = [GEMM.dims_key(p) for p in problems]

    started = time.perf_counter()
    with interleave.Worker(protocol, scratch) as worker:
        screen = worker.measure(plan(libraries, problems, [(k, key) for k in libraries for key in keys],
                                     2, protocol, seed=1))
    racing = {}
    for key in keys:
        levels = {k: stats.median(screen[k, key].samples_s) for k in libraries
                  if screen[k, key].status == "ok" and screen[k, key].samples_s}
        racing[key] = sorted(levels, key=levels.get)[:args.contenders]
    pairs = [(k, key) for key, kernels in racing.items() for k in kernels]
    print(f"screen: {time.perf_counter() - started:.0f} s; racing {len(pairs)} pairs", flush=True)

    labels = {arm: [] for arm in ARMS}
    keep = {arm: interleave.Worker(protocol, scratch) for arm in ARMS[:2]}
    fresh = interleave.Worker(protocol, scratch)
    try:
        for index in range(args.rounds):
            for arm in ARMS:
                seed = 100 + index
                if arm == "fresh":
                    fresh.close()
                    timings = fresh.measure(plan(libraries, problems, pairs, args.cycles, protocol,
                                                 seed, placement_seed=7000 + index))
                else:
                    timings = keep[arm].measure(plan(libraries, problems, pairs, args.cycles,
                                                     protocol, seed))
                labels[arm].append(relative_labels(timings, racing))
            print(f"round {index + 1}/{args.rounds} of each arm: "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    finally:
        for worker in (*keep.values(), fresh):
            worker.close()

    half = args.rounds // 2
    print(f"\n{len(pairs)} contenders, {args.rounds} rounds of {args.cycles} cycles per arm; "
          "robust sd of log time relative to the problem's median contender")
    for arm in ARMS:
        print(f"  one round, round to round, {arm:7s}: {round_scatter(labels[arm]):.4f}")
    keep_scatter = math.sqrt(np.mean([round_scatter(labels[a]) ** 2 for a in ARMS[:2]]))
    keep_diff = mean_difference(labels["keep A"], labels["keep B"])
    keep_pred = keep_scatter * math.sqrt(2 / args.rounds)
    print(f"  keep A's mean of {args.rounds} rounds - keep B's: {keep_diff:.4f} "
          f"(round scatter predicts {keep_pred:.4f}; per-process bias "
          f"{math.sqrt(max(keep_diff ** 2 - keep_pred ** 2, 0) / 2):.4f} per process)")
    fresh_scatter = round_scatter(labels["fresh"])
    fresh_diff = mean_difference(labels["fresh"][:half], labels["fresh"][half:])
    fresh_pred = fresh_scatter * math.sqrt(2 / half)
    print(f"  fresh's mean of rounds 1-{half} - of rounds {half + 1}-{args.rounds}: {fresh_diff:.4f} "
          f"(its round scatter predicts {fresh_pred:.4f})")
    print(f"  wall {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
