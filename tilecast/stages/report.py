"""The run report: `report/evaluation.json` (DESIGN.md's contract), `report/report.md`, one
efficiency plot per model and, where given, one roofline plot per model (tilecast.stages.roofline),
every file written atomically."""
from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from tilecast.core.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from tilecast.stages import layout, roofline
from tilecast.stages.evaluate import Evaluation

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
METRIC_ROWS = ("n_problems", "mean_efficiency", "median_efficiency", "p10_efficiency",
               "min_efficiency", "top1", "top5", "top1_tie", "margin_over_static_best")
WORST_COLUMNS = ("dims_key", "chosen_kernel", "best_kernel", "efficiency",
                 "static_best_efficiency", "winner_rank")
WORST_COUNT = 10


def write_report(workdir: str | Path, results: Mapping[str, tuple[Evaluation, dict]],
                 peer: Mapping,
                 rooflines: Mapping[str, tuple[pd.DataFrame, Mapping]] | None = None) -> Path:
    """Write the report files under `<workdir>/report/`; returns that directory.

    `results` maps model name -> (Evaluation, extra); extra's JSON-able entries (e.g. "cv")
    are added to the model's evaluation.json entry. `peer` is evaluate.peer_ratios()'s result
    ({} when there were no peer rows); its summary is attached to every model entry unless
    the model's extra carries its own "peer". `rooflines` maps a model name -> (roofline.table(),
    the ceilings it was computed with): such a model gets a roofline section, plot and
    "roofline" entry.
    """
    if not results:
        raise ValueError("write_report: no model results to report")
    rooflines = dict(rooflines or {})
    unknown = sorted(set(rooflines) - set(results))
    if unknown:
        raise ValueError(f"write_report: rooflines for {unknown}, which have no results; "
                         f"models: {sorted(results)}")
    for name in results:
        if not MODEL_NAME_RE.match(str(name)):
            raise ValueError(f"model name {name!r} cannot be used in a file name; use letters, "
                             "digits, '_', '.' and '-'")
    work = layout.Workdir(workdir)
    directory = work.report_dir
    directory.mkdir(parents=True, exist_ok=True)
    models, sections = {}, ["# tilecast evaluation report", ""]
    for name, (evaluation, extra) in results.items():
        extra = dict(extra or {})
        model_peer = extra.pop("peer", peer)
        models[name] = {**evaluation.metrics, **extra,
                        "peer": dict((model_peer or {}).get("problem_sets", {}))}
        sections += _model_section(name, evaluation, extra, model_peer or {})
        atomic_write_bytes(work.plot(name), _plot(name, evaluation))
        if name in rooflines:
            frame, ceilings = rooflines[name]
            models[name]["roofline"] = roofline.summary(frame, ceilings)
            sections += _roofline_section(name, models[name]["roofline"])
            atomic_write_bytes(work.roofline_plot(name), roofline.plot(name, frame, ceilings))
    atomic_write_json(directory / layout.EVALUATION_FILE, {"models": models})
    atomic_write_text(directory / layout.REPORT_FILE, "\n".join(sections) + "\n")
    return directory


def _format(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        return f"{value:.4f}"
    if value is None or value is pd.NA:
        return "-"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_format(v) for v in row) + " |" for row in rows]
    return lines + [""]


def _model_section(name: str, evaluation: Evaluation, extra: dict, peer: Mapping) -> list[str]:
    metrics = evaluation.metrics
    static = metrics["static_best"]
    lines = [f"## Model `{name}`", "", "### Holdout metrics", ""]
    lines += _table(["metric", "value"], [[key, metrics[key]] for key in METRIC_ROWS
                                         if key in metrics])
    lines += ["### Model vs static best", ""]
    lines += _table(["choice", "mean efficiency"],
                    [[f"model `{name}`", metrics["mean_efficiency"]],
                     [f"static best `{static['kernel']}`", static["mean_efficiency"]],
                     ["margin (model - static)", metrics["margin_over_static_best"]]])
    cv = extra.get("cv")
    if cv:
        lines += ["### Cross-validation (GroupKFold on dims_key)", ""]
        lines += _table(["folds", "mean rmse (target space)", "mean efficiency"],
                        [[len(cv["folds"]) if "folds" in cv else None, cv.get("mean_rmse"),
                          cv.get("mean_efficiency")]])
    noise = extra.get("noise")
    if noise:
        lines += ["### Measurement noise of this run", "",
                  "How far this run's labels can be trusted: the spread of the best kernel's "
                  "round medians (stretches of cycles, or processes), the problems whose winner "
                  "has practical ties, the samples the guards kept apart. `tilecast "
                  "repeatability` with a second run gives the ceiling any model is judged under.",
                  ""]
        lines += _table(["figure", "value"], [
            ["problems", noise.get("n_problems")],
            ["round spread of the best kernel, median (max/min)", noise.get("round_spread_median")],
            ["round spread of the best kernel, P90", noise.get("round_spread_p90")],
            ["share of problems with practical ties", noise.get("tie_share")],
            ["share of samples kept apart", noise.get("samples_kept_apart_share")],
            ["protocol (share of records)", ", ".join(f"{k} {v:.2f}" for k, v in
                                                      (noise.get("timing") or {}).items()) or None]])
    pooled = metrics.get("pooled_labels")
    if pooled:
        lines += ["### Labels pooled over nights", "",
                  f"Trained and scored on the labels of store `{pooled['store']}` for hardware "
                  f"class `{pooled['hardware_class']}`, pooled over the nights that measured each "
                  "problem (tilecast.store.labels); spread is max - min of a kernel's "
                  "night-adjusted time over its nights, relative.", ""]
        lines += _table(["problems", "pairs", "median nights", "median spread", "P90 spread"],
                        [[ps, v["pairs"], v["median_nights"], v["median_spread"], v["p90_spread"]]
                         for ps, v in pooled.items() if isinstance(v, dict)])
    if pooled:
        moved = metrics.get("change_points") or []
        lines += ["### Change points", "",
                  "Kernels whose last nights all moved the same way against their rivals "
                  "(median over problems, the night's level taken out; tilecast.store.drift): "
                  "a rebuilt binary, a compiler or a machine change.", ""]
        lines += (_table(["kernel", "since night", "shift (time)", "z", "problems"],
                         [[c["kernel"], c["night"], f"{c['shift']:+.1%}", c["z"], c["problems"]]
                          for c in moved]) if moved else ["None.", ""])
    lines += _night_section(metrics)
    slices = metrics.get("slices")
    if slices:
        lines += ["### Per-slice results (held-out problems)", ""]
        lines += _table(["slice", "problems", "mean efficiency", "P10", "top-1",
                         "static best mean"],
                        [[key, v["n_problems"], v["mean_efficiency"], v["p10_efficiency"],
                          v["top1"], v["static_best_mean_efficiency"]]
                         for key, v in slices.items()])
    worst = evaluation.per_problem.sort_values(["efficiency", "dims_key"]).head(WORST_COUNT)
    lines += [f"### Worst {WORST_COUNT} problems", ""]
    lines += _table(list(WORST_COLUMNS), worst[list(WORST_COLUMNS)].values.tolist())
    lines += ["### Best candidate vs peer library", ""]
    sets = peer.get("problem_sets", {})
    if sets:
        lines += _table(["problem set", "problems", "geomean best/peer", "min", "max"],
                        [[key, s["n_problems"], s["geomean_ratio"], s["min_ratio"], s["max_ratio"]]
                         for key, s in sets.items()])
    else:
        lines += ["No peer measurements.", ""]
    return lines


def _night_section(metrics: Mapping) -> list[str]:
    """A budgeted night's plan, and the model's held-out figures night by night."""
    lines = []
    plan = metrics.get("night_plan")
    if plan:
        counts, considered = plan["counts"], plan.get("considered", {})
        lines += ["### Tonight's plan", "",
                  f"A night of {plan['budget_s'] / 60:g} minutes, policy {plan['policy']} "
                  "(tilecast.store.plan): labels to settle first, then drift sentinels, then new "
                  "shapes where the model's members disagree most. Estimated "
                  f"{plan['seconds'] / 60:.1f} min (calibration x{plan['calibration']:.2f}), "
                  f"measured {plan['measured_s'] / 60:.1f} min.", ""]
        lines += _table(["why", "problems", "could have"],
                        [[why, n, considered.get(why)] for why, n in counts.items()])
        lines += [f"- {note}" for note in plan.get("notes", [])] + ([""] if plan.get("notes") else [])
    fleet = metrics.get("fleet")
    if fleet:
        shards = fleet["shards"]
        lines += ["### The fleet tonight", "",
                  f"{len(shards)} shard(s) on the work pool of class "
                  f"{metrics.get('pooled_labels', {}).get('hardware_class')} "
                  "(tilecast.workflows.fleet).", ""]
        lines += _table(["shard", "state", "host", "records", "attempts", "problems"],
                        [[s["shard"], s["state"], s.get("host") or "-", s.get("records", 0),
                          s.get("attempt", 0), len(s.get("problems", []))] for s in shards])
        missing = fleet.get("missing", [])
        if missing:
            lines += ["Unmeasured tonight:", ""] + [f"- {line}" for line in missing] + [""]
    history = metrics.get("nights")
    if history is not None:
        now = {"version": "tonight", **{k: metrics.get(k) for k in
                                         ("run_id", "train_problems", "n_problems",
                                          "mean_efficiency", "p10_efficiency", "top1", "top5")},
               "static_best": metrics["static_best"]["mean_efficiency"]}
        lines += ["### The model night by night", "",
                  "Held-out figures of this class's model as each night published it (the "
                  "registry's versions), each scored on the labels pooled by its night.", ""]
        lines += _table(["version", "night", "training shapes", "held-out", "mean", "P10",
                         "top-1", "top-5", "static best"],
                        [[r["version"], r.get("run_id"), r.get("train_problems"),
                          r.get("n_problems"), r.get("mean_efficiency"), r.get("p10_efficiency"),
                          r.get("top1"), r.get("top5"), r.get("static_best")]
                         for r in [*history, now]])
    return lines


def _roofline_section(name: str, summary: dict) -> list[str]:
    lines = ["### Roofline (held-out problems)", "",
             f"Each problem's roof is the lower of the CPU's fp32 FMA peak and its read bandwidth "
             f"times the problem's FLOP per compulsory byte; both ceilings were measured at "
             f"report time on this machine's CPU with {summary['threads']} threads "
             f"(bandwidth from a {summary['buffer_mib']} MiB buffer, so a problem "
             f"that stays in cache can pass it).", ""]
    lines += _table(["figure", "value"], [
        ["FMA peak (GFLOP/s)", summary["fma_peak_gflops"]],
        ["read bandwidth (GB/s)", summary["read_bandwidth_gbps"]],
        ["problems (memory-bound)", f"{summary['n_problems']} ({summary['memory_bound']})"],
        ["chosen / roof, median", summary["median_chosen_of_roof"]],
        ["chosen / roof, P10", summary["p10_chosen_of_roof"]],
        ["measured best / roof, median", summary["median_best_of_roof"]],
        ["peer / roof, median", summary["median_peer_of_roof"]]])
    plot_file = layout.ROOFLINE_PLOT_FILE.format(model=name)
    return lines + [f"![roofline of `{name}`]({plot_file})", ""]


def _plot(name: str, evaluation: Evaluation) -> bytes:
    """PNG of the sorted per-problem efficiency of the model and of the static best."""
    # matplotlib is slow to import; only a report's plots need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure   # matplotlib: only the plots need it

    table = evaluation.per_problem
    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)  # Agg, without touching pyplot's global state
    axes = figure.add_subplot()
    static_kernel = evaluation.metrics["static_best"]["kernel"]
    for column, label in (("efficiency", f"model {name}"),
                          ("static_best_efficiency", f"static best {static_kernel}")):
        values = np.sort(table[column].to_numpy(dtype=np.float64))
        axes.plot(np.arange(1, len(values) + 1), values, marker=".", label=label)
    axes.set_xlabel("holdout problems, sorted by efficiency")
    axes.set_ylabel("efficiency (measured / best)")
    axes.set_ylim(0, 1.05)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
