"""psi in the K-packed (blocked CSR) layout: one entry per (output latitude, neighbour), each
carrying all K basis values contiguously, zero-padded to K_PAD.

    offset  [Ho + 1]            int64    neighbours of output latitude ho: offset[ho]:offset[ho+1]
    idx     [nbr, 2]            int64    (input latitude, input longitude) of each neighbour
    vals    [nbr, K_PAD]        float32  psi[k, ho, neighbour] for k < K, zeros after

The layout exists only when every basis function has the same support at every output
latitude (the harmonic basis; not the piecewise-linear one, whose functions cover different
sectors): then one input value feeds all K basis functions, which is what the kpacked kernels
exploit. kpack_psi returns None otherwise and the convolution falls back to CSR. Rows are not
padded to the longest neighbourhood: the polar rows, whose support spans the whole ring,
would set that length far above the mean.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tilecast.disco.psi import Psi

#: K_PAD values the kpacked kernels are instantiated for
SUPPORTED_K_PAD = (8, 16)
#: K is padded to a multiple of this
K_ALIGN = 8


@dataclass(frozen=True, eq=False)
class KPacked:
    """psi's kpacked tensors and the padded basis count they were built with."""
    idx: torch.Tensor
    vals: torch.Tensor
    offset: torch.Tensor
    k_pad: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.idx, self.vals, self.offset


def padded_kernel_size(kernel_size: int) -> int:
    """K rounded up to the next multiple of K_ALIGN."""
    return -(-kernel_size // K_ALIGN) * K_ALIGN


def kpack_psi(psi: Psi) -> Optional[KPacked]:
    """psi in the kpacked layout, or None when the basis functions' supports differ (or psi
    has no entries)."""
    kernel_size = psi.kernel_size
    nlat_out = psi.out_shape[0]
    nlon_in = psi.in_shape[1]
    if psi.nnz == 0 or psi.nnz % kernel_size != 0:
        return None
    per_kernel = psi.nnz // kernel_size
    # psi is sorted by (kernel, output latitude, column): with a shared support, the K
    # kernel-major runs hold the same (latitude, column) sequence
    row_lengths = (psi.roff[1:] - psi.roff[:-1]).view(kernel_size, nlat_out)
    if not torch.equal(row_lengths, row_lengths[:1].expand_as(row_lengths)):
        return None
    columns = psi.idx[2].view(kernel_size, per_kernel)
    if not torch.equal(columns, columns[:1].expand_as(columns)):
        return None
    k_pad = padded_kernel_size(kernel_size)
    vals = torch.zeros(per_kernel, k_pad, dtype=torch.float32)
    vals[:, :kernel_size] = psi.vals.view(kernel_size, per_kernel).t().to(torch.float32)
    column = columns[0]
    idx = torch.stack([column // nlon_in, column % nlon_in], dim=1).contiguous()
    offset = psi.roff[: nlat_out + 1].clone()
    return KPacked(idx=idx, vals=vals.contiguous(), offset=offset, k_pad=k_pad)
