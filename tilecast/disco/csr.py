"""psi in the two CSR layouts the CPU contraction kernels read.

forward    rows k * nlat_out + ho (psi's own order), columns hi * nlon_in + wi
transpose  rows hi * s + p (input latitude hi, longitude phase p = wi mod s, s = nlon_in /
           nlon_out), columns (k * nlat_out + ho) * nlon_out + q with q = wi div s

The transpose layout lets every input pixel gather from its neighbourhood (no scatter, no
atomics): input longitude p + s*j receives entry e from output longitude (j - q_e) mod
nlon_out. Both are built once, when a convolution is constructed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tilecast.disco.psi import Psi


@dataclass(frozen=True, eq=False)
class DiscoCSR:
    """The forward CSR (roff, col, vals) and transpose CSR (troff, tcol, tvals) of one psi.

    Offsets and columns are int64, values float32, all contiguous, on the CPU as built (`to`
    moves them). in_shape and out_shape are psi's (nlat, nlon); kernel_size its number of
    basis functions.
    """
    roff: torch.Tensor
    col: torch.Tensor
    vals: torch.Tensor
    troff: torch.Tensor
    tcol: torch.Tensor
    tvals: torch.Tensor
    in_shape: tuple[int, int]
    out_shape: tuple[int, int]
    kernel_size: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(roff, col, vals, troff, tcol, tvals): the order the tilecast ops take them in."""
        return self.roff, self.col, self.vals, self.troff, self.tcol, self.tvals

    def to(self, device: torch.device | str) -> "DiscoCSR":
        """This psi with its tensors on `device` (the ops read psi where the activations are)."""
        names = ("roff", "col", "vals", "troff", "tcol", "tvals")
        return replace(self, **{name: getattr(self, name).to(device) for name in names})


def csr_from_psi(psi: Psi) -> DiscoCSR:
    """Both CSR layouts of `psi`, for its own output longitude count."""
    (nlat_in, nlon_in), (nlat_out, nlon_out) = psi.in_shape, psi.out_shape
    stride = nlon_in // nlon_out
    ker, ho, column = psi.idx
    hi, wi = column // nlon_in, column % nlon_in
    line = hi * stride + wi % stride
    tcol = (ker * nlat_out + ho) * nlon_out + wi // stride
    order = torch.argsort(line * (psi.kernel_size * nlat_out * nlon_out) + tcol)
    troff = torch.zeros(nlat_in * stride + 1, dtype=torch.int64)
    troff[1:] = torch.cumsum(torch.bincount(line, minlength=nlat_in * stride), 0)
    vals = psi.vals.to(torch.float32)
    return DiscoCSR(roff=psi.roff.contiguous(), col=column.contiguous(), vals=vals.contiguous(),
                    troff=troff, tcol=tcol[order].contiguous(), tvals=vals[order].contiguous(),
                    in_shape=psi.in_shape, out_shape=psi.out_shape, kernel_size=psi.kernel_size)
