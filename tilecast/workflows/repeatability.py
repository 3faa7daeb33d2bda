"""Repeatability: how well one run's measurements agree with another's run of the same config.

Every model figure is capped by its labels: a model cannot be judged better than one run's
own winners score on another run. For two converted datasets A and B (same family, same
problems, e.g. two nights on one machine), each taken in turn as the truth, the other's
winners (tuning policy: practical ties broken by binary size) are scored with the
evaluation's definitions: efficiency = truth's best TFLOP/s / truth's TFLOP/s of the pick;
winner agreement = the pick is in the truth's practical-tie set; "within 2 %" = the pick runs
within 2 % of the truth's best. Figures per problem set and per runtime bin of the truth's
best kernel, since microsecond problems are where timings agree least.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from tilecast.core import dataset
from tilecast.families import get_family
from tilecast.stages import layout
from tilecast.stages.evaluate import evaluate
from tilecast.stages.train import load_predictor

# runtime bins of the truth's best kernel (microseconds): [low, high)
RUNTIME_BINS_US = ((0.0, 20.0, "< 20 us"), (20.0, 1000.0, "20 us - 1 ms"),
                   (1000.0, float("inf"), "> 1 ms"))
WITHIN_PCT = 2.0


@dataclass(frozen=True)
class Agreement:
    """One direction's figures over some problems."""
    n_problems: int
    mean: float
    p10: float
    min: float
    winner_in_tie: float     # share of problems whose pick is in the truth's tie set
    within_2pct: float       # share whose pick runs within 2 % of the truth's best

    def line(self) -> str:
        if not self.n_problems:
            return "   0 problems"
        return (f"{self.n_problems:4d} problems  mean {self.mean:.4f}  P10 {self.p10:.4f}  "
                f"min {self.min:.4f}  winner in tie {self.winner_in_tie:.3f}  "
                f"within {WITHIN_PCT:g} % {self.within_2pct:.3f}")


def per_problem(pick_run: pd.DataFrame, truth_run: pd.DataFrame,
                tie_threshold_pct: float = 1.0) -> pd.DataFrame:
    """Per problem both runs measured: the pick run's winner scored on the truth run."""
    picks = dataset.winners(pick_run, tie_threshold_pct)
    truths = dataset.winners(truth_run, tie_threshold_pct)
    speed = dataset.valid(truth_run).set_index(["dims_key", "kernel"])["tflops"]
    problem_set = truth_run.drop_duplicates("dims_key").set_index("dims_key")["problem_set"]
    rows = []
    for key in sorted(set(picks) & set(truths)):
        truth = truths[key]
        pick = picks[key].kernel
        measured = speed.get((key, pick))
        efficiency = 0.0 if measured is None or not np.isfinite(measured) else measured / truth.best_tflops
        rows.append({"dims_key": key, "problem_set": problem_set.get(key, ""),
                     "pick": pick, "truth_winner": truth.kernel, "efficiency": efficiency,
                     "in_tie": pick in truth.tie_set,
                     "within": efficiency >= 1 - WITHIN_PCT / 100,
                     "best_us": truth.median_s * 1e6})
    return pd.DataFrame(rows, columns=["dims_key", "problem_set", "pick", "truth_winner",
                                       "efficiency", "in_tie", "within", "best_us"])


def summarize(table: pd.DataFrame) -> Agreement:
    """The figures of a per_problem table (or a slice of it)."""
    if table.empty:
        return Agreement(0, float("nan"), float("nan"), float("nan"), float("nan"), float("nan"))
    eff = table["efficiency"].to_numpy(dtype=float)
    return Agreement(len(table), float(eff.mean()), float(np.percentile(eff, 10)),
                     float(eff.min()), float(table["in_tie"].mean()), float(table["within"].mean()))


def run_noise(records: pd.DataFrame, tie_threshold_pct: float = 1.0) -> dict:
    """One run's own noise, from its records: how far apart the rounds (stretches of cycles,
    or processes) of each problem's best kernel lie (median and P90 over problems of max /
    min round median), the share of problems whose winner has practical ties, and the share
    of samples the guards kept apart. A ceiling on agreement with another run, seen from
    inside one run."""
    final = dataset.final_table(records)
    winners = dataset.winners(final, tie_threshold_pct)
    candidates = records[records["role"] == "candidate"]
    spreads = []
    if "round_medians_s" in final.columns:
        rounds = final.set_index(["dims_key", "kernel"])["round_medians_s"]
        for key, winner in winners.items():
            medians = [m for m in rounds.get((key, winner.kernel), []) if m and m > 0]
            if len(medians) >= 2:
                spreads.append(max(medians) / min(medians))
    kept = sum(len(v) for v in candidates["samples_s"])
    apart = (sum(len(v) for v in candidates["disturbed_samples_s"])
             if "disturbed_samples_s" in candidates.columns else 0)
    measured = candidates[candidates["status"] == "ok"]
    timings = measured["timing"].value_counts(normalize=True).round(4).to_dict() \
        if "timing" in measured.columns else {}
    return {"n_problems": len(winners),
            "round_spread_median": float(np.median(spreads)) if spreads else None,
            "round_spread_p90": float(np.percentile(spreads, 90)) if spreads else None,
            "tie_share": float(np.mean([len(w.tie_set) > 1 for w in winners.values()]))
            if winners else None,
            "samples_kept_apart_share": apart / (kept + apart) if kept + apart else None,
            "timing": timings}


def model_on(run_a: Path, family_name: str, truth: pd.DataFrame,
             tie_threshold_pct: float) -> dict | None:
    """Run A's trained model (A/models/<family>) scored on another run's held-out
    measurements, or None when A has no model there."""
    model_dir = layout.Workdir(run_a).model_dir(family_name)
    if not (model_dir / layout.MODEL_FILE).is_file():
        return None
    family = get_family(family_name)
    spec = json.loads((model_dir / layout.FEATURE_SPEC_FILE).read_text())
    candidates = json.loads((model_dir / layout.CANDIDATES_FILE).read_text())["kernels"]
    by_set = {ps: truth[truth["problem_set"] == ps] for ps in ("train", "holdout")}
    result = evaluate(family, family.feature_engine(spec["hardware"]), load_predictor(model_dir),
                      by_set["holdout"], by_set["train"], candidates, tie_threshold_pct)
    return result.metrics


def final_rows(path: str | Path) -> pd.DataFrame:
    """A run's final table (finalists pooled) from its parquet file or its workdir + family."""
    return dataset.final_table(dataset.load(path))


def dataset_path(run: str | Path, family: str) -> Path:
    """`run` itself if it is a file, else the workdir's converted dataset of `family`."""
    run = Path(run)
    return run if run.is_file() else layout.Workdir(run).dataset(family)


def report(run_a: str | Path, run_b: str | Path, family: str = "gemm",
           tie_threshold_pct: float = 1.0) -> str:
    """The text `tilecast repeatability` prints: both directions, per problem set and bin."""
    paths = dataset_path(run_a, family), dataset_path(run_b, family)
    records = [dataset.load(p) for p in paths]
    finals = [dataset.final_table(r) for r in records]
    lines = [f"repeatability of {family}: A = {paths[0]}, B = {paths[1]}", "",
             "each run's own noise (round spread of the best kernel: median / P90 of max/min; "
             "share of problems with ties; share of samples kept apart; protocol)"]
    for name, run in zip("AB", records):
        noise = run_noise(run, tie_threshold_pct)
        lines.append(f"  {name}: {noise['n_problems']} problems  spread "
                     f"{_num(noise['round_spread_median'])} / {_num(noise['round_spread_p90'])}  "
                     f"ties {_num(noise['tie_share'])}  kept apart "
                     f"{_num(noise['samples_kept_apart_share'])}  {noise['timing']}")
    for (pick, truth), label in (((0, 1), "A's winners scored on B"),
                                 ((1, 0), "B's winners scored on A")):
        table = per_problem(finals[pick], finals[truth], tie_threshold_pct)
        lines.append(f"\n{label}")
        if table.empty:
            lines.append("  no problem has a valid measurement in both runs")
            continue
        for problem_set in ["all", *sorted(set(table["problem_set"]))]:
            rows = table if problem_set == "all" else table[table["problem_set"] == problem_set]
            lines.append(f"  {problem_set:8s} {summarize(rows).line()}")
            for low, high, name in RUNTIME_BINS_US:
                binned = rows[(rows["best_us"] >= low) & (rows["best_us"] < high)]
                if len(binned):
                    lines.append(f"    {name:12s} {summarize(binned).line()}")
        model = model_on(Path(run_a if pick == 0 else run_b), family, finals[truth],
                         tie_threshold_pct) if Path(run_a if pick == 0 else run_b).is_dir() else None
        if model is not None:
            lines.append(f"  the model trained on {'AB'[pick]}'s run, on {'AB'[truth]}'s held-out "
                         f"measurements: mean {model['mean_efficiency']:.4f}  P10 "
                         f"{model['p10_efficiency']:.4f}  top-1 {model['top1']:.3f}  top-5 "
                         f"{model['top5']:.3f}  (static best "
                         f"{model['static_best']['mean_efficiency']:.4f})")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.3f}"


# -- two series of nights in two stores (tilecast.store) ----------------------------------

def is_store(run: str | Path) -> bool:
    """True for a measurement store: a URL, or a directory holding STORE.json."""
    from tilecast.store.store import MARKER_FILE

    return "://" in str(run) or (Path(run) / MARKER_FILE).is_file()


def common_class(stores, hardware_class: str | None, family: str) -> str:
    """The hardware class the stores' `family` records are compared on: the one named, or
    the only one all of them hold (StoreError otherwise)."""
    from tilecast.store.store import StoreError

    classes = [{p.hardware_class for p in s.parts(family=family)} for s in stores]
    if hardware_class:
        for store, held in zip(stores, classes):
            if hardware_class not in held:
                raise StoreError(f"store {store.location} holds no {family} records of class "
                                 f"{hardware_class!r}; it has: {sorted(held) or 'none'}")
        return hardware_class
    common = sorted(set.intersection(*classes))
    if len(common) != 1:
        raise StoreError(f"the store(s) share {len(common)} hardware classes with {family} "
                         f"records ({common or 'none'}): name one with --hardware-class")
    return common[0]


def series_agreement(records_a: pd.DataFrame, records_b: pd.DataFrame, nights: int,
                     tie_threshold_pct: float = 1.0) -> dict[str, pd.DataFrame]:
    """Both directions of per_problem between the labels pooled over each series' first
    `nights` nights (tilecast.store.labels)."""
    from tilecast.store import labels

    finals = [labels.series_labels(r, labels.nights_in_order(r)[:nights]) for r in
              (records_a, records_b)]
    return {"A's winners scored on B": per_problem(finals[0], finals[1], tie_threshold_pct),
            "B's winners scored on A": per_problem(finals[1], finals[0], tie_threshold_pct)}


def store_report(store_a: str | Path, store_b: str | Path, family: str = "gemm",
                 tie_threshold_pct: float = 1.0, hardware_class: str | None = None,
                 max_nights: int | None = None) -> str:
    """The text `tilecast repeatability` prints for two stores (two independent series of
    nights of one class): for K = 1, 2, ... nights, one series' pooled winners scored on
    the other's pooled labels, both ways, overall and per runtime bin."""
    from tilecast.store import nights as store_nights
    from tilecast.store.store import Store

    stores = [Store(s).require() for s in (store_a, store_b)]
    chosen = common_class(stores, hardware_class, family)
    records = [store_nights.read_frame(s, chosen, family) for s in stores]
    counts = [len(set(r["run_id"])) for r in records]
    most = min(counts) if max_nights is None else min(min(counts), max_nights)
    lines = [f"repeatability of {family} on {chosen}: labels pooled over each series' first "
             f"K nights", f"  A = {store_a} ({counts[0]} nights), B = {store_b} "
             f"({counts[1]} nights)"]
    for nights in range(1, most + 1):
        lines.append(f"\nK = {nights}")
        for label, table in series_agreement(*records, nights, tie_threshold_pct).items():
            lines.append(f"  {label}: {summarize(table).line().strip()}")
            for low, high, name in RUNTIME_BINS_US:
                binned = table[(table["best_us"] >= low) & (table["best_us"] < high)]
                if len(binned):
                    lines.append(f"    {name:12s} {summarize(binned).line()}")
    return "\n".join(lines)
