"""Latency of Dispatcher.select on problems it has not seen, against Booster.predict alone.

    python benchmarks/dispatch_latency.py                       # a synthetic ~200-candidate model
    python benchmarks/dispatch_latency.py --registry R --model gemm [--alias production]

Without --registry it trains a model shaped like the nightly's (31 leaves, ~130 trees) on a
synthetic target over ~200 GEMM candidates and publishes it to a temporary registry. It
prints the candidate and tree counts, p50/p90 of select() on unseen random problems, p50 on
memoized ones, p50 of Booster.predict on the same feature matrices (the peer), the ratio, and
how many choices differ from the booster's own argmax (must be 0). Figures, not a test.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import lightgbm
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.registry import api as registry  # noqa: E402
from tilecast.runtime.dispatch import INVERSE_TRANSFORMS, Dispatcher  # noqa: E402
from tilecast.families import get_family  # noqa: E402

GEMM = get_family("gemm")
HARDWARE = {"threads": 8, "simd_bits": 512, "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
            "l3_bytes": 32 << 20, "clock_mhz": 3000.0,
            "flags": ["avx2", "fma", "avx512f", "avx512_bf16"]}
# 9 micro-tiles x 2 mc x 2 nc x 2 kc x 3 parallel schemes = 216 fp32 candidates
OPTIONS = {"dtype": ["fp32"], "isa": ["avx512", "avx2"], "mc": [96, 192], "nc": [512, 2048],
           "kc": [128, 384], "parallel": ["m", "n", "k"], "pack_a": [True], "prefetch": [True]}
PARAMS = {"objective": "regression", "num_leaves": 31, "learning_rate": 0.05,
          "min_data_in_leaf": 10, "feature_fraction": 0.9, "bagging_fraction": 0.9,
          "bagging_freq": 1, "verbose": -1, "num_threads": 1, "seed": 0}
METRICS = {"mean_efficiency": 0.9, "median_efficiency": 0.9, "p10_efficiency": 0.8,
           "min_efficiency": 0.5, "static_best": {"kernel": "?", "mean_efficiency": 0.7}}


def random_problems(rng, count: int, dtypes) -> list[dict]:
    """Shapes log-uniform in 1..5000, both layouts of A and B, the candidates' dtypes."""
    dims = np.exp(rng.uniform(0, np.log(5000), size=(count, 3))).astype(int) + 1
    return [{"m": int(m), "n": int(n), "k": int(k), "dtype": str(rng.choice(dtypes)),
             "layout_a": str(rng.choice(["row", "col"])),
             "layout_b": str(rng.choice(["row", "col"]))} for m, n, k in dims]


def synthetic_tflops(names, features, rng) -> np.ndarray:
    """A 'measurement' whose winner depends on the shape through many features."""
    col = {name: features[:, i] for i, name in enumerate(names)}
    size = np.clip((col["log2_flops"] - 10) / 25, 0.05, 1.0)
    isa = np.where(col["is_avx512"] > 0, 1.0, 0.55)
    cache = 1.0 / (1.0 + 0.3 * np.maximum(col["a_block_l2_ratio"] - 0.5, 0)
                   + 0.2 * np.maximum(col["b_panel_l3_ratio"] - 0.5, 0))
    traffic = 1.0 / (1.0 + 20 * col["c_traffic_ratio"] + 5 * col["a_pack_traffic_ratio"])
    tflops = (3.0 * isa * col["tile_eff"] ** 2 * col["par_balance"] * size * cache * traffic
              + 0.002 * col["mr"])
    return tflops * np.exp(rng.normal(0, 0.03, size=len(tflops)))


def synthetic_registry(root: Path, trees: int, seed: int) -> tuple[str, float]:
    """Train and publish model 'gemm' on a synthetic target; (model name, seconds)."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space(OPTIONS, HARDWARE)
    kernels = [GEMM.kernel_name(c) for c in configs]
    kernel_matrix = engine.kernel_features(configs)
    blocks = []
    for values in random_problems(rng, 250, ["fp32"]):
        problem = GEMM.problem(values)
        blocks.append(engine.combine(problem, engine.problem_features(problem), kernel_matrix,
                                     configs))
    features = np.vstack(blocks)
    target = np.log1p(synthetic_tflops(engine.feature_names(), features, rng))
    booster = lightgbm.train(PARAMS, lightgbm.Dataset(features, target,
                                                      feature_name=engine.feature_names()),
                             num_boost_round=trees)
    spec = {"family": "gemm", "feature_names": engine.feature_names(), "engine": engine.name,
            "engine_version": engine.version, "target_transform": "log1p_tflops",
            "hardware": HARDWARE}
    candidates = {"family": "gemm", "kernels": kernels, "static_best": kernels[0]}
    files = {"model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
             "candidates.json": json.dumps(candidates), "train_manifest.json": "{}"}
    registry.publish(root, "gemm", files, metrics=METRICS)
    return "gemm", time.perf_counter() - start


class BoosterReference:
    """The booster's own choice for a problem, from the registry artifacts and the numpy
    engine only (none of the dispatcher's fast-path state)."""

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher
        self.configs = [dispatcher.family.parse_name(k) for k in dispatcher.kernels]
        self.kernel_matrix = dispatcher.engine.kernel_features(self.configs)
        engine_names = dispatcher.engine.feature_names()
        self.columns = [engine_names.index(n) for n in dispatcher.feature_spec["feature_names"]]
        self.inverse = INVERSE_TRANSFORMS[dispatcher.feature_spec["target_transform"]]

    def choice(self, values) -> tuple[str, np.ndarray]:
        """The argmax of Booster.predict (ties by name) and the matrix it scored."""
        dispatcher = self.dispatcher
        problem = dispatcher.problem(values)
        rows = [i for i, cfg in enumerate(self.configs)
                if dispatcher.family.applicable(cfg, problem)]
        engine = dispatcher.engine
        features = engine.combine(problem, engine.problem_features(problem),
                                  self.kernel_matrix[rows], [self.configs[i] for i in rows])
        features = np.ascontiguousarray(features[:, self.columns])
        tflops = self.inverse(dispatcher.booster.predict(features, num_threads=1))
        names = [dispatcher.kernels[i] for i in rows]
        best = min(range(len(rows)), key=lambda j: (-tflops[j], names[j]))
        return names[best], features


def percentile_us(samples_ns, q: float) -> float:
    return float(np.percentile(samples_ns, q)) / 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", type=Path, help="a model registry (default: synthetic)")
    parser.add_argument("--model", default="gemm")
    parser.add_argument("--alias", default="production")
    parser.add_argument("--problems", type=int, default=1000)
    parser.add_argument("--trees", type=int, default=130, help="synthetic model's trees")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        root, model = args.registry, args.model
        if root is None:
            root = Path(scratch) / "registry"
            model, seconds = synthetic_registry(root, args.trees, args.seed)
            print(f"synthetic registry model trained and published in {seconds:.1f} s")
        start = time.perf_counter()
        dispatcher = Dispatcher.from_registry(root, model, args.alias)
        print(f"dispatcher built in {(time.perf_counter() - start) * 1e3:.0f} ms")

    scorer = dispatcher._scorer
    dtypes = sorted({cfg.dtype for cfg in dispatcher._configs})
    print(f"model {model!r} version {dispatcher.version}: {len(dispatcher.kernels)} candidates "
          f"({', '.join(dtypes)}), {dispatcher.booster.num_trees()} trees")
    print(f"native forest: {'yes' if scorer.forest else 'no'}; native features: "
          f"{'yes' if scorer.filler else 'no'}" + "".join(f"\n  {n}" for n in scorer.notes))

    rng = np.random.default_rng(args.seed + 1)
    unique = {json.dumps(p, sort_keys=True): p
              for p in random_problems(rng, 2 * args.problems, dtypes)}
    problems = list(unique.values())[:args.problems]
    others = list(unique.values())[args.problems:]

    # back to back, as a dispatcher sees a stream of new shapes
    fresh_ns = []
    for values in problems:
        start = time.perf_counter_ns()
        dispatcher.select(values)
        fresh_ns.append(time.perf_counter_ns() - start)

    # other new shapes, each right after numpy and Booster.predict ran (colder caches)
    reference = BoosterReference(dispatcher)
    cold_ns, expected = [], []
    for values in others:
        expected.append(reference.choice(values)[0])
        start = time.perf_counter_ns()
        dispatcher.select(values)
        cold_ns.append(time.perf_counter_ns() - start)

    # every choice (memoized by now) against the booster's own argmax
    mismatches = sum(dispatcher.select(v) != choice for v, choice in zip(others, expected))
    matrices = []
    for values in problems:
        choice, features = reference.choice(values)
        mismatches += dispatcher.select(values) != choice
        matrices.append(features)

    memo_ns = []
    for values in problems[:200]:
        for _ in range(5):
            start = time.perf_counter_ns()
            dispatcher.select(values)
            memo_ns.append(time.perf_counter_ns() - start)

    peer_ns = []
    for features in matrices:
        start = time.perf_counter_ns()
        dispatcher.booster.predict(features, num_threads=1)
        peer_ns.append(time.perf_counter_ns() - start)

    rows = np.median([len(f) for f in matrices])
    select_p50, peer_p50 = percentile_us(fresh_ns, 50), percentile_us(peer_ns, 50)
    print(f"unseen problems: {len(problems)} (median {rows:.0f} applicable candidates each)")
    print(f"select() unseen      p50 {select_p50:8.1f} us   p90 "
          f"{percentile_us(fresh_ns, 90):8.1f} us")
    print(f"select() unseen, right after Booster.predict (colder caches) p50 "
          f"{percentile_us(cold_ns, 50):.1f} us")
    print(f"select() memoized    p50 {percentile_us(memo_ns, 50):8.2f} us")
    print(f"Booster.predict      p50 {peer_p50:8.1f} us   (same matrices, num_threads=1)")
    print(f"speed-up vs Booster.predict alone: {peer_p50 / select_p50:.1f}x")
    print(f"choices != booster argmax: {mismatches} of {len(problems) + len(others)}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
