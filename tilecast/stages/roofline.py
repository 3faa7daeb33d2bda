"""The roofline of a family's held-out problems: the chosen kernel's, the measured best's and
the peer's GFLOP/s against the machine's ceilings (tilecast.measurement.probe), measured when the
report is written, since a shared machine's speed drifts from one hour to the next.

A problem's roof is min(FMA peak, read bandwidth x FLOP per compulsory byte); the bandwidth is
read from a buffer past the last-level cache, so a problem whose operands stay in cache can
pass the bandwidth slope.
"""
from __future__ import annotations

import io
import math
from typing import Mapping

import numpy as np
import pandas as pd

from tilecast.core import stats
from tilecast.measurement import probe

READS = 3                        # each ceiling is the median of this many probe reads
L3_MULTIPLE = 4                  # the bandwidth buffer is at least this many L3s ...
BUFFER_MIN_MIB, BUFFER_MAX_MIB = 256, 2048   # ... within these bounds
BANDWIDTH_PASSES = 2
CEILING_KEYS = ("fma_peak_gflops", "read_bandwidth_gbps", "threads", "buffer_mib")


def buffer_mib(l3_bytes: int) -> int:
    """MiB of the bandwidth probe's buffer: L3_MULTIPLE last-level caches (some CPUs have
    hundreds of MiB of L3), within [BUFFER_MIN_MIB, BUFFER_MAX_MIB]; 0 bytes: L3 unknown."""
    if isinstance(l3_bytes, bool) or not isinstance(l3_bytes, int) or l3_bytes < 0:
        raise ValueError(f"l3_bytes must be a whole number of bytes >= 0 (0: unknown), "
                         f"got {l3_bytes!r}")
    return min(BUFFER_MAX_MIB, max(BUFFER_MIN_MIB, -(-L3_MULTIPLE * l3_bytes // 2 ** 20)))


def measure_ceilings(threads: int, l3_bytes: int) -> dict:
    """The FMA peak (GFLOP/s) and read bandwidth (GB/s) of `threads` threads, each the median
    of READS reads taken in alternation, so a change of clock mid-way touches both alike."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a whole number of at least 1, got {threads!r}")
    mib = buffer_mib(l3_bytes)
    peaks, bandwidths = [], []
    for _ in range(READS):
        peaks.append(probe.fma_peak_gflops(threads))
        bandwidths.append(probe.read_bandwidth_gbps(threads, mib, BANDWIDTH_PASSES))
    return {"fma_peak_gflops": stats.median(peaks), "read_bandwidth_gbps": stats.median(bandwidths),
            "threads": threads, "buffer_mib": mib}


def _check_ceilings(ceilings: Mapping) -> tuple[float, float]:
    """(FMA peak, read bandwidth) of measure_ceilings()'s dict, refusing one it did not make."""
    values = [ceilings.get(key) for key in CEILING_KEYS]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"ceilings need positive finite {', '.join(CEILING_KEYS)}; got "
                         f"{dict(ceilings)} (measure_ceilings() gives them)")
    return float(values[0]), float(values[1])


def table(family, per_problem: pd.DataFrame, peer_per_problem: pd.DataFrame | None,
          ceilings: Mapping) -> pd.DataFrame:
    """One row per held-out problem of `per_problem` (evaluate's table): its FLOPs, compulsory
    bytes, intensity, the chosen / best / peer GFLOP/s (peer NaN where it was not measured),
    its roof, which ceiling bounds it and the chosen kernel's share of the roof."""
    peak, bandwidth = _check_ceilings(ceilings)
    if per_problem.empty:
        raise ValueError("roofline table: no held-out problems in the per-problem table")
    peer = {} if peer_per_problem is None else dict(
        zip(peer_per_problem["dims_key"], peer_per_problem["peer_tflops"]))
    rows = []
    for _, row in per_problem.iterrows():
        problem = family.problem({f: row[f] for f in family.problem_fields})
        flops, moved = family.flops(problem), family.bytes_moved(problem)
        intensity = flops / moved
        rows.append({"dims_key": row["dims_key"], "flops": flops, "bytes": moved,
                     "intensity": intensity, "chosen_gflops": row["chosen_tflops"] * 1e3,
                     "best_gflops": row["best_tflops"] * 1e3,
                     "peer_gflops": peer.get(row["dims_key"], np.nan) * 1e3,
                     "roof_gflops": min(peak, bandwidth * intensity),
                     "bound": "memory" if bandwidth * intensity < peak else "compute"})
    frame = pd.DataFrame(rows)
    frame["chosen_of_roof"] = frame["chosen_gflops"] / frame["roof_gflops"]
    return frame


def _median_or_none(values: pd.Series) -> float | None:
    values = values.dropna()
    return None if values.empty else float(stats.median(values))


def summary(roofline: pd.DataFrame, ceilings: Mapping) -> dict:
    """The JSON-able figures of a roofline table (None, never NaN, where there is no value)."""
    _check_ceilings(ceilings)
    chosen = roofline["chosen_of_roof"].to_numpy(dtype=np.float64)
    return {"n_problems": int(len(roofline)),
            "memory_bound": int((roofline["bound"] == "memory").sum()),
            "median_chosen_of_roof": float(stats.median(chosen)),
            "p10_chosen_of_roof": float(np.percentile(chosen, 10)),
            "median_best_of_roof": _median_or_none(roofline["best_gflops"] / roofline["roof_gflops"]),
            "median_peer_of_roof": _median_or_none(roofline["peer_gflops"] / roofline["roof_gflops"]),
            "fma_peak_gflops": float(ceilings["fma_peak_gflops"]),
            "read_bandwidth_gbps": float(ceilings["read_bandwidth_gbps"]),
            "threads": int(ceilings["threads"]), "buffer_mib": int(ceilings["buffer_mib"])}


# column -> (legend label, marker, colour, filled) of the points the plot draws
POINTS = {"chosen_gflops": ("chosen kernel", "o", "C0", True),
          "best_gflops": ("measured best", "^", "C1", False),
          "peer_gflops": ("peer library", "s", "C2", False)}


def plot(name: str, roofline: pd.DataFrame, ceilings: Mapping) -> bytes:
    """Log-log PNG: GFLOP/s against FLOP per compulsory byte, under the measured roof."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure   # matplotlib is slow to import; only plots need it

    peak, bandwidth = _check_ceilings(ceilings)
    intensity = roofline["intensity"].to_numpy(dtype=np.float64)
    ridge = peak / bandwidth
    x = np.geomspace(min(intensity.min(), ridge) / 2, max(intensity.max(), ridge) * 2, 256)
    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)  # Agg, without touching pyplot's global state
    axes = figure.add_subplot()
    axes.plot(x, np.minimum(peak, bandwidth * x), color="black", linewidth=1.5,
              label=f"roof: {bandwidth:.1f} GB/s read, {peak:.0f} GFLOP/s FMA peak "
                    f"({ceilings['threads']} threads)")
    top = peak
    for column, (label, marker, colour, filled) in POINTS.items():
        values = roofline[column].to_numpy(dtype=np.float64)
        shown = np.isfinite(values) & (values > 0)   # a log axis cannot show 0 or NaN
        if shown.any():
            axes.scatter(intensity[shown], values[shown], marker=marker, label=label,
                         edgecolors=colour, facecolors=colour if filled else "none")
            top = max(top, values[shown].max())
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_ylim(top=top * 1.5)   # the flat roof clear of the frame
    axes.set_xlabel("FLOP per compulsory byte")
    axes.set_ylabel("GFLOP/s")
    axes.set_title(f"{name}: held-out problems", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
