"""DISCO feature engine: problem, kernel, interaction and hardware features, fixed order.

Problems: the grids (sizes, longitude stride, latitude ratio), channels, K, the cutoff and an
estimate of psi's entries from it (the cap of radius theta_cutoff holds a (1 - cos theta) / 2
share of the input points: no psi is built at dispatch time), work and bytes from that
estimate, precision and basis one-hots. Kernels: variant one-hots (csr, kpacked, lines), the
register tile (BT channels, KREG basis functions for kpacked, 0 otherwise, LB input lines for
lines, 0 otherwise, NV, longitudes per tile, accumulators) and the latitude block (a lines
kernel's work item is LB input lines: LB / stride latitudes). Interactions: padded-longitude
waste of the tile on nlon_out (and whether nlon_out is narrower than one tile, the slow wrap
path), channel-tile waste, KREG padding waste (idle rows of the last pass over K, kpacked
only), work items and their balance over the threads, entries and band bytes per work item
against the caches, FMAs per loaded slice, and a roofline-like time estimate.

Each feature is one entry of PROBLEM_FEATURES, KERNEL_FEATURES or INTERACTION_FEATURES: its
name and its formula, over the quantities the features share (_ProblemTerms, _InteractionTerms);
the column order is the tables' order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from tilecast.spaces.disco import (BASES, ELEMENT_BYTES, LANES, PRECISIONS, VARIANTS,
                                             DiscoConfig, DiscoProblem)
from tilecast.features.hardware import HARDWARE_FEATURES, EngineBase

BASIS_NAMES = tuple(BASES)


def _log2(x: float) -> float:
    return math.log2(max(float(x), 1.0))


def _ceil_div(a, b):
    return -(-a // b)


def cap_fraction(theta_cutoff: float) -> float:
    """Share of the sphere within theta_cutoff of a point."""
    return (1.0 - math.cos(min(theta_cutoff, math.pi))) / 2.0


def nnz_row_estimate(p: DiscoProblem) -> float:
    """Entries of one psi row (basis function, output latitude): the input points in the cap,
    at least one latitude by one longitude (harmonic bases fill the whole disk; a piecewise-
    linear hat about 1 / K of it)."""
    points = max(cap_fraction(p.theta_cutoff) * p.nlat_in * p.nlon_in, 1.0)
    return points if p.basis == "harmonic" else max(points / max(p.kernel_size, 1) * 2.0, 1.0)


# -- problem features ------------------------------------------------------------------------

@dataclass(frozen=True)
class _ProblemTerms:
    """What several problem features share: psi's estimated entries, the work and bytes."""
    p: DiscoProblem
    elt: int           # bytes per stored element
    nnz_row: float     # estimated entries of one psi row
    nnz: float         # estimated entries of psi
    flops: float
    in_bytes: float
    out_bytes: float

    @classmethod
    def of(cls, p: DiscoProblem) -> "_ProblemTerms":
        elt = ELEMENT_BYTES[p.precision]
        nnz_row = nnz_row_estimate(p)
        nnz = nnz_row * p.kernel_size * p.nlat_out
        return cls(p, elt, nnz_row, nnz, flops=2.0 * p.bc * nnz * p.nlon_out,
                   in_bytes=elt * p.bc * p.nlat_in * p.nlon_in,
                   out_bytes=elt * p.bc * p.kernel_size * p.nlat_out * p.nlon_out)


ProblemFormula = Callable[[_ProblemTerms], float]

PROBLEM_FEATURES: dict[str, ProblemFormula] = {
    "batch": lambda t: t.p.batch,
    "channels": lambda t: t.p.channels,
    "log2_bc": lambda t: _log2(t.p.bc),
    "nlat_in": lambda t: t.p.nlat_in,
    "nlon_in": lambda t: t.p.nlon_in,
    "nlat_out": lambda t: t.p.nlat_out,
    "nlon_out": lambda t: t.p.nlon_out,
    "log2_nlon_out": lambda t: _log2(t.p.nlon_out),
    "lon_stride": lambda t: t.p.stride,
    "lat_ratio": lambda t: t.p.nlat_in / t.p.nlat_out,
    "kernel_size": lambda t: t.p.kernel_size,
    "theta_cutoff": lambda t: t.p.theta_cutoff,
    # the cap's extent in input latitudes and longitudes
    "cap_lats_in": lambda t: 2.0 * t.p.theta_cutoff / (math.pi / t.p.nlat_in) + 1.0,
    "cap_lons_in": lambda t: 2.0 * t.p.theta_cutoff / (2.0 * math.pi / t.p.nlon_in) + 1.0,
    "log2_nnz_row_est": lambda t: _log2(t.nnz_row),
    "log2_nnz_est": lambda t: _log2(t.nnz),
    "log2_flops_est": lambda t: _log2(t.flops),
    # activations and psi (12 bytes an entry: column and value, both directions' offsets)
    "log2_bytes_est": lambda t: _log2(t.in_bytes + t.out_bytes + 12 * t.nnz),
    "log2_in_bytes": lambda t: _log2(t.in_bytes),
    "log2_out_bytes": lambda t: _log2(t.out_bytes),
    "element_bytes": lambda t: t.elt,
    **{f"is_{name}": (lambda t, name=name: float(t.p.precision == name)) for name in PRECISIONS},
    **{f"is_{name}": (lambda t, name=name: float(t.p.basis == name)) for name in BASIS_NAMES},
}

# -- kernel features -------------------------------------------------------------------------

KernelFormula = Callable[[DiscoConfig], float]

# a csr row tile holds one basis function (kreg 0), a kpacked one kreg, a lines one lb input
# lines of one channel
KERNEL_FEATURES: dict[str, KernelFormula] = {
    "is_backward": lambda c: float(c.direction == "backward"),
    **{f"is_{name}": (lambda c, name=name: float(c.variant == name)) for name in VARIANTS},
    "bt": lambda c: c.bt,
    "kreg": lambda c: c.kreg,
    "lb": lambda c: c.lb,
    "nv": lambda c: c.nv,
    "tile_lons": lambda c: c.nv * LANES[c.isa],
    "log2_tile_lons": lambda c: math.log2(c.nv * LANES[c.isa]),
    "accumulators": lambda c: c.bt * max(c.kreg, 1) * max(c.lb, 1) * c.nv,
    "lat_block": lambda c: c.lat_block,
    "lanes": lambda c: LANES[c.isa],
}

# -- interaction features --------------------------------------------------------------------


class _InteractionTerms:
    """What several interaction features share, one value per kernel (arrays over the rows
    of the kernel matrix): the tiles' cover of the output, the work items, the working set,
    the work and the machine's peak. kf: kernel feature -> column; pf: problem feature ->
    value; hw: hardware feature -> value."""

    def __init__(self, p: DiscoProblem, pf: dict, kf: dict, hw: dict):
        threads = max(hw["hw_threads"], 1.0)
        self.wo = wo = float(p.nlon_out)
        self.tile = tile = np.maximum(kf["tile_lons"], 1.0)
        self.lon_tiles = _ceil_div(wo, tile)
        self.lon_eff = wo / (self.lon_tiles * tile)
        bt = np.maximum(kf["bt"], 1.0)
        self.bt = bt
        bc = float(p.bc)
        channel_tiles = _ceil_div(bc, bt)
        self.channel_eff = bc / (channel_tiles * bt)
        self.kreg = kf["kreg"]
        self.kernels = pf["kernel_size"]
        self.packed = self.kreg > 0
        self.lb = kf["lb"]
        self.lines = self.lb > 0
        self.nv = kf["nv"]
        # a lines work item is lb input lines, lb / stride input latitudes
        block = np.where(self.lines, self.lb / max(pf["lon_stride"], 1.0),
                         np.maximum(kf["lat_block"], 1.0))
        backward = kf["is_backward"] > 0
        # work items run over output latitudes forward, input latitudes backward
        lats = np.where(backward, float(p.nlat_in), float(p.nlat_out))
        self.items = items = channel_tiles * _ceil_div(lats, block)
        self.balance = items / (_ceil_div(items, threads) * threads)
        self.busy = np.minimum(items, threads) / threads
        self.entries_per_item = 2.0 ** pf["log2_nnz_est"] / np.maximum(lats, 1.0) \
            * np.minimum(block, lats)
        # forward: the band of input lines one item reads (float32), padded by a tile;
        # backward: the gy slices of a channel tile one item reads
        band_lines = (np.minimum(block, lats) * pf["lat_ratio"] + pf["cap_lats_in"]) \
            * pf["lon_stride"]
        band_bytes = 4.0 * band_lines * (wo + tile)
        gy_bytes = ELEMENT_BYTES[p.precision] * bt * pf["kernel_size"] * pf["cap_lats_in"] \
            / max(pf["lat_ratio"], 1e-9) * wo
        self.working = np.where(backward, gy_bytes, band_bytes)
        self.l1 = max(hw["hw_l1d_kib"] * 1024, 1.0)
        self.l2 = max(hw["hw_l2_kib"] * 1024, 1.0)
        self.flops = 2.0 ** pf["log2_flops_est"]
        # 2 FMA ports of `lanes` float32 lanes per core
        self.peak = threads * 2 * 2 * kf["lanes"] * max(hw["hw_clock_mhz"], 1.0) * 1e6


InteractionFormula = Callable[[_InteractionTerms], np.ndarray]

INTERACTION_FEATURES: dict[str, InteractionFormula] = {
    "lon_tile_eff": lambda t: t.lon_eff,
    "lon_tiles": lambda t: t.lon_tiles,
    # nlon_out narrower than one tile: the slow wrap path
    "narrow_lon": lambda t: (t.wo < t.tile).astype(np.float64),
    # a slice starting q longitudes in wraps past the row's end for about tile / wo of them
    "wrap_fraction": lambda t: np.minimum(t.tile / t.wo, 1.0),
    "channel_tile_eff": lambda t: t.channel_eff,
    # register rows idle in the last of a kpacked tile's ceil(K / KREG) passes: the kernel
    # skips them, but they cost registers
    "kreg_waste": lambda t: np.where(
        t.packed, np.ceil(t.kernels / np.maximum(t.kreg, 1.0)) * t.kreg - t.kernels, 0.0),
    "log2_work_items": lambda t: np.log2(np.maximum(t.items, 1.0)),
    "work_balance": lambda t: t.balance,
    "busy_fraction": lambda t: t.busy,
    "log2_entries_per_item": lambda t: np.log2(np.maximum(t.entries_per_item, 1.0)),
    "band_l1_ratio": lambda t: t.working / t.l1,
    "band_l2_ratio": lambda t: t.working / t.l2,
    "log2_flops_per_item": lambda t: np.log2(np.maximum(t.flops / t.items, 1.0)),
    # FMAs per loaded input slice and vector: a kpacked neighbour feeds all K basis
    # functions, a lines key the lb lines of its block (zeros included)
    "psi_reuse": lambda t: t.bt * t.nv * np.where(t.packed, np.minimum(t.kreg, t.kernels), 1.0)
    * np.where(t.lines, t.lb, 1.0),
    "log2_est_ms": lambda t: np.log2(
        t.flops / (t.peak * t.busy * t.balance * t.lon_eff * t.channel_eff + 1.0) * 1e3 + 1e-9),
}


class DiscoFeatureEngine(EngineBase):
    """Features for (DiscoProblem, DiscoConfig) pairs; see the module docstring."""
    name = "disco"
    version = 3

    _problem_names = tuple(PROBLEM_FEATURES)
    _kernel_names = tuple(KERNEL_FEATURES)
    _interaction_names = tuple(INTERACTION_FEATURES)

    def kernel_features(self, configs: Sequence[DiscoConfig]) -> np.ndarray:
        rows = [[float(formula(c)) for formula in KERNEL_FEATURES.values()] for c in configs]
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(KERNEL_FEATURES))

    def problem_features(self, p: DiscoProblem) -> np.ndarray:
        terms = _ProblemTerms.of(p)
        return np.array([formula(terms) for formula in PROBLEM_FEATURES.values()],
                        dtype=np.float64)

    def combine(self, problem: DiscoProblem, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence = ()) -> np.ndarray:
        """The full feature matrix: one row per kernel for this problem."""
        kf = dict(zip(KERNEL_FEATURES, kernel_matrix.T))
        pf = dict(zip(PROBLEM_FEATURES, problem_row))
        hw = dict(zip(HARDWARE_FEATURES, self._hw))
        terms = _InteractionTerms(problem, pf, kf, hw)
        count = kernel_matrix.shape[0]
        interactions = np.column_stack([
            np.broadcast_to(formula(terms), (count,)) for formula in INTERACTION_FEATURES.values()])
        return np.hstack([np.broadcast_to(problem_row, (count, problem_row.size)), kernel_matrix,
                          interactions,
                          np.broadcast_to(self._hw, (count, self._hw.size))])

    def matrix(self, problem, configs: Sequence, kernel_matrix: np.ndarray | None = None) -> np.ndarray:
        """Convenience: features of every config for one problem."""
        if kernel_matrix is None:
            kernel_matrix = self.kernel_features(configs)
        return self.combine(problem, self.problem_features(problem), kernel_matrix, configs)
