"""Change points: a kernel that moves against its rivals for several nights.

The median polish of each problem's kernels x nights (tilecast.store.labels.polished) leaves a
residual per (problem, kernel, night): how much slower (> 0, log) the kernel ran that night
than its pooled time, the night's level taken out. A kernel's shift on a night is the median
of its residuals over the problems that night measured. A kernel whose last `confirm` nights
all shifted the same way, each by more than `min_shift` and by more than `z` robust spreads
(MAD) of its shifts on the nights before them, has a change point at the first of them
(Conbench's lookback z-score, on relative labels): a binary, compiler or machine change that
moved this kernel and not its rivals. A night whose whole level moved shifts no kernel.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from tilecast.store import labels as pooled_labels

DRIFT_WINDOW = 16       # the nights each problem's polish looks at
CONFIRM_NIGHTS = 2      # nights in a row that must agree
MIN_SHIFT = 0.03        # 3 %: smaller moves are within a night's own noise (docs/journal/)
Z_LIMIT = 4.0           # robust z-score against the nights before
MIN_LOOKBACK = 2        # nights before the change needed to judge it


@dataclass(frozen=True)
class ChangePoint:
    """A kernel that moved against its rivals: from `night` on, by `shift` (relative time:
    +0.05 is 5 % slower), over `problems` problems, z-score `z` against the nights before."""
    kernel: str
    night: str
    shift: float
    z: float
    problems: int

    def as_dict(self) -> dict:
        return asdict(self)


def kernel_shifts(records: pd.DataFrame, window: int = DRIFT_WINDOW) -> pd.DataFrame:
    """(kernel x night) median log residual over the problems measured, nights in time order,
    and the count of problems behind each cell (`problems`)."""
    night_labels = pooled_labels.night_labels(records)
    rows = []
    for dims_key, kernels, nights, _, residual in pooled_labels.polished(night_labels, window):
        for i, kernel in enumerate(kernels):
            for j, night in enumerate(nights):
                if np.isfinite(residual[i, j]):
                    rows.append((kernel, night, dims_key, residual[i, j]))
    frame = pd.DataFrame(rows, columns=["kernel", "run_id", "dims_key", "residual"])
    if frame.empty:
        return pd.DataFrame(dtype=float)
    order = pooled_labels.nights_in_order(records)
    shifts = frame.pivot_table(index="kernel", columns="run_id", values="residual",
                               aggfunc="median")
    return shifts.reindex(columns=[n for n in order if n in shifts.columns])


def change_points(records: pd.DataFrame, confirm: int = CONFIRM_NIGHTS,
                  min_shift: float = MIN_SHIFT, z_limit: float = Z_LIMIT) -> list[ChangePoint]:
    """The kernels whose last `confirm` nights moved against their rivals (module docstring)."""
    shifts = kernel_shifts(records)
    found = []
    for kernel, row in shifts.iterrows():
        series = row.dropna()
        if len(series) < confirm + MIN_LOOKBACK:
            continue
        before, recent = series.iloc[:-confirm].to_numpy(), series.iloc[-confirm:].to_numpy()
        centre = float(np.median(before))
        scale = max(1.4826 * float(np.median(np.abs(before - centre))), 1e-3)
        moved = recent - centre
        same_way = np.all(moved > 0) or np.all(moved < 0)
        if not same_way or np.min(np.abs(moved)) < np.log1p(min_shift):
            continue
        z = float(np.min(np.abs(moved)) / scale)
        if z < z_limit:
            continue
        night = series.index[-confirm]
        problems = int(records.loc[(records["run_id"] == night) & (records["kernel"] == kernel),
                                   "dims_key"].nunique())
        found.append(ChangePoint(str(kernel), str(night), float(np.expm1(np.median(moved))), z,
                                 problems))
    return sorted(found, key=lambda c: -abs(c.shift))
