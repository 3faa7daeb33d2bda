"""Train a LightGBM performance model: features, group-aware CV, final model, artifact files.

The model predicts a transformed TFLOP/s (see layout.TARGET_TRANSFORMS) from the family's
feature engine. Cross-validation is GroupKFold keyed on `dims_key`, so one physical problem
never sits on both sides of a fold (the seed's lesson: otherwise the CV metric is wildly
optimistic). The final model is refit on every row with the median of the folds'
early-stopped round counts.

Artifacts (written atomically into `out_dir`): `model.txt`, `feature_spec.json`,
`train_manifest.json`; `load_predictor` reads them back.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from tilecast.core import stats
from tilecast.core.atomic import atomic_write_json, atomic_write_text
from tilecast.core.artifact import (
    FEATURE_SPEC_FILE, MANIFEST_FILE, MODEL_FILE, TARGET_TRANSFORMS, ModelArtifactError,
    git_sha, library_versions)

# Target transforms: name -> (forward applied to TFLOP/s, inverse applied to predictions).
TARGETS = TARGET_TRANSFORMS


def target_transform(name: str):
    """(forward, inverse) of a target transform; ValueError lists the valid names."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown target transform {name!r}; "
                         f"valid: {', '.join(TARGETS)}") from None


@dataclass(frozen=True)
class ModelSpec:
    """LightGBM hyper-parameters and the CV/target settings of one model."""
    num_leaves: int = 31
    learning_rate: float = 0.05
    n_estimators: int = 2000
    min_data_in_leaf: int = 10
    feature_fraction: float = 0.9
    bagging_fraction: float = 0.9
    bagging_freq: int = 1
    lambda_l2: float = 0.0
    folds: int = 5
    early_stopping_rounds: int = 100
    seed: int = 0
    target: str = "log1p_tflops"
    # Row weight (tflops / best tflops of the row's problem) ** top_weight: 0 weighs every row
    # alike; > 0 spends the model's capacity where selection happens, near each problem's best.
    top_weight: float = 0.0
    # kernels a leaf of the model's shortlist keeps (tilecast.runtime.shortlist); 0: none
    shortlist: int = 8

    def __post_init__(self) -> None:
        target_transform(self.target)
        for name in ("num_leaves", "n_estimators", "min_data_in_leaf", "early_stopping_rounds"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelSpec.{name}={getattr(self, name)!r} must be >= 1")
        if int(self.folds) < 2:
            raise ValueError(f"ModelSpec.folds={self.folds!r} must be >= 2 for cross-validation")
        if int(self.shortlist) < 0:
            raise ValueError(f"ModelSpec.shortlist={self.shortlist!r} must be >= 0")
        if not self.top_weight >= 0:
            raise ValueError(f"ModelSpec.top_weight={self.top_weight!r} must be >= 0")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "ModelSpec":
        """A spec from a config mapping; ValueError names unknown keys and lists valid ones."""
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown model spec key(s) {unknown}; valid: {', '.join(valid)}")
        return cls(**dict(values))

    def lgb_params(self, num_threads: int) -> dict:
        """Native LightGBM parameters (deterministic, quiet)."""
        return {"objective": "regression", "num_leaves": self.num_leaves,
                "learning_rate": self.learning_rate, "min_data_in_leaf": self.min_data_in_leaf,
                "feature_fraction": self.feature_fraction,
                "bagging_fraction": self.bagging_fraction, "bagging_freq": self.bagging_freq,
                "lambda_l2": self.lambda_l2, "seed": self.seed, "deterministic": True,
                "force_row_wise": True, "num_threads": num_threads, "verbose": -1}


@dataclass(frozen=True)
class Features:
    """Feature matrix aligned row for row with the input frame."""
    X: np.ndarray
    y_tflops: np.ndarray
    groups: np.ndarray
    kernels: list[str]


def featurize(family, engine, frame: pd.DataFrame) -> Features:
    """Features of every (problem, kernel) row of `frame`, in the frame's row order.

    Kernel rows are computed once per distinct kernel name; each problem's rows are built
    with one vectorized engine.combine call.
    """
    if frame.empty:
        raise ValueError("featurize: the frame has no rows; nothing to train or evaluate on")
    missing = [c for c in ("dims_key", "kernel", "tflops", *family.problem_fields)
               if c not in frame.columns]
    if missing:
        raise ValueError(f"featurize: frame lacks column(s) {missing}")
    kernels = [str(k) for k in frame["kernel"]]
    names = sorted(set(kernels))
    configs = {name: family.parse_name(name) for name in names}
    kernel_rows = engine.kernel_features([configs[n] for n in names])
    kernel_index = {name: i for i, name in enumerate(names)}

    X = np.empty((len(frame), len(engine.feature_names())), dtype=np.float64)
    positions = np.arange(len(frame))
    groups = frame["dims_key"].astype(str).to_numpy()
    for dims_key, rows in pd.Series(positions).groupby(groups, sort=False):
        rows = rows.to_numpy()
        problem_values = frame.iloc[rows][list(family.problem_fields)].drop_duplicates()
        if len(problem_values) != 1:
            raise ValueError(f"dims_key {dims_key!r} has {len(problem_values)} different problem "
                             f"field combinations; re-key the dataset with family.dims_key")
        first = problem_values.iloc[0]
        problem = family.problem({f: first[f] for f in family.problem_fields})
        row_kernels = [kernels[i] for i in rows]
        kernel_matrix = kernel_rows[[kernel_index[k] for k in row_kernels]]
        X[rows] = engine.combine(problem, engine.problem_features(problem), kernel_matrix,
                                 [configs[k] for k in row_kernels])
    y = frame["tflops"].to_numpy(dtype=np.float64)
    return Features(X=X, y_tflops=y, groups=groups, kernels=kernels)


def row_weights(tflops: np.ndarray, groups: np.ndarray, power: float) -> np.ndarray:
    """(tflops / best tflops of the same problem) ** power, one weight per row."""
    best = pd.Series(tflops).groupby(groups).transform("max").to_numpy()
    return (tflops / best) ** power


def group_folds(groups: np.ndarray, folds: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train_idx, val_idx) pairs of GroupKFold(min(folds, n_groups)) keyed on the groups."""
    # sklearn is slow to import (scipy with it); only cross-validation needs it
    from sklearn.model_selection import GroupKFold

    n_groups = len(np.unique(groups))
    if n_groups < 2:
        raise ValueError(f"cross-validation needs at least 2 problems (dims_key groups), got "
                         f"{n_groups}; benchmark more training problems")
    splitter = GroupKFold(n_splits=min(folds, n_groups))
    return list(splitter.split(np.zeros(len(groups)), groups=groups))


def selection_efficiency(pred: np.ndarray, tflops: np.ndarray, groups: np.ndarray) -> float:
    """Mean over groups of tflops[argmax pred] / max tflops (measured, per group)."""
    frame = pd.DataFrame({"pred": pred, "tflops": tflops, "group": groups})
    chosen = frame.loc[frame.groupby("group", sort=False)["pred"].idxmax()].set_index("group")
    best = frame.groupby("group", sort=False)["tflops"].max()
    return float((chosen["tflops"] / best.loc[chosen.index]).mean())


@dataclass(frozen=True)
class TrainResult:
    """What train_model produced: artifact directory, final booster, CV metrics, rounds."""
    out_dir: Path
    booster: Any
    cv: dict
    num_boost_round: int


def check_warm_start(base_dir: str | Path, family, engine, spec: ModelSpec) -> Path:
    """model.txt of a base model that training may continue from; ModelArtifactError naming
    the difference when its family, features (names and order) or target differ."""
    base_dir = Path(base_dir)
    load_predictor(base_dir)  # files present and consistent
    base = json.loads((base_dir / FEATURE_SPEC_FILE).read_text())
    wanted = {"family": family.name, "feature_names": list(engine.feature_names()),
              "target_transform": spec.target}
    for key, value in wanted.items():
        if base.get(key) != value:
            detail = value if key != "feature_names" else (
                f"{len(value)} features of engine {engine.name} v{engine.version}")
            raise ModelArtifactError(f"cannot warm-start from {base_dir}: its {key} differs "
                                     f"(base {str(base.get(key))[:80]!r}, this run {detail!r}); "
                                     "train from scratch (drop warm_start)")
    return base_dir / MODEL_FILE


def train_model(family, engine, frame: pd.DataFrame, spec: ModelSpec, out_dir: str | Path,
                hardware: Mapping, lineage: list | None = None,
                data_hash: str | None = None, init_model: str | Path | None = None) -> TrainResult:
    """Cross-validate, refit on all rows and write the model artifact into `out_dir`.

    `frame` holds valid training rows only (dataset.valid); `data_hash` defaults to a hash of
    the (dims_key, kernel, tflops) rows. `init_model` (a model.txt checked by
    check_warm_start) continues boosting from an earlier model: CV then picks how many trees
    to add (its figure is optimistic, as the base may have seen the validation problems).
    """
    import lightgbm as lgb  # slow to import (sklearn, scipy); only fitting and loading need it

    features = featurize(family, engine, frame)
    bad = ~(np.isfinite(features.y_tflops) & (features.y_tflops > 0))
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{int(bad.sum())} training row(s) have no positive finite tflops, e.g. "
                         f"{features.kernels[first]} on {features.groups[first]}: "
                         f"{features.y_tflops[first]!r}; pass dataset.valid(final)")
    forward, _ = target_transform(spec.target)
    y = forward(features.y_tflops)
    weights = row_weights(features.y_tflops, features.groups, spec.top_weight)
    names = engine.feature_names()
    params = spec.lgb_params(int(hardware.get("threads") or 2))

    init = None if init_model is None else str(init_model)
    base_trees = 0 if init is None else lgb.Booster(model_file=init).current_iteration()
    fold_metrics, best_iterations = [], []
    for number, (train_idx, val_idx) in enumerate(group_folds(features.groups, spec.folds)):
        train_set = lgb.Dataset(features.X[train_idx], y[train_idx], weight=weights[train_idx],
                                feature_name=names)
        val_set = lgb.Dataset(features.X[val_idx], y[val_idx], weight=weights[val_idx],
                              reference=train_set)
        booster = lgb.train(params, train_set, num_boost_round=spec.n_estimators,
                            init_model=init, valid_sets=[val_set], callbacks=[
                                lgb.early_stopping(spec.early_stopping_rounds, verbose=False)])
        best = int(booster.best_iteration) or booster.num_trees()
        pred = booster.predict(features.X[val_idx], num_iteration=best)
        best -= base_trees  # rounds added on top of the base model
        best_iterations.append(best)
        fold_metrics.append({
            "fold": number, "train_rows": int(len(train_idx)), "val_rows": int(len(val_idx)),
            "train_problems": int(len(np.unique(features.groups[train_idx]))),
            "val_problems": int(len(np.unique(features.groups[val_idx]))),
            "best_iteration": best,
            "rmse": float(np.sqrt(np.mean((pred - y[val_idx]) ** 2))),
            "mean_efficiency": selection_efficiency(pred, features.y_tflops[val_idx],
                                                    features.groups[val_idx])})
    cv = {"folds": fold_metrics,
          "mean_rmse": float(np.mean([f["rmse"] for f in fold_metrics])),
          "mean_efficiency": float(np.mean([f["mean_efficiency"] for f in fold_metrics]))}

    num_boost_round = max(1, int(round(stats.median(best_iterations))))
    booster = lgb.train(params, lgb.Dataset(features.X, y, weight=weights, feature_name=names),
                        num_boost_round=num_boost_round, init_model=init)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / MODEL_FILE, booster.model_to_string())
    atomic_write_json(out_dir / FEATURE_SPEC_FILE, {
        "family": family.name, "feature_names": list(names), "engine": engine.name,
        "engine_version": engine.version, "target_transform": spec.target,
        "hardware": dict(hardware), "model_spec": asdict(spec)})
    atomic_write_json(out_dir / MANIFEST_FILE, {
        "data_hash": data_hash or frame_hash(frame), "rows": int(len(frame)),
        "problems": int(len(np.unique(features.groups))),
        "kernels": int(len(set(features.kernels))), "cv": cv,
        "num_boost_round": num_boost_round, "base_trees": base_trees,
        "lineage": list(lineage or []),
        "versions": library_versions(), "git_sha": git_sha(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    return TrainResult(out_dir=out_dir, booster=booster, cv=cv, num_boost_round=num_boost_round)


def frame_hash(frame: pd.DataFrame) -> str:
    """sha256 of the sorted (dims_key, kernel, tflops) rows: what the model was fitted on."""
    rows = frame[["dims_key", "kernel", "tflops"]].astype(str).sort_values(["dims_key", "kernel"])
    return hashlib.sha256(rows.to_csv(index=False).encode()).hexdigest()


class Predictor:
    """A trained model: predicts TFLOP/s from feature rows in the spec's feature order."""

    def __init__(self, booster, feature_spec: Mapping):
        self.booster = booster
        self.feature_spec = dict(feature_spec)
        self.feature_names = list(feature_spec["feature_names"])
        self.target_transform = feature_spec["target_transform"]
        self._inverse = target_transform(self.target_transform)[1]

    def predict_tflops(self, X: np.ndarray) -> np.ndarray:
        """Predicted TFLOP/s, one per row of X (columns in feature_names order)."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != len(self.feature_names):
            raise ValueError(f"feature matrix has shape {X.shape}; the model expects "
                             f"(rows, {len(self.feature_names)}) in feature_spec order")
        return self._inverse(self.booster.predict(X))


def load_predictor(model_dir: str | Path) -> Predictor:
    """Read model.txt and feature_spec.json; ModelArtifactError names a missing/corrupt file."""
    import lightgbm as lgb  # slow to import (sklearn, scipy); only fitting and loading need it

    model_dir = Path(model_dir)
    model_path, spec_path = model_dir / MODEL_FILE, model_dir / FEATURE_SPEC_FILE
    for path in (model_path, spec_path):
        if not path.is_file():
            raise ModelArtifactError(f"model file {path} is missing; retrain or re-publish the "
                                     "model")
    try:
        spec = json.loads(spec_path.read_text())
        names, transform = spec["feature_names"], spec["target_transform"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ModelArtifactError(f"feature spec {spec_path} is corrupt ({err!r}); it needs "
                                 "feature_names and target_transform: retrain") from None
    if transform not in TARGETS:
        raise ModelArtifactError(f"feature spec {spec_path} names unknown target transform "
                                 f"{transform!r}; valid: {', '.join(TARGETS)}")
    try:
        booster = lgb.Booster(model_file=str(model_path))
    except lgb.basic.LightGBMError as err:
        raise ModelArtifactError(f"model file {model_path} is corrupt ({err}); retrain") from None
    if booster.num_feature() != len(names):
        raise ModelArtifactError(f"model file {model_path} uses {booster.num_feature()} features "
                                 f"but {spec_path} lists {len(names)}; the files do not match")
    return Predictor(booster, spec)
