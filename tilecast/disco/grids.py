"""Latitude/longitude grids of the sphere: nodes, quadrature weights and the default cutoff.

Colatitudes run from the north pole (0) to the south pole (pi). Quadrature weights integrate
over x = cos(colatitude) on [-1, 1], so they sum to 2 and already carry the sin(theta) of the
surface element; turning them into per-pixel weights (dividing by 2 * nlon) is the job of the
psi builder. This is torch-harmonics' convention, kept so the two agree entry for entry.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch


def _clenshaw_curtis(nlat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clenshaw-Curtis nodes (ascending in x) and weights on [-1, 1] for nodes equispaced in angle."""
    if nlat < 2:
        raise ValueError(f"the equiangular grid needs at least 2 latitudes, got nlat={nlat}")
    # the nodes are cos of an equispaced angle; these exact values (rather than a reformulation
    # such as sin) keep the colatitudes bit-identical to torch-harmonics, which matters where a
    # grid point sits exactly on a basis-function boundary
    nodes = torch.cos(torch.linspace(math.pi, 0.0, nlat, dtype=torch.float64))
    intervals = nlat - 1
    angles = torch.arange(nlat, dtype=torch.float64) * (math.pi / intervals)
    harmonics = torch.arange(1, intervals // 2 + 1, dtype=torch.float64)
    # closed-form weights: w_k = c_k / n * (1 - sum_j b_j cos(2 j theta_k) / (4 j^2 - 1))
    b = torch.full_like(harmonics, 2.0)
    if intervals % 2 == 0:
        b[-1] = 1.0
    series = (b / (4.0 * harmonics**2 - 1.0) * torch.cos(2.0 * angles[:, None] * harmonics)).sum(dim=1)
    end_factor = torch.full((nlat,), 2.0, dtype=torch.float64)
    end_factor[0] = end_factor[-1] = 1.0
    weights = end_factor / intervals * (1.0 - series)
    return nodes, weights


def _legendre_gauss(nlat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss-Legendre nodes (ascending in x) and weights on [-1, 1]."""
    if nlat < 1:
        raise ValueError(f"the legendre-gauss grid needs at least 1 latitude, got nlat={nlat}")
    nodes, weights = np.polynomial.legendre.leggauss(nlat)
    return torch.from_numpy(nodes), torch.from_numpy(weights)


#: grid name -> rule giving (nodes in cos(colatitude), ascending; weights summing to 2)
GRIDS: dict[str, Callable[[int], tuple[torch.Tensor, torch.Tensor]]] = {
    "equiangular": _clenshaw_curtis,
    "legendre-gauss": _legendre_gauss,
}


def check_grid(grid: str) -> None:
    """Raise ValueError naming `grid` and the valid grids unless `grid` is one of GRIDS."""
    if grid not in GRIDS:
        raise ValueError(f"unknown grid {grid!r}; valid: {', '.join(GRIDS)}")


def latitudes(nlat: int, grid: str = "equiangular") -> tuple[torch.Tensor, torch.Tensor]:
    """Colatitudes in [0, pi], ascending, and their quadrature weights (float64, sum 2)."""
    check_grid(grid)
    nodes, weights = GRIDS[grid](nlat)
    # ascending x = cos(colatitude) means descending colatitude; flip to run north to south
    return torch.flip(torch.arccos(nodes), dims=(0,)), torch.flip(weights, dims=(0,))


def longitudes(nlon: int) -> torch.Tensor:
    """`nlon` equispaced longitudes in [0, 2 pi), float64; 2 pi itself is left out (it is 0)."""
    return torch.linspace(0.0, 2.0 * math.pi, nlon + 1, dtype=torch.float64)[:-1]


def default_theta_cutoff(nlat: int, grid: str = "equiangular") -> float:
    """The filter radius used when none is given: the largest gap between adjacent latitudes.

    Pass the output grid for a forward convolution (the coarser one when downsampling). On the
    equiangular grid this is pi / (nlat - 1); Gauss nodes are not uniform in colatitude, so
    there it is the widest of their gaps.
    """
    colatitudes, _ = latitudes(nlat, grid)
    return float((colatitudes[1:] - colatitudes[:-1]).max())
