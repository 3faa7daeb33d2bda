"""Other devices' measurements as features: what a configuration reached on the same problem
on the devices the model was trained on is the best evidence of what it reaches on another.

A `Reference` keeps the training data's efficiencies (best ok time of a (device, problem)
group / the configuration's time; 0 for a configuration that failed or was invalid there,
missing where it was not measured) as a dense array devices x problems x candidates. For a
row (device d, problem p, configuration c) it gives NAMES, computed over the reference devices
other than d, so that a training row sees exactly what a row of a new device sees at serving
time (every device is left out of its own features, trained on or not):

    ref:near            efficiency of c on p on the most similar device that measured it
                        (devices.feature_distance over the device features)
    ref:wmean           mean over the devices that measured it, weighted 1 / (1 + distance)^2
    ref:mean, max, min  plain mean, best and worst over those devices
    ref:rank            mean over those devices of c's rank in its group, 1 the best, 0 the
                        worst
    ref:devices         how many devices measured it
    ref:near_distance   distance of d to its most similar reference device
    ref:problem_distance  0 when p itself was measured on a reference device; otherwise the
                        features come from the most similar measured problem and this says
                        how unlike it is (log2 problem dimensions in standard deviations, a
                        differing category counting CATEGORY_GAP)
    ref:gap0..5         for the first numeric configuration parameters, how far c's value lies
                        from the value predicted best on d (tilecast.table.ideal: the
                        reference devices' best values and their trend over one hardware
                        figure); missing for a schema with fewer parameters

A problem no reference device measured (a new problem, or a fold's held-out ones) takes its
features from the nearest measured problem. Training marks NEW_PROBLEM_SHARE of its
(device, problem) groups as new (seeded) and computes theirs from the nearest other problem,
so the model learns how far a neighbour's figures carry.

The array costs 4 bytes a cell; beyond MAX_CELLS the reference keeps a seeded sample of
problems (logged), and features of the others come from their nearest kept problem.
"""
from __future__ import annotations

import io
import logging
import zipfile
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from tilecast.table import ideal
from tilecast.table.dataset import TableDataError, TableSchema, key_of, parse_key
from tilecast.table.devices import CATEGORICAL, CATEGORY_GAP, feature_distance

log = logging.getLogger("tilecast.table.reference")

NAMES = ("ref:near", "ref:wmean", "ref:mean", "ref:max", "ref:min", "ref:rank", "ref:devices",
         "ref:near_distance", "ref:problem_distance",
         *(f"ref:gap{j}" for j in range(ideal.MAX_PARAMETERS)))
#: NAMES computed per cell by _summaries (the rest are per device or per problem)
SUMMARIES = NAMES.index("ref:devices") + 1
FILE = "reference.npz"
MAX_CELLS = 40_000_000
NEW_PROBLEM_SHARE = 0.25
#: cells (reference devices x problems x candidates) gathered at once
BLOCK_CELLS = 8_000_000


def _problem_matrix(frame: pd.DataFrame, schema: TableSchema) -> tuple[np.ndarray, np.ndarray]:
    """(log2 numeric dimensions, categorical values as strings) of `frame`'s problem columns."""
    numeric = [c.name for c in schema.problem if c.kind == "numeric"]
    categorical = [c.name for c in schema.problem if c.kind == "categorical"]
    values = (np.log2(np.abs(frame[numeric].to_numpy(dtype=np.float64)) + 1.0) if numeric
              else np.empty((len(frame), 0)))
    labels = (frame[categorical].astype(str).to_numpy(dtype=str) if categorical
              else np.empty((len(frame), 0), dtype=str))
    return values, labels


def _ranks(efficiency: np.ndarray) -> np.ndarray:
    """Per (device, problem) group along the last axis: 1 for the best measured candidate,
    0 for the worst, evenly between; NaN where not measured (0.5 for a lone measurement)."""
    measured = np.isfinite(efficiency)
    filled = np.where(measured, efficiency, -np.inf)
    order = np.argsort(np.argsort(filled, axis=-1, kind="stable"), axis=-1, kind="stable")
    count = measured.sum(axis=-1, keepdims=True)
    missing = efficiency.shape[-1] - count            # sorted first
    with np.errstate(divide="ignore", invalid="ignore"):
        rank = np.where(count > 1, (order - missing) / np.maximum(count - 1, 1), 0.5)
    return np.where(measured, rank, np.nan).astype(np.float32)


@dataclass
class Reference:
    """The training devices' efficiencies (module docstring). Build with `build` or `load`."""
    devices: list[str]                 # canonical names, sorted
    device_vectors: np.ndarray         # (D, device features)
    scale: np.ndarray                  # device feature scale (DeviceTable.scale at training)
    kernels: list[str]                 # candidate keys, sorted
    problem_values: np.ndarray         # (P, numeric problem columns): log2(|x| + 1)
    problem_labels: np.ndarray         # (P, categorical problem columns): strings
    efficiency: np.ndarray             # (D, P, C) float32

    def __post_init__(self):
        self._kernel_index = {k: i for i, k in enumerate(self.kernels)}
        self._device_index = {d: i for i, d in enumerate(self.devices)}
        self._measured = np.isfinite(self.efficiency).any(axis=2)          # (D, P)
        self._ranks = _ranks(self.efficiency)
        spread = self.problem_values.std(axis=0) if len(self.problem_values) else np.zeros(0)
        self._problem_scale = np.where(spread > 0, spread, np.inf)
        self._ideal: tuple[np.ndarray, np.ndarray] | None = None
        self._predicted: dict[tuple[str, bytes], np.ndarray] = {}
        self._reach: dict[bytes, float] = {}     # per device mask: a dispatcher asks per problem

    # -- building --------------------------------------------------------------------------

    @classmethod
    def build(cls, ok: pd.DataFrame, efficiency: np.ndarray, failed: pd.DataFrame,
              schema: TableSchema, device_table, kernels: Sequence[str],
              seed: int = 0) -> "Reference":
        """From the ok rows (canonical devices) with their `efficiency`, and the failed or
        invalid rows (`failed`, efficiency 0 where no ok time exists for the same cell)."""
        devices = sorted(set(ok["device"]))
        problems = ok.drop_duplicates("dims_key").sort_values("dims_key")
        kernels = sorted(kernels)
        cells = len(devices) * len(problems) * len(kernels)
        if cells > MAX_CELLS:
            keep = max(1, MAX_CELLS // max(1, len(devices) * len(kernels)))
            picked = np.sort(np.random.default_rng(seed).choice(len(problems), keep,
                                                                 replace=False))
            log.info("reference: %d devices x %d problems x %d candidates is over %d cells; "
                     "keeping %d problems (seeded)", len(devices), len(problems),
                     len(kernels), MAX_CELLS, keep)
            problems = problems.iloc[picked]
        problem_index = pd.Index(problems["dims_key"])
        device_index, kernel_index = pd.Index(devices), pd.Index(kernels)
        array = np.full((len(devices), len(problems), len(kernels)), np.nan, dtype=np.float32)
        for rows, values in ((failed, None), (ok, efficiency)):
            if rows is None or rows.empty:
                continue
            d = device_index.get_indexer(rows["device"])
            p = problem_index.get_indexer(rows["dims_key"])
            k = kernel_index.get_indexer(rows["kernel"])
            inside = (d >= 0) & (p >= 0) & (k >= 0)
            array[d[inside], p[inside], k[inside]] = (
                0.0 if values is None else np.asarray(values, dtype=np.float32)[inside])
        vectors = np.array([device_table.features(d) for d in devices], dtype=np.float64)
        values, labels = _problem_matrix(problems, schema)
        return cls(devices=devices, device_vectors=vectors, scale=device_table.scale,
                   kernels=kernels, problem_values=values, problem_labels=labels,
                   efficiency=array)

    # -- features --------------------------------------------------------------------------

    def _nearest_problems(self, values: np.ndarray, labels: np.ndarray, usable: np.ndarray,
                          exclude: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(index, distance) of the nearest reference problem in `usable` (P bool) for each
        query problem; `exclude` (Q, reference index or -1) is never chosen. Index -1 when no
        problem is usable."""
        count = len(values)
        index = np.full(count, -1, dtype=np.int64)
        distance = np.full(count, np.nan)
        if not usable.any():
            return index, distance
        step = max(1, BLOCK_CELLS // max(1, len(self.problem_values)))
        for start in range(0, count, step):
            stop = min(count, start + step)
            gaps = (values[start:stop, None, :] - self.problem_values[None, :, :]) \
                / self._problem_scale
            squares = np.sum(np.where(np.isfinite(gaps), gaps, 0.0) ** 2, axis=2)
            if labels.shape[1]:
                differ = labels[start:stop, None, :] != self.problem_labels[None, :, :]
                squares = squares + differ.sum(axis=2) * CATEGORY_GAP ** 2
            squares = np.where(usable[None, :], squares, np.inf)
            if exclude is not None:
                rows = np.flatnonzero(exclude[start:stop] >= 0)
                squares[rows, exclude[start:stop][rows]] = np.inf
            best = np.argmin(squares, axis=1)
            found = np.isfinite(squares[np.arange(stop - start), best])
            index[start:stop] = np.where(found, best, -1)
            distance[start:stop] = np.where(found, np.sqrt(squares[np.arange(stop - start),
                                                                   best]), np.nan)
        return index, distance

    def grid(self, device: str, device_vector: np.ndarray, problems: pd.DataFrame,
             kernels: Sequence[str], schema: TableSchema,
             new_problem: np.ndarray | None = None) -> np.ndarray:
        """(P, C, len(NAMES)) float32 for every row of `problems` (problem columns) with every
        key of `kernels` on `device` (canonical; left out of the reference devices) whose
        features are `device_vector`. `new_problem` (P bool): compute those problems' features
        from their nearest other measured problem (training's augmentation)."""
        out = np.full((len(problems), len(kernels), len(NAMES)), np.nan, dtype=np.float32)
        others = np.array([d != device for d in self.devices], dtype=bool)
        out[:, :, NAMES.index("ref:devices")] = 0.0
        if not others.any() or len(problems) == 0:
            return out
        distances = np.array([feature_distance(device_vector, vector, self.scale)
                              for vector in self.device_vectors[others]])
        order = np.argsort(distances, kind="stable")
        refs = np.flatnonzero(others)[order]                 # reference devices, nearest first
        distances = distances[order]
        out[:, :, NAMES.index("ref:near_distance")] = distances[0]
        weights = (1.0 / (1.0 + distances) ** 2).astype(np.float32)

        values, labels = _problem_matrix(problems, schema)
        usable = self._measured[refs].any(axis=0)
        exact, gap = self._nearest_problems(values, labels, usable)
        exact_hit = np.isfinite(gap) & (gap == 0)
        if new_problem is not None and new_problem.any():
            rows = np.flatnonzero(exact_hit & new_problem)      # moved to their neighbour
            exact[rows], gap[rows] = self._nearest_problems(values[rows], labels[rows], usable,
                                                            exclude=exact[rows])
        out[:, :, NAMES.index("ref:problem_distance")] = gap[:, None]

        columns = np.array([self._kernel_index.get(k, -1) for k in kernels])
        known = np.flatnonzero(columns >= 0)
        rows = np.flatnonzero(exact >= 0)
        if not len(known) or not len(rows):
            return out
        step = max(1, BLOCK_CELLS // max(1, len(refs) * len(known)))
        for start in range(0, len(rows), step):
            chunk = rows[start:start + step]
            picked = np.ix_(refs, exact[chunk], columns[known])
            cells = self.efficiency[picked]                     # (R, Q, K)
            ranks = self._ranks[picked]
            out[np.ix_(chunk, known, np.arange(SUMMARIES))] = _summaries(cells, ranks, weights)
        values, ideals = self._ideals(schema)
        if values.shape[1]:
            key = (device, np.asarray(device_vector, dtype=np.float64).tobytes())
            predicted = self._predicted.get(key)
            if predicted is None:           # once per device: a dispatcher asks again and again
                predicted, _ = ideal.predict(ideals[refs], self.device_vectors[refs],
                                             device_vector, self.scale, ~CATEGORICAL)
                predicted = np.clip(predicted, values.min(axis=0), values.max(axis=0))
                self._predicted[key] = predicted
            first = NAMES.index("ref:gap0")
            gaps = values[columns[known]][None, :, :] - predicted[exact[rows]][:, None, :]
            out[np.ix_(rows, known, np.arange(first, first + values.shape[1]))] = gaps
        return out

    def measured(self, device: str, problems: pd.DataFrame, schema: TableSchema) -> np.ndarray:
        """(P,) bool: whether each row of `problems` (problem columns) was measured on
        `device` in the training data (kept problems only: see MAX_CELLS)."""
        row = self._device_index.get(device)
        if row is None or len(problems) == 0:
            return np.zeros(len(problems), dtype=bool)
        values, labels = _problem_matrix(problems, schema)
        _, gap = self._nearest_problems(values, labels, self._measured[row])
        return np.isfinite(gap) & (gap == 0)

    def _ideals(self, schema: TableSchema) -> tuple[np.ndarray, np.ndarray]:
        """(the candidates' log parameter values (C, J), the ideals (D, P, J)) of the first
        ideal.MAX_PARAMETERS numeric configuration parameters, computed once."""
        if self._ideal is None:
            names = [c.name for c in schema.config if c.kind == "numeric"]
            names = names[:ideal.MAX_PARAMETERS]
            configs = [[float(parse_key(k, schema.config)[n]) for n in names]
                       for k in self.kernels]
            values = ideal.log_values(configs).reshape(len(self.kernels), len(names))
            self._ideal = (values, ideal.ideals(self.efficiency, values))
        return self._ideal

    def beyond(self, device: str, device_vector: np.ndarray) -> list[str]:
        """Why `device` lies further from the other reference devices than leave-one-device-
        out calibration measured, or [] when it does not. Calibration held out each training
        device in turn, so it measured picks on devices as far from their nearest training
        device as `reach` and no farther: a device whose nearest other reference device lies
        further off (devices.feature_distance), or with a category (vendor, kind) none of them
        has, is beyond. The reasons are the device features (DeviceTable.FEATURE_NAMES) on
        which it lies outside the others (outside their range, a category none has), else
        "distance". With one other reference device every difference is beyond."""
        from tilecast.table.devices import DeviceTable

        mask = np.array([d != device for d in self.devices])
        others = self.device_vectors[mask]
        if not len(others):
            return list(DeviceTable.FEATURE_NAMES)
        outside, novel = [], False
        for index, name in enumerate(DeviceTable.FEATURE_NAMES):
            value, known = device_vector[index], others[:, index]
            known = known[np.isfinite(known)]
            if not np.isfinite(value) or not len(known):
                continue
            if CATEGORICAL[index] and value not in known:
                outside.append(name)
                novel = True
            elif not CATEGORICAL[index] and (value < known.min() or value > known.max()):
                outside.append(name)
        nearest = min(feature_distance(device_vector, other, self.scale) for other in others)
        if not novel and nearest <= self.reach(mask) + 1e-9:
            return []
        return outside or ["distance"]

    def reach(self, mask: np.ndarray | None = None) -> float:
        """How far from their nearest other device the reference devices selected by `mask`
        (default all) lie, at most (devices.feature_distance; 0 with fewer than two): the
        farthest leave-one-device-out calibration has measured a pick from its training
        devices."""
        mask = np.ones(len(self.devices), dtype=bool) if mask is None else np.asarray(mask, bool)
        key = mask.tobytes()
        if key not in self._reach:
            vectors = self.device_vectors[mask]
            self._reach[key] = 0.0 if len(vectors) < 2 else max(
                min(feature_distance(vector, other, self.scale)
                    for j, other in enumerate(vectors) if j != i)
                for i, vector in enumerate(vectors))
        return self._reach[key]

    # -- files -----------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The reference as an .npz (no pickled objects)."""
        buffer = io.BytesIO()
        np.savez_compressed(buffer, devices=np.array(self.devices, dtype=str),
                            device_vectors=self.device_vectors, scale=self.scale,
                            kernels=np.array(self.kernels, dtype=str),
                            problem_values=self.problem_values,
                            problem_labels=self.problem_labels.astype(str),
                            efficiency=self.efficiency)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, source: str = FILE) -> "Reference":
        """The reference `to_bytes` wrote; TableDataError naming what is missing or
        inconsistent."""
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as stored:
                arrays = {name: stored[name] for name in (
                    "devices", "device_vectors", "scale", "kernels", "problem_values",
                    "problem_labels", "efficiency")}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
            raise TableDataError(f"{source} is damaged: {err}") from None
        shape = arrays["efficiency"].shape
        expected = (len(arrays["devices"]), len(arrays["problem_values"]), len(arrays["kernels"]))
        if (len(shape) != 3 or shape != expected
                or len(arrays["device_vectors"]) != len(arrays["devices"])
                or len(arrays["problem_labels"]) != len(arrays["problem_values"])):
            raise TableDataError(f"{source} is damaged: efficiency {shape} does not match "
                                 f"devices x problems x candidates {expected}")
        return cls(devices=[str(d) for d in arrays["devices"]],
                   device_vectors=arrays["device_vectors"].astype(np.float64),
                   scale=arrays["scale"].astype(np.float64),
                   kernels=[str(k) for k in arrays["kernels"]],
                   problem_values=arrays["problem_values"].astype(np.float64),
                   problem_labels=arrays["problem_labels"].astype(str),
                   efficiency=arrays["efficiency"].astype(np.float32))


def _summaries(cells: np.ndarray, ranks: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(Q, K, the first NAMES up to ref:devices) from reference cells (R, Q, K) with devices
    nearest first, their ranks and the devices' weights."""
    measured = np.isfinite(cells)
    count = measured.sum(axis=0)
    has = count > 0
    first = np.argmax(measured, axis=0)                         # nearest device measured
    near = np.take_along_axis(cells, first[None], axis=0)[0]
    zero = np.where(measured, cells, 0.0)
    w = np.where(measured, weights[:, None, None], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        wmean = (zero * w).sum(axis=0) / w.sum(axis=0)
        mean = zero.sum(axis=0) / count
        rank = np.where(measured, ranks, 0.0).sum(axis=0) / count
    best = np.where(measured, cells, -np.inf).max(axis=0)
    worst = np.where(measured, cells, np.inf).min(axis=0)
    stacked = np.stack([near, wmean, mean, best, worst, rank], axis=-1)
    stacked = np.where(has[..., None], stacked, np.nan)
    return np.concatenate([stacked, count[..., None]], axis=-1).astype(np.float32)


def new_problem_mask(devices: Sequence[str], dims_keys: Sequence[str], seed: int) -> np.ndarray:
    """NEW_PROBLEM_SHARE of the (device, problem) pairs, seeded: training rows whose
    reference features come from their nearest other problem (module docstring)."""
    groups = pd.DataFrame({"device": list(devices), "dims_key": list(dims_keys)})
    codes = groups.groupby(["device", "dims_key"], sort=True).ngroup().to_numpy()
    draws = np.random.default_rng(seed + 7919).random(codes.max() + 1 if len(codes) else 0)
    return draws[codes] < NEW_PROBLEM_SHARE if len(codes) else np.zeros(0, dtype=bool)


def rows_features(reference: Reference | None, frame: pd.DataFrame, schema: TableSchema,
                  vectors: Mapping[str, np.ndarray], new_problem: np.ndarray | None = None
                  ) -> np.ndarray:
    """(N, len(NAMES)) for rows holding `device` (canonical), `dims_key`, `kernel` and the
    problem columns: per device, the grid of its distinct problems x distinct kernels,
    gathered to the rows. `vectors`: device name -> feature vector. All missing without a
    reference."""
    out = np.full((len(frame), len(NAMES)), np.nan, dtype=np.float32)
    if reference is None or frame.empty:
        return out
    mask = np.zeros(len(frame), dtype=bool) if new_problem is None else np.asarray(new_problem)
    keys = (frame["dims_key"].astype(str) if "dims_key" in frame.columns else
            frame[list(schema.problem_names)].astype(str).agg("|".join, axis=1))
    if "kernel" not in frame.columns:       # rows given by their configuration columns
        names = list(schema.config_names)
        frame = frame.assign(kernel=[key_of(names, dict(zip(names, values))) for values
                                     in frame[names].itertuples(index=False, name=None)])
    for device, positions in frame.groupby("device", sort=False).indices.items():
        rows = frame.iloc[positions]
        # a (problem, new?) pair is one grid row: a problem may appear in both modes
        problem_keys = keys.iloc[positions] + np.where(mask[positions], "|new", "")
        p_codes, p_unique = pd.factorize(problem_keys)
        k_codes, k_unique = pd.factorize(rows["kernel"])
        _, first = np.unique(p_codes, return_index=True)
        problems = rows.iloc[first]
        grid = reference.grid(device, vectors[device], problems, list(k_unique), schema,
                              new_problem=mask[positions][first])
        out[positions] = grid[p_codes, k_codes]
    return out
