"""tilecast's grouped-convolution variants against torch's CPU convolution (oneDNN), in one run.

    .venv/bin/python benchmarks/conv_peers.py                        # held-out layers, 3 directions
    .venv/bin/python benchmarks/conv_peers.py --directions forward --rounds 5
    .venv/bin/python benchmarks/conv_peers.py --match Y=3,X=3 --set train
    .venv/bin/python benchmarks/conv_peers.py --directions forward --by-pipeline   # each pipeline's best
    .venv/bin/python benchmarks/conv_peers.py --layers benchmarks/layers/real_networks.yaml

The variants are a config's candidates per direction (default: the grouped_conv config's 24,
those this CPU runs), built as in-process libraries like the benchmark stage builds them. Each
round times, per layer, every applicable variant and torch's own op for the direction (conv,
or aten.convolution_backward with only the wanted gradient) in a shuffled order on the same
operands, each variant into its own output, whose error against the float64 torch reference
is checked every round: a fast and wrong variant is dropped from that layer, never the best.
Medians over the rounds; per layer the best variant and best / torch; per direction the
geometric mean of best / torch over its layers and over the slices the issue names
(depthwise, 3x3 stride 1, pointwise, the rest). --by-pipeline adds each pipeline's best / torch
per layer, and per pair of pipelines the geometric mean of one's best over the other's on the
layers both run: what a pipeline adds, read in the same rounds. Figures, not a test: a shared machine's
timings are not a pass/fail matter.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.core import hardware  # noqa: E402
from tilecast.config import load_config  # noqa: E402
from tilecast.families import get_family  # noqa: E402
from tilecast.core import build  # noqa: E402
from tilecast.workflows.pipeline import budgeted  # noqa: E402

DIRECTIONS = ("forward", "bwd_data", "bwd_weight")


def slice_of(p) -> str:
    """The slice of the issue's figures a layer belongs to."""
    taps = p.Z * p.Y * p.X
    if p.G > 1 and p.C == 1 and p.K == 1:
        return "depthwise"
    if taps == 1:
        return "pointwise"
    strides = (p.stride_d, p.stride_h, p.stride_w)
    dilations = (p.dilation_d, p.dilation_h, p.dilation_w)
    if (p.Y, p.X) == (3, 3) and p.Z in (1, 3) and set(strides) == {1} and set(dilations) == {1}:
        return "3x3 stride 1"
    return "other"


def label(p) -> str:
    """A layer in a line: N G C K, spatial size, taps, stride, pad, dilation."""
    dims = (lambda d, h, w: f"{d}x{h}x{w}" if p.ndim == 3 else f"{h}x{w}")
    return (f"N{p.N} G{p.G} C{p.C} K{p.K} {dims(p.Di, p.Hi, p.Wi)} k{dims(p.Z, p.Y, p.X)} "
            f"s{dims(p.stride_d, p.stride_h, p.stride_w)} p{dims(p.pad_d, p.pad_h, p.pad_w)}"
            + ("" if {p.dilation_d, p.dilation_h, p.dilation_w} == {1}
               else f" d{dims(p.dilation_d, p.dilation_h, p.dilation_w)}"))


def sized(call, min_s: float) -> int:
    """Calls per sample so that one sample lasts about min_s."""
    start = time.perf_counter()
    call(1)
    once = max(time.perf_counter() - start, 1e-7)
    return max(1, min(5_000, int(min_s / once)))


def peer_timer(fn):
    def time_calls(reps: int) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps
    return time_calls


def layer_file(path: Path) -> list[dict]:
    """The layers of a --layers file: every list entry under its top-level keys."""
    document = yaml.safe_load(path.read_text())
    if not isinstance(document, dict) or not all(isinstance(v, list) for v in document.values()):
        raise SystemExit(f"{path}: expected lists of layers under top-level keys")
    return [layer for layers in document.values() for layer in layers]


def geomean(values) -> float:
    values = list(values)
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else math.nan


def run_direction(direction: str, args, machine: dict, cfg) -> list[tuple]:
    """[(problem, slice, best kernel, best GFLOP/s, torch GFLOP/s, {pipeline: its best
    GFLOP/s})] for one direction."""
    name = f"grouped_conv_{direction}"
    family, fc = get_family(name), cfg.families[name]
    configs = budgeted(family, family.candidate_space(fc.candidates, machine), fc.seed, fc.budget)
    if args.pipelines:
        configs = [c for c in configs if c.pipeline in args.pipelines]
    builts = build.build_candidates(family, configs, build.default_cache_dir(), jobs=2, shared=True)
    libraries = {b.kernel: (b.config, b.binary) for b in builts if b.binary is not None}
    problems = [family.problem(v) for v in (layer_file(args.layers) if args.layers else fc.problems[args.set])]
    problems = [p for p in problems if args.match in family.dims_key(p)]
    print(f"\n{direction}: {len(libraries)} of {len(configs)} variants of config "
          f"{args.config!r} built; {len(problems)} {args.layers or args.set} layers", flush=True)

    setups = []
    for number, problem in enumerate(problems):
        prepared = family.prepare(problem, Path("/tmp") / "tilecast-conv-peers" / direction
                                  / f"p{number}", seed=number)
        kernels = {k: lib for k, (c, lib) in libraries.items() if family.applicable(c, problem)}
        outputs = {k: family.output_tensor(prepared) for k in kernels}
        calls = {k: family.timer(lib, prepared, args.threads, outputs[k]) for k, lib in kernels.items()}
        peer_name, peer = family.peer(prepared, args.threads)
        calls[peer_name] = peer_timer(peer)
        reference = prepared.reference.reshape(-1).astype(np.float64)
        setups.append((problem, prepared, outputs, calls, peer_name, reference))

    rng = random.Random(0)
    samples: dict[tuple, list[float]] = {}
    for round_index in range(args.rounds):
        started = time.monotonic()
        for number, (problem, prepared, outputs, calls, peer_name, reference) in enumerate(setups):
            order = list(calls)
            rng.shuffle(order)
            for kernel in order:
                reps = sized(calls[kernel], args.sample_ms / 1e3)
                samples.setdefault((number, kernel), []).append(
                    min(calls[kernel](reps) for _ in range(2)))
            norm = max(float(np.linalg.norm(reference)), 1e-30)
            for kernel, out in outputs.items():
                got = out.numpy()[:reference.size].astype(np.float64)
                if not float(np.linalg.norm(got - reference)) / norm <= family.tolerance(problem):
                    samples[number, kernel] = [math.inf]   # fast and wrong is never a winner
        print(f"  round {round_index + 1}/{args.rounds}: {time.monotonic() - started:.0f} s",
              flush=True)

    rows = []
    for number, (problem, prepared, outputs, calls, peer_name, reference) in enumerate(setups):
        median = {k: statistics.median(v) for (n, k), v in samples.items() if n == number}
        best = min(outputs, key=lambda k: median.get(k, math.inf), default=None)
        flops = family.flops(problem)
        rate = {k: flops / median[k] / 1e9 for k in outputs if math.isfinite(median.get(k, math.inf))}
        by_pipeline: dict[str, float] = {}
        for kernel, value in rate.items():
            pipeline = libraries[kernel][0].pipeline
            by_pipeline[pipeline] = max(by_pipeline.get(pipeline, 0.0), value)
        rows.append((problem, slice_of(problem), best, rate.get(best, 0.0),
                     flops / median[peer_name] / 1e9, by_pipeline))
    return rows


def report(direction: str, rows: list[tuple], by_pipeline: bool = False) -> None:
    print(f"\n{direction}: best variant against torch (medians)")
    pipelines = sorted({p for row in rows for p in row[5]})
    extra = "".join(f" {p + '/torch':>14}" for p in pipelines) if by_pipeline else ""
    print(f"{'layer':>62} {'slice':>12} {'best GFLOP/s':>12} {'torch':>8} {'best/torch':>10}{extra}"
          f"  best variant")
    for problem, part, best, rate, torch_rate, best_of in rows:
        extra = "".join(f" {best_of[p] / torch_rate:14.2f}" if p in best_of else f" {'-':>14}"
                        for p in pipelines) if by_pipeline else ""
        print(f"{label(problem):>62} {part:>12} {rate:12.1f} {torch_rate:8.1f} "
              f"{rate / torch_rate:10.2f}{extra}  {(best or 'none').replace('grouped_conv_', '')}")
    if by_pipeline:
        for first in pipelines:
            for second in pipelines:
                shared = [r[5][first] / r[5][second] for r in rows
                          if first < second and first in r[5] and second in r[5]]
                if shared:
                    print(f"{direction}: {first} / {second}, best against best: geometric mean "
                          f"{geomean(shared):.2f} over the {len(shared)} layers both run "
                          f"(range {min(shared):.2f}-{max(shared):.2f})")
    ratios = [(part, max(rate, 1e-9) / torch_rate) for _, part, _, rate, torch_rate, _ in rows]
    parts = sorted({p for p, _ in ratios})
    print(f"{direction}: geometric mean best/torch {geomean(r for _, r in ratios):.3f} over "
          f"{len(ratios)} layers; " + ", ".join(
              f"{p} {geomean(r for q, r in ratios if q == p):.2f} ({sum(q == p for q, _ in ratios)})"
              for p in parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="grouped_conv", help="whose candidates and layers")
    parser.add_argument("--directions", nargs="*", default=list(DIRECTIONS), choices=DIRECTIONS)
    parser.add_argument("--set", default="holdout", choices=("holdout", "train"))
    parser.add_argument("--layers", type=Path, default=None,
                        help="a YAML file of layers (lists of problem fields, under any keys) in "
                             "place of the config's set, e.g. benchmarks/layers/real_networks.yaml")
    parser.add_argument("--match", default="", help="only layers whose dims key contains this (e.g. 'Y=3,X=3')")
    parser.add_argument("--pipelines", nargs="*", default=None,
                        help="only variants of these pipelines (default: all)")
    parser.add_argument("--by-pipeline", action="store_true",
                        help="each pipeline's best per layer, and pipelines against each other")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    machine = hardware.profile(args.threads)
    print(f"CPU: {machine['cpu_model']}; {args.threads} threads; torch {torch.__version__} "
          f"(mkldnn {torch.backends.mkldnn.is_available()})")
    cfg = load_config(args.config)
    for direction in args.directions:
        rows = run_direction(direction, args, machine, cfg)
        report(direction, rows, args.by_pipeline)


if __name__ == "__main__":
    main()
