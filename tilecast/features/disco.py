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
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from tilecast.families.disco import ELEMENT_BYTES, PRECISIONS, DiscoProblem
from tilecast.families.disco_kernels import LANES, VARIANTS, DiscoConfig
from tilecast.features.hardware import EngineBase

BASIS_NAMES = ("harmonic", "piecewise_linear")

PROBLEM_FEATURES = (
    "batch", "channels", "log2_bc", "nlat_in", "nlon_in", "nlat_out", "nlon_out",
    "log2_nlon_out", "lon_stride", "lat_ratio", "kernel_size", "theta_cutoff",
    "cap_lats_in", "cap_lons_in", "log2_nnz_row_est", "log2_nnz_est", "log2_flops_est",
    "log2_bytes_est", "log2_in_bytes", "log2_out_bytes", "element_bytes",
    *(f"is_{p}" for p in PRECISIONS), *(f"is_{b}" for b in BASIS_NAMES),
)
KERNEL_FEATURES = (
    "is_backward", *(f"is_{v}" for v in VARIANTS), "bt", "kreg", "lb", "nv", "tile_lons",
    "log2_tile_lons", "accumulators", "lat_block", "lanes",
)
INTERACTION_FEATURES = (
    "lon_tile_eff", "lon_tiles", "narrow_lon", "wrap_fraction", "channel_tile_eff",
    "kreg_waste", "log2_work_items", "work_balance", "busy_fraction", "log2_entries_per_item",
    "band_l1_ratio", "band_l2_ratio", "log2_flops_per_item", "psi_reuse", "log2_est_ms",
)


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


class DiscoFeatureEngine(EngineBase):
    """Features for (DiscoProblem, DiscoConfig) pairs; see the module docstring."""
    name = "disco"
    version = 3

    _problem_names = PROBLEM_FEATURES
    _kernel_names = KERNEL_FEATURES
    _interaction_names = INTERACTION_FEATURES

    def kernel_features(self, configs: Sequence[DiscoConfig]) -> np.ndarray:
        rows = []
        for c in configs:
            lanes = LANES[c.isa]
            # a csr row tile holds one basis function (kreg 0), a kpacked one kreg, a lines
            # one lb input lines of one channel
            values = {"is_backward": float(c.direction == "backward"),
                      f"is_{c.variant}": 1.0, "bt": c.bt, "kreg": c.kreg, "lb": c.lb, "nv": c.nv,
                      "tile_lons": c.nv * lanes, "log2_tile_lons": math.log2(c.nv * lanes),
                      "accumulators": c.bt * max(c.kreg, 1) * max(c.lb, 1) * c.nv,
                      "lat_block": c.lat_block, "lanes": lanes}
            rows.append([float(values.get(name, 0.0)) for name in KERNEL_FEATURES])
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(KERNEL_FEATURES))

    def problem_features(self, p: DiscoProblem) -> np.ndarray:
        elt = ELEMENT_BYTES[p.precision]
        k = p.kernel_size
        nnz_row = nnz_row_estimate(p)
        nnz = nnz_row * k * p.nlat_out
        flops = 2.0 * p.bc * nnz * p.nlon_out
        in_bytes = elt * p.bc * p.nlat_in * p.nlon_in
        out_bytes = elt * p.bc * k * p.nlat_out * p.nlon_out
        cap_lats = 2.0 * p.theta_cutoff / (math.pi / p.nlat_in) + 1.0
        cap_lons = 2.0 * p.theta_cutoff / (2.0 * math.pi / p.nlon_in) + 1.0
        return np.array([
            p.batch, p.channels, _log2(p.bc), p.nlat_in, p.nlon_in, p.nlat_out, p.nlon_out,
            _log2(p.nlon_out), p.stride, p.nlat_in / p.nlat_out, k, p.theta_cutoff,
            cap_lats, cap_lons, _log2(nnz_row), _log2(nnz), _log2(flops),
            _log2(in_bytes + out_bytes + 12 * nnz), _log2(in_bytes), _log2(out_bytes), elt,
            *(float(p.precision == name) for name in PRECISIONS),
            *(float(p.basis == name) for name in BASIS_NAMES),
        ], dtype=np.float64)

    def combine(self, problem: DiscoProblem, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence = ()) -> np.ndarray:
        """The full feature matrix: one row per kernel for this problem."""
        kf = {name: kernel_matrix[:, i] for i, name in enumerate(KERNEL_FEATURES)}
        pf = dict(zip(PROBLEM_FEATURES, problem_row))
        count = kernel_matrix.shape[0]
        backward = kf["is_backward"]
        threads = max(self._hw[0], 1.0)
        p = problem
        wo = float(p.nlon_out)
        tile = np.maximum(kf["tile_lons"], 1.0)
        lon_tiles = _ceil_div(wo, tile)
        lon_eff = wo / (lon_tiles * tile)
        narrow = (wo < tile).astype(np.float64)
        # a slice starting q longitudes in wraps past the row's end for about tile / wo of them
        wrap = np.minimum(tile / wo, 1.0)
        bt = np.maximum(kf["bt"], 1.0)
        bc = float(p.bc)
        channel_tiles = _ceil_div(bc, bt)
        channel_eff = bc / (channel_tiles * bt)
        kreg = kf["kreg"]
        kernels = pf["kernel_size"]
        packed = kreg > 0
        # register rows idle in the last of a kpacked tile's ceil(K / KREG) passes: the kernel
        # skips them, but they cost registers
        passes = np.ceil(kernels / np.maximum(kreg, 1.0))
        kreg_waste = np.where(packed, passes * kreg - kernels, 0.0)
        lb = kf["lb"]
        lines = lb > 0
        # a lines work item is lb input lines, lb / stride input latitudes
        block = np.where(lines, lb / max(pf["lon_stride"], 1.0), np.maximum(kf["lat_block"], 1.0))
        # work items run over output latitudes forward, input latitudes backward
        lats = np.where(backward > 0, float(p.nlat_in), float(p.nlat_out))
        items = channel_tiles * _ceil_div(lats, block)
        balance = items / (_ceil_div(items, threads) * threads)
        busy = np.minimum(items, threads) / threads
        nnz = 2.0 ** pf["log2_nnz_est"]
        entries_per_item = nnz / np.maximum(lats, 1.0) * np.minimum(block, lats)
        # forward: the band of input lines one item reads (float32), padded by a tile
        band_lines = (np.minimum(block, lats) * pf["lat_ratio"] + pf["cap_lats_in"]) * pf["lon_stride"]
        band_bytes = 4.0 * band_lines * (wo + tile)
        gy_bytes = ELEMENT_BYTES[p.precision] * bt * pf["kernel_size"] * pf["cap_lats_in"] \
            / max(pf["lat_ratio"], 1e-9) * wo
        working = np.where(backward > 0, gy_bytes, band_bytes)
        l1, l2 = (max(v * 1024, 1.0) for v in self._hw[2:4])
        flops = 2.0 ** pf["log2_flops_est"]
        flops_per_item = flops / items
        # FMAs per loaded input slice and vector: a kpacked neighbour feeds all K basis
        # functions, a lines key the lb lines of its block (zeros included)
        reuse = bt * kf["nv"] * np.where(packed, np.minimum(kreg, kernels), 1.0) \
            * np.where(lines, lb, 1.0)
        peak = threads * 2 * 2 * kf["lanes"] * max(self._hw[5], 1.0) * 1e6   # 2 FMA ports
        est_s = flops / (peak * busy * balance * lon_eff * channel_eff + 1.0)
        interactions = np.column_stack([
            lon_eff, lon_tiles, narrow, wrap, channel_eff, kreg_waste,
            np.log2(np.maximum(items, 1.0)),
            balance, busy, np.log2(np.maximum(entries_per_item, 1.0)), working / l1,
            working / l2, np.log2(np.maximum(flops_per_item, 1.0)), reuse,
            np.log2(est_s * 1e3 + 1e-9)])
        return np.hstack([np.broadcast_to(problem_row, (count, problem_row.size)), kernel_matrix,
                          interactions,
                          np.broadcast_to(self._hw, (count, self._hw.size))])

    def matrix(self, problem, configs: Sequence, kernel_matrix: np.ndarray | None = None) -> np.ndarray:
        """Convenience: features of every config for one problem."""
        if kernel_matrix is None:
            kernel_matrix = self.kernel_features(configs)
        return self.combine(problem, self.problem_features(problem), kernel_matrix, configs)
