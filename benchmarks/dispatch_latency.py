"""Latency of one kernel choice, per path, for 16 and 200 candidates: the exported C selector
(`tilecast export`, timed in C++) scoring every candidate and through the model's shortlist
(`--shortlist K`), Dispatcher.select (both ways), Booster.predict on the candidates' feature
rows, and the compiled-forest libraries lleaves and treelite + tl2cgen when importable
(installed for this benchmark only, e.g. `pip install --target DIR lleaves treelite tl2cgen`
and PYTHONPATH=DIR).

    python benchmarks/dispatch_latency.py                       # a synthetic nightly-shaped model
    python benchmarks/dispatch_latency.py --registry R --model gemm [--alias production]

Without --registry it trains a model shaped like the nightly's (31 leaves, ~130 trees) on a
synthetic target over 216 GEMM candidates, learns its shortlist (tilecast.runtime.shortlist)
and publishes the same forest twice to a temporary registry, with 200 and with 16 of the
candidates. Every path scores the same unseen random problems, each problem once
(Dispatcher.select memoizes a shape: each is new to it); the C selector's per-problem time
is the mean of --repeat calls (it memoizes nothing). It prints p50 / p90 per path in
microseconds (and of Dispatcher.select asked each problem again, when it answers from its
memo), and how many exported choices differ from the dispatcher's (must be 0). Needs g++.
Figures, not a test.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightgbm
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.families import get_family  # noqa: E402
from tilecast.registry import api as registry  # noqa: E402
from tilecast.runtime import export  # noqa: E402
from tilecast.runtime.dispatch import Dispatcher  # noqa: E402
from tilecast.runtime.export import c_source  # noqa: E402
from tilecast.runtime import shortlist as shortlists  # noqa: E402
from tilecast.runtime.export.gemm import DTYPE_CODES, LAYOUT_CODES  # noqa: E402

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
CANDIDATE_COUNTS = (16, 200)
SHORTLISTS = (1, 4, 8)   # shortlist sizes timed (the synthetic models' shortlists keep 8)
C_FLAGS = ("-O3", "-march=native")

TIMER = r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "HEADER"

// problems "m n k dtype layout_a layout_b" on stdin; per problem: "choice ns-per-call"
int main(int argc, char** argv) {
  const int repeat = argc > 1 ? std::atoi(argv[1]) : 10;
  std::vector<long long> p;
  long long value;
  while (std::scanf("%lld", &value) == 1) p.push_back(value);
  volatile int sink = 0;
  for (size_t i = 0; i + 6 <= p.size(); i += 6)  // warm-up pass
    sink = sink + SELECT(p[i], p[i + 1], p[i + 2], (int)p[i + 3], (int)p[i + 4], (int)p[i + 5]);
  for (size_t i = 0; i + 6 <= p.size(); i += 6) {
    int choice = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < repeat; ++r) {
      choice = SELECT(p[i], p[i + 1], p[i + 2], (int)p[i + 3], (int)p[i + 4], (int)p[i + 5]);
      sink = sink + choice;
    }
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    std::printf("%d %.1f\n", choice, took.count() / repeat);
  }
  return 0;
}
"""


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


def synthetic_registry(root: Path, trees: int, seed: int) -> list[str]:
    """Train one model on a synthetic target over 216 candidates; publish it once per
    CANDIDATE_COUNTS (the same forest, that many of the candidates). Returns the models."""
    rng = np.random.default_rng(seed)
    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space(OPTIONS, HARDWARE)
    kernels = [GEMM.kernel_name(c) for c in configs]
    kernel_matrix = engine.kernel_features(configs)
    blocks, problems = [], []
    for values in random_problems(rng, 250, ["fp32"]):
        problem = GEMM.problem(values)
        problems.append(problem)
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
    models = []
    for count in CANDIDATE_COUNTS:
        chosen = [kernels[i] for i in np.linspace(0, len(kernels) - 1, count).astype(int)]
        candidates = {"family": "gemm", "kernels": chosen, "static_best": chosen[0]}
        files = {"model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
                 "candidates.json": json.dumps(candidates), "train_manifest.json": "{}"}
        dispatcher = Dispatcher(booster, spec, candidates)
        shortlist = shortlists.learn(dispatcher, problems, max(SHORTLISTS), seed=seed)
        files[shortlists.FILE] = json.dumps(shortlist.to_json())
        models.append(f"gemm-{count}")
        registry.publish(root, models[-1], files, metrics=METRICS)
    return models


def percentiles(samples_ns) -> str:
    p50, p90 = (float(np.percentile(samples_ns, q)) / 1e3 for q in (50, 90))
    return f"p50 {p50:9.2f} us   p90 {p90:9.2f} us"


def feature_rows(dispatcher: Dispatcher, values) -> np.ndarray:
    """The model's feature rows of the problem's applicable candidates (numpy engine)."""
    problem = dispatcher.problem(values)
    configs = [c for c in (dispatcher.family.parse_name(k) for k in dispatcher.kernels)
               if dispatcher.family.applicable(c, problem)]
    engine = dispatcher.engine
    features = engine.matrix(problem, configs)
    columns = [engine.feature_names().index(n) for n in dispatcher.feature_spec["feature_names"]]
    return np.ascontiguousarray(features[:, columns])


def time_exported(selector, problems, scratch: Path, repeat: int) -> tuple[list, list, float]:
    """(choices, ns per call, compile seconds) of the exported C selector."""
    directory = scratch / c_source.file_stem(selector)
    export.write(selector, directory, "c")
    stem = c_source.file_stem(selector)
    (directory / "timer.cpp").write_text(TIMER.replace("HEADER", f"{stem}.h").replace(
        "SELECT", f"tilecast_{c_source.identifier(selector.model)}_select"))
    start = time.perf_counter()
    subprocess.run(["g++", *C_FLAGS, "-I", str(directory), str(directory / "timer.cpp"),
                    str(directory / f"{stem}.c"), "-o", str(directory / "timer")],
                   check=True, capture_output=True, text=True)
    compile_s = time.perf_counter() - start
    rows = "".join(f"{p['m']} {p['n']} {p['k']} {DTYPE_CODES[p['dtype']]} "
                   f"{LAYOUT_CODES[p['layout_a']]} {LAYOUT_CODES[p['layout_b']]}\n"
                   for p in problems)
    out = subprocess.run([str(directory / "timer"), str(repeat)], input=rows, check=True,
                         capture_output=True, text=True).stdout.split()
    return [int(v) for v in out[::2]], [float(v) for v in out[1::2]], compile_s


def compiled_forests(booster_file: Path, scratch: Path) -> list:
    """(library name, predict(rows)) of each importable compiled-forest library."""
    found = []
    if importlib.util.find_spec("lleaves") is not None:
        try:
            import lleaves

            compiled = lleaves.Model(model_file=str(booster_file))
            compiled.compile(cache=str(scratch / f"{booster_file.stem}.lleaves.o"))
            found.append(("lleaves", lambda rows: compiled.predict(rows, n_jobs=1)))
        except Exception as err:  # noqa: BLE001 - a peer that fails is reported, not fatal
            print(f"  lleaves failed: {type(err).__name__}: {err}")
    if importlib.util.find_spec("treelite") is not None and \
            importlib.util.find_spec("tl2cgen") is not None:
        try:
            import tl2cgen
            import treelite

            model = treelite.frontend.load_lightgbm_model(str(booster_file))
            library = scratch / f"{booster_file.stem}.so"
            tl2cgen.export_lib(model, toolchain="gcc", libpath=str(library),
                               params={"parallel_comp": 8}, nthread=1)
            predictor = tl2cgen.Predictor(str(library), nthread=1)
            found.append(("treelite/tl2cgen", lambda rows: predictor.predict(
                tl2cgen.DMatrix(rows, dtype="float64"))))
        except Exception as err:  # noqa: BLE001
            print(f"  treelite/tl2cgen failed: {type(err).__name__}: {err}")
    return found


def timed(call, items) -> list[int]:
    """ns per call(item), one call each."""
    took = []
    for item in items:
        begin = time.perf_counter_ns()
        call(item)
        took.append(time.perf_counter_ns() - begin)
    return took


def exported_choices(selector, problems, scratch: Path, repeat: int, label: str,
                     dispatcher) -> tuple[list, int]:
    """(ns per call, choices differing from `dispatcher`'s) of one exported selector."""
    choices, c_ns, _ = time_exported(selector, problems, scratch / label, repeat)
    expected = [selector.kernels.index(dispatcher.select(values)) for values in problems]
    return c_ns, sum(c != e for c, e in zip(choices, expected))


def measure(root, model: str, alias, problems_count: int, repeat: int, seed: int,
            scratch: Path) -> int:
    """Print one model's figures; returns how many exported choices differ."""
    dispatcher = Dispatcher.from_registry(root, model, alias)
    start = time.perf_counter()
    selector = export.load(root, model, alias)
    export_s = time.perf_counter() - start
    dtypes = sorted({GEMM.parse_name(k).dtype for k in dispatcher.kernels})
    rng = np.random.default_rng(seed)
    unique = {json.dumps(p, sort_keys=True): p
              for p in random_problems(rng, 2 * problems_count, dtypes)}
    problems = list(unique.values())[:problems_count]
    print(f"\nmodel {model!r} version {dispatcher.version}: {len(dispatcher.kernels)} candidates, "
          f"{dispatcher.booster.num_trees()} trees; exported in {export_s:.1f} s "
          f"({len(selector.forest.slot)} splits, {len(selector.slots)} slots)")
    print(f"  (C built with g++ {' '.join(C_FLAGS)}; mean of {repeat} calls per problem)")
    rows_out, mismatches = [], 0

    unseen = timed(dispatcher.select, problems)     # first: each problem is new to it
    memoized = timed(dispatcher.select, problems)
    c_ns, differ = exported_choices(selector, problems, scratch, repeat, f"{model}-all",
                                    dispatcher)
    mismatches += differ
    rows_out += [("exported C selector, every candidate", c_ns),
                 ("Dispatcher.select, unseen problems", unseen),
                 ("Dispatcher.select, the same again (memoized)", memoized)]
    for size in SHORTLISTS:
        try:
            listed = Dispatcher.from_registry(root, model, alias, shortlist=size)
        except registry.RegistryError as err:
            print(f"  shortlist {size}: {err}")
            break
        listed_ns = timed(listed.select, problems)
        short = export.load(root, model, alias, shortlist=size)
        c_ns, differ = exported_choices(short, problems, scratch, repeat,
                                        f"{model}-short{size}", listed)
        mismatches += differ
        same = sum(listed.select(p) == dispatcher.select(p) for p in problems)
        # the forest's predicted TFLOP/s of the shortlisted pick over that of its own pick
        kept = [dispatcher.predict(p)[listed.select(p)] / dispatcher.predict(p)[
            dispatcher.select(p)] for p in problems]
        rows_out += [(f"exported C selector, shortlist {size}", c_ns),
                     (f"Dispatcher.select, shortlist {size}", listed_ns)]
        print(f"  shortlist {size}: the forest's own choice on {same} of {len(problems)} "
              f"problems; predicted efficiency kept: mean {np.mean(kept):.3f}, "
              f"P10 {np.percentile(kept, 10):.3f}")

    features = [feature_rows(dispatcher, values) for values in problems]
    rows_out.append(("Booster.predict on the feature rows",
                     timed(lambda rows: dispatcher.booster.predict(rows, num_threads=1),
                           features)))
    booster_file = scratch / f"{model}.txt"
    dispatcher.booster.save_model(str(booster_file))
    libraries = compiled_forests(booster_file, scratch)
    if not libraries:
        print("  compiled forests (lleaves, treelite/tl2cgen) not installed")
    for name, predict in libraries:
        rows_out.append((f"{name} on the feature rows", timed(predict, features)))
    for label, samples in rows_out:
        print(f"  {label:<50}{percentiles(samples)}")
    print(f"  exported choices != Dispatcher.select: {mismatches}")
    return mismatches


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", type=Path, help="a model registry (default: synthetic)")
    parser.add_argument("--model", default="gemm")
    parser.add_argument("--alias", default="production")
    parser.add_argument("--problems", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=10, help="C calls per problem timed")
    parser.add_argument("--trees", type=int, default=130, help="synthetic model's trees")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    print(f"{cpu_name()}, python {platform.python_version()}, lightgbm {lightgbm.__version__}")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        root, models = args.registry, [args.model]
        if root is None:
            root = scratch / "registry"
            start = time.perf_counter()
            models = synthetic_registry(root, args.trees, args.seed)
            print(f"synthetic model trained and published in {time.perf_counter() - start:.1f} s")
        mismatches = sum(measure(root, model, args.alias, args.problems, args.repeat,
                                 args.seed + 1, scratch) for model in models)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
