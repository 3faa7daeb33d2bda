"""`tilecast evaluate`: a published model on a user's own problem set, against a measured oracle.

The candidates are the ones the model version was published with (its candidates.json); they
are built (content-hash cache in the workdir, or $TILECAST_BUILD_CACHE), every one is
measured on every problem of the file with the run protocol of a config (the quick config by
default; finalists confirmed, resumable like a run), and the version's choices (its
Dispatcher, exactly what a kernel library gets at run time) are scored with the definitions
of DESIGN.md. The workdir is laid out like a run's (tilecast.stages.layout), with the
model's name in place of the family's:

    W/bench/<model>.jsonl, W/data/<model>.parquet       the measurements
    W/eval/<model>/metrics.json, per_problem.parquet     the published model on these problems

The problems file is YAML (or JSON): `problems:` followed by the entries of a config's problem
set (list / grid / random; see tilecast.config.expand_problems).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pandas as pd

from tilecast.core import dataset, hardware, stats
from tilecast.core.atomic import atomic_write_json
from tilecast.config import load_config, read_problem_file
from tilecast.core.device import default_device, exclusive
from tilecast.registry import api as registry
from tilecast.runtime.dispatch import Dispatcher
from tilecast.core import build
from tilecast.stages import layout
from tilecast.stages.bench import BenchSettings, benchmark, in_process_libraries
from tilecast.stages.convert import convert_raw

log = logging.getLogger("tilecast.workflows.user_eval")

PROBLEM_SET = "holdout"  # every problem of the file is unseen by the model's training


class EvaluationError(ValueError):
    """A user's problems left nothing to score: none of them has a valid measurement."""


def read_problems(path: str | Path, family) -> list:
    """The family's problems listed in a problems file, each once (in file order); checked as
    a config's problem sets are (`config.read_problem_file`): ConfigError names the file, the
    key path, the bad value and what is allowed."""
    found, seen = [], set()
    for problem in read_problem_file(path, family):
        key = family.dims_key(problem)
        if key not in seen:
            seen.add(key)
            found.append(problem)
    return found


def evaluate_published(registry_root, model: str, problems_file, workdir, *,
                       alias: str = registry.PRODUCTION, config: str = "quick") -> dict:
    """Measure the oracle on the problems file and score the published version's choices;
    returns (and writes) the metrics. See the module docstring."""
    work = layout.Workdir(Path(workdir).resolve())
    dispatcher = Dispatcher.from_registry(registry_root, model, alias)
    family = dispatcher.family
    problems = read_problems(problems_file, family)
    cfg = load_config(config)
    profile = hardware.profile(cfg.protocol.threads)

    configs = [family.parse_name(name) for name in dispatcher.kernels]
    log.info("evaluate %s version %d: %d candidates x %d problems", model, dispatcher.version,
             len(configs), len(problems))
    builts = build.build_candidates(family, configs, work.build_cache,
                                    jobs=cfg.build_jobs, progress=build.log_progress)
    libraries = (in_process_libraries(family, builts, work.build_cache, cfg.build_jobs)
                 if cfg.interleave else {})
    settings = BenchSettings.from_config(cfg, libraries=libraries)
    raw = work.raw_log(model)
    run_info = {"run_id": f"evaluate-{model}-v{dispatcher.version}", "git_sha": "",
                "hardware": profile["fingerprint"]}
    # the device a run's benchmark stage holds: never time kernels beside a nightly
    with exclusive(default_device()):
        benchmark(family, builts, [(PROBLEM_SET, p) for p in problems], raw, work.scratch(),
                  run_info, settings)
    data = work.dataset(model)
    convert_raw([raw], data)
    final = dataset.final_table(dataset.load(data))
    final = final[final["dims_key"].isin({family.dims_key(p) for p in problems})]

    per_problem = _score(dispatcher, family, final, cfg.tie_threshold_pct)
    if per_problem.empty:
        raise EvaluationError(f"no problem of {problems_file} has a valid measurement: "
                              f"nothing to score (see the statuses in {raw})")
    metrics = _metrics(per_problem, dispatcher, model)
    out = work.eval_dir(model)
    out.mkdir(parents=True, exist_ok=True)
    per_problem.to_parquet(out / layout.PER_PROBLEM_FILE, index=False)
    atomic_write_json(out / layout.METRICS_FILE, metrics)
    return metrics


def _score(dispatcher, family, final: pd.DataFrame, tie_threshold_pct: float) -> pd.DataFrame:
    rows = []
    for dims_key, problem, winner, tflops_of in dataset.measured_problems(family, final,
                                                                           tie_threshold_pct):
        ranking = dispatcher.ranking(problem)
        order = list(ranking.kernels)
        rows.append({"dims_key": dims_key, "chosen_kernel": ranking.best,
                     "chosen_tflops": tflops_of(ranking.best), "best_kernel": winner.kernel,
                     "best_tflops": winner.best_tflops,
                     "efficiency": tflops_of(ranking.best) / winner.best_tflops,
                     "static_best_efficiency": tflops_of(dispatcher.static_best) / winner.best_tflops,
                     "winner_rank": order.index(winner.kernel) + 1 if winner.kernel in order else None,
                     "top1_tie": ranking.best in winner.tie_set,
                     "fallback": ranking.fallback_reason})
    return pd.DataFrame(rows)


def _metrics(table: pd.DataFrame, dispatcher, model: str) -> dict:
    eff = table["efficiency"].to_numpy(dtype=np.float64)
    ranks = pd.to_numeric(table["winner_rank"], errors="coerce")
    static = float(table["static_best_efficiency"].mean())
    return {"model": model, "version": dispatcher.version, "n_problems": int(len(table)),
            "mean_efficiency": float(eff.mean()), "median_efficiency": float(stats.median(eff)),
            "p10_efficiency": float(np.percentile(eff, 10)), "min_efficiency": float(eff.min()),
            "top1": float((ranks <= 1).mean()), "top5": float((ranks <= 5).mean()),
            "top1_tie": float(table["top1_tie"].mean()),
            "static_best": {"kernel": dispatcher.static_best, "mean_efficiency": static},
            "margin_over_static_best": float(eff.mean()) - static,
            "fallbacks": int(table["fallback"].notna().sum())}


def summary_line(metrics: dict) -> str:
    """One line for the console."""
    return (f"{metrics['model']} v{metrics['version']} on {metrics['n_problems']} problems: "
            f"mean efficiency {metrics['mean_efficiency']:.3f}, median "
            f"{metrics['median_efficiency']:.3f}, P10 {metrics['p10_efficiency']:.3f}, min "
            f"{metrics['min_efficiency']:.3f}, top-1 {metrics['top1']:.2f}, top-5 "
            f"{metrics['top5']:.2f}; static best {metrics['static_best']['kernel']} "
            f"{metrics['static_best']['mean_efficiency']:.3f}")


def dump(metrics: dict) -> str:
    return json.dumps(metrics, indent=2)
