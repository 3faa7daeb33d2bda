"""Train and publish a table model: `tilecast train --dataset` and `tilecast publish`.

`train_table` fits a TableModel on an imported dataset and writes W/models/table/: the model's
files (TableModel.save), calibration.json, out_of_fold.parquet and train_manifest.json.
The calibrations and the published metrics come from out-of-fold picks: an inner
leave-one-device-out over the training devices when there are two or more (each device's
problems answered by a model that never saw that device, from its features alone), else
problem folds (PROBLEM_FOLDS, grouped by dims_key). The first calibrates picks on a new
device, the second picks for a new problem on a training device (confidence.Calibrations);
with two or more devices and two or more problems both splits run (the problem split in
KNOWN_DEVICE_FOLDS folds), and the published metrics stay leave-one-device-out's. The
inner models train with a smaller row budget and fewer rounds than the final one (INNER_*),
so a 6-device dataset trains within minutes on two cores; their figures are therefore a
little pessimistic.

`publish_table` publishes the directory through registry.publish with those metrics and a
gate that, like the built-in one (tilecast.runtime.gate), scores production's choices on the
same measurements as the new model's and applies gate.compare: production's picks on the
(device, problem) pairs of this dataset whose device production was not trained on, against
the new model's out-of-fold picks there (both held out). When production saw every device of
this dataset, or cannot be loaded, the registry's default gate decides on the stored
out-of-fold metrics, and the reason says why.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from tilecast.core.artifact import CALIBRATION_FILE, ModelArtifactError, git_sha, library_versions
from tilecast.core.atomic import atomic_write_json
from tilecast.core.dataset import LEGACY_STATUSES
from tilecast.stages.layout import MANIFEST_FILE, Workdir
from tilecast.table.dataset import TableDataError, TableDataset, read_dataset
from tilecast.table.model import (DEFAULT_FORMULATION, FORMULATIONS, ROW_BUDGET, TableModel,
                                  canonical_devices, excluded_names, efficiencies)

log = logging.getLogger("tilecast.table.train")

MODEL_NAME = "table"                  # W/models/table/
OUT_OF_FOLD_FILE = "out_of_fold.parquet"
PROBLEM_FOLDS = 5
#: problem folds of the known-device calibration when leave-one-device-out runs as well:
#: every problem is still held out once, in fewer, larger folds (5 cost 127 s where the
#: budget is 2 minutes: benchmarks/table_formulations.py's 6-device dataset)
KNOWN_DEVICE_FOLDS = 3
#: the inner (calibration) models: this share of the final model's rounds and row budget
INNER_ROUNDS_SHARE = 0.5
INNER_BUDGET_SHARE = 0.25
#: problems per device scored out of fold and in sample (a seeded sample beyond it)
MAX_SCORED_PROBLEMS = 100
#: a pick within 1 % of the best counts as top-1 (as in tilecast.table.transfer)
TIE_EFFICIENCY = 1.0 / 1.01 - 1e-12
PICK_COLUMNS = ["device", "dims_key", "pick", "efficiency", "top1", "top5", "beyond",
                "incumbent", "incumbent_gain", "incumbent_efficiency", "top5_guarded",
                "guarded"]


@dataclass
class Picks:
    """Per scored (device, problem): the pick, its measured efficiency (0 when it failed or
    was not measured there), top-1 / top-5 flags, and the predicted scores behind it; the
    model's incumbent, the top prediction's gain over it and its efficiency there
    (tilecast.table.confidence, the incumbent guard), whether the guard answered it."""
    table: pd.DataFrame          # PICK_COLUMNS
    scores: list[np.ndarray]     # aligned with table rows: predictions over allowed candidates

    def guarded(self, margin: float) -> "Picks":
        """The picks the dispatcher gives with the incumbent guard's `margin`: the incumbent
        where the top prediction's gain over it is below the margin (`guarded`: the answer
        changed)."""
        from tilecast.table.confidence import guarded

        table = self.table.copy()
        chosen = guarded(table["incumbent_gain"].to_numpy(dtype=np.float64), margin)
        table.loc[chosen, "pick"] = table.loc[chosen, "incumbent"]
        table.loc[chosen, "efficiency"] = table.loc[chosen, "incumbent_efficiency"]
        table.loc[chosen, "top1"] = table.loc[chosen, "efficiency"] >= TIE_EFFICIENCY
        table.loc[chosen, "top5"] = table.loc[chosen, "top5_guarded"]
        table["guarded"] = chosen & (table["pick"] != self.table["pick"]).to_numpy()
        return Picks(table=table, scores=self.scores)


def score_picks(model: TableModel, frame: pd.DataFrame, schema, *, seed: int = 0) -> Picks:
    """`model`'s top predictions, among each problem's offered choices (those with a record),
    on the (device, problem) pairs of `frame` (canonical device names) with an ok
    measurement, at most MAX_SCORED_PROBLEMS problems per device (seeded sample), unguarded
    (Picks.guarded applies a margin). `beyond`: the device lies beyond the
    model's other training devices (TableModel.beyond)."""
    from tilecast.table.confidence import incumbent_gain

    incumbent = model.incumbent
    rows, scores = [], []
    ok = frame[frame["status"] == "ok"]
    efficiency = ok.assign(efficiency=efficiencies(ok))
    offered_on = frame.groupby(["device", "dims_key"])["kernel"].agg(set)
    for device, measured in efficiency.groupby("device", sort=True):
        allowed = model.allowed(device)
        if not allowed:
            continue
        beyond = bool(model.beyond(device))
        problems = sorted(measured["dims_key"].unique())
        if len(problems) > MAX_SCORED_PROBLEMS:
            picked = np.random.default_rng(seed).choice(len(problems), MAX_SCORED_PROBLEMS,
                                                        replace=False)
            problems = [problems[i] for i in sorted(picked)]
        by_problem = measured[measured["dims_key"].isin(problems)].groupby("dims_key")
        for dims_key, group in by_problem:
            # ranked among the choices the problem was offered there (transfer.offered_matrix)
            offered = offered_on[(device, dims_key)]
            kernels = [k for k in allowed if k in offered]
            if not kernels:
                continue
            values = group.iloc[0][list(schema.problem_names)].to_dict()
            predicted = model.scores(values, device, kernels)
            order = np.argsort(-predicted, kind="stable")
            known = dict(zip(group["kernel"], group["efficiency"]))
            ranked = np.array([known.get(kernels[i], 0.0) for i in order[:5]])
            # the top five with the incumbent first, as a guarded answer ranks them
            others = [known.get(kernels[i], 0.0) for i in order[:5] if kernels[i] != incumbent]
            behind = max([known.get(incumbent, 0.0), *others[:4]])
            rows.append({"device": device, "dims_key": dims_key, "pick": kernels[order[0]],
                         "efficiency": float(ranked[0]),
                         "top1": bool(ranked[0] >= TIE_EFFICIENCY),
                         "top5": bool(ranked.max() >= TIE_EFFICIENCY), "beyond": beyond,
                         "incumbent": incumbent,
                         "incumbent_gain": incumbent_gain(predicted, kernels, incumbent),
                         "incumbent_efficiency": float(known.get(incumbent, 0.0)),
                         "top5_guarded": bool(behind >= TIE_EFFICIENCY), "guarded": False})
            scores.append(predicted)
    return Picks(table=pd.DataFrame(rows, columns=PICK_COLUMNS), scores=scores)


def summary(picks: Picks) -> dict:
    """n_problems, mean / median / P10 / min efficiency, top1, top5 of a Picks table."""
    efficiency = picks.table["efficiency"].to_numpy(dtype=np.float64)
    if efficiency.size == 0:
        return {"n_problems": 0}
    return {"n_problems": int(efficiency.size), "mean_efficiency": float(efficiency.mean()),
            "median_efficiency": float(np.median(efficiency)),
            "p10_efficiency": float(np.percentile(efficiency, 10)),
            "min_efficiency": float(efficiency.min()),
            "top1": float(picks.table["top1"].mean()), "top5": float(picks.table["top5"].mean())}


def out_of_fold(dataset: TableDataset, devices, *, exclude_devices: Sequence[str] = (),
                rounds: int = 300, threads: int | None = None, seed: int = 0,
                budget: int = ROW_BUDGET, method: str | None = None,
                problem_folds: int = PROBLEM_FOLDS,
                formulation: str = DEFAULT_FORMULATION) -> tuple[str, Picks]:
    """(method, held-out picks) of inner models (module docstring): `method`
    "leave-one-device-out" or "problems", by default the first when two or more devices were
    measured; method "none" with no picks when the data allows no such split."""
    frame = dataset.frame.assign(device=canonical_devices(dataset.frame, devices))
    frame = frame[~frame["device"].isin(excluded_names(frame, devices, exclude_devices))]
    trained = sorted(frame.loc[frame["status"] == "ok", "device"].unique())
    none = "none", Picks(table=pd.DataFrame(columns=PICK_COLUMNS), scores=[])
    if method is None:
        method = "leave-one-device-out" if len(trained) >= 2 else "problems"
    if method == "leave-one-device-out":
        if len(trained) < 2:
            return none
        folds = [(frame["device"] != device, frame["device"] == device) for device in trained]
    else:
        keys = np.array(sorted(frame["dims_key"].unique()))
        if len(keys) < 2:
            return none
        parts = np.array_split(np.random.default_rng(seed).permutation(keys),
                               min(problem_folds, len(keys)))
        folds = [(~frame["dims_key"].isin(set(part)), frame["dims_key"].isin(set(part)))
                 for part in parts]
    tables, scores = [], []
    for train_mask, test_mask in folds:
        train = frame[train_mask]
        if not (train["status"] == "ok").any():
            continue
        inner = TableModel.fit(
            TableDataset(frame=train.reset_index(drop=True), schema=dataset.schema),
            devices, rounds=max(1, int(rounds * INNER_ROUNDS_SHARE)), threads=threads,
            seed=seed, budget=max(1, int(budget * INNER_BUDGET_SHARE)),
            formulation=formulation)
        picks = score_picks(inner, frame[test_mask], dataset.schema, seed=seed)
        tables.append(picks.table)
        scores += picks.scores
    table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=PICK_COLUMNS)
    return method, Picks(table=table, scores=scores)


@dataclass
class TrainSummary:
    """What train_table wrote and measured."""
    directory: Path
    rows: int
    devices: list[str]
    candidates: int
    in_sample: dict
    out_of_fold: dict
    method: str
    seconds: float
    fit_seconds: float

    def line(self) -> str:
        """The one-line summary `tilecast train` prints."""
        held = self.out_of_fold
        held_text = (f"out-of-fold ({self.method}) mean efficiency "
                     f"{held['mean_efficiency']:.3f}, P10 {held['p10_efficiency']:.3f}, top-1 "
                     f"{held['top1']:.2f} over {held['n_problems']} problems"
                     if held.get("n_problems") else "no out-of-fold figures (one device, one "
                                                    "problem: every answer is unsure)")
        inside = self.in_sample
        return (f"trained table model on {self.rows} rows ({len(self.devices)} devices, "
                f"{self.candidates} candidates) in {self.seconds:.1f} s (final fit "
                f"{self.fit_seconds:.1f} s): in-sample mean efficiency "
                f"{inside.get('mean_efficiency', float('nan')):.3f}; {held_text}; wrote "
                f"{self.directory}")


def train_table(dataset_dir, workdir, *, devices_files: Sequence = (),
                exclude_devices: Sequence[str] = (), rounds: int = 300,
                threads: int | None = None, seed: int = 0,
                budget: int = ROW_BUDGET,
                formulation: str = DEFAULT_FORMULATION) -> TrainSummary:
    """Train a table model on the dataset in `dataset_dir` and write W/models/table/ (module
    docstring); `formulation`: TableModel.fit's. TableDataError for a bad dataset, an unknown
    device or an excluded device the dataset lacks."""
    from tilecast.table.confidence import Calibrations, fit_calibration
    from tilecast.table.devices import DeviceTable

    if int(rounds) < 1:
        raise TableDataError(f"--rounds {rounds} must be a positive number of boosting rounds")
    if formulation not in FORMULATIONS:
        raise TableDataError(f"--formulation {formulation!r}: valid: {', '.join(FORMULATIONS)}")
    started = time.monotonic()
    dataset = read_dataset(dataset_dir)
    devices = DeviceTable.load(extra=list(devices_files))
    fit_started = time.monotonic()
    model = TableModel.fit(dataset, devices, exclude_devices=exclude_devices, rounds=rounds,
                           threads=threads, seed=seed, budget=budget, formulation=formulation)
    fit_seconds = time.monotonic() - fit_started
    inner = {"exclude_devices": exclude_devices, "rounds": rounds, "threads": threads,
             "seed": seed, "budget": budget, "formulation": formulation}
    method, held = out_of_fold(dataset, devices, **inner)
    known_method, known_held = ((method, held) if method != "leave-one-device-out" else
                                out_of_fold(dataset, devices, method="problems",
                                            problem_folds=KNOWN_DEVICE_FOLDS, **inner))

    def calibrate(picks: Picks, groups=None):
        return fit_calibration(picks.scores, picks.table["efficiency"].tolist(), groups=groups,
                               gains=picks.table["incumbent_gain"].to_numpy(dtype=np.float64),
                               efficiency_of_incumbent=picks.table["incumbent_efficiency"]
                               .to_numpy(dtype=np.float64))

    calibrations = Calibrations(
        new_device=(calibrate(held, held.table["device"].tolist())
                    if method == "leave-one-device-out" else None),
        known_device=calibrate(known_held) if known_method == "problems" else None)
    # the published figures are the dispatcher's answers: guarded picks (margin 0: none)
    new_margin, known_margin = (0.0 if found is None else found.margin for found in
                                (calibrations.new_device, calibrations.known_device))
    held = held.guarded(new_margin if method == "leave-one-device-out" else known_margin)
    known_held = known_held.guarded(known_margin)
    frame = dataset.frame.assign(device=canonical_devices(dataset.frame, devices))
    # measured pairs: the dispatcher answers them unguarded (TableModel.measured)
    in_sample = score_picks(model, frame[frame["device"].isin(model.training_devices)],
                            dataset.schema, seed=seed)

    directory = Workdir(workdir).model_dir(MODEL_NAME)
    model.save(directory)
    atomic_write_json(directory / CALIBRATION_FILE, calibrations.to_json())
    held.table.to_parquet(directory / OUT_OF_FOLD_FILE, index=False)
    seconds = time.monotonic() - started
    result = TrainSummary(directory=directory, rows=int(model.info["rows"]),
                          devices=model.training_devices, candidates=len(model.candidates()),
                          in_sample=summary(in_sample), out_of_fold=summary(held),
                          method=method, seconds=seconds, fit_seconds=fit_seconds)
    atomic_write_json(directory / MANIFEST_FILE, {
        "family": "table", "dataset": str(Path(dataset_dir).resolve()),
        "dataset_name": dataset.manifest.get("name"), "data_hash": data_hash(dataset.frame),
        "rows": result.rows, "devices": result.devices,
        "excluded_devices": model.info["excluded_devices"], "candidates": result.candidates,
        "rounds": int(rounds), "formulation": model.formulation,
        "in_sample": result.in_sample, "out_of_fold": {"method": method, **result.out_of_fold},
        "incumbent": model.incumbent,
        "calibration": {case: None if found is None else
                        {"threshold": found.to_json()["threshold"], "note": found.note,
                         "margin": found.to_json()["margin"], "margin_note": found.margin_note}
                        for case, found in (("new_device", calibrations.new_device),
                                            ("known_device", calibrations.known_device))},
        "known_device_out_of_fold": {"method": known_method, **summary(known_held)},
        "seconds": round(seconds, 2), "fit_seconds": round(fit_seconds, 2),
        "versions": library_versions(), "git_sha": git_sha()})
    return result


def data_hash(frame: pd.DataFrame) -> str:
    """sha256 of the sorted (device, dims_key, kernel, status, median_s) rows, the time's
    column spelled `time_s` as in a version-1 dataset: a model trained on one keeps the hash
    of its data when that data reads as version 2 (table.dataset.upgrade_v1)."""
    import hashlib

    rows = frame[["device", "dims_key", "kernel", "status", "median_s"]].astype(str)
    rows = rows.rename(columns={"median_s": "time_s"})
    rows = rows.sort_values(["device", "dims_key", "kernel"])
    return hashlib.sha256(rows.to_csv(index=False).encode()).hexdigest()


def same_data(frame: pd.DataFrame, recorded: str) -> bool:
    """Whether `recorded` (a manifest's data_hash) is the hash of `frame`: as read, or, for a
    model trained before the one status vocabulary, with the renamed statuses spelled as that
    dataset held them (LEGACY_STATUSES; read_dataset renames them)."""
    if data_hash(frame) == recorded:
        return True
    old_names = {new: old for old, new in LEGACY_STATUSES.items()}
    return data_hash(frame.assign(status=frame["status"].replace(old_names))) == recorded


# -- publish --------------------------------------------------------------------------------

def published_files(directory: Path) -> dict[str, Path]:
    """The files of a trained table model directory that a registry version holds;
    ModelArtifactError naming one that is missing."""
    from tilecast.table.model import (CANDIDATES_FILE, FAILURES_FILE, FEATURE_SPEC_FILE,
                                      MEMBERS, REFERENCE_FILE)

    names = (*MEMBERS.values(), FEATURE_SPEC_FILE, CANDIDATES_FILE, FAILURES_FILE,
             REFERENCE_FILE, CALIBRATION_FILE, MANIFEST_FILE, OUT_OF_FOLD_FILE)
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise ModelArtifactError(f"{directory} is not a trained table model (missing "
                                 f"{', '.join(missing)}); run `tilecast train --dataset DIR "
                                 f"--workdir W` first")
    return {name: directory / name for name in names}


def publish_metrics(manifest: dict) -> dict:
    """metrics.json of a table model: the out-of-fold figures at the top level (what the
    default gate and `registry list` read), the in-sample ones apart."""
    held = dict(manifest["out_of_fold"])
    method = held.pop("method", None)
    if not held.get("n_problems"):
        # nothing held out: the in-sample figures are all there is, and the gate says so
        held = {**manifest["in_sample"], "in_sample_only": True}
    return {**held, "family": "table", "out_of_fold_method": method,
            "in_sample": manifest["in_sample"], "devices": manifest["devices"],
            "data_hash": manifest["data_hash"], "dataset": manifest.get("dataset_name")}


def table_gate(root, model: str, dataset: TableDataset | None, held: pd.DataFrame):
    """A registry gate (module docstring): production's picks vs this model's out-of-fold
    picks on the (device, problem) pairs production was not trained on."""
    from tilecast.registry import api as registry
    from tilecast.runtime.gate import compare

    def fallback(production_metrics, new_metrics, why: str):
        promote, reason = registry.default_gate(production_metrics, new_metrics)
        return promote, f"{reason} [stored out-of-fold metrics: {why}]"

    def gate(production_metrics, new_metrics):
        if production_metrics is None:
            return registry.default_gate(production_metrics, new_metrics)
        production, why = _production_table(root, model, dataset, held)
        if production is None:
            return fallback(production_metrics, new_metrics, why)
        candidate = held.assign(dims_key=held["device"] + "|" + held["dims_key"])
        promote, reason, _ = compare(production, candidate[["dims_key", "efficiency"]])
        return promote, f"{reason} [{why}]"
    return gate


def _production_table(root, model: str, dataset: TableDataset | None, held: pd.DataFrame):
    """(production's per-pair efficiencies keyed 'device|dims_key', what they cover) or
    (None, why they cannot be had)."""
    from tilecast.registry import api as registry
    from tilecast.runtime.dispatch import Dispatcher
    from tilecast.table.dispatch import TableDispatcher

    try:
        version = registry.read_alias(root, model, registry.PRODUCTION)
        dispatcher = Dispatcher.from_registry(root, model, version)
    except (registry.RegistryError, ValueError, OSError) as err:
        return None, f"production does not load ({err})"
    if not isinstance(dispatcher, TableDispatcher):
        return None, f"production version {version} is a {dispatcher.family.name} model"
    if dataset is None or held.empty:
        return None, "the training dataset or its out-of-fold picks are not available"
    seen = set(dispatcher.table_model.training_devices)
    unseen = held[~held["device"].isin(seen)]
    if unseen.empty:
        return None, (f"production version {version} was trained on every device of this "
                      "dataset, so its picks there are not held out")
    stored = dispatcher.table_model.devices
    names = {label: _canonical(stored, label) for label in dataset.frame["device"].unique()}
    frame = dataset.frame.assign(device=dataset.frame["device"].map(names))
    ok = frame[frame["status"] == "ok"]
    ok = ok.assign(efficiency=efficiencies(ok))
    measured = {(d, p, k): e for d, p, k, e in
                zip(ok["device"], ok["dims_key"], ok["kernel"], ok["efficiency"])}
    problems = frame.drop_duplicates("dims_key").set_index("dims_key")
    rows = []
    for device, dims_key in zip(unseen["device"], unseen["dims_key"]):
        values = problems.loc[dims_key, list(dataset.schema.problem_names)].to_dict()
        try:
            pick = dispatcher.select(values, device=device)
        except (ValueError, registry.RegistryError) as err:
            return None, f"production version {version} cannot answer for {device} ({err})"
        rows.append({"dims_key": f"{device}|{dims_key}",
                     "efficiency": measured.get((device, dims_key, pick), 0.0)})
    covered = sorted(unseen["device"].unique())
    return pd.DataFrame(rows), (f"production version {version} and this model scored on the "
                                f"devices neither trained on: {', '.join(covered)}")


def _canonical(table, label: str) -> str:
    """`label`'s canonical name in `table`, else in the shipped table, else itself."""
    from tilecast.table.model import resolve_device

    try:
        return resolve_device(table, label)[0]
    except TableDataError:
        return label


def publish_table(workdir, root, model: str):
    """Publish W/models/table/ as the next version of `model` in the registry at `root`
    (module docstring); the registry's PublishResult."""
    from tilecast.registry import api as registry

    directory = Workdir(workdir).model_dir(MODEL_NAME)
    files = published_files(directory)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    held = pd.read_parquet(directory / OUT_OF_FOLD_FILE)
    try:
        dataset = read_dataset(manifest["dataset"])
    except TableDataError as err:
        log.warning("the training dataset is not readable (%s): the gate compares stored "
                    "metrics", err)
        dataset = None
    if dataset is not None and not same_data(dataset.frame, manifest["data_hash"]):
        log.warning("the dataset at %s changed since training: the gate compares stored "
                    "metrics", manifest["dataset"])
        dataset = None
    return registry.publish(root, model, files, metrics=publish_metrics(manifest),
                            gate=table_gate(root, model, dataset, held))
