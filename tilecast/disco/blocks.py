"""psi restricted to a range of output latitudes: the problem one block of the fused
convolution, or one latitude shard of the distributed convolution, solves.

Output latitudes [h0, h1) read a band of input latitudes [lo, hi): the restriction keeps the
entries of those output rows, renumbers the output latitudes from 0 and the input columns from
the band's first latitude, so the result is an ordinary Psi from a (hi - lo, nlon_in) grid to
a (h1 - h0, nlon_out) grid, consumed by every kernel unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tilecast.disco.psi import Psi


@dataclass(frozen=True, eq=False)
class PsiBlock:
    """psi of output latitudes `out_rows` = [h0, h1), reading input latitudes `in_rows` =
    [lo, hi) of the full grid (re-based: input latitude lo is the block's row 0)."""
    psi: Psi
    out_rows: tuple[int, int]
    in_rows: tuple[int, int]


def restrict_psi(psi: Psi, out_rows: tuple[int, int], rebase: bool = True) -> PsiBlock:
    """The block of `psi` for output latitudes [h0, h1) (0 <= h0 < h1 <= nlat_out). With
    rebase=False the input side stays the full grid (columns and in_shape unchanged), for a
    kernel that reads the whole input; in_rows still names the band the block reads."""
    h0, h1 = int(out_rows[0]), int(out_rows[1])
    (nlat_in, nlon_in), (nlat_out, nlon_out) = psi.in_shape, psi.out_shape
    if not 0 <= h0 < h1 <= nlat_out:
        raise ValueError(f"output latitude range [{h0}, {h1}) is empty or outside 0..{nlat_out}")
    kernel, lat_out, column = psi.idx
    keep = (lat_out >= h0) & (lat_out < h1)
    kernel, lat_out, column, vals = kernel[keep], lat_out[keep] - h0, column[keep], psi.vals[keep]
    lat_in = column // nlon_in
    if lat_in.numel():
        lo, hi = int(lat_in.min()), int(lat_in.max()) + 1
    else:
        lo, hi = min(h0, nlat_in - 1), min(h0, nlat_in - 1) + 1
    if rebase:
        column = column - lo * nlon_in
    rows = h1 - h0
    # the entries keep psi's (kernel, latitude, column) order: the renumbering is monotone
    roff = torch.zeros(psi.kernel_size * rows + 1, dtype=torch.int64)
    roff[1:] = torch.cumsum(torch.bincount(kernel * rows + lat_out,
                                           minlength=psi.kernel_size * rows), 0)
    idx = torch.stack([kernel, lat_out, column]).contiguous()
    in_shape = (hi - lo, nlon_in) if rebase else psi.in_shape
    block = Psi(idx, vals.contiguous(), roff, in_shape, (rows, nlon_out),
                psi.kernel_size, psi.theta_cutoff)
    return PsiBlock(block, (h0, h1), (lo, hi))


def split_rows(nlat: int, parts: int) -> list[tuple[int, int]]:
    """[h0, h1) ranges cutting nlat latitudes into `parts` near-equal contiguous ranges (the
    first ones one longer); parts must be between 1 and nlat."""
    if not 1 <= parts <= nlat:
        raise ValueError(f"cannot split {nlat} latitudes into {parts} non-empty parts")
    base, extra = divmod(nlat, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))
