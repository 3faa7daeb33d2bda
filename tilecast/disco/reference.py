"""Slow, plainly correct DISCO convolutions in pure torch: the references fast kernels are
tested against.

The forward contraction applies psi once per output longitude j, to the input rolled west by
j * (nlon_in // nlon_out) longitudes; the transpose contraction is its exact adjoint. Both work
in float64 for float64 input and in float32 otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch

from tilecast.disco.psi import Psi


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _psi_matrix(psi: Psi, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """psi as a sparse (kernel_size * nlat_out, nlat_in * nlon_in) matrix, row k * nlat_out + t."""
    nlat_in, nlon_in = psi.in_shape
    rows = psi.idx[0] * psi.out_shape[0] + psi.idx[1]
    return torch.sparse_coo_tensor(torch.stack([rows, psi.idx[2]]), psi.vals,
                                   size=(psi.kernel_size * psi.out_shape[0], nlat_in * nlon_in),
                                   dtype=dtype, device=device).coalesce()


def _longitude_stride(nlon_in: int, nlon_out: int) -> int:
    if nlon_out < 1 or nlon_in % nlon_out != 0:
        raise ValueError(f"nlon_in ({nlon_in}) must be an integer multiple of nlon_out ({nlon_out})")
    return nlon_in // nlon_out


def disco_contraction(x: torch.Tensor, psi: Psi, nlon_out: int) -> torch.Tensor:
    """x (B, C, nlat_in, nlon_in) -> (B, C, K, nlat_out, nlon_out): every basis filter applied
    at every output point."""
    if x.dim() != 4 or tuple(x.shape[-2:]) != psi.in_shape:
        raise ValueError(f"x must be (B, C, {psi.in_shape[0]}, {psi.in_shape[1]}) for this psi, "
                         f"got {tuple(x.shape)}")
    stride = _longitude_stride(psi.in_shape[1], nlon_out)
    batch, channels = x.shape[:2]
    dtype = _compute_dtype(x.dtype)
    matrix = _psi_matrix(psi, dtype, x.device)
    # columns are (batch, channel) pairs, rows are input pixels
    columns = x.to(dtype).reshape(batch * channels, -1).T
    grid = columns.reshape(*psi.in_shape, batch * channels)
    out = torch.empty(nlon_out, matrix.shape[0], batch * channels, dtype=dtype, device=x.device)
    for lon_out in range(nlon_out):
        shifted = torch.roll(grid, -lon_out * stride, dims=1).reshape(-1, batch * channels)
        out[lon_out] = torch.sparse.mm(matrix, shifted)
    out = out.reshape(nlon_out, psi.kernel_size, psi.out_shape[0], batch, channels)
    return out.permute(3, 4, 1, 2, 0).contiguous().to(x.dtype)


def disco_transpose_contraction(x: torch.Tensor, psi: Psi, nlon_out: int) -> torch.Tensor:
    """The adjoint of disco_contraction: x (B, C, K, psi nlat_out, nlon_in) ->
    (B, C, psi nlat_in, nlon_out), where nlon_out is psi's nlon_in.

    For the transpose convolution build psi with the shapes swapped and
    transpose_normalization=True, as DiscreteContinuousConvTransposeS2 does.
    """
    nlat_fine, nlon_fine = psi.in_shape
    if x.dim() != 5 or x.shape[2] != psi.kernel_size or x.shape[3] != psi.out_shape[0]:
        raise ValueError(f"x must be (B, C, {psi.kernel_size}, {psi.out_shape[0]}, nlon) for this psi, "
                         f"got {tuple(x.shape)}")
    if nlon_out != nlon_fine:
        raise ValueError(f"nlon_out ({nlon_out}) must be psi's input nlon ({nlon_fine})")
    stride = _longitude_stride(nlon_out, x.shape[-1])
    batch, channels = x.shape[:2]
    dtype = _compute_dtype(x.dtype)
    matrix_t = _psi_matrix(psi, dtype, x.device).t().coalesce()
    rows = x.to(dtype).reshape(batch * channels, -1, x.shape[-1])
    out = torch.zeros(nlat_fine, nlon_fine, batch * channels, dtype=dtype, device=x.device)
    for lon_in in range(x.shape[-1]):
        spread = torch.sparse.mm(matrix_t, rows[:, :, lon_in].T).reshape(nlat_fine, nlon_fine, -1)
        out += torch.roll(spread, lon_in * stride, dims=1)
    return out.permute(2, 0, 1).reshape(batch, channels, nlat_fine, nlon_fine).contiguous().to(x.dtype)


def _check_weight(weight: torch.Tensor, channels: int, kernel_size: int, groups: int) -> None:
    if channels % groups != 0 or weight.dim() != 3 or weight.shape[0] % groups != 0 \
            or weight.shape[1] * groups != channels or weight.shape[2] != kernel_size:
        raise ValueError(f"weight must be (C_out, C_in / groups, K) = (multiple of {groups}, "
                         f"{channels // groups}, {kernel_size}) for {channels} input channels and "
                         f"groups={groups}, got {tuple(weight.shape)}")


def disco_conv(x: torch.Tensor, psi: Psi, weight: torch.Tensor, nlon_out: int, groups: int = 1,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """DISCO convolution x (B, C_in, nlat_in, nlon_in) -> (B, C_out, nlat_out, nlon_out) with
    weight (C_out, C_in / groups, K): the contraction, then a per-group channel/basis mix."""
    batch, channels = x.shape[:2]
    _check_weight(weight, channels, psi.kernel_size, groups)
    expanded = disco_contraction(x, psi, nlon_out)
    expanded = expanded.reshape(batch, groups, channels // groups, *expanded.shape[2:])
    mix = weight.reshape(groups, weight.shape[0] // groups, *weight.shape[1:])
    out = torch.einsum("bgckxy,gock->bgoxy", expanded, mix).reshape(batch, weight.shape[0], *expanded.shape[-2:])
    return out if bias is None else out + bias.reshape(1, -1, 1, 1)


def disco_transpose_conv(x: torch.Tensor, psi: Psi, weight: torch.Tensor, nlon_out: int,
                         groups: int = 1, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Transpose DISCO convolution x (B, C_in, nlat, nlon) -> (B, C_out, psi nlat_in, nlon_out)
    with weight (C_out, C_in / groups, K): the channel/basis mix, then the transpose contraction."""
    batch, channels = x.shape[:2]
    _check_weight(weight, channels, psi.kernel_size, groups)
    grouped = x.reshape(batch, groups, channels // groups, *x.shape[2:])
    mix = weight.reshape(groups, weight.shape[0] // groups, *weight.shape[1:])
    expanded = torch.einsum("bgcxy,gock->bgokxy", grouped, mix)
    expanded = expanded.reshape(batch, weight.shape[0], *expanded.shape[3:])
    out = disco_transpose_contraction(expanded, psi, nlon_out)
    return out if bias is None else out + bias.reshape(1, -1, 1, 1)
