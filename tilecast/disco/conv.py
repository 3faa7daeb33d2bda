"""DiscoConvS2 and DiscoConvTransposeS2: DISCO convolutions on the sphere as nn.Modules, drop-in
for torch-harmonics' DiscreteContinuousConvS2 / DiscreteContinuousConvTransposeS2.

The constructor arguments they share mean the same (defaults included), the weight has the
same shape (out_channels, in_channels / groups, kernel_size) and initialisation, and the
forward is the same computation: the contraction with psi (tilecast's CPU or CUDA kernels,
ops.py), then a per-group channel/basis mix and the bias, as in reference.disco_conv. psi is
built once, in __init__, into buffers that move with the module. float64 input runs the
pure-torch reference instead (the kernels compute in float32).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor, nn

from . import ops, reference
from .basis import get_basis
from .csr import DiscoCSR, csr_from_psi
from .grids import default_theta_cutoff
from .psi import Psi, compute_psi

KernelShape = Union[int, tuple[int], tuple[int, int]]

# psi's values are kept as the int32 bits of their float32 values, so that module.to(dtype)
# and .half() (which cast every floating buffer) leave them exact; device moves still apply
_CSR_BUFFERS = ("roff", "col", "vals", "troff", "tcol", "tvals")
_BIT_VIEWED = ("vals", "tvals")


class _DiscoConvBase(nn.Module):
    """Weight, bias and psi buffers shared by the forward and transpose convolutions."""

    def __init__(self, in_channels: int, out_channels: int, kernel_shape: KernelShape,
                 basis_type: str, groups: int, bias: bool):
        super().__init__()
        if groups < 1 or in_channels % groups != 0 or out_channels % groups != 0:
            raise ValueError(f"in_channels ({in_channels}) and out_channels ({out_channels}) "
                             f"must be multiples of groups ({groups})")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_shape = kernel_shape
        self.basis_type = basis_type
        self.kernel_size = get_basis(basis_type, kernel_shape).kernel_size
        self.groupsize = in_channels // groups
        # torch-harmonics' init: unit variance over the groupsize * kernel_size fan-in
        scale = math.sqrt(1.0 / (self.groupsize * self.kernel_size))
        self.weight = nn.Parameter(scale * torch.randn(out_channels, self.groupsize, self.kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None

    def _store_psi(self, psi: Psi) -> None:
        self.psi = psi
        csr = csr_from_psi(psi)
        for name in _CSR_BUFFERS:
            tensor = getattr(csr, name)
            if name in _BIT_VIEWED:
                tensor = tensor.view(torch.int32)
            self.register_buffer(f"psi_{name}", tensor, persistent=False)

    def _psi_tensors(self) -> tuple[Tensor, ...]:
        """The six CSR tensors in the ops' order, values as float32."""
        tensors = []
        for name in _CSR_BUFFERS:
            tensor = getattr(self, f"psi_{name}")
            tensors.append(tensor.view(torch.float32) if name in _BIT_VIEWED else tensor)
        return tuple(tensors)

    def csr(self) -> DiscoCSR:
        """psi in the kernels' CSR layouts (the module's buffers)."""
        return DiscoCSR(*self._psi_tensors(), in_shape=self.psi.in_shape,
                        out_shape=self.psi.out_shape, kernel_size=self.kernel_size)

    def _check_input(self, x: Tensor, shape: tuple[int, int]) -> None:
        if x.dim() != 4 or x.shape[1] != self.in_channels or tuple(x.shape[-2:]) != shape:
            raise ValueError(f"{type(self).__name__} expects x of shape (B, {self.in_channels}, "
                             f"{shape[0]}, {shape[1]}), got {tuple(x.shape)}")

    def _grouped_weight(self) -> Tensor:
        return self.weight.reshape(self.groups, self.out_channels // self.groups,
                                   self.groupsize, self.kernel_size)

    def _add_bias(self, out: Tensor) -> Tensor:
        return out if self.bias is None else out + self.bias.reshape(1, -1, 1, 1)


class DiscoConvS2(_DiscoConvBase):
    """DISCO convolution x (B, in_channels, *in_shape) -> (B, out_channels, *out_shape).

    Arguments as torch-harmonics' DiscreteContinuousConvS2: kernel_shape and basis_type pick
    the filter basis, basis_norm_mode its normalisation (default "nodal"), grid_in / grid_out
    the latitude grids, theta_cutoff the filter radius (default: one latitude gap of the
    output grid). nlon_in must be a multiple of nlon_out.
    """

    def __init__(self, in_channels: int, out_channels: int, in_shape: tuple[int, int],
                 out_shape: tuple[int, int], kernel_shape: KernelShape,
                 basis_type: str = "piecewise linear", basis_norm_mode: str = "nodal",
                 groups: int = 1, grid_in: str = "equiangular", grid_out: str = "equiangular",
                 bias: bool = True, theta_cutoff: Optional[float] = None):
        super().__init__(in_channels, out_channels, kernel_shape, basis_type, groups, bias)
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        if theta_cutoff is None:
            theta_cutoff = default_theta_cutoff(self.out_shape[0], grid_out)
        self.theta_cutoff = float(theta_cutoff)
        self._store_psi(compute_psi(self.in_shape, self.out_shape, kernel_shape,
                                    basis_type=basis_type, basis_norm_mode=basis_norm_mode,
                                    grid_in=grid_in, grid_out=grid_out,
                                    theta_cutoff=self.theta_cutoff))

    def extra_repr(self) -> str:
        return (f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
                f"in_shape={self.in_shape}, out_shape={self.out_shape}, "
                f"kernel_shape={self.kernel_shape}, basis_type={self.basis_type!r}, "
                f"groups={self.groups}, theta_cutoff={self.theta_cutoff:g}")

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x, self.in_shape)
        nlat_out, nlon_out = self.out_shape
        if x.dtype == torch.float64:
            expanded = reference.disco_contraction(x, self.psi, nlon_out)
        else:
            expanded = ops.disco_contraction(x, *self._psi_tensors(), self.kernel_size,
                                             nlat_out, nlon_out)
        batch = x.shape[0]
        expanded = expanded.reshape(batch, self.groups, self.groupsize, self.kernel_size,
                                    nlat_out, nlon_out)
        out = torch.einsum("bgckxy,gock->bgoxy", expanded, self._grouped_weight())
        return self._add_bias(out.reshape(batch, self.out_channels, nlat_out, nlon_out))


class DiscoConvTransposeS2(_DiscoConvBase):
    """Transpose DISCO convolution x (B, in_channels, *in_shape) -> (B, out_channels,
    *out_shape), the adjoint of DiscoConvS2 from out_shape to in_shape (typically upsampling).

    Arguments as torch-harmonics' DiscreteContinuousConvTransposeS2; theta_cutoff defaults to
    one latitude gap of the input grid. nlon_out must be a multiple of nlon_in.
    """

    def __init__(self, in_channels: int, out_channels: int, in_shape: tuple[int, int],
                 out_shape: tuple[int, int], kernel_shape: KernelShape,
                 basis_type: str = "piecewise linear", basis_norm_mode: str = "nodal",
                 groups: int = 1, grid_in: str = "equiangular", grid_out: str = "equiangular",
                 bias: bool = True, theta_cutoff: Optional[float] = None):
        super().__init__(in_channels, out_channels, kernel_shape, basis_type, groups, bias)
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        if self.out_shape[1] % self.in_shape[1] != 0:
            raise ValueError(f"nlon_out ({self.out_shape[1]}) must be a multiple of nlon_in "
                             f"({self.in_shape[1]})")
        if theta_cutoff is None:
            theta_cutoff = default_theta_cutoff(self.in_shape[0], grid_in)
        self.theta_cutoff = float(theta_cutoff)
        # psi of the forward convolution out_shape -> in_shape, normalised for the transpose
        self._store_psi(compute_psi(self.out_shape, self.in_shape, kernel_shape,
                                    basis_type=basis_type, basis_norm_mode=basis_norm_mode,
                                    grid_in=grid_out, grid_out=grid_in,
                                    theta_cutoff=self.theta_cutoff, transpose_normalization=True))

    extra_repr = DiscoConvS2.extra_repr

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x, self.in_shape)
        batch, _, nlat_in, nlon_in = x.shape
        grouped = x.reshape(batch, self.groups, self.groupsize, nlat_in, nlon_in)
        expanded = torch.einsum("bgcxy,gock->bgokxy", grouped, self._grouped_weight())
        expanded = expanded.reshape(batch, self.out_channels, self.kernel_size, nlat_in, nlon_in)
        if x.dtype == torch.float64:
            out = reference.disco_transpose_contraction(expanded, self.psi, self.out_shape[1])
        else:
            out = ops.disco_transpose_contraction(expanded, *self._psi_tensors(), *self.out_shape)
        return self._add_bias(out)
