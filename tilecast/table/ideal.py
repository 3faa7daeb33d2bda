"""Where a configuration parameter's best value lies on a device no one measured.

On each measured (device, problem) the *ideal* of a numeric configuration parameter is the
soft-argmax of its log2 value over the configurations measured there: the mean of
log2(|value| + 1) weighted exp((efficiency - 1) / TEMPERATURE), so the configurations within a
few per cent of the best decide it. Across devices an ideal often follows one hardware figure
(a tile that grows with shared memory, an unroll that follows the warp size); a tree model
cannot extrapolate such a trend past its training devices, so the trend is fitted here and the
model sees, per row, how far the row's value lies from the ideal predicted for its device:

    gap_j(d, p, c) = log2(|c_j| + 1) - predicted ideal_j(d, p)

The prediction for device d from reference devices R (d never among them): per problem the
mean of the references' ideals plus one slope, shared by the problems, on a single numeric
device feature (in units of the device table's scale). The feature is the one whose
leave-one-reference-out error beats the plain mean by at least MIN_GAIN, else none (the mean
alone); fewer than MIN_REFERENCES references never fit a slope. The prediction is clipped to
the range the candidates span: no configuration lies beyond it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

TEMPERATURE = 0.03
#: gap features for the first MAX_PARAMETERS numeric configuration parameters
MAX_PARAMETERS = 6
MIN_REFERENCES = 3
#: a feature's leave-one-out error must be under (1 - MIN_GAIN) x the mean's to be used
MIN_GAIN = 0.1


def log_values(configs: Sequence[Sequence[float]]) -> np.ndarray:
    """(C, J) log2(|value| + 1) of numeric parameter values (rows: candidates)."""
    values = np.asarray(configs, dtype=np.float64)
    return np.log2(np.abs(values) + 1.0)


def ideals(efficiency: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(D, P, J) soft-argmax ideals from efficiencies (D, P, C; NaN not measured, 0 failed)
    and log values (C, J); NaN where a (device, problem) has no ok measurement."""
    out = np.full((*efficiency.shape[:2], values.shape[1]), np.nan)
    for device, cells in enumerate(efficiency):      # a device at a time bounds the memory
        ok = np.isfinite(cells) & (cells > 0)
        weight = np.where(ok, np.exp((np.where(ok, cells, 0.0) - 1.0) / TEMPERATURE), 0.0)
        total = weight.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (weight @ values) / total[:, None]
        out[device] = np.where(total[:, None] > 0, mean, np.nan)
    return out


def _fit(ideal: np.ndarray, z: np.ndarray | None):
    """(per-problem mean (P, J), slope (J,), per-problem mean of z (P, J)) over the
    references' ideals (R, P, J) and their feature values z (R,) (None: no slope)."""
    measured = np.isfinite(ideal)
    count = measured.sum(axis=0)
    safe = np.maximum(count, 1)
    mean = np.where(count > 0, np.where(measured, ideal, 0.0).sum(axis=0) / safe, np.nan)
    if z is None:
        return mean, np.zeros(ideal.shape[2]), np.zeros(ideal.shape[1:])
    spread = np.where(measured, z[:, None, None], 0.0)
    mean_z = spread.sum(axis=0) / safe
    dz = np.where(measured, z[:, None, None] - mean_z, 0.0)
    dy = np.where(measured, ideal - np.nan_to_num(mean), 0.0)
    numerator, denominator = (dz * dy).sum(axis=(0, 1)), (dz * dz).sum(axis=(0, 1))
    slope = np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1.0),
                     0.0)
    return mean, slope, mean_z


def _apply(fitted, z_target: float | None) -> np.ndarray:
    mean, slope, mean_z = fitted
    return mean if z_target is None else mean + slope * (z_target - mean_z)


def predict(ideal: np.ndarray, vectors: np.ndarray, target: np.ndarray, scale: np.ndarray,
            numeric: np.ndarray) -> tuple[np.ndarray, list[int | None]]:
    """(predicted ideals (P, J) on the device of feature vector `target`, the device feature
    chosen per parameter or None) from the reference devices' ideals (R, P, J) and feature
    vectors (R, F). `numeric` (F bool): features that may carry a slope."""
    references, parameters = len(vectors), ideal.shape[2]
    usable = [f for f in range(vectors.shape[1])
              if numeric[f] and scale[f] > 0 and np.isfinite(target[f])
              and np.all(np.isfinite(vectors[:, f])) and np.ptp(vectors[:, f]) > 0]
    choice: list[int | None] = [None] * parameters
    if references >= MIN_REFERENCES and usable:
        errors = {}
        for feature in [None, *usable]:
            z = None if feature is None else vectors[:, feature] / scale[feature]
            error = np.zeros(parameters)
            for left in range(references):
                rest = np.arange(references) != left
                guess = _apply(_fit(ideal[rest], None if z is None else z[rest]),
                               None if z is None else z[left])
                wrong = (guess - ideal[left]) ** 2
                error += np.where(np.isfinite(wrong), wrong, 0.0).sum(axis=0)
            errors[feature] = error
        for j in range(parameters):
            best = min(usable, key=lambda f: errors[f][j])
            if errors[best][j] < (1.0 - MIN_GAIN) * errors[None][j]:
                choice[j] = best
    out = np.empty(ideal.shape[1:])
    for j, feature in enumerate(choice):
        z = None if feature is None else vectors[:, feature] / scale[feature]
        z_target = None if feature is None else target[feature] / scale[feature]
        out[:, j] = _apply(_fit(ideal[:, :, j:j + 1], z), z_target)[:, 0]
    return out, choice
