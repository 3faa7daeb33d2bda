"""psi's transpose regrouped by blocks of input lines, for the line-blocked transpose kernel
(kernels/cpu/disco/disco_lines_transpose.hpp).

    boff   [blocks + 1]      int64    keys of block b (input lines b*LB .. b*LB + LB - 1,
                                      line = hi * s + p as in the transpose CSR): boff[b]:boff[b+1]
    bcol   [keys]            int64    a transpose-CSR column (k * nlat_out + ho) * nlon_out + q
                                      that some line of the block reads, ascending per block
    bvals  [keys, LB]        float32  the value each line of the block gives it (0: none)

One loaded gy slice then feeds every line of the block that reads it, where the CSR transpose
loads one slice per FMA; the zeros cost FMAs. The share of non-zero values (`fill`) decides:
on the AVX2 CPU the line-blocked kernel ran down_73x721x1440's transpose (fill 0.81 at LB = 4)
1.48x faster than the CSR one (83 against 56 GFLOP/s) and self_256x360x720's (fill 0.47)
0.8x as fast, so `line_blocked` builds the layout only from MIN_FILL up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tilecast.disco.csr import DiscoCSR

#: the share of non-zero values from which the line-blocked kernel is used (module docstring)
MIN_FILL = 0.75


@dataclass(frozen=True, eq=False)
class LineBlocked:
    """The line-blocked layout of one psi's transpose: see the module docstring."""
    boff: torch.Tensor
    bcol: torch.Tensor
    bvals: torch.Tensor
    fill: float

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.boff, self.bcol, self.bvals

    def to(self, device: torch.device | str) -> "LineBlocked":
        return LineBlocked(self.boff.to(device), self.bcol.to(device), self.bvals.to(device),
                           self.fill)


def regroup(troff: torch.Tensor, tcol: torch.Tensor, tvals: torch.Tensor,
            line_block: int) -> LineBlocked:
    """The transpose CSR (troff over the input lines, tcol, tvals) regrouped by blocks of
    `line_block` lines."""
    if line_block < 1:
        raise ValueError(f"line_block must be a positive integer, got {line_block}")
    lines = troff.numel() - 1
    blocks = -(-lines // line_block)
    line_of = torch.repeat_interleave(torch.arange(lines), (troff[1:] - troff[:-1]).cpu())
    columns = int(tcol.max()) + 1 if tcol.numel() else 1
    keys, slot = torch.unique((line_of // line_block) * columns + tcol.cpu(), return_inverse=True)
    bvals = torch.zeros(keys.numel(), line_block, dtype=torch.float32)
    bvals[slot, line_of % line_block] = tvals.cpu().to(torch.float32)
    boff = torch.zeros(blocks + 1, dtype=torch.int64)
    boff[1:] = torch.cumsum(torch.bincount(keys // columns, minlength=blocks), 0)
    fill = float(tcol.numel()) / max(keys.numel() * line_block, 1)
    return LineBlocked(boff, (keys % columns).contiguous(), bvals.contiguous(), fill)


def line_blocked(csr: DiscoCSR, line_block: int,
                 min_fill: float = MIN_FILL) -> Optional[LineBlocked]:
    """csr's transpose in the line-blocked layout when its fill reaches min_fill, else None
    (the CSR transpose is then the faster kernel)."""
    if csr.tcol.numel() == 0:
        return None
    layout = regroup(csr.troff, csr.tcol, csr.tvals, line_block)
    return layout if layout.fill >= min_fill else None
