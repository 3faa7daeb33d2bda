"""DISCO convolutions split over a (polar x azimuth) grid of ranks: each rank holds the shard
(B, C, its latitudes, its longitudes) of the input and returns the same shard of the output.

Latitudes and longitudes, of the input grid and of the output grid alike, are cut by
blocks.split_rows (contiguous, near-equal, the first parts one longer): polar rank p holds
latitudes split_rows(nlat, P)[p], azimuth rank q longitudes split_rows(nlon, Q)[q]. None for a
group means a group of 1 (no split in that direction).

Communication of DistributedDiscoConvS2, all differentiable exchanges (exchange.py):

1. polar band gather: the output latitudes of polar rank p read a contiguous band of input
   latitudes (blocks.restrict_psi's in_rows); every rank sends each peer the rows of its shard
   inside the peer's band (a halo exchange, not a full all-gather). Gradient: the band's
   gradient is scatter-added back to the shards that own its rows.
2. azimuth all-to-all, longitude split -> channel split: a filter at one output longitude
   reads whole input rings near the poles, so every rank gets whole rings of its slice of the
   input channels (split_rows(in_channels / groups, Q)[q] of every group). Gradient: the
   inverse all-to-all.
3. the serial kernels on the shard: `_contract_and_mix` of a `_ShardConv`, the same four-way
   dispatch (fused x kpacked) as DiscoConvS2 on the shard's psi (the full psi restricted to
   the rank's output latitudes, input re-based to its band), with the rank's slice of the
   weight. The result holds every output channel and longitude, summed over the rank's input
   channels only.
4. azimuth reduce-scatter over output longitudes: the partial sums of the Q ranks are added
   and each keeps its longitudes. Gradient: an all-gather of the output gradient.

Work is split P x Q ways: each rank contracts its output latitudes for 1/Q of the channels.
DistributedDiscoConvTransposeS2 runs the transpose the same way: the all-to-all to a channel
split, the local channel mix and transpose contraction (its input latitudes scatter into a
band of output latitudes), then the band's partial sums scatter-added to the polar shards
(step 1's adjoint) and step 4.

Parameters: every rank holds the whole weight and bias (same shapes and initialisation as the
serial module, so state dicts are interchangeable). Their gradients on one rank are partial:
the weight's is that rank's channel slice over its latitudes, the bias's its output shard's.
As in torch-harmonics, the caller must sum them over the polar x azimuth grid before the
optimizer step: `reduce_gradients()` does it (an all-reduce over each group).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from tilecast.disco.blocks import restrict_psi, split_rows
from tilecast.runtime.disco.conv import KernelShape, _DiscoConvBase
from tilecast.runtime.disco.exchange import (ShardPosition, Span, as_communicator, band_gather_plan, band_scatter_plan,
                       exchange, reduce_scatter_plan, split_to_split_plan)
from tilecast.disco.psi import Psi, compute_psi

Group = Union[None, dist.ProcessGroup, ShardPosition]


@lru_cache(maxsize=2)
def _full_psi(**arguments) -> Psi:
    """compute_psi, once per process for the same arguments: every rank's shard module (and a
    benchmark building all of them) restricts the same full psi."""
    return compute_psi(**arguments)


def _split(what: str, n: int, parts: int, direction: str) -> list[tuple[int, int]]:
    if parts > n:
        raise ValueError(f"cannot split {n} {what} over {parts} {direction} ranks; use a "
                         f"{direction} group of at most {n}")
    return split_rows(n, parts)


@dataclass(frozen=True)
class ShardLayout:
    """Where every rank's shards lie: latitudes per polar rank (input, output, and the band of
    input (or, transposed, output) latitudes its psi block touches), longitudes per azimuth rank,
    and the slice of each group's input channels an azimuth rank contracts."""
    lat_in: list[Span]
    lat_out: list[Span]
    bands: list[Span]
    lon_in: list[Span]
    lon_out: list[Span]
    channels: list[Span]


class _ShardConv(_DiscoConvBase):
    """One shard's serial problem: its psi block, `channels_per_group` input channels of each
    group, every output channel. It has no weight of its own: the distributed module passes its
    slice of the weight with each call."""

    def __init__(self, channels_per_group: int, out_channels: int, kernel_shape: KernelShape,
                 basis_type: str, groups: int, optimized_kernel: bool, fused: bool):
        with torch.random.fork_rng(devices=[]):    # the unused weight init must not consume RNG
            super().__init__(groups * channels_per_group, out_channels, kernel_shape, basis_type,
                             groups, bias=False, optimized_kernel=optimized_kernel)
        del self.weight
        self.weight: Optional[Tensor] = None
        self.fused = fused

    def forward(self, x: Tensor, weight: Tensor) -> Tensor:
        """_contract_and_mix with `weight` (out_channels, channels_per_group, K)."""
        self.weight = weight
        try:
            return self._contract_and_mix(x)
        finally:
            self.weight = None

    def transpose(self, x: Tensor, weight: Tensor, nlon_out: int) -> Tensor:
        """DiscoConvTransposeS2's forward without the bias on this shard: the channel mix, then
        the transpose contraction into psi's input grid (nlon_out longitudes)."""
        self.weight = weight
        try:
            return self._mix_and_transpose(x, nlon_out)
        finally:
            self.weight = None


class _DistributedBase(_DiscoConvBase):
    """Weight, bias, groups and the shard's serial problem (`local`), for both directions."""

    def _setup(self, polar_group: Group, azimuth_group: Group) -> None:
        self.polar = as_communicator(polar_group, "polar_group")
        self.azimuth = as_communicator(azimuth_group, "azimuth_group")

    @property
    def psi_kpacked_K_pad(self) -> Optional[int]:
        """The shard's K_PAD (None: no kpacked layout); set it outside SUPPORTED_K_PAD to force
        the CSR path, as on the serial module."""
        return self.local.psi_kpacked_K_pad

    @psi_kpacked_K_pad.setter
    def psi_kpacked_K_pad(self, value: Optional[int]) -> None:
        self.local.psi_kpacked_K_pad = value

    def _layout(self, psi: Psi) -> tuple[ShardLayout, Psi]:
        """The layout of every rank and this rank's psi block."""
        (nlat_in, nlon_in), (nlat_out, nlon_out) = self.in_shape, self.out_shape
        P, Q = self.polar.size, self.azimuth.size
        lat_in = _split("input latitudes", nlat_in, P, "polar")
        lat_out = _split("output latitudes", nlat_out, P, "polar")
        # psi's output rows are the transpose's input latitudes
        psi_rows = lat_in if self._transposed else lat_out
        blocks = [restrict_psi(psi, span) for span in psi_rows]
        layout = ShardLayout(lat_in, lat_out, [block.in_rows for block in blocks],
                             _split("input longitudes", nlon_in, Q, "azimuth"),
                             _split("output longitudes", nlon_out, Q, "azimuth"),
                             _split("input channels per group", self.groupsize, Q, "azimuth"))
        return layout, blocks[self.polar.rank].psi

    def _build_local_psi(self, psi: Psi) -> None:
        """This rank's serial problem, built as DiscoConvS2 builds its psi: the full psi
        restricted to the rank's rows, stored by _store_psi (CSR and kpacked layouts)."""
        self.layout, block = self._layout(psi)
        channels = self.layout.channels[self.azimuth.rank]
        self.local = _ShardConv(channels[1] - channels[0], self.out_channels, self.kernel_shape,
                                self.basis_type, self.groups, self.optimized_kernel, self.fused)
        self.psi_kpacked_K_pad = None
        self.local._store_psi(block, kpacked=self.optimized_kernel and not self._transposed)

    def _local_weight(self) -> Tensor:
        start, stop = self.layout.channels[self.azimuth.rank]
        return self.weight[:, start:stop]

    def shard_shape(self, grid: str) -> tuple[int, int]:
        """(latitudes, longitudes) of this rank's shard of the "in" or "out" grid."""
        lats = getattr(self.layout, f"lat_{grid}")[self.polar.rank]
        lons = getattr(self.layout, f"lon_{grid}")[self.azimuth.rank]
        return lats[1] - lats[0], lons[1] - lons[0]

    def _check_shard(self, x: Tensor) -> None:
        shape = self.shard_shape("in")
        if x.dim() != 4 or x.shape[1] != self.in_channels or tuple(x.shape[-2:]) != shape:
            raise ValueError(
                f"{type(self).__name__} on polar rank {self.polar.rank}/{self.polar.size}, "
                f"azimuth rank {self.azimuth.rank}/{self.azimuth.size} expects its shard of x, "
                f"(B, {self.in_channels}, {shape[0]}, {shape[1]}), got {tuple(x.shape)}")

    def _to_channel_split(self, x: Tensor) -> Tensor:
        """(B, C, rows, my longitudes) -> (B, my channels of each group, rows, nlon_in)."""
        batch, _, rows, _ = x.shape
        grouped = x.reshape(batch, self.groups, self.groupsize, rows, x.shape[-1])
        rings = exchange(grouped, self.azimuth, self._plans["to_channels"])
        return rings.reshape(batch, -1, rows, rings.shape[-1])

    def reduce_gradients(self) -> None:
        """Sum the weight's and bias's gradients over the polar x azimuth grid (each rank's are
        partial), so every rank holds the serial module's gradients."""
        for parameter in self.parameters():
            if parameter.grad is not None:
                self.polar.all_reduce(parameter.grad)
                self.azimuth.all_reduce(parameter.grad)

    def extra_repr(self) -> str:
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
                f"in_shape={self.in_shape}, out_shape={self.out_shape}, "
                f"kernel_shape={self.kernel_shape}, basis_type={self.basis_type!r}, "
                f"groups={self.groups}, theta_cutoff={self.theta_cutoff:g}, "
                f"polar={self.polar.rank}/{self.polar.size}, "
                f"azimuth={self.azimuth.rank}/{self.azimuth.size}")


def _psi_arguments(in_shape, out_shape, kernel_shape, basis_type, basis_norm_mode, grid_in,
                   grid_out, theta_cutoff, transpose_normalization=False) -> dict:
    kernel_shape = tuple(kernel_shape) if isinstance(kernel_shape, (list, tuple)) else kernel_shape
    return dict(in_shape=tuple(in_shape), out_shape=tuple(out_shape), kernel_shape=kernel_shape,
                basis_type=basis_type, basis_norm_mode=basis_norm_mode, grid_in=grid_in,
                grid_out=grid_out, theta_cutoff=theta_cutoff,
                transpose_normalization=transpose_normalization)


class DistributedDiscoConvS2(_DistributedBase):
    """DiscoConvS2 over a polar x azimuth grid of ranks (module docstring): x is this rank's
    shard (B, in_channels, lat_in shard, lon_in shard), the result its shard of the output.

    Arguments as DiscoConvS2, plus polar_group and azimuth_group (torch.distributed process
    groups splitting latitudes and longitudes; None: no split). The group sizes may not exceed
    the latitudes / longitudes of either grid, nor the azimuth size in_channels / groups.
    """
    _transposed = False

    def __init__(self, in_channels: int, out_channels: int, in_shape: tuple[int, int],
                 out_shape: tuple[int, int], kernel_shape: KernelShape,
                 basis_type: str = "piecewise linear", basis_norm_mode: str = "nodal",
                 groups: int = 1, grid_in: str = "equiangular", grid_out: str = "equiangular",
                 bias: bool = True, theta_cutoff: Optional[float] = None,
                 optimized_kernel: bool = True, fused: bool = False,
                 polar_group: Group = None, azimuth_group: Group = None):
        super().__init__(in_channels, out_channels, kernel_shape, basis_type, groups, bias,
                         optimized_kernel)
        self.fused = bool(fused) and self.optimized_kernel
        if tuple(in_shape)[1] % tuple(out_shape)[1] != 0:
            raise ValueError(f"nlon_in ({in_shape[1]}) must be a multiple of nlon_out "
                             f"({out_shape[1]})")
        self._forward_geometry(in_shape, out_shape, theta_cutoff, grid_out)
        self._setup(polar_group, azimuth_group)
        psi = _full_psi(**_psi_arguments(self.in_shape, self.out_shape, kernel_shape, basis_type,
                                         basis_norm_mode, grid_in, grid_out, self.theta_cutoff))
        self._build_local_psi(psi)
        layout, p, q = self.layout, self.polar.rank, self.azimuth.rank
        self._plans = {
            "band": band_gather_plan(layout.lat_in, layout.bands, p, dim=2),
            "to_channels": split_to_split_plan(layout.lon_in, layout.channels, q,
                                               from_dim=4, to_dim=2),
            "reduce_scatter": reduce_scatter_plan(layout.lon_out, q, dim=3),
        }

    def forward(self, x: Tensor) -> Tensor:
        self._check_shard(x)
        if x.shape[0] == 0:  # every rank holds the same batch: none exchanges anything
            return self._empty_batch(x, self.shard_shape("out"))
        band = exchange(x, self.polar, self._plans["band"])
        partial = self.local(self._to_channel_split(band), self._local_weight())
        return self._add_bias(exchange(partial, self.azimuth, self._plans["reduce_scatter"]))


class DistributedDiscoConvTransposeS2(_DistributedBase):
    """DiscoConvTransposeS2 over a polar x azimuth grid of ranks, arguments as it plus
    polar_group and azimuth_group; shards and gradients as DistributedDiscoConvS2. The
    transpose has no fused or kpacked path (as in serial): it runs the CSR kernels."""
    _transposed = True

    def __init__(self, in_channels: int, out_channels: int, in_shape: tuple[int, int],
                 out_shape: tuple[int, int], kernel_shape: KernelShape,
                 basis_type: str = "piecewise linear", basis_norm_mode: str = "nodal",
                 groups: int = 1, grid_in: str = "equiangular", grid_out: str = "equiangular",
                 bias: bool = True, theta_cutoff: Optional[float] = None,
                 optimized_kernel: bool = True,
                 polar_group: Group = None, azimuth_group: Group = None):
        super().__init__(in_channels, out_channels, kernel_shape, basis_type, groups, bias,
                         optimized_kernel)
        self.fused = False
        self._transpose_geometry(in_shape, out_shape, theta_cutoff, grid_in)
        self._setup(polar_group, azimuth_group)
        # psi of the forward convolution out_shape -> in_shape, normalised for the transpose
        psi = _full_psi(**_psi_arguments(self.out_shape, self.in_shape, kernel_shape, basis_type,
                                         basis_norm_mode, grid_out, grid_in, self.theta_cutoff,
                                         transpose_normalization=True))
        self._build_local_psi(psi)
        layout, p, q = self.layout, self.polar.rank, self.azimuth.rank
        self._plans = {
            "to_channels": split_to_split_plan(layout.lon_in, layout.channels, q,
                                               from_dim=4, to_dim=2),
            # the band is of output latitudes here: what this rank's input rows scatter into
            "band": band_scatter_plan(layout.lat_out, layout.bands, p, dim=2),
            "reduce_scatter": reduce_scatter_plan(layout.lon_out, q, dim=3),
        }

    def forward(self, x: Tensor) -> Tensor:
        self._check_shard(x)
        if x.shape[0] == 0:
            return self._empty_batch(x, self.shard_shape("out"))
        partial = self.local.transpose(self._to_channel_split(x), self._local_weight(),
                                       self.out_shape[1])
        partial = exchange(partial, self.polar, self._plans["band"])
        return self._add_bias(exchange(partial, self.azimuth, self._plans["reduce_scatter"]))
