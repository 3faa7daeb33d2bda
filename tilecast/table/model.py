"""A table-family performance model: which configuration is fastest for a problem on a device.

What transfers across devices is relative performance, not absolute time, so the target is
each configuration's efficiency within its (device, problem) group, best ok time / its time
(1.0 for the best, in (0, 1]), learned from the problem, configuration and device features of
tilecast.table.features and from what the configuration reached on the other training devices
(tilecast.table.reference: every device left out of its own, so a training row sees what a
new device's row sees). On a device absent from the training data the prediction comes from
its hardware features and the training devices' measurements, nearest first.

The prediction is an ensemble (MEMBERS): the mean of the predicted efficiencies of two
boosters, one learning from every feature ("hardware") and one without the raw device features
("relative": the device enters only through the other devices' measurements, its distance to
them and the gaps to the predicted ideal parameters of tilecast.table.ideal), and of the
prior PRIOR (the other devices' efficiencies weighted by similarity) where it is defined. With
a handful of training devices the raw hardware figures identify each device, and a tree splits
on them to remember a device rather than learn what carries to a new one; on other data they
are what sets an unseen device apart; and where one configuration is near-best everywhere the
prior alone is hard to beat. Leave-one-device-out on three generated datasets
(docs/journal/2026-12-03-avx-512-xeon.md, "An ensemble for the cross-device model") put each
alone first on one and last or near it on another; the ensemble was the best or close to it
on all three. A member leaves features out by blanking them (NaN) in its training matrix:
LightGBM never splits on a feature missing throughout, so every member reads the same feature
matrix.

Formulation (FORMULATIONS): L2 regression on efficiency itself, every row weighted alike.
benchmarks/table_formulations.py compared it by leave-one-device-out on three generated
GEMM-shaped datasets (6 GPUs x 8 problems x 5,480 CLBlast configurations) with
`log_efficiency` (L2 on log efficiency, rows weighted WEIGHT_FLOOR + efficiency ** TOP_POWER
towards each group's best) and LambdaRank ((device, problem) query groups, graded relevance):
mean held-out efficiency 0.803 against 0.791 (better on 2 of 3 datasets: within noise), and
LambdaRank 0.705 against 0.815 on the one dataset it ran on. Failed or invalid configurations
are not training rows; they are kept per device (`failed_on`) and never chosen there. The
model also keeps its incumbent, the configuration best on average over its training data,
which the dispatcher answers instead of a pick not predicted to beat it by the calibration's
margin (tilecast.table.confidence, "the incumbent guard").

A group with more than `group_cap` ok rows (the row budget spread over the groups, at most
MAX_GROUP_ROWS) keeps its best TOP_SHARE of that cap and a deterministic random sample of the
rest, so training stays within ROW_BUDGET rows whatever the dataset's size.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from tilecast.core.artifact import (CANDIDATES_FILE, FAILURES_FILE, FEATURE_SPEC_FILE, MODEL_FILE,
                                    ModelArtifactError)
from tilecast.core.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from tilecast.table.dataset import TableDataError, TableDataset, TableSchema, parse_key
from tilecast.table.features import DEVICE_PREFIX, TableFeatures
from tilecast.table.reference import (NAMES as REFERENCE_NAMES, FILE as REFERENCE_FILE,
                                      Reference, new_problem_mask, rows_features)
from tilecast.table.transfer_baselines import best_on_average

FAMILY = "table"
#: 2: other devices' measurements as features (reference.npz); 3: ideal gaps, an ensemble
FORMAT_VERSION = 3
#: ensemble member -> its booster's file (module docstring); the first is MODEL_FILE
MEMBERS = {"hardware": MODEL_FILE, "relative": "model_relative.txt"}
#: the reference feature averaged with the members' predictions where it is defined
PRIOR = "ref:wmean"

#: Training rows at most (all groups together); a group keeps at least MIN_GROUP_ROWS.
ROW_BUDGET = 300_000
MIN_GROUP_ROWS = 200
#: LambdaRank's limit on one query group; kept for regression too, so both see the same rows.
MAX_GROUP_ROWS = 10_000
#: Share of a capped group's rows that are its best (by efficiency); the rest are sampled.
TOP_SHARE = 0.25
#: Efficiencies below this are this in the log target (a config 1000x slower than the best).
EFFICIENCY_FLOOR = 1e-3
TOP_POWER = 2.0
WEIGHT_FLOOR = 0.05
#: Rows predicted per LightGBM call (bounds the float32 feature matrix to ~100 MB).
PREDICT_CHUNK = 250_000


@dataclass(frozen=True)
class Formulation:
    """How efficiencies become a LightGBM target and row weights, and predictions
    efficiencies again."""
    objective: str
    target: Callable[[np.ndarray], np.ndarray]
    weight: Callable[[np.ndarray], np.ndarray]
    to_efficiency: Callable[[np.ndarray], np.ndarray]


def _log_efficiency(efficiency: np.ndarray) -> np.ndarray:
    return np.log(np.maximum(efficiency, EFFICIENCY_FLOOR))


def _top_weight(efficiency: np.ndarray) -> np.ndarray:
    return WEIGHT_FLOOR + efficiency ** TOP_POWER


def _grades(efficiency: np.ndarray) -> np.ndarray:
    """LambdaRank's relevance: integer grades 0..30, top-heavy (1.0 -> 30, 0.95 -> 20,
    0.9 -> 13, 0.8 -> 5), within LightGBM's default label_gain."""
    return np.rint(30.0 * np.clip(efficiency, 0.0, 1.0) ** 8).astype(np.int32)


def _sigmoid(scores: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(scores, dtype=np.float64)))


FORMULATIONS = {
    "log_efficiency": Formulation("regression", _log_efficiency, _top_weight, np.exp),
    "efficiency": Formulation("regression", target=lambda e: e, weight=np.ones_like,
                              to_efficiency=lambda s: s),
    # (device, problem) groups as queries; a score, mapped into (0, 1) for the ensemble
    "lambdarank": Formulation("lambdarank", _grades, np.ones_like, _sigmoid),
}
DEFAULT_FORMULATION = "efficiency"


def lgb_params(formulation: str, rows: int, threads: int | None, seed: int) -> dict:
    """LightGBM parameters: fixed rounds (no early stopping), row and feature bagging,
    deterministic; small leaves only for small data."""
    return {"objective": FORMULATIONS[formulation].objective if formulation in FORMULATIONS
            else formulation, "learning_rate": 0.05, "num_leaves": 63,
            "min_data_in_leaf": 20 if rows >= 5_000 else 3, "min_data_per_group": 10,
            "cat_smooth": 5.0, "feature_fraction": 0.8, "bagging_fraction": 0.8,
            "bagging_freq": 1, "lambda_l2": 1.0, "max_bin": 255, "seed": seed,
            "deterministic": True, "force_row_wise": True, "num_threads": threads or 2,
            "verbose": -1}


# -- training rows --------------------------------------------------------------------------

def member_blanks(names: Sequence[str], member: str) -> np.ndarray:
    """(len(names),) bool: the feature columns ensemble `member` leaves out (the raw device
    features for "relative", none for "hardware")."""
    if member not in MEMBERS:
        raise ValueError(f"unknown ensemble member {member!r}; valid: {', '.join(MEMBERS)}")
    return np.array([member == "relative" and n.startswith(DEVICE_PREFIX) for n in names],
                    dtype=bool)


def canonical_devices(frame: pd.DataFrame, devices) -> pd.Series:
    """The frame's `device` column in the device table's canonical names (UnknownDeviceError
    for a device the table lacks)."""
    names = {label: devices.resolve(label) for label in frame["device"].unique()}
    return frame["device"].map(names)


def excluded_names(frame: pd.DataFrame, devices, exclude: Sequence[str]) -> set[str]:
    """The dataset devices named by `exclude` (a dataset name or any label resolving to one);
    TableDataError for a name that is neither."""
    present = set(frame["device"])
    chosen = set()
    for name in exclude:
        if name in present:
            chosen.add(name)
            continue
        try:
            resolved = devices.resolve(name)
        except ValueError:
            resolved = None
        if resolved not in present:
            raise TableDataError(f"excluded device {name!r} is not a device of the dataset; "
                                 f"its devices: {', '.join(sorted(present))}")
        chosen.add(resolved)
    return chosen


def efficiencies(ok: pd.DataFrame) -> np.ndarray:
    """best ok time of the row's (device, dims_key) group / the row's time."""
    best = ok.groupby(["device", "dims_key"], sort=False)["median_s"].transform("min")
    return (best / ok["median_s"]).to_numpy(dtype=np.float64)


def sample_rows(ok: pd.DataFrame, efficiency: np.ndarray, *, budget: int = ROW_BUDGET,
                seed: int = 0) -> np.ndarray:
    """Positions of the ok rows to train on: every row of a group within its cap; of a
    larger group its best TOP_SHARE * cap rows and a seeded random sample of the rest.
    Deterministic for a given seed and row order (training_rows sorts the rows first)."""
    groups = ok.groupby(["device", "dims_key"], sort=False).ngroup().to_numpy()
    sizes = np.bincount(groups)
    cap = int(min(MAX_GROUP_ROWS, max(MIN_GROUP_ROWS, budget // max(1, len(sizes)))))
    if sizes.max() <= cap:
        return np.arange(len(ok))
    draw = np.random.default_rng(seed).random(len(ok))
    keys = pd.DataFrame({"group": groups, "efficiency": -efficiency, "draw": draw})
    top_count = int(cap * TOP_SHARE)
    top = keys.groupby("group")["efficiency"].rank(method="first").to_numpy() <= top_count
    rest = keys[~top].groupby("group")["draw"].rank(method="first").to_numpy()
    keep = top.copy()
    keep[np.flatnonzero(~top)] = rest <= cap - top_count
    return np.flatnonzero(keep)


@dataclass
class TrainingRows:
    """The rows a model learns from, after exclusion, canonical names and sampling."""
    ok: pd.DataFrame                  # sampled ok rows, canonical device names
    efficiency: np.ndarray            # aligned with ok
    all_ok: pd.DataFrame              # every ok row (before sampling)
    all_efficiency: np.ndarray        # aligned with all_ok
    failed: pd.DataFrame              # failed or invalid rows, canonical device names
    candidates: list[str]
    failures: dict[str, list[str]]
    devices: list[str]


def training_rows(dataset: TableDataset, devices, *, exclude_devices: Sequence[str] = (),
                  budget: int = ROW_BUDGET, seed: int = 0) -> TrainingRows:
    """Canonical, filtered and sampled training rows of `dataset` (see the module docstring)."""
    frame = dataset.frame.assign(device=canonical_devices(dataset.frame, devices))
    frame = frame[~frame["device"].isin(excluded_names(frame, devices, exclude_devices))]
    ok = frame[frame["status"] == "ok"].sort_values(["device", "dims_key", "kernel"])
    if ok.empty:
        raise TableDataError("no ok measurement to train on (after excluding devices "
                             f"{list(exclude_devices)}); import measurements that ran")
    bad = frame[frame["status"] != "ok"]
    failures = {device: sorted(set(rows["kernel"])) for device, rows in bad.groupby("device")}
    efficiency = efficiencies(ok)
    keep = sample_rows(ok, efficiency, budget=budget, seed=seed)
    return TrainingRows(ok=ok.iloc[keep].reset_index(drop=True), efficiency=efficiency[keep],
                        all_ok=ok, all_efficiency=efficiency, failed=bad,
                        candidates=sorted(set(ok["kernel"])), failures=failures,
                        devices=sorted(set(frame["device"])))


# -- the model ------------------------------------------------------------------------------

class TableModel:
    """A trained table model (see the module docstring). Build with `fit` or `load`."""

    def __init__(self, boosters: Mapping[str, Any], features: TableFeatures,
                 candidates: Sequence[str],
                 failures: Mapping[str, Sequence[str]], *, formulation: str = DEFAULT_FORMULATION,
                 training_devices: Sequence[str] = (), info: Mapping | None = None,
                 reference: Reference | None = None):
        if list(boosters) != list(MEMBERS):
            raise ValueError(f"a table model's boosters are {list(MEMBERS)}, got {list(boosters)}")
        self.boosters = dict(boosters)
        self.features = features
        self.reference = reference
        self.names = list(features.names) + list(REFERENCE_NAMES)
        self.schema: TableSchema = features.schema
        self.devices = features.device_table
        self.formulation = formulation
        self.training_devices = list(training_devices)
        self.info = dict(info or {})
        self._candidates = list(candidates)
        self._failures = {device: frozenset(kernels) for device, kernels in failures.items()}
        self._to_efficiency = FORMULATIONS[formulation].to_efficiency
        self._configs: pd.DataFrame | None = None
        self._prior = len(features.names) + REFERENCE_NAMES.index(PRIOR)

    @property
    def booster(self):
        """The first member's booster (every member reads the same features)."""
        return self.boosters[next(iter(MEMBERS))]

    # -- fitting ---------------------------------------------------------------------------

    @classmethod
    def fit(cls, dataset: TableDataset, devices, *, exclude_devices: Sequence[str] = (),
            rounds: int = 300, threads: int | None = None, seed: int = 0,
            formulation: str = DEFAULT_FORMULATION, budget: int = ROW_BUDGET,
            keep_devices: Sequence[str] = (), params: Mapping | None = None) -> "TableModel":
        """Train on `dataset`'s ok rows, without `exclude_devices`. `devices` is the
        DeviceTable the dataset's devices resolve in; `keep_devices` are other devices of it
        whose entries the saved model carries (so it answers for them without the shipped
        table); `params` override LightGBM parameters of lgb_params."""
        import lightgbm as lgb  # ~2 s to import: only fitting and loading pay for it

        if formulation not in FORMULATIONS:
            raise ValueError(f"unknown formulation {formulation!r}; valid: "
                             f"{', '.join(FORMULATIONS)}")
        if int(rounds) < 1:
            raise ValueError(f"rounds={rounds!r} must be >= 1")
        rows = training_rows(dataset, devices, exclude_devices=exclude_devices, budget=budget,
                             seed=seed)
        how = FORMULATIONS[formulation]
        features = TableFeatures(dataset.schema, devices).fit(rows.all_ok)
        reference = Reference.build(rows.all_ok, rows.all_efficiency, rows.failed,
                                    dataset.schema, devices, rows.candidates, seed=seed)
        vectors = {name: devices.features(name) for name in rows.ok["device"].unique()}
        mask = new_problem_mask(rows.ok["device"], rows.ok["dims_key"], seed)
        X = np.hstack([features.rows(rows.ok),
                       rows_features(reference, rows.ok, dataset.schema, vectors, mask)])
        params = {**lgb_params(formulation, len(X), threads, seed), **(params or {})}
        group, efficiency = None, rows.efficiency
        if how.objective == "lambdarank":   # queries: each (device, problem)'s rows together
            keys = (rows.ok["device"].astype(str) + "\0" + rows.ok["dims_key"].astype(str)
                    ).to_numpy()
            order = np.argsort(keys, kind="stable")
            X, keys, efficiency = X[order], keys[order], efficiency[order]
            starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
            group = np.diff(np.r_[starts, len(keys)])
        boosters = {}
        for member in MEMBERS:
            blank = member_blanks([*features.names, *REFERENCE_NAMES], member)
            train_set = lgb.Dataset(np.where(blank[None, :], np.nan, X) if blank.any() else X,
                                    how.target(efficiency), group=group,
                                    weight=None if group is not None
                                    else how.weight(efficiency),
                                    categorical_feature=features.categorical_indices or "auto",
                                    free_raw_data=True)
            boosters[member] = lgb.train(params, train_set, num_boost_round=int(rounds))
        kept = sorted(set(rows.devices) | {devices.resolve(d) for d in keep_devices})
        info = {"rounds": int(rounds), "rows": int(len(X)), "seed": seed, "params": params,
                "incumbent": best_on_average(rows.all_ok, rows.candidates),
                "excluded_devices": sorted(set(canonical_devices(dataset.frame, devices))
                                           - set(rows.devices)),
                "kept_devices": kept}
        return cls(boosters, features, rows.candidates, rows.failures, formulation=formulation,
                   training_devices=rows.devices, info=info, reference=reference)

    # -- queries ---------------------------------------------------------------------------

    @property
    def incumbent(self) -> str | None:
        """The configuration best on average over the training (device, problem) pairs
        (transfer_baselines.best_on_average): what the incumbent guard falls back on
        (tilecast.table.confidence). None for a model saved before the guard."""
        return self.info.get("incumbent")

    def candidates(self) -> list[str]:
        """Configuration keys seen ok on some training device, sorted."""
        return list(self._candidates)

    def failed_on(self, device: str) -> set[str]:
        """Configurations that failed or were invalid on `device` (a canonical name or label)
        in the training data: never chosen there. Empty for a device without data."""
        failures = self._failures.get(device)
        if failures is None:
            try:
                failures = self._failures.get(self.devices.resolve(device), frozenset())
            except ValueError:
                failures = frozenset()
        return set(failures)

    def allowed(self, device: str) -> list[str]:
        """The candidates that may be chosen on `device`, sorted."""
        failed = self.failed_on(device)
        return [k for k in self._candidates if k not in failed]

    def candidate_configs(self) -> pd.DataFrame:
        """The candidates' configuration columns, one row per candidate (index: the key)."""
        if self._configs is None:
            records = [parse_key(k, self.schema.config) for k in self._candidates]
            self._configs = pd.DataFrame(records, index=pd.Index(self._candidates, name="kernel"),
                                         columns=list(self.schema.config_names))
        return self._configs

    def scores(self, problem: Mapping[str, Any], device: str, kernels: Sequence[str],
               device_table=None) -> np.ndarray:
        """Predicted efficiencies of `kernels` (candidate keys) for one checked problem on a
        canonical `device` (features from `device_table`, default the model's)."""
        configs = self.candidate_configs().loc[list(kernels)]
        problems = pd.DataFrame([problem], columns=list(self.schema.problem_names))
        X = self.features.grid(problems, configs, device, device_table)
        vector = (device_table or self.devices).features(device)
        measured = self.reference.grid(device, vector, problems, list(kernels), self.schema)
        return self._predict(np.hstack([X, measured.reshape(len(X), len(REFERENCE_NAMES))]))

    def measured(self, problem: Mapping[str, Any], device: str) -> bool:
        """Whether one checked problem was measured on canonical `device` in the training
        data: the model has seen its answer, so the incumbent guard, calibrated on new
        problems, does not apply."""
        problems = pd.DataFrame([problem], columns=list(self.schema.problem_names))
        return bool(self.reference.measured(device, problems, self.schema)[0])

    def beyond(self, device: str, device_table=None) -> list[str]:
        """The hardware figures on which canonical `device` (features from `device_table`,
        default the model's) lies further out than any training device lies from the rest
        (Reference.beyond): its picks there are extrapolations no calibration has measured.
        Empty for a training device."""
        if device in self.training_devices:
            return []
        vector = (device_table or self.devices).features(device)
        return self.reference.beyond(device, vector)

    def predict(self, problem: Mapping[str, Any], device: str) -> dict[str, float]:
        """kernel -> predicted efficiency (best time / its time; about 1.0 for a
        configuration predicted to be the best there, may exceed 1 by the model's error) of
        every candidate allowed on `device` (a name or label in the model's device entries
        or the shipped table)."""
        name, table = resolve_device(self.devices, device)
        kernels = self.allowed(name)
        values = self.scores(check_problem(self.schema, problem), name, kernels, table)
        return dict(zip(kernels, values.tolist()))

    def predict_many(self, frame: pd.DataFrame) -> np.ndarray:
        """Predicted efficiencies of rows holding the problem and configuration columns and
        `device` (names or labels), in row order."""
        names = {label: resolve_device(self.devices, label)
                 for label in frame["device"].astype(str).unique()}
        out = np.empty(len(frame), dtype=np.float64)
        for name, table, labels in _by_table(names):
            positions = np.flatnonzero(frame["device"].astype(str).isin(labels).to_numpy())
            for start in range(0, len(positions), PREDICT_CHUNK):
                chunk = positions[start:start + PREDICT_CHUNK]
                rows = frame.iloc[chunk].assign(device=name)
                measured = rows_features(self.reference, rows, self.schema,
                                         {name: table.features(name)})
                out[chunk] = self._predict(np.hstack([self.features.rows(rows, table),
                                                      measured]))
        return out

    def _predict(self, X: np.ndarray) -> np.ndarray:
        if len(X) == 0:
            return np.empty(0)
        threads = self.info.get("params", {}).get("num_threads", 2)
        total = sum(self._to_efficiency(booster.predict(X, num_threads=threads))
                    for booster in self.boosters.values())
        prior = X[:, self._prior].astype(np.float64)
        known = np.isfinite(prior)
        return np.where(known, total + np.where(known, prior, 0.0), total) / (
            len(self.boosters) + known)

    # -- files -----------------------------------------------------------------------------

    def feature_spec(self, extra_devices: Sequence[str] = ()) -> dict:
        """feature_spec.json: family, format, formulation, the feature engine (schema,
        categories, names) and the device entries of every training and kept device."""
        kept = sorted(set(self.info.get("kept_devices", self.training_devices))
                      | {self.devices.resolve(d) for d in extra_devices})
        return {"family": FAMILY, "format_version": FORMAT_VERSION,
                "formulation": self.formulation, **self.features.to_json(),
                "device_features": list(self.devices.FEATURE_NAMES),
                "reference_features": list(REFERENCE_NAMES),
                "devices": self.devices.to_json(kept),
                "training_devices": self.training_devices,
                "training": dict(self.info)}

    def save(self, directory, *, extra_devices: Sequence[str] = ()) -> dict[str, Path]:
        """Write the members' boosters (MEMBERS), feature_spec.json, candidates.json,
        failures.json and reference.npz into `directory` (each atomically); name -> path, as
        registry.publish takes them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files = {name: directory / name for name in (*MEMBERS.values(), FEATURE_SPEC_FILE,
                                                      CANDIDATES_FILE, FAILURES_FILE,
                                                      REFERENCE_FILE)}
        atomic_write_bytes(files[REFERENCE_FILE], self.reference.to_bytes())
        for member, name in MEMBERS.items():
            atomic_write_text(files[name], self.boosters[member].model_to_string())
        atomic_write_json(files[FEATURE_SPEC_FILE], self.feature_spec(extra_devices))
        atomic_write_json(files[CANDIDATES_FILE], {"family": FAMILY, "kernels": self._candidates})
        atomic_write_json(files[FAILURES_FILE], {d: sorted(k) for d, k in
                                                 sorted(self._failures.items())})
        return files

    @classmethod
    def load(cls, directory) -> "TableModel":
        """The model saved in `directory`; ModelArtifactError naming a missing or damaged file."""
        import lightgbm as lgb

        from tilecast.table.devices import DeviceTable

        directory = Path(directory)
        documents = {}
        for name in (FEATURE_SPEC_FILE, CANDIDATES_FILE, FAILURES_FILE):
            try:
                documents[name] = json.loads((directory / name).read_text())
            except FileNotFoundError:
                raise ModelArtifactError(f"table model {directory} has no {name}; train it "
                                         "again with `tilecast train --dataset`") from None
            except (OSError, ValueError) as err:
                raise ModelArtifactError(f"{directory / name} is damaged: {err}") from None
        spec = documents[FEATURE_SPEC_FILE]
        if not isinstance(spec, dict) or spec.get("family") != FAMILY:
            raise ModelArtifactError(f"{directory / FEATURE_SPEC_FILE} is not a table model's "
                                     f"(family {spec.get('family') if isinstance(spec, dict) else spec!r})")
        if spec.get("format_version") != FORMAT_VERSION:
            raise ModelArtifactError(f"{directory / FEATURE_SPEC_FILE} has format_version "
                                     f"{spec.get('format_version')!r}; this tilecast reads "
                                     f"{FORMAT_VERSION}: retrain the model")
        try:
            table = DeviceTable.from_json(spec["devices"])
            features = TableFeatures.from_json(spec, table)
            kernels = list(documents[CANDIDATES_FILE]["kernels"])
            formulation = spec["formulation"]
            FORMULATIONS[formulation]
        except (KeyError, TypeError, ValueError) as err:
            raise ModelArtifactError(f"{directory / FEATURE_SPEC_FILE} or {CANDIDATES_FILE} "
                                     f"is damaged: {err!r}") from None
        try:
            reference = Reference.from_bytes((directory / REFERENCE_FILE).read_bytes(),
                                             str(directory / REFERENCE_FILE))
        except FileNotFoundError:
            raise ModelArtifactError(f"table model {directory} has no {REFERENCE_FILE}; train "
                                     "it again with `tilecast train --dataset`") from None
        except (OSError, TableDataError) as err:
            raise ModelArtifactError(str(err)) from None
        if list(spec.get("reference_features", [])) != list(REFERENCE_NAMES):
            raise ModelArtifactError(f"{directory / FEATURE_SPEC_FILE} lists reference features "
                                     f"{spec.get('reference_features')!r}, this tilecast "
                                     f"computes {list(REFERENCE_NAMES)}: retrain the model")
        from tilecast.registry import integrity
        boosters = {}
        for member, name in MEMBERS.items():
            model_path = directory / name
            if not model_path.is_file():
                raise ModelArtifactError(f"table model {directory} has no {name}")
            try:
                integrity.check_model_text(model_path)
                booster = lgb.Booster(model_file=str(model_path))
            except Exception as err:  # LightGBMError, ValueError, RegistryError: "damaged"
                raise ModelArtifactError(f"{model_path} is damaged: {err}") from None
            expected = len(features.names) + len(REFERENCE_NAMES)
            if booster.num_feature() != expected:
                raise ModelArtifactError(f"{model_path} expects {booster.num_feature()} "
                                         f"features, {FEATURE_SPEC_FILE} lists {expected}")
            boosters[member] = booster
        return cls(boosters, features, kernels, documents[FAILURES_FILE], formulation=formulation,
                   training_devices=spec.get("training_devices", []),
                   info=spec.get("training", {}), reference=reference)


# -- problems and devices -------------------------------------------------------------------

def check_problem(schema: TableSchema, problem: Mapping[str, Any]) -> dict[str, Any]:
    """The problem's values in schema order: numbers for numeric columns (finite), strings for
    categorical ones; a partial column left out (or None) is missing (NaN, ""). TableDataError naming a missing, unknown or unreadable column."""
    if not isinstance(problem, Mapping):
        raise TableDataError(f"a problem is a mapping of {list(schema.problem_names)}, got "
                             f"{type(problem).__name__}")
    names = list(schema.problem_names)
    optional = {c.name for c in schema.problem if c.partial}   # some sources lack them
    missing = [n for n in names if n not in problem and n not in optional]
    unknown = sorted(set(problem) - set(names))
    if missing or unknown:
        raise TableDataError(f"problem {dict(problem)!r}: " + "; ".join(
            part for part in (missing and f"missing {missing}", unknown and f"unknown {unknown}")
            if part) + f"; the model's problem columns are {names or '(none)'}")
    values = {}
    for column in schema.problem:
        value = problem.get(column.name)
        if column.partial and (value is None or (isinstance(value, float) and math.isnan(value))):
            values[column.name] = "" if column.kind == "categorical" else math.nan
            continue
        if column.kind == "categorical":
            values[column.name] = str(value)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = float("nan")
        if isinstance(value, bool) or not np.isfinite(number):
            raise TableDataError(f"problem column {column.name}={value!r} is not a finite "
                                 "number")
        values[column.name] = number
    return values


def resolve_device(table, label: str):
    """(canonical name, table holding it): from `table` (a model's device entries), else from
    the shipped device table with the user's additions (DeviceTable.load()).
    UnknownDeviceError when neither knows it."""
    from tilecast.table.devices import UnknownDeviceError

    try:
        return table.resolve(label), table
    except UnknownDeviceError:
        shipped = shipped_devices()
        return shipped.resolve(label), shipped


def shipped_devices():
    """DeviceTable.load(), read once per value of TILECAST_DEVICES (parsing the YAML costs
    ~0.2 s, a query answers in milliseconds)."""
    from tilecast.core.settings import settings

    return _load_devices(settings().device_tables)


@functools.lru_cache(maxsize=4)
def _load_devices(tables: tuple):
    from tilecast.table.devices import DeviceTable

    return DeviceTable.load()


def _by_table(resolved: Mapping[str, tuple[str, Any]]) -> list[tuple[str, Any, list[str]]]:
    """label -> (name, table) grouped: (name, table, its labels) per distinct device."""
    grouped: dict[tuple[str, int], tuple[str, Any, list[str]]] = {}
    for label, (name, table) in resolved.items():
        grouped.setdefault((name, id(table)), (name, table, []))[2].append(label)
    return list(grouped.values())
