"""The DISCO filter tensor psi: every basis function, rotated to every output latitude and
sampled on the input grid, as one sparse tensor in CSR order.

psi[k, t, i * nlon_in + p] is basis function k, centred at output colatitude t and longitude 0,
evaluated at input point (colatitude i, longitude p), normalised and (by default) multiplied by
that point's quadrature weight. Because longitudes are equispaced, the filter for output
longitude j is the same tensor with the input shifted by j * (nlon_in // nlon_out), so psi only
needs longitude 0. Conventions (grids, rotation, cutoff widening, normalisation) follow
torch-harmonics' DiscreteContinuousConvS2, against which the tests check entry for entry.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from tilecast.disco.basis import FilterBasis, KernelShape, get_basis
from tilecast.disco.grids import check_grid, default_theta_cutoff, latitudes, longitudes

#: the support is built with the cutoff widened by this fraction: the default cutoff is one
#: latitude gap, which puts the neighbouring ring exactly on it, and the widening includes such
#: points whatever the rounding (torch-harmonics widens by the same fraction)
CUTOFF_WIDENING = 1e-3

#: floor on normalisation denominators, so an empty (kernel, latitude) group divides by this
#: rather than by zero
_NORM_FLOOR = 1e-9

#: candidate points (input rings in the band x input longitudes) evaluated at once
_POINTS_PER_CHUNK = 1 << 20


@dataclass(frozen=True, eq=False)
class Psi:
    """The sparse filter tensor, shape (kernel_size, nlat_out, nlat_in * nlon_in).

    idx: int64 [3, nnz] rows (kernel, output latitude, input latitude * nlon_in + longitude),
    sorted by those three in that order. vals: float64 [nnz]. roff: int64 CSR offsets over the
    kernel_size * nlat_out rows (kernel-major), so row r = k * nlat_out + t holds the entries
    roff[r]:roff[r + 1]. theta_cutoff is the filter radius asked for, before the widening.
    """
    idx: torch.Tensor
    vals: torch.Tensor
    roff: torch.Tensor
    in_shape: tuple[int, int]
    out_shape: tuple[int, int]
    kernel_size: int
    theta_cutoff: float

    @property
    def nnz(self) -> int:
        return int(self.vals.numel())


@dataclass(frozen=True)
class _Entries:
    """Unnormalised psi entries with what the normalisation modes group and weight them by."""
    vals: torch.Tensor
    kernel: torch.Tensor
    ring: torch.Tensor            # latitude a group is formed over: output, or input if transposed
    quadrature: torch.Tensor      # per-pixel quadrature weight of each entry
    kernel_size: int
    n_rings: int
    theta_cutoff: float

    def group_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum of `values` over each (kernel, ring) group, shape [kernel_size, n_rings]."""
        sums = torch.zeros(self.kernel_size * self.n_rings, dtype=values.dtype)
        sums.scatter_add_(0, self.kernel * self.n_rings + self.ring, values)
        return sums.view(self.kernel_size, self.n_rings)

    def per_entry(self, group_values: torch.Tensor) -> torch.Tensor:
        return group_values[self.kernel, self.ring]


def _norm_none(entries: _Entries) -> torch.Tensor:
    return entries.vals


def _norm_nodal(entries: _Entries) -> torch.Tensor:
    """Each (kernel, latitude) filter integrates to 1 in absolute value."""
    scale = entries.group_sum(entries.vals.abs() * entries.quadrature)
    return entries.vals / entries.per_entry(scale).clamp(min=_NORM_FLOOR)


def _norm_mean(entries: _Entries) -> torch.Tensor:
    """One scale per kernel: the nodal scale averaged over all latitudes (empty ones count 0)."""
    scale = entries.group_sum(entries.vals.abs() * entries.quadrature).mean(dim=1)
    return entries.vals / scale[entries.kernel].clamp(min=_NORM_FLOOR)


def _norm_support(entries: _Entries) -> torch.Tensor:
    """Divide by the area (sum of quadrature weights) of each filter's support."""
    area = entries.group_sum(entries.quadrature)
    return entries.vals / entries.per_entry(area).clamp(min=_NORM_FLOOR)


def _norm_geometric(entries: _Entries) -> torch.Tensor:
    """Divide by (1 - cos theta_cutoff) / 4, half the cap's share of the sphere, with the
    unwidened cutoff (torch-harmonics' definition of this mode)."""
    half_cap_share = (1.0 - math.cos(entries.theta_cutoff)) / 4.0
    return entries.vals / max(half_cap_share, _NORM_FLOOR)


#: basis_norm_mode -> normalisation; the one list of valid modes
NORM_MODES: dict[str, Callable[[_Entries], torch.Tensor]] = {
    "none": _norm_none,
    "nodal": _norm_nodal,
    "mean": _norm_mean,
    "support": _norm_support,
    "geometric": _norm_geometric,
}


def _check_shape(name: str, shape: tuple[int, int]) -> tuple[int, int]:
    if len(shape) != 2 or any(int(n) != n or n < 1 for n in shape):
        raise ValueError(f"{name} must be (nlat, nlon) of positive integers, got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def _support_points(lats_in: torch.Tensor, lats_out: torch.Tensor, nlon_in: int,
                    cutoff: float) -> Iterator[tuple[torch.Tensor, ...]]:
    """Input points within `cutoff` of each output ring's longitude-0 point, chunk by chunk.

    Yields (output ring, input ring, input longitude, theta, phi): the input point in polar
    coordinates about the output point, with phi measured so that the basis is oriented the
    same way at every output latitude. Only input rings whose colatitude is within the cutoff
    are evaluated: the colatitude gap is a lower bound on the distance.
    """
    band_start = torch.searchsorted(lats_in, lats_out - cutoff, right=False)
    band_stop = torch.searchsorted(lats_in, lats_out + cutoff, right=True)
    band_width = (band_stop - band_start).clamp(min=0)

    lons = longitudes(nlon_in)
    cos_lon, sin_lon = torch.cos(lons), torch.sin(lons)
    # the output point is rotated to the pole by a rotation of -colatitude about y
    cos_out, sin_out = torch.cos(-lats_out), torch.sin(-lats_out)
    cos_in, sin_in = torch.cos(lats_in), torch.sin(lats_in)

    rings_per_chunk = max(1, _POINTS_PER_CHUNK // (nlon_in * max(1, int(band_width.max()))))
    for first in range(0, lats_out.numel(), rings_per_chunk):
        out_rings = torch.arange(first, min(first + rings_per_chunk, lats_out.numel()))
        widths = band_width[out_rings]
        out_ring = torch.repeat_interleave(out_rings, widths)
        pair_start = torch.repeat_interleave(torch.cumsum(widths, 0) - widths, widths)
        in_ring = band_start[out_ring] + torch.arange(out_ring.numel()) - pair_start

        c_out, s_out = cos_out[out_ring, None], sin_out[out_ring, None]
        c_in, s_in = cos_in[in_ring, None], sin_in[in_ring, None]
        # Cartesian position of each input point after the rotation (YZY Euler angles); the
        # operation order mirrors torch-harmonics so that points lying exactly on a basis
        # boundary (phi = pi on the output meridian, say) fall on the same side in both
        x = c_out * cos_lon * s_in + c_in * s_out
        y = sin_lon * s_in
        z = -cos_lon * s_out * s_in + c_out * c_in
        # renormalise so rounding cannot push z outside [-1, 1] (arccos would give NaN)
        norm = torch.sqrt(x * x + y * y + z * z)
        x, y, z = x / norm, y / norm, z / norm

        theta = torch.arccos(z)
        pair, lon = torch.nonzero(theta <= cutoff, as_tuple=True)
        phi = torch.arctan2(y[pair, lon], x[pair, lon])
        phi = torch.where(phi < 0.0, phi + 2 * math.pi, phi)
        yield out_ring[pair], in_ring[pair], lon, theta[pair, lon], phi


def _unnormalised_entries(basis: FilterBasis, lats_in: torch.Tensor, lats_out: torch.Tensor,
                          nlon_in: int, cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx [3, nnz], vals [nnz]) of the raw basis values, in no particular order."""
    idx_parts, val_parts = [], []
    for out_ring, in_ring, lon, theta, phi in _support_points(lats_in, lats_out, nlon_in, cutoff):
        in_support, values = basis.evaluate(theta, phi, cutoff)
        kernel, point = torch.nonzero(in_support, as_tuple=True)
        idx_parts.append(torch.stack([kernel, out_ring[point], in_ring[point] * nlon_in + lon[point]]))
        val_parts.append(values[kernel, point])
    if not idx_parts:
        return torch.empty(3, 0, dtype=torch.int64), torch.empty(0, dtype=torch.float64)
    return torch.cat(idx_parts, dim=1), torch.cat(val_parts)


def compute_psi(in_shape: tuple[int, int], out_shape: tuple[int, int], kernel_shape: KernelShape,
                basis_type: str = "piecewise linear", basis_norm_mode: str = "mean",
                grid_in: str = "equiangular", grid_out: str = "equiangular",
                theta_cutoff: Optional[float] = None, transpose_normalization: bool = False,
                merge_quadrature: bool = True) -> Psi:
    """The DISCO filter tensor for a convolution from `in_shape` to `out_shape` (nlat, nlon).

    theta_cutoff defaults to the widest latitude gap of the output grid. With
    transpose_normalization the shapes are those of the transpose convolution swapped (its
    output as in_shape), and normalisation groups and quadrature run over the other grid, as
    DiscreteContinuousConvTransposeS2 builds it. Raises ValueError on an unknown grid, basis or
    normalisation mode, on nlon_in not a multiple of nlon_out, or on a non-positive cutoff.
    """
    nlat_in, nlon_in = _check_shape("in_shape", in_shape)
    nlat_out, nlon_out = _check_shape("out_shape", out_shape)
    check_grid(grid_in)
    check_grid(grid_out)
    if basis_norm_mode not in NORM_MODES:
        raise ValueError(f"unknown basis_norm_mode {basis_norm_mode!r}; valid: {', '.join(NORM_MODES)}")
    if nlon_in % nlon_out != 0:
        raise ValueError(f"nlon_in ({nlon_in}) must be an integer multiple of nlon_out ({nlon_out}): "
                         f"output longitude j reuses psi with the input shifted by j * nlon_in / nlon_out")
    basis = get_basis(basis_type, kernel_shape)
    if theta_cutoff is None:
        theta_cutoff = default_theta_cutoff(nlat_out, grid_out)
    if not theta_cutoff > 0.0:
        raise ValueError(f"theta_cutoff must be positive, got {theta_cutoff}")

    lats_in, weights_in = latitudes(nlat_in, grid_in)
    lats_out, weights_out = latitudes(nlat_out, grid_out)
    idx, vals = _unnormalised_entries(basis, lats_in, lats_out, nlon_in,
                                      (1.0 + CUTOFF_WIDENING) * theta_cutoff)

    in_ring = idx[2] // nlon_in
    if transpose_normalization:
        ring, n_rings, quadrature = in_ring, nlat_in, weights_out[idx[1]]
    else:
        ring, n_rings, quadrature = idx[1], nlat_out, weights_in[in_ring]
    # latitude weights sum to 2 and there are nlon_in longitudes: the pixel weights sum to 1
    quadrature = quadrature / nlon_in / 2.0
    entries = _Entries(vals, idx[0], ring, quadrature, basis.kernel_size, n_rings, float(theta_cutoff))
    vals = NORM_MODES[basis_norm_mode](entries)
    if merge_quadrature:
        vals = vals * quadrature
        if transpose_normalization:
            vals = vals / (nlon_out / nlon_in)

    n_inputs = nlat_in * nlon_in
    row = idx[0] * nlat_out + idx[1]
    order = torch.argsort(row * n_inputs + idx[2])
    idx, vals, row = idx[:, order].contiguous(), vals[order].contiguous(), row[order]
    roff = torch.zeros(basis.kernel_size * nlat_out + 1, dtype=torch.int64)
    roff[1:] = torch.cumsum(torch.bincount(row, minlength=basis.kernel_size * nlat_out), 0)
    return Psi(idx, vals, roff, (nlat_in, nlon_in), (nlat_out, nlon_out), basis.kernel_size,
               float(theta_cutoff))
