"""What runs each variant of the DISCO kernel space in DiscoConvS2's unfused paths.

The kernel space (tilecast.spaces.disco: VARIANTS, TILES) names each direction's
variants; FORWARD and BACKWARD here hold one row per variant, the op that runs it, and
DiscoConvS2 dispatches through them, never on names: a new variant is its rows there and one
row here (tests/test_disco_paths.py checks that both name the same variants). This table
cannot live in tilecast/spaces/disco.py itself: the ops import torch, the kernel space must not.

    FORWARD[variant](x, psi, packed, kernel_size, nlat_out, nlon_out, tile, gradient)
        x (B, C, nlat_in, nlon_in) -> (B, C, K, nlat_out, nlon_out) on that variant's kernel:
        psi the six CSR tensors, packed psi's kpacked layout (None where it has none), tile
        the kernel's register tile (None: the library's), gradient the kernel its input
        gradient runs (a Gradient)
    BACKWARD[variant](tile, line_layout) -> Gradient
        the input gradient on that variant's kernel: tile the selector's, line_layout() psi's
        transpose in the line-blocked layout whatever its fill
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from torch import Tensor

from tilecast.disco import ops
from tilecast.disco.kpacked import KPacked
from tilecast.disco.lines import LineBlocked
from tilecast.spaces.disco import VARIANTS


@dataclass(frozen=True)
class Gradient:
    """The kernel of a contraction's input gradient: the CSR transpose with `tile` ((bt, nv,
    lat_block); None: the library's), or the line-blocked transpose on `lines` (psi's
    transpose in that layout) where it is not None."""
    tile: Optional[list[int]] = None
    lines: Optional[LineBlocked] = None


def _csr_forward(x: Tensor, psi: tuple[Tensor, ...], packed: Optional[KPacked],
                 kernel_size: int, nlat_out: int, nlon_out: int, tile: Optional[list[int]],
                 gradient: Gradient) -> Tensor:
    # the op pairs the CSR forward with its gradient's kernel (the pairing is the op's autograd)
    if gradient.lines is not None:
        return ops.disco_contraction_lines(x, *psi, kernel_size, nlat_out, nlon_out,
                                           gradient.lines, tile)
    return ops.disco_contraction(x, *psi, kernel_size, nlat_out, nlon_out, tile, gradient.tile)


def _kpacked_forward(x: Tensor, psi: tuple[Tensor, ...], packed: Optional[KPacked],
                     kernel_size: int, nlat_out: int, nlon_out: int, tile: Optional[list[int]],
                     gradient: Gradient) -> Tensor:
    return ops.disco_contraction_kpacked(x, *packed.tensors(), *psi, kernel_size, nlat_out,
                                         nlon_out, tile, gradient.tile, gradient.lines)


def _csr_gradient(tile: Sequence[int],
                  line_layout: Callable[[], Optional[LineBlocked]]) -> Gradient:
    return Gradient(tile=list(tile))


def _lines_gradient(tile: Sequence[int],
                    line_layout: Callable[[], Optional[LineBlocked]]) -> Gradient:
    # its one tile: nothing to pass; no layout (psi without entries): the CSR transpose
    return Gradient(lines=line_layout())


FORWARD: dict[str, Callable[..., Tensor]] = {"csr": _csr_forward, "kpacked": _kpacked_forward}
BACKWARD: dict[str, Callable[..., Gradient]] = {"csr": _csr_gradient, "lines": _lines_gradient}
#: the forward variants DiscoConvS2 runs without a selector's choice, the first psi has the
#: layout for
FORWARD_PREFERENCE = ("kpacked", "csr")


def _row(table: dict, direction: str, variant: str):
    try:
        return table[variant]
    except (KeyError, TypeError):
        raise ValueError(f"unknown DISCO {direction} variant {variant!r}; valid: "
                         f"{', '.join(table)}") from None


def forward_op(variant: str) -> Callable[..., Tensor]:
    """FORWARD's row for `variant`; ValueError naming it and the valid ones otherwise."""
    return _row(FORWARD, "forward", variant)


def gradient_kernel(variant: str, tile: Sequence[int],
                    line_layout: Callable[[], Optional[LineBlocked]]) -> Gradient:
    """The Gradient of BACKWARD's row for `variant` (the selector's tile, a builder of the
    line-blocked layout); ValueError naming the variant and the valid ones otherwise."""
    return _row(BACKWARD, "backward", variant)(tile, line_layout)


def has_layout(variant: str, packed: Optional[KPacked]) -> bool:
    """Whether psi has the layout the forward variant's kernels read (kpacked ones need
    `packed`); ValueError for a variant FORWARD lacks."""
    forward_op(variant)
    return packed is not None or not VARIANTS[variant].kpacked_layout
