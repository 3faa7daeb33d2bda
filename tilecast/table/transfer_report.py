"""The cross-hardware report: W/report/transfer.json (evaluate_transfer's JSON), a readable
transfer.md rendered from it, and transfer_per_problem.parquet (the rows behind the figures),
each written atomically."""
from __future__ import annotations

import io
from pathlib import Path

from tilecast.core.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text

REPORT_DIR = "report"
JSON_FILE, MARKDOWN_FILE, ROWS_FILE = ("transfer.json", "transfer.md",
                                       "transfer_per_problem.parquet")

BASELINE_TITLES = {"most_similar_device": "most similar device",
                   "best_on_average": "best on average", "random": "random ok configuration",
                   "plain_lightgbm": "plain LightGBM", "default": "default"}
MEANING = (
    "Efficiency is the best measured time on the held-out device divided by the time of the "
    "configuration chosen without measuring anything there (1.00 = the best; a choice that "
    "failed or was never measured there counts 0), and top-1 is the share of problems where "
    "that choice is within {tie:g} % of the best. A shortlist of k is what measuring the "
    "model's k best guesses and keeping the fastest gives; \"unsure\" is the dispatcher "
    "declining to answer below a confidence threshold calibrated on the training devices "
    "alone: coverage is the share it answers, confident-wrong the share of all problems it "
    "answers below {target:.0%} of the best.")


def _number(value) -> str:
    return "–" if value is None else f"{value:.3f}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header, rows) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows), ""]


def _versus(block: dict) -> list[str]:
    """Model and baselines side by side: mean, P10, min, top-1 (and top-5 for the model)."""
    rows = [["table model", *(_number(block[k]) for k in ("mean_efficiency", "p10_efficiency",
                                                          "min_efficiency", "top1", "top5"))]]
    for name, title in BASELINE_TITLES.items():
        figures = block["baselines"].get(name)
        if figures is None:
            continue
        detail = {"most_similar_device": ", ".join(figures.get("devices", [])),
                  "best_on_average": ", ".join(figures.get("kernels", [])),
                  "default": figures.get("kernel", "")}.get(name, "")
        rows.append([f"{title} ({detail})" if detail else title,
                     *(_number(figures[k]) for k in ("mean_efficiency", "p10_efficiency",
                                                     "min_efficiency", "top1")), "–"])
    return _table(["choice", "mean", "P10", "min", "top-1", "top-5"], rows)


def render(report: dict) -> str:
    """The markdown of one report (see the module docstring)."""
    overall, devices = report["overall"], report["devices"]
    lines = ["# Cross-hardware evaluation", "",
             f"Split {report['split']}: {report['n_devices']} devices, "
             f"{overall['n_problems']} (device, problem) pairs scored, {report['rounds']} "
             f"boosting rounds, {report['seconds']:.0f} s. "
             f"Picks without an ok time on their device: {overall['unmeasured_picks']} "
             f"({overall['failed_picks']} failed there).", "",
             MEANING.format(tie=report["tie_pct"], target=report["target"]), "",
             "## Overall", "", *_versus(overall)]
    if "beats_default" in overall:
        lines += [f"The model beats the default on {overall['devices_beating_default']} of "
                  f"{len(devices)} devices.", ""]
    guard = overall["incumbent"]
    lines += [f"The incumbent guard answered the training devices' best-on-average "
              f"configuration on {guard['share']:.0%} of the pairs, where the model's top "
              f"prediction was not predicted to beat it by the calibrated margin; the top "
              f"predictions alone would have reached {guard['model_alone']:.3f}.", ""]
    ks = list(overall["shortlist"])
    lines += ["## Shortlist: the best of k measured", "",
              *_table(["k", "table model", "random ok configurations"],
                      [[k, _number(overall["shortlist"][k]),
                        _number(overall["shortlist_random"][k])] for k in ks]),
              f"## Unsure (target {report['target']:.0%} of the best, at most "
              f"{report['max_wrong']:.0%} confident-wrong on the calibration data)", "",
              *_table(["", "coverage", "precision", "confident-wrong"],
                      [[name, *(_number(block["unsure"][k])
                                for k in ("coverage", "precision", "confident_wrong"))]
                       for name, block in (("overall", overall), *devices.items())]),
              "## Per device", "",
              *_table(["device", "problems", "model mean", "P10", "top-1", "top-5",
                       *(BASELINE_TITLES[n] for n in BASELINE_TITLES
                         if n in overall["baselines"]),
                       *(f"best of {k}" for k in ks), "unmeasured picks", "seconds"],
                      [[name, block["n_problems"], _number(block["mean_efficiency"]),
                        _number(block["p10_efficiency"]), _number(block["top1"]),
                        _number(block["top5"]),
                        *(_number(block["baselines"][n]["mean_efficiency"])
                          for n in BASELINE_TITLES if n in overall["baselines"]),
                        *(_number(block["shortlist"][k]) for k in ks),
                        block["unmeasured_picks"], f"{block['seconds']:.1f}"]
                       for name, block in devices.items()])]
    for name, block in devices.items():
        lines += [f"### {name}", ""]
        for fold in block["folds"]:
            threshold = "never sure" if fold["threshold"] is None else f"{fold['threshold']:.3f}"
            lines.append(f"Trained on {', '.join(fold['trained_on'])}; confidence calibrated by "
                         f"{fold['method']} over their problems, threshold {threshold} "
                         f"({fold['note']}); incumbent {fold['incumbent']}, "
                         f"{fold['margin_note'] or 'no guard'}.")
        lines += ["", *_versus(block)]
    return "\n".join(lines).rstrip() + "\n"


def overall_line(report: dict) -> str:
    """One line for the console."""
    overall = report["overall"]
    baselines = ", ".join(f"{BASELINE_TITLES[n]} {f['mean_efficiency']:.3f}"
                          for n, f in overall["baselines"].items())
    unsure = overall["unsure"]
    return (f"{report['split']} over {report['n_devices']} devices, {overall['n_problems']} "
            f"(device, problem) pairs: mean efficiency {overall['mean_efficiency']:.3f}, P10 "
            f"{overall['p10_efficiency']:.3f}, min {overall['min_efficiency']:.3f}, top-1 "
            f"{overall['top1']:.2f}, top-5 {overall['top5']:.2f}; sure on "
            f"{unsure['coverage']:.0%} (confident-wrong {unsure['confident_wrong']:.1%}); "
            f"baselines: {baselines}")


def write_report(workdir: str | Path, transfer) -> list[Path]:
    """Write a Transfer's report files under `workdir`/report; their paths."""
    out = Path(workdir) / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    rows = io.BytesIO()
    transfer.per_problem.to_parquet(rows, index=False)
    return [atomic_write_json(out / JSON_FILE, transfer.report),
            atomic_write_text(out / MARKDOWN_FILE, render(transfer.report)),
            atomic_write_bytes(out / ROWS_FILE, rows.getvalue())]
