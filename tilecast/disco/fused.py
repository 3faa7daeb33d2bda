"""The fused DISCO convolution: the contraction and the channel/basis mix in one pass over
blocks of output latitudes, so the (B, C, K, nlat_out, nlon_out) intermediate never exists.

Each block contracts x into a (B, C, K, rows, nlon_out) slab sized to stay in cache
(TARGET_SLAB_BYTES per batch element), mixes it with the weight by one matmul per group and
writes its rows of the output. The backward recomputes each slab instead of keeping it,
then runs the weight gradient and the slab's gradient as matmuls and the CSR transpose
contraction on the block's band of input latitudes (psi re-based to the band, blocks.py), so
the input gradient is accumulated band by band. Forward and backward run different kernels
(the kpacked forward where eligible, CSR backward), hence an autograd.Function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import ops
from .blocks import restrict_psi
from .csr import csr_from_psi
from .kpacked import KPacked
from .psi import Psi

#: float32 bytes of one block's slab per batch element (C * K * rows * nlon_out * 4): a few
#: MB keeps it in the last-level cache between the contraction and the matmul
TARGET_SLAB_BYTES = 4 << 20


@dataclass(frozen=True, eq=False)
class FusedBlock:
    """Output latitudes [h0, h1) reading input latitudes [lo, hi): `forward_csr` is the
    block's psi over the whole input grid (the forward reads x in place), `band_csr` the same
    re-based to the band (the backward's transpose writes the band only)."""
    out_rows: tuple[int, int]
    in_rows: tuple[int, int]
    forward_csr: tuple[Tensor, ...]
    band_csr: tuple[Tensor, ...]


@dataclass(frozen=True, eq=False)
class FusedPlan:
    """psi cut into blocks of output latitudes, on one device."""
    blocks: tuple[FusedBlock, ...]
    kernel_size: int
    in_shape: tuple[int, int]
    out_shape: tuple[int, int]


def block_rows(channels: int, kernel_size: int, nlon_out: int,
               target_bytes: Optional[int] = None) -> int:
    """Output latitudes per block: the most whose slab fits target_bytes (default
    TARGET_SLAB_BYTES), at least one."""
    target_bytes = TARGET_SLAB_BYTES if target_bytes is None else target_bytes
    return max(1, target_bytes // (4 * channels * kernel_size * nlon_out))


def plan_blocks(psi: Psi, channels: int, device: torch.device | str,
                rows: Optional[int] = None) -> FusedPlan:
    """psi's fused blocks for `channels` input channels (rows per block: block_rows)."""
    nlat_out, nlon_out = psi.out_shape
    rows = rows or block_rows(channels, psi.kernel_size, nlon_out)
    blocks = []
    for h0 in range(0, nlat_out, rows):
        h1 = min(nlat_out, h0 + rows)
        whole = restrict_psi(psi, (h0, h1), rebase=False)
        band = restrict_psi(psi, (h0, h1), rebase=True)
        blocks.append(FusedBlock((h0, h1), band.in_rows,
                                 tuple(t.to(device) for t in csr_from_psi(whole.psi).tensors()),
                                 tuple(t.to(device) for t in csr_from_psi(band.psi).tensors())))
    return FusedPlan(tuple(blocks), psi.kernel_size, psi.in_shape, psi.out_shape)


def _slab(x: Tensor, block: FusedBlock, plan: FusedPlan, packed: Optional[KPacked]) -> Tensor:
    """The block's contraction (B, C, K, rows, nlon_out)."""
    (h0, h1), (_, nlon_out) = block.out_rows, plan.out_shape
    if packed is not None:
        return ops.disco_kpacked_contraction(x, *packed.tensors(), plan.kernel_size,
                                             plan.out_shape[0], nlon_out, h0, h1 - h0)
    return ops.disco_contraction(x, *block.forward_csr, plan.kernel_size, h1 - h0, nlon_out)


def mix_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype a slab is mixed in: its own, but float32 for float16 on the CPU (torch's CPU
    float16 matmul is far slower than float32's)."""
    if tensor.dtype == torch.float16 and tensor.device.type == "cpu":
        return torch.float32
    return tensor.dtype


class _DiscoFusedFn(torch.autograd.Function):
    """out = mix(weight, contraction(x)) block by block; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, plan, packed, groups):
        batch, channels = x.shape[:2]
        out_channels = weight.shape[0]
        nlat_out, nlon_out = plan.out_shape
        mix = weight.reshape(groups, out_channels // groups, -1)
        out = x.new_empty(batch, out_channels, nlat_out, nlon_out,
                          dtype=torch.result_type(x, weight))
        for block in plan.blocks:
            h0, h1 = block.out_rows
            slab = _slab(x, block, plan, packed).reshape(batch, groups, -1, (h1 - h0) * nlon_out)
            dtype = mix_dtype(slab)
            mixed = torch.matmul(mix.to(dtype), slab.to(dtype))
            out[:, :, h0:h1] = mixed.reshape(batch, out_channels, h1 - h0, nlon_out)
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.packed, ctx.groups = plan, packed, groups
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        plan, packed, groups = ctx.plan, ctx.packed, ctx.groups
        batch, channels = x.shape[:2]
        out_channels = weight.shape[0]
        nlon_in = plan.in_shape[1]
        nlon_out = plan.out_shape[1]
        mix = weight.reshape(groups, out_channels // groups, -1)
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if want_x else None
        grad_mix = torch.zeros(mix.shape, dtype=torch.float32, device=x.device) if want_w else None
        for block in plan.blocks:
            (h0, h1), (lo, hi) = block.out_rows, block.in_rows
            rows = h1 - h0
            grad_rows = grad_out[:, :, h0:h1].reshape(batch, groups, -1, rows * nlon_out)
            grad_rows = grad_rows.to(mix_dtype(grad_rows))
            if want_w:
                slab = _slab(x, block, plan, packed).reshape(batch, groups, -1, rows * nlon_out)
                grad_mix += torch.matmul(grad_rows, slab.to(grad_rows.dtype).transpose(-1, -2)).sum(0)
            if want_x:
                grad_slab = torch.matmul(mix.transpose(-1, -2).to(grad_rows.dtype), grad_rows)
                grad_slab = grad_slab.to(x.dtype).reshape(batch, channels, plan.kernel_size, rows,
                                                          nlon_out)
                grad_band = ops.disco_transpose_contraction(grad_slab, *block.band_csr, hi - lo,
                                                            nlon_in)
                grad_x[:, :, lo:hi] += grad_band
        grad_weight = grad_mix.reshape(weight.shape).to(weight.dtype) if want_w else None
        return (grad_x.to(x.dtype) if want_x else None), grad_weight, None, None, None


def fused_conv(x: Tensor, weight: Tensor, plan: FusedPlan, packed: Optional[KPacked],
               groups: int) -> Tensor:
    """The convolution without bias, x (B, C, nlat_in, nlon_in) -> (B, C_out, nlat_out,
    nlon_out), weight (C_out, C / groups, K), fused block by block; `packed` (kpacked psi, or
    None for CSR) picks the forward contraction kernel."""
    if x.device.type != "cpu":
        packed = None  # the kpacked kernel is CPU only
    return _DiscoFusedFn.apply(x, weight, plan, packed, groups)
