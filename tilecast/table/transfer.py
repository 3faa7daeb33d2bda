"""Cross-hardware evaluation: how well a table model picks configurations on a device it has
never seen measured, against what a user would otherwise do.

Split `leave-one-device-out`: each device of the dataset is held out in turn and a model is
trained on the others (TableModel.fit with that device excluded). Split `problems`: problems
are grouped into PROBLEM_FOLDS folds by dims_key; each fold is held out on every device while
the model trains on the rest.

Per (held-out device, problem): the oracle is the best ok time among the configurations
measured there; the efficiency of a pick is best time / its time, 0 when the pick has no ok
time there (counted as `unmeasured_picks`, of which `failed_picks` failed there). The model
and every baseline choose, for each problem, among the configurations it was offered on the
held-out device, those with a record there (ok, failed or invalid; column `offered`): an
autotuner offers each problem its own choices, one never offered is no choice there, and
devices' caches of one kernel often cover different spaces; a pick that failed there scores
0. Split `sources`: each imported file's problems held out in turn on every device (a
workload the model never saw). `top1`: the
pick is within TIE_PCT of the best; `top5`: one of the five highest predictions is;
`shortlist[k]`: the best efficiency among the k highest predictions (a user measures those k
and keeps the fastest), beside `shortlist_random[k]`, the expected best of k random ok
configurations. `unsure`: the model's confidence (tilecast.table.confidence) is calibrated
on the training rows only, by an inner split of the same kind as the outer one, as a trained
model's calibrations are (tilecast.table.train): leave-one-device-out over the training
devices (grouped by held-out device) when a device is held out and two or more remain,
problem folds when problems are held out, so a held-out device's confidences never saw it; a
device held out from one training device cannot be calibrated: answered with the incumbent,
unsure, as the dispatcher answers it; `coverage` is the
share of problems answered sure, `precision` the share of sure answers reaching `target`,
`confident_wrong` the share of ALL problems answered sure below `target`. A held-out device
further from its nearest training device than any training device lies from the rest, or of
a vendor none of them has (TableModel.beyond; column `beyond`), is answered unsure
throughout, as the dispatcher does: no calibration measured a pick that far out. The picks
are the dispatcher's: the model's incumbent (its training devices' best-on-average
configuration) where the top prediction does not beat it by the margin the inner split
calibrated (tilecast.table.confidence, "the incumbent guard"; `guarded`), the top
prediction (`model_pick`, `model_efficiency`) otherwise; the shortlist puts a guarded
problem's incumbent first. Baselines
(tilecast.table.transfer_baselines) are scored on the same problems. Figures pool every
(device, problem) for `overall` and each device's for `devices`
(tilecast.table.transfer_summary); the per-(device, problem) table behind them (picks, their
efficiencies, confidences, the baselines' picks) comes back beside the report.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd

from tilecast.table import transfer_baselines as baselines
from tilecast.table.confidence import NEVER, Calibration, fit_calibration, guarded
from tilecast.table.dataset import TableDataset, parse_key, key_of
from tilecast.table.transfer_baselines import TIE_EFFICIENCY, TIE_PCT
from tilecast.table.transfer_summary import summarize

log = logging.getLogger("tilecast.table.transfer")

SPLITS = ("leave-one-device-out", "problems", "sources")
PROBLEM_FOLDS = 5
DEFAULT_KS = (1, 5, 20, 50)
#: Rows of (problem, candidate) predicted at once: bounds the feature matrix's memory.
GRID_ROWS = 200_000


class TransferError(ValueError):
    """A dataset or option the evaluation cannot use: says which and what would work."""


@dataclass(frozen=True)
class Fold:
    """One fold of a split over `rows`: the model is fitted on `fit_rows` without
    `exclude_devices` (TableModel.fit's arguments) and scored on `test_devices` x
    `test_problems` (None: every problem of the test devices)."""
    rows: pd.DataFrame
    test_devices: tuple[str, ...]
    test_problems: frozenset | None = None
    exclude_devices: tuple[str, ...] = ()
    name: str = ""                  # what is held out, for the log (a file of --split sources)

    @property
    def fit_rows(self) -> pd.DataFrame:
        if self.test_problems is None:
            return self.rows
        return self.rows[~self.rows["dims_key"].isin(self.test_problems)]

    @property
    def train(self) -> pd.DataFrame:
        """The rows the model and the baselines may learn from."""
        rows = self.fit_rows
        return rows[~rows["device"].isin(self.exclude_devices)]

    def test(self, device: str) -> pd.DataFrame:
        """`device`'s rows scored in this fold: its test problems with an ok time there."""
        rows = self.rows[self.rows["device"] == device]
        if self.test_problems is not None:
            rows = rows[rows["dims_key"].isin(self.test_problems)]
        return rows[rows["dims_key"].isin(set(rows.loc[rows["status"] == "ok", "dims_key"]))]


@dataclass
class Transfer:
    """The report (`evaluate_transfer`'s JSON) and the per-(device, problem) table behind it."""
    report: dict
    per_problem: pd.DataFrame = field(repr=False)


def folds(frame: pd.DataFrame, split: str, seed: int = 0,
          exclude: tuple[str, ...] = ()) -> list[Fold]:
    """The folds of `split` over the devices of `frame` not in `exclude` (see the module
    docstring); an inner split passes the outer fold's rows and exclusions."""
    devices = sorted(set(frame["device"]) - set(exclude))
    if split == "leave-one-device-out":
        if len(devices) < 2:
            raise TransferError(f"the dataset holds {len(devices)} device(s) {devices}: "
                                "leave-one-device-out needs 2 or more (nothing to hold out); "
                                "import another device's measurements, or use --split problems")
        return [Fold(rows=frame, test_devices=(d,), exclude_devices=(*exclude, d))
                for d in devices]
    if split == "problems":
        keys = np.array(sorted(frame.loc[frame["device"].isin(devices), "dims_key"].unique()))
        if len(keys) < 2:
            raise TransferError(f"the dataset holds {len(keys)} problem(s): --split problems "
                                "needs 2 or more")
        groups = np.array_split(np.random.default_rng(seed).permutation(keys),
                                min(PROBLEM_FOLDS, len(keys)))
        return [Fold(rows=frame, test_devices=tuple(devices), test_problems=frozenset(group),
                     exclude_devices=tuple(exclude)) for group in groups]
    if split == "sources":
        return source_folds(frame, devices, exclude)
    raise TransferError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")


def source_folds(frame: pd.DataFrame, devices: Sequence[str],
                 exclude: tuple[str, ...] = ()) -> list[Fold]:
    """Each imported file's problems held out in turn on every device, the model trained on
    the other files' (a workload it never saw: AutoHeuristic's hf_train against timm_train).
    A problem that other files also hold stays in training, never scored."""
    rows = frame[frame["device"].isin(devices)]
    sources = sorted(rows["source"].unique())
    if len(sources) < 2:
        raise TransferError(f"the dataset's rows come from {len(sources)} file(s): --split "
                            "sources holds each file's problems out in turn and needs 2 or "
                            "more; import another workload's file")
    by_source = rows.groupby("source")["dims_key"].agg(set)
    result = []
    for source in sources:
        others = set().union(*(by_source[s] for s in sources if s != source))
        held = frozenset(by_source[source] - others)
        if not held:
            log.warning("--split sources: every problem of %s is in another file too; "
                        "nothing of it to hold out", source)
            continue
        result.append(Fold(rows=frame, test_devices=tuple(devices), test_problems=held,
                           exclude_devices=tuple(exclude), name=Path(source).name))
    return result


def resolve_default(dataset: TableDataset, key: str | None) -> str | None:
    """The canonical key of a --default configuration (its name=value pairs in any order);
    TransferError when it is malformed or names no configuration of the dataset."""
    if key is None:
        return None
    names = list(dataset.schema.config_names)
    pairs = [part.split("=", 1) for part in key.split(",")]
    if any(len(p) != 2 for p in pairs) or sorted(p[0] for p in pairs) != sorted(names):
        raise TransferError(f"--default {key!r} must give every configuration column once as "
                            f"name=value: {', '.join(names)}")
    in_order = sorted(pairs, key=lambda pair: names.index(pair[0]))
    try:
        values = parse_key(",".join(f"{n}={v}" for n, v in in_order), dataset.schema.config)
    except ValueError as err:   # a numeric column given a word
        raise TransferError(f"--default {key!r}: {err}") from None
    canonical = key_of(names, values)
    if canonical not in set(dataset.frame["kernel"]):
        raise TransferError(f"--default {key!r} is not a configuration of the dataset "
                            f"(e.g. {dataset.frame['kernel'].iloc[0]!r})")
    return canonical


# -- one fold -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Run:
    """What every fold of one evaluation shares."""
    dataset: TableDataset
    devices: object
    configs: pd.DataFrame              # configuration columns, indexed by key
    rounds: int
    threads: int | None
    seed: int
    formulation: str = "efficiency"

    def fit(self, fold: Fold):
        from tilecast.table.model import TableModel

        part = TableDataset(frame=fold.fit_rows.reset_index(drop=True),
                            schema=self.dataset.schema, manifest=self.dataset.manifest)
        return TableModel.fit(part, self.devices, exclude_devices=fold.exclude_devices,
                              rounds=self.rounds, threads=self.threads, seed=self.seed,
                              formulation=self.formulation)

    def grid(self, problems: pd.DataFrame, kernels: Sequence[str], device: str) -> pd.DataFrame:
        """Every (problem, candidate) pair of `problems` on `device`: key, problem and
        configuration columns."""
        schema = self.dataset.schema
        configs = self.configs.loc[list(kernels)].reset_index()
        return (problems[["dims_key", *schema.problem_names]].merge(configs, how="cross")
                .assign(device=device))


def offered_matrix(test: pd.DataFrame, problems: Sequence[str],
                   kernels: Sequence[str]) -> np.ndarray:
    """Which of `kernels` each problem was offered on the test device: those with a record
    there (ok, failed or invalid). An autotuner offers each problem its own choices; one it
    never offered is no choice for that problem (module docstring)."""
    counts = pd.crosstab(test["dims_key"], test["kernel"])
    return counts.reindex(index=list(problems), columns=list(kernels)).fillna(0).to_numpy() > 0


def _score(run: _Run, model, test: pd.DataFrame, device: str, ks: Sequence[int],
           margin: float = 0.0):
    """The model's ranking, on each test problem of `device`, of its allowed candidates the
    problem was offered, its incumbent first where the guard with `margin` answers it
    (tilecast.table.confidence): the score rows (per problem in key order, the predictions
    over its offered candidates) and the per-problem figures of its picks, beside the top
    prediction's (`model_pick`, `model_efficiency`) and the incumbent's (`incumbent_gain`,
    `incumbent_efficiency`)."""
    failed = model.failed_on(device)
    known = set(test["kernel"])     # what the held-out device has a record of (module docstring)
    kernels = sorted(k for k in model.candidates() if k not in failed and k in known)
    if not kernels:
        raise TransferError(f"no candidate configuration is allowed on {device}")
    problems = test.drop_duplicates("dims_key").sort_values("dims_key")
    offered = offered_matrix(test, problems["dims_key"], kernels)
    problems, offered = problems[offered.any(axis=1)], offered[offered.any(axis=1)]
    step = max(1, GRID_ROWS // len(kernels))
    blocks = []
    for start in range(0, len(problems), step):   # a block of problems at a time
        grid = run.grid(problems.iloc[start:start + step], kernels, device)
        scores = np.asarray(model.predict_many(grid), dtype=np.float64)
        if scores.shape != (len(grid),) or not np.all(np.isfinite(scores)):
            raise ValueError(f"predict_many returned {scores.shape} values (finite: "
                             f"{bool(np.all(np.isfinite(scores)))}) for {len(grid)} rows")
        blocks.append(scores.reshape(-1, len(kernels)))
    matrix = np.where(offered, np.vstack(blocks), -np.inf)
    efficiency = np.nan_to_num(
        baselines.efficiency_table(test[test["status"] == "ok"])
        .reindex(index=problems["dims_key"], columns=kernels).to_numpy(), nan=-1.0)
    rows = np.arange(len(matrix))
    order = np.argsort(-matrix, axis=1, kind="stable")      # equal scores in key order
    top = order[:, 0].copy()
    if model.incumbent in kernels:
        column = kernels.index(model.incumbent)
        # no guard where the incumbent was not offered
        gains = np.where(offered[:, column], matrix[rows, top] - matrix[:, column], np.nan)
        for row in np.flatnonzero(guarded(gains, margin)):
            order[row] = np.concatenate(([column], order[row][order[row] != column]))
        incumbent_efficiency = np.maximum(efficiency[:, column], 0.0)
    else:
        gains, incumbent_efficiency = np.full(len(matrix), np.nan), np.zeros(len(matrix))
    # past a problem's offered choices a ranking holds nothing: efficiency 0 there
    ranked = np.take_along_axis(np.where(offered, np.maximum(efficiency, 0.0), 0.0), order,
                                axis=1)
    best_of = np.maximum.accumulate(ranked, axis=1)
    picks = np.array(kernels)[order[:, 0]]
    measured = set(zip(test["dims_key"], test["kernel"]))
    pick_measured = efficiency[rows, order[:, 0]] >= 0.0
    score_rows = [row[mask] for row, mask in zip(matrix, offered)]
    return score_rows, pd.DataFrame({
        "device": device, "dims_key": problems["dims_key"].to_numpy(), "pick": picks,
        "offered": offered.sum(axis=1),
        "efficiency": ranked[:, 0], "top1": ranked[:, 0] >= TIE_EFFICIENCY,
        "top5": best_of[:, min(5, len(kernels)) - 1] >= TIE_EFFICIENCY,
        "pick_measured": pick_measured,
        "pick_failed": [(p, k) in measured and not ok for p, k, ok
                        in zip(problems["dims_key"], picks, pick_measured)],
        "model_pick": np.array(kernels)[top],
        "model_efficiency": np.maximum(efficiency[rows, top], 0.0),
        "incumbent": model.incumbent, "incumbent_gain": gains,
        "incumbent_efficiency": incumbent_efficiency, "guarded": picks != np.array(kernels)[top],
        **{f"shortlist_{k}": best_of[:, min(k, len(kernels)) - 1] for k in ks}})


def _outcomes(run: _Run, fold: Fold, ks: Sequence[int], margin: float = 0.0):
    """The fold's model, its pick figures per test device (guarded with `margin`) and its
    score rows (one array of predicted efficiencies over the allowed candidates per test
    problem)."""
    model = run.fit(fold)
    tables, score_rows = [], []
    for device in fold.test_devices:
        test = fold.test(device)
        if test.empty:
            continue
        rows, table = _score(run, model, test, device, ks, margin)
        tables.append(table)
        score_rows.extend(rows)
    return model, tables, score_rows


def _calibrate(run: _Run, fold: Fold, target: float, max_wrong: float) -> tuple[Calibration, str]:
    """A calibration from the fold's training rows alone (module docstring): the inner
    split's held-out picks, fitted by fit_calibration."""
    # the case the outer fold scores: a new problem on training devices, or a new device
    if fold.test_problems is None and fold.train["device"].nunique() < 2:
        # a new device and one training device: no pick on a new device can be calibrated;
        # the dispatcher answers such a model's incumbent, unsure (tilecast.table.dispatch)
        return Calibration(slacks=(0.0,), probabilities=(0.0,), threshold=math.inf,
                           target=target, max_wrong=max_wrong, margin=NEVER,
                           note="one training device: a new device's picks cannot be "
                                "calibrated; the incumbent, unsure"), "none"
    method = "problems" if fold.test_problems is not None else "leave-one-device-out"
    scores, tables = [], []
    try:
        inner_folds = folds(fold.fit_rows, method, run.seed, exclude=fold.exclude_devices)
    except TransferError:   # one training problem: nothing to hold out, too little data
        inner_folds = []
    for inner in inner_folds:
        model, parts, rows = _outcomes(run, inner, (1,))
        scores.extend(rows)
        tables.extend(parts)
    picks = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(
        columns=["device", "efficiency", "incumbent_gain", "incumbent_efficiency"])
    # a device is the unit a new device resembles; problem folds share their devices
    by_device = picks["device"].tolist() if method == "leave-one-device-out" else None
    return fit_calibration(scores, picks["efficiency"].to_numpy(dtype=np.float64),
                           target=target, max_wrong=max_wrong, groups=by_device,
                           gains=picks["incumbent_gain"].to_numpy(dtype=np.float64),
                           efficiency_of_incumbent=picks["incumbent_efficiency"]
                           .to_numpy(dtype=np.float64)), method


def _baseline_columns(run: _Run, fold: Fold, table: pd.DataFrame, pool: Sequence[str],
                      ks: Sequence[int], default: str | None) -> pd.DataFrame:
    """`table` with the baselines' efficiencies on the same (device, problem) pairs."""
    train_ok = fold.train[fold.train["status"] == "ok"]
    extra = []
    for device, rows in table.groupby("device", sort=False):
        test = fold.test(device)
        efficiency = baselines.efficiency_table(test[test["status"] == "ok"])
        problems = list(rows["dims_key"])
        # every baseline chooses among what each problem was offered there, as the model
        device_pool = sorted(set(pool) & set(test["kernel"]))
        offered = test[test["kernel"].isin(device_pool)].groupby("dims_key")["kernel"].agg(set)
        ranking = baselines.average_ranking(train_ok, device_pool)
        static = ranking[0]
        nearest = baselines.nearest_device(device, sorted(train_ok["device"].unique()),
                                           run.devices)
        pairs = test.loc[test["kernel"].isin(device_pool), ["dims_key", "kernel"]]
        grid = run.grid(test.drop_duplicates("dims_key"), device_pool, device).merge(
            pairs.drop_duplicates(), on=["dims_key", "kernel"])     # the offered pairs only
        picks = {"most_similar_device": baselines.most_similar_device_picks(
                     train_ok, nearest, problems, device_pool, offered),
                 "best_on_average": {key: baselines.first_offered(ranking, offered[key])
                                     for key in problems},
                 "plain_lightgbm": baselines.plain_lightgbm_picks(
                     train_ok, run.dataset.schema, grid, rounds=run.rounds,
                     threads=run.threads, seed=run.seed)}
        if default is not None:
            picks["default"] = dict.fromkeys(problems, default)
        columns = {"dims_key": problems, "device": device, "nearest_device": nearest,
                   "best_on_average_kernel": static}
        for name, chosen in picks.items():
            columns[f"{name}_pick"] = [chosen[key] for key in problems]
            values = [efficiency.at[key, chosen[key]] if chosen[key] in efficiency.columns
                      else np.nan for key in problems]
            columns[name] = np.nan_to_num(np.array(values, dtype=np.float64), nan=0.0)
        random = baselines.random_expectations(efficiency, ks, TIE_EFFICIENCY).loc[problems]
        extra.append(pd.DataFrame(columns).join(random, on="dims_key"))
    return table.merge(pd.concat(extra), on=["device", "dims_key"], how="left")


def run_transfer(dataset: TableDataset, devices, *, split: str = "leave-one-device-out",
                 rounds: int = 300, threads: int | None = None,
                 ks: Sequence[int] = DEFAULT_KS, target: float = 0.9, max_wrong: float = 0.02,
                 default: str | None = None, seed: int = 0,
                 formulation: str | None = None) -> Transfer:
    """Evaluate a table model across devices (module docstring); the report and the
    per-(device, problem) table. `formulation`: the model's (TableModel.fit; default its
    default)."""
    from tilecast.table.model import DEFAULT_FORMULATION, FORMULATIONS

    formulation = formulation or DEFAULT_FORMULATION
    if formulation not in FORMULATIONS:
        raise TransferError(f"unknown formulation {formulation!r}; valid: "
                            f"{', '.join(FORMULATIONS)}")
    ks = tuple(sorted({int(k) for k in ks}))
    if not ks or ks[0] < 1:
        raise TransferError(f"shortlist sizes {ks} must be positive integers")
    default = resolve_default(dataset, default)
    outer = folds(dataset.frame, split, seed)
    configs = (dataset.frame.drop_duplicates("kernel").set_index("kernel")
               [list(dataset.schema.config_names)])
    run = _Run(dataset, devices, configs, rounds, threads, seed, formulation)
    started, tables, calibrations = time.monotonic(), [], {}
    for number, fold in enumerate(outer, 1):
        fold_started = time.monotonic()
        if all(fold.test(device).empty for device in fold.test_devices):
            log.warning("transfer %d/%d: no ok measurement to score on %s", number, len(outer),
                        ", ".join(fold.test_devices))
            continue
        calibration, method = _calibrate(run, fold, target, max_wrong)
        model, parts, rows = _outcomes(run, fold, ks, calibration.margin)
        table = pd.concat(parts, ignore_index=True)
        table["confidence"] = [calibration.confidence(r) for r in rows]
        beyond = {device: model.beyond(device) for device in fold.test_devices}
        table["beyond"] = table["device"].map(lambda d: ",".join(beyond[d]))
        table["sure"] = (table["confidence"] >= calibration.threshold) & (table["beyond"] == "")
        table = _baseline_columns(run, fold, table, model.candidates(), ks, default)
        seconds = time.monotonic() - fold_started
        table["fold"] = number
        tables.append(table)
        trained_on = sorted(fold.train["device"].unique())
        for device in fold.test_devices:
            calibrations.setdefault(device, []).append(
                {"fold": number, "method": method, "seconds": round(seconds, 2),
                 "trained_on": trained_on, "incumbent": model.incumbent,
                 **calibration.to_json()})
        held_out = (", ".join(fold.test_devices) if fold.test_problems is None
                    else f"{len(fold.test_problems)} problems" + (
                        f" of {fold.name}" if fold.name else ""))
        log.info("transfer %d/%d: %s held out, trained on %d device(s): %d (device, problem) "
                 "pairs, mean efficiency %.3f, %.1f s", number, len(outer), held_out,
                 len(trained_on), len(table), float(table["efficiency"].mean()), seconds)
    if not tables:
        raise TransferError("no held-out device has an ok measurement: nothing to score")
    per_problem = pd.concat(tables, ignore_index=True)
    report = summarize(per_problem, calibrations, ks=ks, target=target, default=default)
    report.update({"split": split, "formulation": formulation, "target": target,
                   "max_wrong": max_wrong,
                   "tie_pct": TIE_PCT, "ks": list(ks), "rounds": rounds,
                   "n_devices": int(dataset.frame["device"].nunique()),
                   "seconds": round(time.monotonic() - started, 2)})
    return Transfer(report=report, per_problem=per_problem)


def evaluate_transfer(dataset: TableDataset, devices, *, split: str = "leave-one-device-out",
                      rounds: int = 300, threads: int | None = None,
                      ks: Sequence[int] = DEFAULT_KS, target: float = 0.9,
                      default: str | None = None, seed: int = 0) -> dict:
    """The cross-hardware report: {"overall": {...}, "devices": {name: {...}}, ...} (see
    tilecast.table.transfer_summary for the keys)."""
    return run_transfer(dataset, devices, split=split, rounds=rounds, threads=threads, ks=ks,
                        target=target, default=default, seed=seed).report
