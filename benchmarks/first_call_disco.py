"""First-call latency of a served DISCO contraction in a fresh process: DISCO's kernel libraries
compiled on first use (a version without prebuilt libraries, an empty cache: what every
serving process of a new host paid before) against the version's prebuilt ones
(tilecast.registry.prebuilt's process libraries), with and without a compiler on the host.

    python benchmarks/first_call_disco.py [--processes 3]

It publishes a small synthetic disco_forward model (a forest on the family's features over
two csr and two kpacked kernels of this CPU) as version 1 and runs `tilecast prebuild` on it
(version 2: the same model with this host's libraries, from their caches where they are
built). Each row is the median over --processes fresh Python processes, each with an empty
$TILECAST_CACHE: `load` is the selector's first answer (the Dispatcher loaded, its native
forest compiled or prebuilt), `csr` the first `native.contraction` with the chosen tile
(B=2, C=8 on a 64x128 -> 32x64 grid; it loads disco_csr), `kpacked` the first
`native.kpacked_contraction` (it loads disco_kpacked), `second` the csr call again. The
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
from tilecast.families import get_family  # noqa: E402
from tilecast.registry import api as registry  # noqa: E402
from tilecast.runtime import prebuild  # noqa: E402

DISCO = get_family("disco_forward")
METRICS = {"mean_efficiency": 0.9, "median_efficiency": 0.9, "p10_efficiency": 0.8,
           "min_efficiency": 0.5, "static_best": {"kernel": "?", "mean_efficiency": 0.7}}
GRID = {"nlat_in": 64, "nlon_in": 128, "nlat_out": 32, "nlon_out": 64,
        "grid_out": "legendre-gauss"}
NOWHERE = "/nonexistent/first-call/g++"

CHILD = """
import json, os, sys, time
start = time.perf_counter()
import torch
from tilecast.disco import compute_psi, csr_from_psi, native
from tilecast.disco.kpacked import kpack_psi
from tilecast.runtime.disco import selector

root, version, grid = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
x = torch.randn(2, 8, grid["nlat_in"], grid["nlon_in"], generator=torch.Generator().manual_seed(0))
out = (grid["nlat_out"], grid["nlon_out"])
fields = selector.problem_fields(x.shape, (grid["nlat_in"], grid["nlon_in"]), out,
                                 grid_out=grid["grid_out"], dtype=x.dtype)
psi = compute_psi((grid["nlat_in"], grid["nlon_in"]), out, (3, 3), basis_type="harmonic",
                  grid_out=grid["grid_out"])
csr, packed = csr_from_psi(psi), kpack_psi(psi)
times = {"imports_and_psi": time.perf_counter() - start}
start = time.perf_counter()
chosen = selector.choose_variant(root, fields, alias=version)
times["load"] = time.perf_counter() - start
tile = chosen["tile"] if chosen["entry"] == "contraction" else None
for label in ("csr", "second"):
    start = time.perf_counter()
    native.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, *out, tile=tile)
    times[label] = time.perf_counter() - start
start = time.perf_counter()
native.kpacked_contraction(x, *packed.tensors(), psi.kernel_size, *out)
times["kpacked"] = time.perf_counter() - start
cache = os.environ["TILECAST_CACHE"]
times["compiled"] = sorted(name for folder in ("disco", "native")
                           if os.path.isdir(os.path.join(cache, folder))
                           for name in os.listdir(os.path.join(cache, folder))
                           if name.endswith(".so"))
print(json.dumps(times))
"""


def synthetic_model(root: Path) -> None:
    """A small disco_forward model on a synthetic target, published to `root` as version 1."""
    profile = hardware.profile(1)
    configs = DISCO.candidate_space({"variant": ["csr", "kpacked"], "lat_block": [4]}, profile)
    configs = [c for variant in ("csr", "kpacked")
               for c in [c for c in configs if c.variant == variant][:2]]
    names = [DISCO.kernel_name(c) for c in configs]
    engine = DISCO.feature_engine(profile)
    problems = [DISCO.problem({**GRID, "batch": batch, "channels": channels})
                for batch in (1, 2, 4) for channels in (1, 8, 32)]
    features = np.vstack([engine.matrix(p, configs) for p in problems])
    target = np.log1p(np.random.default_rng(0).uniform(0.1, 2.0, len(features)))
    booster = lightgbm.train({"objective": "regression", "min_data_in_leaf": 2, "verbose": -1,
                              "num_threads": 1, "seed": 0},
                             lightgbm.Dataset(features, target), num_boost_round=10)
    spec = {"family": "disco_forward", "feature_names": list(engine.feature_names()),
            "engine": engine.name, "engine_version": engine.version,
            "target_transform": "log1p_tflops", "hardware": profile}
    registry.publish(root, "disco_forward", {
        "model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
        "candidates.json": json.dumps({"family": "disco_forward", "kernels": names,
                                       "static_best": names[0]}),
        "train_manifest.json": "{}"}, metrics=METRICS)


def run_child(root: Path, version: int, env: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="first-call-disco-cache-") as cache:
        done = subprocess.run([sys.executable, "-c", CHILD, str(root), str(version),
                               json.dumps(GRID)], env={**env, "TILECAST_CACHE": cache},
                              capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the child process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3)
    args = parser.parse_args()
    profile = hardware.profile(1)
    print(f"CPU: {profile['cpu_model']} ({hardware.isa_level(profile)}), {profile['cores']} "
          f"cores, load average {os.getloadavg()[0]:.2f}; {args.processes} fresh processes a row")
    with tempfile.TemporaryDirectory(prefix="first-call-disco-") as scratch:
        scratch = Path(scratch)
        root = scratch / "registry"
        synthetic_model(root)
        done = prebuild.prebuild(root, "disco_forward", 1)
        print(f"disco_forward: version 1 without libraries, version {done.version} with "
              f"{done.libraries} prebuilt libraries ({done.bytes / 2**20:.2f} MiB, {done.tag})")
        no_compiler = scratch / "bin"
        no_compiler.mkdir()
        base = {key: value for key, value in os.environ.items()
                if key not in ("TILECAST_CACHE", "TILECAST_BUILD_CACHE")}
        rows = [("compiled on first use (no prebuilt libraries)", 1, base),
                ("prebuilt libraries, compiler present", done.version, base),
                ("prebuilt libraries, no compiler on the host", done.version,
                 {**base, "PATH": str(no_compiler), "TILECAST_CXX": NOWHERE})]
        for label, version, env in rows:
            runs = [run_child(root, version, env) for _ in range(args.processes)]
            median = {key: statistics.median(r[key] for r in runs)
                      for key in ("load", "csr", "kpacked", "second")}
            each = ", ".join(f"{r['csr'] * 1e3:.1f}" for r in runs)
            print(f"{label:48s} load {median['load'] * 1e3:8.1f} ms, first csr call "
                  f"{median['csr'] * 1e3:8.1f} ms ({each}), first kpacked call "
                  f"{median['kpacked'] * 1e3:8.1f} ms, second csr call "
                  f"{median['second'] * 1e3:.2f} ms; compiled {runs[0]['compiled']}")


if __name__ == "__main__":
    main()
