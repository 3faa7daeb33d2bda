"""Filter bases on the disk of radius `cutoff` around the north pole, for the DISCO psi tensor.

A basis is evaluated at points given in polar coordinates (theta: distance from the pole,
phi: angle in [0, 2 pi)) and answers, for every basis function k and point p, whether p lies in
the support of k and the value there. The support is reported separately from the value because
the sparsity pattern keeps points where a basis function happens to be exactly zero (on the
edge of a hat, on a node line of a harmonic); torch-harmonics does the same.
"""
from __future__ import annotations

import math
from typing import Protocol, Sequence, Union

import torch

from tilecast.spaces.disco import harmonic_size, piecewise_linear_size

KernelShape = Union[int, Sequence[int]]


class FilterBasis(Protocol):
    """What compute_psi needs from a basis."""
    kernel_shape: tuple[int, int]

    @property
    def kernel_size(self) -> int: ...

    @property
    def isotropic_mask(self) -> tuple[bool, ...]: ...

    def evaluate(self, theta: torch.Tensor, phi: torch.Tensor, cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_support [K, P] bool, values [K, P]) at P points."""
        ...


def _positive_pair(kernel_shape: Sequence[int], basis_type: str) -> tuple[int, int]:
    if len(kernel_shape) != 2 or any(int(n) != n or n < 1 for n in kernel_shape):
        raise ValueError(f"{basis_type} basis: kernel_shape must be positive integers, got {tuple(kernel_shape)}")
    return int(kernel_shape[0]), int(kernel_shape[1])


def _circle_distance(angle: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """Distance between angles on the circle, in [0, pi]."""
    gap = torch.abs(angle - centre)
    return torch.minimum(gap, torch.abs(2 * math.pi - gap))


class PiecewiseLinearBasis:
    """Hat functions on rings (and, when kernel_shape[1] > 1, sectors) of the disk.

    kernel_shape = (n_rings, n_sectors); an int n or (n,) means (n, 1), the isotropic basis.
    An odd n_rings puts one hat at the centre, shared by all sectors; an even one does not.
    """

    def __init__(self, kernel_shape: KernelShape):
        if isinstance(kernel_shape, int):
            kernel_shape = (kernel_shape,)
        if len(kernel_shape) == 1:
            kernel_shape = (kernel_shape[0], 1)
        self.kernel_shape = _positive_pair(kernel_shape, "piecewise linear")

    @property
    def kernel_size(self) -> int:
        return piecewise_linear_size(*self.kernel_shape)

    @property
    def isotropic_mask(self) -> tuple[bool, ...]:
        n_rings, n_sectors = self.kernel_shape
        if n_sectors == 1:
            return (True,) * self.kernel_size
        return tuple(k == 0 and n_rings % 2 == 1 for k in range(self.kernel_size))

    def _centres(self, cutoff: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """Radius and angle of each hat's peak, shaped [K, 1], and the hat half-widths."""
        n_rings, n_sectors = self.kernel_shape
        k = torch.arange(self.kernel_size).reshape(-1, 1)
        radial_width = 2 * cutoff / (n_rings + 1)
        angular_width = 2.0 * math.pi / n_sectors
        # odd: hat 0 at the centre, then n_sectors hats per ring at 1, 2, ... widths out;
        # even: rings at half-integer widths, so no hat sits on the centre
        if n_rings % 2 == 1:
            ring, sector = (k - 1) // n_sectors + 1, (k - 1) % n_sectors
            radius = ring.to(dtype) * radial_width
        else:
            ring, sector = k // n_sectors, k % n_sectors
            radius = (ring.to(dtype) + 0.5) * radial_width
        angle = sector.to(dtype) * angular_width - math.pi
        return radius, angle, radial_width, angular_width

    def evaluate(self, theta: torch.Tensor, phi: torch.Tensor, cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Support mask and values [K, P] of every hat at the points (theta, phi)."""
        radius, angle, radial_width, angular_width = self._centres(cutoff, theta.dtype)
        radial_gap = torch.abs(theta - radius)
        near_ring = (radial_gap <= radial_width) & (theta <= cutoff)
        radial_hat = 1 - radial_gap / radial_width
        if self.kernel_shape[1] == 1:
            return near_ring, torch.where(near_ring, radial_hat, 0.0)

        angular_gap = _circle_distance(phi, angle)
        angular_hat = 1 - angular_gap / angular_width
        if self.kernel_shape[0] % 2 == 1:
            is_centre = torch.arange(self.kernel_size).reshape(-1, 1) == 0
            in_support = near_ring & (is_centre | (angular_gap <= angular_width))
            values = radial_hat * torch.where(is_centre, 1.0, angular_hat)
            return in_support, torch.where(in_support, values, 0.0)

        # even rings: the innermost hats straddle the centre, so a point is also seen from the
        # opposite side, at negative radius and the angle turned by pi
        mirrored_theta = -theta
        mirrored_phi = torch.where(phi + math.pi >= math.pi, phi - math.pi, phi + math.pi)
        mirrored_radial_gap = torch.abs(mirrored_theta - radius)
        mirrored_angular_gap = _circle_distance(mirrored_phi, angle)
        direct = near_ring & (angular_gap <= angular_width)
        mirrored = ((mirrored_radial_gap <= radial_width) & (mirrored_theta <= cutoff)
                    & (mirrored_angular_gap <= angular_width))
        values = (torch.where(direct, radial_hat * angular_hat, 0.0)
                  + torch.where(mirrored, (1 - mirrored_radial_gap / radial_width)
                                * (1 - mirrored_angular_gap / angular_width), 0.0))
        return direct | mirrored, values


class HarmonicBasis:
    """Sine/cosine products in the disk's Cartesian coordinates under a Hann window in radius.

    kernel_shape = (n_y, n_x); an int n means (n, n). Function k has x-index k % n_x and
    y-index k // n_x; index i means cos for even i and sin for odd i, frequency ceil(i / 2).
    Each function is scaled to unit L2 norm on the unit disk. The support is the whole disk.
    """

    # midpoint rule used for the L2 norms: part of the definition, since the norms scale psi
    _NORM_RADII = 50
    _NORM_ANGLES = 200

    def __init__(self, kernel_shape: KernelShape):
        if isinstance(kernel_shape, int):
            kernel_shape = (kernel_shape, kernel_shape)
        self.kernel_shape = _positive_pair(kernel_shape, "harmonic")
        self._l2_norms = self._unit_disk_l2_norms()

    @property
    def kernel_size(self) -> int:
        return harmonic_size(*self.kernel_shape)

    @property
    def isotropic_mask(self) -> tuple[bool, ...]:
        return tuple(k == 0 for k in range(self.kernel_size))

    def _unnormalized(self, radius: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
        """Values [K, P] at radius (in units of the cutoff, <= 1) and angle phi."""
        k = torch.arange(self.kernel_size).reshape(-1, 1)
        index_x, index_y = k % self.kernel_shape[1], k // self.kernel_shape[1]
        x, y = radius * torch.sin(phi), radius * torch.cos(phi)

        def wave(index: torch.Tensor, coordinate: torch.Tensor) -> torch.Tensor:
            phase = torch.ceil(index.to(coordinate.dtype) / 2) * math.pi * coordinate
            return torch.where(index % 2 == 1, torch.sin(phase), torch.cos(phase))

        hann = torch.cos(0.5 * math.pi * radius) ** 2
        return hann * wave(index_x, x) * wave(index_y, y)

    def _unit_disk_l2_norms(self) -> torch.Tensor:
        radial_step = 1.0 / self._NORM_RADII
        angular_step = 2 * math.pi / self._NORM_ANGLES
        radius = (torch.arange(self._NORM_RADII, dtype=torch.float64) + 0.5) * radial_step
        angle = torch.arange(self._NORM_ANGLES, dtype=torch.float64) * angular_step
        radius, angle = (grid.reshape(-1) for grid in torch.meshgrid(radius, angle, indexing="ij"))
        squares = self._unnormalized(radius, angle) ** 2
        return (squares * radius * radial_step * angular_step).sum(dim=1).sqrt()

    def evaluate(self, theta: torch.Tensor, phi: torch.Tensor, cutoff: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Support mask and values [K, P] of every harmonic at the points (theta, phi)."""
        inside = (theta <= cutoff).expand(self.kernel_size, -1)
        norms = self._l2_norms.to(theta.dtype).clamp(min=1e-12).reshape(-1, 1)
        values = self._unnormalized(theta / cutoff, phi) / norms
        return inside, torch.where(inside, values, 0.0)


#: basis name -> class; the one list of valid basis types
BASES: dict[str, type] = {
    "piecewise linear": PiecewiseLinearBasis,
    "harmonic": HarmonicBasis,
}


def get_basis(basis_type: str, kernel_shape: KernelShape) -> FilterBasis:
    """The basis `basis_type` with `kernel_shape`; ValueError names the valid types otherwise."""
    if basis_type not in BASES:
        raise ValueError(f"unknown basis_type {basis_type!r}; valid: {', '.join(BASES)}")
    return BASES[basis_type](kernel_shape)
