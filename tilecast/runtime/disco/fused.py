"""The fused DISCO convolution: the contraction and the channel/basis mix in one pass over
blocks of output latitudes, so the (B, C, K, nlat_out, nlon_out) intermediate never exists.

Each block contracts x into a (B, C, K, rows, nlon_out) slab sized to stay in cache
(TARGET_SLAB_BYTES per batch element), mixes it with the weight by one matmul per group and
writes its rows of the output. The backward recomputes each slab instead of keeping it,
then runs the weight gradient and the slab's gradient as matmuls and the CSR transpose
contraction on the block's band of input latitudes (psi re-based to the band, blocks.py; the
line-blocked kernel where the band's filter is several input lines tall, tilecast.disco.lines),
so the input gradient is accumulated band by band. Forward and backward run different kernels
(the kpacked forward where eligible, CSR backward), hence an autograd.Function.

The mix in the kernel. With the kpacked layout, float32 on the CPU, one group and nlon_out a
whole number of GEMM panels (16 longitudes on AVX2, 32 on AVX-512), the forward can run as
one kernel (native.kpacked_mix, kernels/cpu/disco/disco_kpacked_mix.hpp): the contraction writes
each output latitude's expansion straight into the GEMM's packed B panels, which the GEMM
micro-kernel consumes while they are in cache, so no slab is written, read back and packed.
Whether that beats the contraction plus torch's sgemm depends on the machine and the grid,
so the mixer races the two per input shape over the blocks of a whole forward (SweepRace),
and the winner runs every later forward (the kernel in one call); on the AVX2 EPYC the
kernel ran self_256x360x720's forward 1.17-1.38x faster.

The transposed backward. Where kpacked is eligible, both grids have the same longitudes and
the backward does no more matrix work on the input grid than on the output grid (nlat_in <=
nlat_out, C_out <= C_in: the self-convolutions), the backward contracts the output gradient
first and mixes after. psi's adjoint is itself a DISCO filter from the output grid to the
input grid (transpose_psi), with the kpacked layout whenever psi has it, so

    T[b, o, k, hi, v] = sum over psi's entries (k, ho, hi, wi) of val * gy[b, o, ho, v - wi]

is the kpacked forward kernel run on gy, block by block of input latitudes, and then

    grad_x[b, c, hi, v] = sum_{o, k} W[o, c, k] T[b, o, k, hi, v]
    grad_W[o, c, k]     = sum_{b, hi, v} T[b, o, k, hi, v] x[b, c, hi, v]

are two matmuls on the block. Each input latitude's gradient is written once (a gather, no
accumulation over bands), no slab is recomputed, and the kpacked kernel (one loaded slice
feeds every basis function) replaces the CSR transpose (one load per FMA): on the AVX2 CPU,
self_256x360x720's backward went from 6.2 to ~4.8 s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from tilecast.disco import native, ops
from tilecast.runtime.disco import mix as mixing
from tilecast.disco.blocks import restrict_psi
from tilecast.disco.csr import csr_from_psi
from tilecast.disco.kpacked import KPacked, kpack_psi
from tilecast.disco.lines import LineBlocked, line_blocked
from tilecast.runtime.disco.mix import TORCH, TORCH_SIDE, Mixer
from tilecast.disco.psi import Psi

#: float32 bytes of one block's slab per batch element (C * K * rows * nlon_out * 4): most of
#: a 32 MB last-level cache keeps it there between the contraction and the matmul, and the
#: rows it allows give the kernels and the matmul enough work per call (more rows per block
#: were faster on the AVX2 CPU, forward and transposed backward, on a large self-map; flat on
#: a downsampling one)
TARGET_SLAB_BYTES = 24 << 20


@dataclass(frozen=True, eq=False)
class FusedBlock:
    """Output latitudes [h0, h1) reading input latitudes [lo, hi): `forward_csr` is the
    block's psi over the whole input grid (the forward reads x in place), `band_csr` the same
    re-based to the band (the backward's transpose writes the band only), `band_lines` the
    band's transpose in the line-blocked layout where that kernel is the faster one (CPU;
    tilecast.disco.lines) and the blockwise backward runs (no transposed backward), else
    None."""
    out_rows: tuple[int, int]
    in_rows: tuple[int, int]
    forward_csr: tuple[Tensor, ...]
    band_csr: tuple[Tensor, ...]
    band_lines: Optional[LineBlocked] = None


@dataclass(frozen=True, eq=False)
class FusedPlan:
    """psi cut into blocks of output latitudes, on one device; `transposed` is psi's adjoint
    in the kpacked layout where the transposed backward applies (module docstring), else
    None."""
    blocks: tuple[FusedBlock, ...]
    kernel_size: int
    in_shape: tuple[int, int]
    out_shape: tuple[int, int]
    transposed: Optional[KPacked] = None


def block_rows(channels: int, kernel_size: int, nlon_out: int,
               target_bytes: Optional[int] = None) -> int:
    """Output latitudes per block: the most whose slab fits target_bytes (default
    TARGET_SLAB_BYTES), at least one."""
    target_bytes = TARGET_SLAB_BYTES if target_bytes is None else target_bytes
    return max(1, target_bytes // (4 * channels * kernel_size * nlon_out))


def transpose_psi(psi: Psi) -> Psi:
    """psi's adjoint as a filter from psi's output grid to its input grid, for grids of the
    same longitudes: entry (k, ho, hi * W + wi) becomes (k, hi, ho * W + (-wi mod W)) with
    the same value, so that contracting gy with it gives, at input point (hi, v), the sum
    of val * gy[ho, v - wi] over the entries that read (hi, v) from longitude 0."""
    (nlat_in, nlon), (nlat_out, nlon_out) = psi.in_shape, psi.out_shape
    if nlon != nlon_out:
        raise ValueError(f"transpose_psi needs grids of the same longitudes, got {psi.in_shape} "
                         f"-> {psi.out_shape}")
    kernel, lat_out, column = psi.idx
    lat_in, lon_in = column // nlon, column % nlon
    new_column = lat_out * nlon + (-lon_in) % nlon
    order = torch.argsort((kernel * nlat_in + lat_in) * (nlat_out * nlon) + new_column)
    kernel, lat_in, new_column = kernel[order], lat_in[order], new_column[order]
    roff = torch.zeros(psi.kernel_size * nlat_in + 1, dtype=torch.int64)
    roff[1:] = torch.cumsum(torch.bincount(kernel * nlat_in + lat_in,
                                           minlength=psi.kernel_size * nlat_in), 0)
    return Psi(torch.stack([kernel, lat_in, new_column]).contiguous(),
               psi.vals[order].contiguous(), roff, psi.out_shape, psi.in_shape,
               psi.kernel_size, psi.theta_cutoff)


def transposed_backward_applies(psi: Psi, channels: int, out_channels: int) -> bool:
    """Whether the transposed backward (module docstring) does no more work than the
    blockwise one: same longitudes, no more input latitudes than output ones, no more output
    channels than input ones."""
    (nlat_in, nlon_in), (nlat_out, nlon_out) = psi.in_shape, psi.out_shape
    return nlon_in == nlon_out and nlat_in <= nlat_out and out_channels <= channels


def plan_blocks(psi: Psi, channels: int, device: torch.device | str,
                rows: Optional[int] = None, out_channels: Optional[int] = None) -> FusedPlan:
    """psi's fused blocks for `channels` input channels (rows per block: block_rows), and
    with `out_channels` psi's transposed kpacked layout where the transposed backward
    applies (transposed_backward_applies) and psi has the kpacked layout."""
    nlat_out, nlon_out = psi.out_shape
    rows = rows or block_rows(channels, psi.kernel_size, nlon_out)
    on_cpu = torch.device(device).type == "cpu"
    transposed = None
    if out_channels is not None and transposed_backward_applies(psi, channels, out_channels):
        packed = kpack_psi(transpose_psi(psi))
        if packed is not None:
            transposed = KPacked(*(t.to(device) for t in packed.tensors()), packed.k_pad)
    blocks = []
    for h0 in range(0, nlat_out, rows):
        h1 = min(nlat_out, h0 + rows)
        whole = restrict_psi(psi, (h0, h1), rebase=False)
        band = restrict_psi(psi, (h0, h1), rebase=True)
        band_csr = csr_from_psi(band.psi)
        # the line-blocked bands serve the blockwise backward only (CPU)
        lines = (line_blocked(band_csr, native.line_block())
                 if on_cpu and transposed is None else None)
        blocks.append(FusedBlock((h0, h1), band.in_rows,
                                 tuple(t.to(device) for t in csr_from_psi(whole.psi).tensors()),
                                 tuple(t.to(device) for t in band_csr.tensors()), lines))
    return FusedPlan(tuple(blocks), psi.kernel_size, psi.in_shape, psi.out_shape, transposed)


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


#: batch * groups up to which the per-matrix loops below beat one batched matmul and a copy
MAX_LOOPED_MATMULS = 8


def _matmul_into(out: Tensor, h0: int, h1: int, mix: Tensor, slab: Tensor,
                 mixer: Mixer = TORCH) -> None:
    """out[:, :, h0:h1] = mix (G, M, N) @ slab (B, G, N, rows * nlon) per batch element and
    group, the product written straight into out's rows (a strided matrix the mixer writes in
    place) where the dtypes agree and there are few products (or the mixer runs a tilecast
    kernel), else through a copy."""
    batch, groups = slab.shape[:2]
    rows, nlon = h1 - h0, out.shape[-1]
    looped = mixer.gemm is not None or batch * groups <= MAX_LOOPED_MATMULS
    if out.dtype != slab.dtype or not looped:
        mixed = torch.matmul(mix, slab)
        out[:, :, h0:h1] = mixed.reshape(batch, -1, rows, nlon)
        return
    m = mix.shape[1]
    for b in range(batch):
        for g in range(groups):
            mixer.mm(mix[g], slab[b, g], out[b, g * m:(g + 1) * m, h0:h1].view(m, rows * nlon))


def _accumulate_products(total: Tensor, left: Tensor, right: Tensor,
                         mixer: Mixer = TORCH) -> None:
    """total (G, M, N) += sum over the batch of left (B, G, M, K) @ right (B, G, K, N), in place
    (addmm_) where the dtypes agree and there are few products (or the mixer runs a tilecast
    kernel)."""
    batch, groups = left.shape[:2]
    looped = mixer.gemm is not None or batch * groups <= MAX_LOOPED_MATMULS
    if total.dtype != left.dtype or not looped:
        total += torch.matmul(left, right).sum(0).to(total.dtype)
        return
    for b in range(batch):
        for g in range(groups):
            mixer.addmm_(total[g], left[b, g], right[b, g])


#: the contender of a forward's race that runs the contraction and the mix as one kernel
KERNEL_SIDE = "kpacked_mix"
#: output latitudes a race unit spans at least (whole blocks): a kernel call on fewer splits
#: its latitudes across the threads and repacks the weight for little work, which would
#: time the kernel below what it does on a whole forward
RACE_ROWS = 8


def kernel_mix_applies(x: Tensor, weight: Tensor, packed: Optional[KPacked],
                       groups: int, mixer: Mixer) -> bool:
    """Whether the forward may run on the one-kernel contraction and mix (native.kpacked_mix):
    the kpacked layout, float32 on the CPU, one group, and a mixer that allows it
    (Mixer.in_kernel, and no GEMM choice or a raced one: a GEMM kernel forced on every
    product keeps the forward's products on it)."""
    return (mixer.in_kernel and (mixer.gemm is None or mixer.race) and packed is not None
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and groups == 1)


def _race_units(blocks: tuple[FusedBlock, ...]) -> list[tuple[FusedBlock, ...]]:
    """The blocks in runs of RACE_ROWS output latitudes or more (the last run may be short)."""
    rows = blocks[0].out_rows[1] - blocks[0].out_rows[0]
    size = -(-RACE_ROWS // rows)
    return [blocks[i:i + size] for i in range(0, len(blocks), size)]


class SweepRace:
    """The forward's race between torch's mix (TORCH_SIDE) and the kernel (KERNEL_SIDE), over
    whole forwards: the units (runs of blocks, _race_units) go to the two in the order A B B
    A, A B B A, ... from the first to the last, so each gets units from every latitude (a
    polar block's neighbourhood can be many times an equatorial one's, and the two sides'
    costs grow differently with it); each side's first unit is untimed. At the end of the
    first forward in which both have RACE_SAMPLES timed units, the side with the lower mean
    seconds per timed unit wins (torch on a tie); `winner` is None until then. `medians()`
    gives those means (the name Race's printers read)."""

    contenders = (TORCH_SIDE, KERNEL_SIDE)

    def __init__(self):
        self.seconds: dict[str, list[float]] = {side: [] for side in self.contenders}
        self._calls = 0
        self._untimed: set[str] = set()
        self.winner: Optional[str] = None

    def side(self) -> str:
        return self.contenders[(self._calls + 1) // 2 % 2]

    def record(self, side: str, seconds: float) -> None:
        self._calls += 1
        if side in self._untimed:
            self.seconds[side].append(seconds)
        else:
            self._untimed.add(side)

    def end_forward(self) -> None:
        """Called after each raced forward: decides the race once both sides have enough."""
        if self.winner is None and all(len(t) >= mixing.RACE_SAMPLES for t in self.seconds.values()):
            means = self.medians()
            self.winner = min(self.contenders, key=means.__getitem__)

    def medians(self) -> dict[str, float]:
        """Each side's mean seconds per timed unit (nan where none yet)."""
        return {side: sum(times) / len(times) if times else float("nan")
                for side, times in self.seconds.items()}

    def __repr__(self) -> str:
        times = ", ".join(f"{side} {mean * 1e3:.3g} ms" for side, mean in self.medians().items())
        return f"SweepRace({times} a unit; winner {self.winner})"


class _DiscoFusedFn(torch.autograd.Function):
    """out = mix(weight, contraction(x)) block by block; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, plan, packed, groups, mixer):
        batch, channels = x.shape[:2]
        out_channels = weight.shape[0]
        nlat_out, nlon_out = plan.out_shape
        mix = weight.reshape(groups, out_channels // groups, -1)
        out = x.new_empty(batch, out_channels, nlat_out, nlon_out,
                          dtype=torch.result_type(x, weight))
        in_kernel = kernel_mix_applies(x, weight, packed, groups, mixer)
        if in_kernel:
            x = x.contiguous()
            mix_2d = mix[0].contiguous()
        # with a race (Mixer.race), the kernel runs the whole forward once it has won
        race = None
        if in_kernel and mixer.race:
            key = (KERNEL_SIDE, tuple(x.shape), out_channels, plan.out_shape)
            race = mixer.races.setdefault(key, SweepRace())
        if in_kernel and (race is None or race.winner == KERNEL_SIDE):
            native.kpacked_mix(x, mix_2d, *packed.tensors(), plan.kernel_size, nlat_out,
                               nlon_out, out=out)
        else:
            racing = race is not None and race.winner is None
            for unit in _race_units(plan.blocks) if racing else [plan.blocks]:
                side = race.side() if racing else TORCH_SIDE
                start = mixing.clock()
                if side == KERNEL_SIDE:
                    h0, h1 = unit[0].out_rows[0], unit[-1].out_rows[1]
                    native.kpacked_mix(x, mix_2d, *packed.tensors(), plan.kernel_size, nlat_out,
                                       nlon_out, h0, h1 - h0, out=out)
                for block in unit if side == TORCH_SIDE else ():
                    h0, h1 = block.out_rows
                    slab = _slab(x, block, plan, packed).reshape(batch, groups, -1,
                                                                 (h1 - h0) * nlon_out)
                    dtype = mix_dtype(slab)
                    _matmul_into(out, h0, h1, mix.to(dtype), slab.to(dtype), mixer)
                if racing:
                    race.record(side, mixing.clock() - start)
            if racing:
                race.end_forward()
        ctx.save_for_backward(x, weight)
        ctx.plan, ctx.packed, ctx.groups, ctx.mixer = plan, packed, groups, mixer
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        plan, packed, groups, mixer = ctx.plan, ctx.packed, ctx.groups, ctx.mixer
        if packed is not None and plan.transposed is not None:
            return (*_transposed_backward(x, weight, grad_out, plan, groups,
                                          ctx.needs_input_grad[:2], mixer), None, None, None,
                    None)
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
                _accumulate_products(grad_mix, grad_rows,
                                     slab.to(grad_rows.dtype).transpose(-1, -2), mixer)
            if want_x:
                grad_slab = mixer.matmul(mix.transpose(-1, -2).to(grad_rows.dtype), grad_rows)
                grad_slab = grad_slab.to(x.dtype).reshape(batch, channels, plan.kernel_size, rows,
                                                          nlon_out)
                if block.band_lines is not None and grad_slab.device.type == "cpu":
                    grad_band = native.transpose_lines(grad_slab.contiguous(),
                                                       *block.band_lines.tensors(), hi - lo, nlon_in)
                else:
                    grad_band = ops.disco_transpose_contraction(grad_slab, *block.band_csr,
                                                                hi - lo, nlon_in)
                grad_x[:, :, lo:hi] += grad_band
        grad_weight = grad_mix.reshape(weight.shape).to(weight.dtype) if want_w else None
        return (grad_x.to(x.dtype) if want_x else None), grad_weight, None, None, None, None


def _transposed_backward(x: Tensor, weight: Tensor, grad_out: Tensor, plan: FusedPlan,
                         groups: int, needs: tuple[bool, bool], mixer: Mixer = TORCH):
    """(grad_x, grad_weight) by the transposed backward of the module docstring, block by
    block of input latitudes; None for a gradient not needed. (grad_x alone could run on the
    forward's kpacked mix kernel, on gy and psi's adjoint, but the weight gradient then
    needs the contraction again: on the AVX2 EPYC the two came out level.)"""
    want_x, want_w = needs
    batch, channels, nlat_in, nlon = x.shape
    out_channels, kernel_size = weight.shape[0], plan.kernel_size
    cin, cout = channels // groups, out_channels // groups
    dtype = mix_dtype(grad_out)
    # W[g, o, c, k] as (c, (o, k)) per group: grad_x = w_x @ T
    w_x = weight.reshape(groups, cout, cin, kernel_size).permute(0, 2, 1, 3)
    w_x = w_x.reshape(groups, cin, cout * kernel_size).to(dtype)
    grad_out = grad_out.contiguous()
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_x else None
    grad_w = (torch.zeros(groups, cout * kernel_size, cin, dtype=torch.float32, device=x.device)
              if want_w else None)
    rows = block_rows(out_channels, kernel_size, nlon)
    for h0 in range(0, nlat_in, rows):
        h1 = min(nlat_in, h0 + rows)
        width = (h1 - h0) * nlon
        expanded = ops.disco_kpacked_contraction(grad_out, *plan.transposed.tensors(),
                                                 kernel_size, nlat_in, nlon, h0, h1 - h0)
        expanded = expanded.reshape(batch, groups, cout * kernel_size, width).to(dtype)
        if want_x:
            _matmul_into(grad_x, h0, h1, w_x, expanded, mixer)
        if want_w:
            rows_x = x[:, :, h0:h1].reshape(batch, groups, cin, width).to(dtype)
            _accumulate_products(grad_w, expanded, rows_x.transpose(-1, -2), mixer)
    grad_weight = None
    if want_w:
        grad_weight = grad_w.reshape(groups, cout, kernel_size, cin).permute(0, 1, 3, 2)
        grad_weight = grad_weight.reshape(weight.shape).to(weight.dtype)
    return grad_x, grad_weight


def fused_conv(x: Tensor, weight: Tensor, plan: FusedPlan, packed: Optional[KPacked],
               groups: int, mixer: Mixer = TORCH) -> Tensor:
    """The convolution without bias, x (B, C, nlat_in, nlon_in) -> (B, C_out, nlat_out,
    nlon_out), weight (C_out, C / groups, K), fused block by block; `packed` (kpacked psi, or
    None for CSR) picks the forward contraction kernel, `mixer` who runs the mix's products
    (tilecast.runtime.disco.mix)."""
    if x.device.type != "cpu":
        packed = None  # the kpacked kernel is CPU only
    return _DiscoFusedFn.apply(x, weight, plan, packed, groups, mixer)
