"""First-call latency of a served GEMM op in a fresh process: the kernel compiled on first use
(a version without prebuilt kernels, an empty build cache: what every serving process paid
before) against the version's prebuilt library (tilecast.registry.prebuilt), with and without a
compiler on the host.

    python benchmarks/first_call.py                          # a synthetic 2-candidate model
    python benchmarks/first_call.py --registry R --model gemm@<class> [--alias production]
    python benchmarks/first_call.py --processes 5 --size 256

It copies the served version's files (without any kernels/) into a temporary registry as
version 1 and runs `tilecast prebuild` on it (version 2: the same model with this host's
libraries, from the build cache where they are built). Each row is the median over
--processes fresh Python processes of one `ops.gemm(a, b, dispatcher=...)` on a
--size cube, timed from the call to its return, after the Dispatcher loaded (its own native
scorer is compiled once beforehand, outside the timing, where there is a compiler). Every
process gets an empty build cache; each prints how many files it compiled into it. The
no-compiler row runs with PATH holding no g++ and TILECAST_CXX pointing nowhere. Figures,
not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import lightgbm
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.core import hardware  # noqa: E402
from tilecast.core.compile import native_target  # noqa: E402
from tilecast.families import get_family  # noqa: E402
from tilecast.registry import api as registry  # noqa: E402
from tilecast.runtime import prebuild  # noqa: E402
from tilecast.registry import prebuilt

GEMM = get_family("gemm")
METRICS = {"mean_efficiency": 0.9, "median_efficiency": 0.9, "p10_efficiency": 0.8,
           "min_efficiency": 0.5, "static_best": {"kernel": "?", "mean_efficiency": 0.7}}
OPTIONS = {"dtype": ["fp32"], "isa": ["avx2"], "tiles": ["6x16", "8x8"], "mc": [96],
           "nc": [512], "kc": [256], "parallel": ["m"], "pack_a": [True], "prefetch": [True]}
NOWHERE = "/nonexistent/first-call/g++"

CHILD = """
import json, os, sys, time
import torch
from tilecast.runtime import ops
from tilecast.runtime.dispatch import Dispatcher

root, model, version, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dispatcher = Dispatcher.from_registry(root, model, version)
gen = torch.Generator().manual_seed(0)
a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
start = time.perf_counter()
c = ops.gemm(a, b, dispatcher=dispatcher)
first = time.perf_counter() - start
start = time.perf_counter()
ops.gemm(a, b, dispatcher=dispatcher)
second = time.perf_counter() - start
reference = torch.matmul(a.double(), b.double())
cache = os.environ["TILECAST_BUILD_CACHE"]
print(json.dumps({"first_s": first, "second_s": second,
                  "error": float((c.double() - reference).norm() / reference.norm()),
                  "compiled": len([f for f in os.listdir(cache) if f.endswith(".so")])
                  if os.path.isdir(cache) else 0}))
"""


def synthetic_model(root: Path) -> tuple[str, int]:
    """A small GEMM model on a synthetic target over OPTIONS' candidates, published to `root`."""
    profile = hardware.profile(1)
    configs = GEMM.candidate_space(OPTIONS, profile)
    names = [GEMM.kernel_name(c) for c in configs]
    engine = GEMM.feature_engine(profile)
    rows, target = [], []
    for m in (8, 64, 512):
        for n in (16, 128, 1024):
            for k in (32, 256):
                features = engine.matrix(GEMM.problem({"m": m, "n": n, "k": k}), configs)
                rows.append(features)
                target.append(np.log1p(1.0 + features[:, engine.feature_names().index("mr")]
                                       * np.log2(m * n * k) / 100))
    booster = lightgbm.train({"objective": "regression", "min_data_in_leaf": 2, "verbose": -1,
                              "num_threads": 1, "seed": 0},
                             lightgbm.Dataset(np.vstack(rows), np.concatenate(target)),
                             num_boost_round=10)
    spec = {"family": "gemm", "feature_names": engine.feature_names(), "engine": engine.name,
            "engine_version": engine.version, "target_transform": "log1p_tflops",
            "hardware": profile}
    result = registry.publish(root, "gemm", {
        "model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
        "candidates.json": json.dumps({"family": "gemm", "kernels": names,
                                       "static_best": names[0]}),
        "train_manifest.json": "{}"}, metrics=METRICS)
    return "gemm", result.version


def copy_without_kernels(source_root, model: str, alias: str, target: Path) -> str:
    """The served version's files, kernels/ left out, as version 1 of `model` in `target`."""
    number = registry.resolve_version(source_root, registry.serving_name(source_root, model),
                                      alias)
    model = registry.serving_name(source_root, model)
    directory = registry.local_copy(source_root, model, number)
    files = {name: path for name, path in prebuild.version_files(directory).items()
             if not name.startswith(prebuilt.FOLDER + "/")}
    registry.publish(target, model, files, metrics=registry.read_metrics(source_root, model,
                                                                         number))
    return model


def run_child(root: Path, model: str, version: int, size: int, env: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="first-call-build-") as build_cache:
        done = subprocess.run([sys.executable, "-c", CHILD, str(root), model, str(version),
                               str(size)], env={**env, "TILECAST_BUILD_CACHE": build_cache},
                              capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the child process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", help="serve a model of this registry (default: synthetic)")
    parser.add_argument("--model", default="gemm")
    parser.add_argument("--alias", default="production")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()

    profile = hardware.profile(1)
    print(f"CPU: {profile['cpu_model']} ({hardware.isa_level(profile)}, "
          f"{native_target('g++') or '-march=native unknown'}), {profile['cores']} cores; "
          f"torch threads as the process sets them; {args.processes} fresh processes a row")
    with tempfile.TemporaryDirectory(prefix="first-call-") as scratch:
        scratch = Path(scratch)
        root = scratch / "registry"
        if args.registry:
            model = copy_without_kernels(args.registry, args.model, args.alias, root)
        else:
            model, _ = synthetic_model(root)
        done = prebuild.prebuild(root, model, 1)
        print(f"model {model}: version 1 without kernels, version {done.version} with "
              f"{done.libraries} prebuilt libraries ({done.bytes / 2**20:.2f} MiB, {done.tag})")
        no_compiler = scratch / "bin"
        no_compiler.mkdir()
        base = {**os.environ, "TILECAST_CACHE": str(scratch / "cache")}
        base.pop("TILECAST_BUILD_CACHE", None)
        run_child(root, model, 2, 8, base)   # the dispatcher's native scorer, compiled once
        rows = [("compile on first call (no prebuilt kernels)", 1, base),
                ("prebuilt library, compiler present", done.version, base),
                ("prebuilt library, no compiler on the host", done.version,
                 {**base, "PATH": str(no_compiler), "TILECAST_CXX": NOWHERE})]
        medians = {}
        for label, version, env in rows:
            runs = [run_child(root, model, version, args.size, env)
                    for _ in range(args.processes)]
            medians[label] = statistics.median(r["first_s"] for r in runs)
            each = ", ".join(f"{r['first_s'] * 1e3:.1f}" for r in runs)
            print(f"{label:45s} first call {medians[label] * 1e3:9.1f} ms (median; "
                  f"{each}), second "
                  f"{statistics.median(r['second_s'] for r in runs) * 1e3:.2f} ms, libraries "
                  f"compiled {[r['compiled'] for r in runs]}, max rel. error vs torch.matmul "
                  f"{max(r['error'] for r in runs):.1e}")
        compiled, served = medians[rows[0][0]], medians[rows[1][0]]
        print(f"ratio: compile / prebuilt first call = {compiled / served:.0f}x "
              f"({compiled:.2f} s vs {served * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
