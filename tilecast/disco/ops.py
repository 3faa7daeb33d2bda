"""The DISCO contractions as torch custom ops (namespace `tilecast`), backed by the CPU kernels
(native.py) and, for CUDA tensors, the CUDA kernels (cuda.py).

    tilecast::disco_contraction(x, roff, col, vals, troff, tcol, tvals,
                                kernel_size, nlat_out, nlon_out)      x (B, C, Hi, Wi) -> (B, C, K, Ho, Wo)
    tilecast::disco_transpose_contraction(y, roff, col, vals, troff, tcol, tvals,
                                          nlat_in, nlon_in)           y (B, C, K, Ho, Wo) -> (B, C, Hi, Wi)

The psi arguments are the six tensors of a DiscoCSR (csr.py), in its `tensors()` order, on
x's device (DiscoCSR.to, or the module's buffers moved with it). Each op has one
implementation for both devices (dispatched through BACKENDS), a fake (shape)
implementation, autograd (the gradient of one is the other), a CPU autocast implementation
that runs it in float32 and a CUDA one that runs it in the autocast dtype (the seed's
AutocastCUDA pattern: the 16-bit kernels halve the memory traffic of a memory-bound op).

The line-blocked pair (CPU) is registered the same way (schema, fake, autograd, CPU
autocast), with psi's transpose in the line-blocked layout (boff, bcol, bvals:
tilecast.disco.lines) after the six psi tensors:

    tilecast::disco_lines_contraction(x, psi..., boff, bcol, bvals, kernel_size, nlat_out,
                                      nlon_out)   disco_contraction, gradient line-blocked
    tilecast::disco_lines_transpose_contraction(y, psi..., boff, bcol, bvals, nlat_in,
                                                nlon_in)   the line-blocked transpose kernel

each the gradient of the other; disco_contraction_lines / disco_transpose_contraction_lines
take the layout as a LineBlocked. The line-blocked kernel has one tile, so the pair carries
only the CSR forward kernel's: `tile` of the first, `backward_tile` of the second. The kpacked forward (tilecast::disco_kpacked_contraction)
has no autograd of its own: disco_contraction_kpacked pairs it with a transpose.

Each op takes an optional register `tile` for its own kernel and a `backward_tile` for its
gradient's (the other op's tile format): None lets the CPU library pick per call; DiscoConvS2
passes the tiles a published selector chose (tilecast.runtime.disco.selector). The CUDA kernels pick
their own tiles and ignore both.

The kernels compute in float32: float32, bfloat16 and float16 inputs are accepted, the
16-bit ones converted to float32 in registers as they are read, the result rounded to the
input's dtype (nearest even) as it is written. float64 is refused (tilecast.disco.reference
computes in float64).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tilecast.disco import cuda, native
from tilecast.disco.lines import LineBlocked

#: the dtypes the kernels read and write (all computed in float32)
SUPPORTED_DTYPES = tuple(native.STORAGE)
#: device type -> the module whose contraction / transpose_contraction serve it
BACKENDS = {"cpu": native, "cuda": cuda}


def _check_dtype(name: str, tensor: Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {tensor.dtype}; the DISCO kernels take "
                         f"{', '.join(map(str, SUPPORTED_DTYPES))} (tilecast.disco.reference "
                         "computes in float64)")


def _check_psi(roff: Tensor, col: Tensor, vals: Tensor, troff: Tensor, tcol: Tensor,
               tvals: Tensor, rows: int, lines: int, grid: str) -> None:
    """psi's tensors must have the row and line counts that the shapes imply."""
    if roff.numel() != rows + 1 or troff.numel() != lines + 1:
        raise ValueError(f"psi does not fit {grid}: it has {roff.numel() - 1} rows and "
                         f"{troff.numel() - 1} transposed rows, the shapes need {rows} "
                         f"(kernel_size * nlat_out) and {lines} (nlat_in * nlon_in / nlon_out)")
    lengths = [col.numel(), vals.numel(), tcol.numel(), tvals.numel()]
    if any(length != lengths[0] for length in lengths[1:]):
        raise ValueError(f"psi's col, vals, tcol and tvals must have one length, got {lengths}")


def _check_device(name: str, tensor: Tensor, psi: tuple[Tensor, ...]) -> None:
    """The kernels read psi where they read the activations."""
    elsewhere = sorted({str(t.device) for t in psi if t.device != tensor.device})
    if elsewhere:
        raise ValueError(f"psi's tensors are on {', '.join(elsewhere)} but {name} is on "
                         f"{tensor.device}: move psi there too (DiscoCSR.to(device), or move "
                         "the module, whose buffers hold psi)")


def _contraction_shape(x: Tensor, psi: tuple[Tensor, ...], kernel_size: int, nlat_out: int,
                       nlon_out: int) -> tuple[int, ...]:
    if x.dim() != 4:
        raise ValueError(f"x must be (B, C, nlat_in, nlon_in), got shape {tuple(x.shape)}")
    nlat_in, nlon_in = x.shape[-2:]
    if nlon_out < 1 or nlon_in % nlon_out != 0:
        raise ValueError(f"x's nlon_in ({nlon_in}, shape {tuple(x.shape)}) must be a multiple "
                         f"of nlon_out ({nlon_out})")
    _check_psi(*psi, kernel_size * nlat_out, nlat_in * (nlon_in // nlon_out),
               f"x of shape {tuple(x.shape)} -> (K={kernel_size}, {nlat_out}, {nlon_out})")
    return (x.shape[0], x.shape[1], kernel_size, nlat_out, nlon_out)


def _transpose_shape(y: Tensor, psi: tuple[Tensor, ...], nlat_in: int,
                     nlon_in: int) -> tuple[int, ...]:
    if y.dim() != 5:
        raise ValueError(f"y must be (B, C, K, nlat_out, nlon_out), got shape {tuple(y.shape)}")
    kernel_size, nlat_out, nlon_out = y.shape[2:]
    if nlon_out < 1 or nlon_in % nlon_out != 0:
        raise ValueError(f"nlon_in ({nlon_in}) must be a multiple of y's nlon_out ({nlon_out}, "
                         f"shape {tuple(y.shape)})")
    _check_psi(*psi, kernel_size * nlat_out, nlat_in * (nlon_in // nlon_out),
               f"y of shape {tuple(y.shape)} -> ({nlat_in}, {nlon_in})")
    return (y.shape[0], y.shape[1], nlat_in, nlon_in)


def _index(tensor: Tensor) -> Tensor:
    return tensor.to(torch.int64).contiguous()


def _values(tensor: Tensor) -> Tensor:
    return tensor.to(torch.float32).contiguous()


def _tile_kwargs(tensor: Tensor, tile: Optional[list[int]]) -> dict:
    """The backend's tile argument: the CPU library's, where a tile was given."""
    return {"tile": tuple(tile)} if tile and tensor.device.type == "cpu" else {}


@torch.library.custom_op("tilecast::disco_contraction", mutates_args=(),
                         device_types=tuple(BACKENDS))
def disco_contraction(x: Tensor, roff: Tensor, col: Tensor, vals: Tensor, troff: Tensor,
                      tcol: Tensor, tvals: Tensor, kernel_size: int, nlat_out: int,
                      nlon_out: int, tile: Optional[list[int]] = None,
                      backward_tile: Optional[list[int]] = None) -> Tensor:
    """Every basis filter of psi at every output point: x (B, C, nlat_in, nlon_in) ->
    (B, C, kernel_size, nlat_out, nlon_out). Computed in float32, returned in x's dtype.
    tile: (nv, lat_block) of the CPU forward kernel; backward_tile: (bt, nv, lat_block) of
    the gradient's transpose kernel; None: the library's choice."""
    psi = (roff, col, vals, troff, tcol, tvals)
    shape = _contraction_shape(x, psi, kernel_size, nlat_out, nlon_out)
    _check_dtype("x", x)
    _check_device("x", x, psi)
    if x.numel() == 0:
        return x.new_zeros(shape)
    return BACKENDS[x.device.type].contraction(x.contiguous(), _index(roff), _index(col),
                                               _values(vals), kernel_size, nlat_out, nlon_out,
                                               **_tile_kwargs(x, tile))


@torch.library.custom_op("tilecast::disco_transpose_contraction", mutates_args=(),
                         device_types=tuple(BACKENDS))
def disco_transpose_contraction(y: Tensor, roff: Tensor, col: Tensor, vals: Tensor,
                                troff: Tensor, tcol: Tensor, tvals: Tensor, nlat_in: int,
                                nlon_in: int, tile: Optional[list[int]] = None,
                                backward_tile: Optional[list[int]] = None) -> Tensor:
    """The adjoint of disco_contraction: y (B, C, K, nlat_out, nlon_out) ->
    (B, C, nlat_in, nlon_in). Computed in float32, returned in y's dtype. tile: (bt, nv,
    lat_block) of the CPU transpose kernel; backward_tile: (nv, lat_block) of the gradient's
    forward kernel; None: the library's choice."""
    psi = (roff, col, vals, troff, tcol, tvals)
    shape = _transpose_shape(y, psi, nlat_in, nlon_in)
    _check_dtype("y", y)
    _check_device("y", y, psi)
    if y.numel() == 0:
        return y.new_zeros(shape)
    return BACKENDS[y.device.type].transpose_contraction(y.contiguous(), _index(troff),
                                                         _index(tcol), _values(tvals), nlat_in,
                                                         nlon_in, **_tile_kwargs(y, tile))


@disco_contraction.register_fake
def _(x, roff, col, vals, troff, tcol, tvals, kernel_size, nlat_out, nlon_out, tile=None,
      backward_tile=None):
    shape = _contraction_shape(x, (roff, col, vals, troff, tcol, tvals), kernel_size, nlat_out,
                               nlon_out)
    return x.new_empty(shape)


@disco_transpose_contraction.register_fake
def _(y, roff, col, vals, troff, tcol, tvals, nlat_in, nlon_in, tile=None, backward_tile=None):
    return y.new_empty(_transpose_shape(y, (roff, col, vals, troff, tcol, tvals), nlat_in, nlon_in))


def _save_psi(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:7])
    ctx.in_shape = tuple(inputs[0].shape)
    ctx.tiles = tuple(inputs[-2:])   # (tile, backward_tile)


def _contraction_backward(ctx, grad):
    grad_x = None
    if ctx.needs_input_grad[0]:
        tile, backward_tile = ctx.tiles
        grad_x = disco_transpose_contraction(grad, *ctx.saved_tensors, *ctx.in_shape[-2:],
                                             backward_tile, tile)
    return (grad_x,) + (None,) * 11


def _transpose_backward(ctx, grad):
    grad_y = None
    if ctx.needs_input_grad[0]:
        tile, backward_tile = ctx.tiles
        grad_y = disco_contraction(grad, *ctx.saved_tensors, *ctx.in_shape[-3:], backward_tile,
                                   tile)
    return (grad_y,) + (None,) * 10


disco_contraction.register_autograd(_contraction_backward, setup_context=_save_psi)
disco_transpose_contraction.register_autograd(_transpose_backward, setup_context=_save_psi)


@torch.library.impl("tilecast::disco_contraction", "AutocastCPU")
def _(x, roff, col, vals, troff, tcol, tvals, kernel_size, nlat_out, nlon_out,
      tile=None, backward_tile=None):
    with torch.amp.autocast("cpu", enabled=False):
        return disco_contraction(x.float(), roff, col, vals.float(), troff, tcol, tvals.float(),
                                 kernel_size, nlat_out, nlon_out, tile, backward_tile)


@torch.library.impl("tilecast::disco_transpose_contraction", "AutocastCPU")
def _(y, roff, col, vals, troff, tcol, tvals, nlat_in, nlon_in,
      tile=None, backward_tile=None):
    with torch.amp.autocast("cpu", enabled=False):
        return disco_transpose_contraction(y.float(), roff, col, vals.float(), troff, tcol,
                                           tvals.float(), nlat_in, nlon_in, tile, backward_tile)


def _autocast_cuda(tensor: Tensor) -> Tensor:
    """tensor in CUDA autocast's dtype; float64 stays (autocast leaves it, and the kernels
    refuse it with a pointer to the reference)."""
    return tensor if tensor.dtype == torch.float64 else tensor.to(torch.get_autocast_dtype("cuda"))


@torch.library.impl("tilecast::disco_contraction", "AutocastCUDA")
def _(x, roff, col, vals, troff, tcol, tvals, kernel_size, nlat_out, nlon_out,
      tile=None, backward_tile=None):
    with torch.amp.autocast("cuda", enabled=False):
        return disco_contraction(_autocast_cuda(x), roff, col, vals.float(), troff, tcol,
                                 tvals.float(), kernel_size, nlat_out, nlon_out, tile,
                                 backward_tile)


@torch.library.impl("tilecast::disco_transpose_contraction", "AutocastCUDA")
def _(y, roff, col, vals, troff, tcol, tvals, nlat_in, nlon_in,
      tile=None, backward_tile=None):
    with torch.amp.autocast("cuda", enabled=False):
        return disco_transpose_contraction(_autocast_cuda(y), roff, col, vals.float(), troff,
                                           tcol, tvals.float(), nlat_in, nlon_in, tile,
                                           backward_tile)


# ------------------------------------------------------------------ the line-blocked pair
def _check_line_layout(troff: Tensor, boff: Tensor, bcol: Tensor, bvals: Tensor) -> None:
    """The line-blocked layout must be that of psi's transpose (troff over its lines)."""
    lines = troff.numel() - 1
    if bvals.dim() != 2 or bvals.shape[0] != bcol.numel() or bvals.shape[1] < 1 \
            or boff.numel() != -(-lines // bvals.shape[1]) + 1:
        raise ValueError(f"the line-blocked layout does not fit psi's transpose of {lines} lines: "
                         f"boff {tuple(boff.shape)}, bcol {tuple(bcol.shape)}, bvals "
                         f"{tuple(bvals.shape)} (need [ceil(lines / LB) + 1], [keys], [keys, LB]; "
                         "tilecast.disco.lines.line_blocked builds it)")


@torch.library.custom_op("tilecast::disco_lines_contraction", mutates_args=(),
                         device_types=("cpu",))
def disco_lines_contraction(x: Tensor, roff: Tensor, col: Tensor, vals: Tensor, troff: Tensor,
                            tcol: Tensor, tvals: Tensor, boff: Tensor, bcol: Tensor,
                            bvals: Tensor, kernel_size: int, nlat_out: int, nlon_out: int,
                            tile: Optional[list[int]] = None) -> Tensor:
    """disco_contraction (its CSR kernel, its result) whose gradient runs the line-blocked
    transpose (disco_lines_transpose_contraction) on psi's transpose in that layout (boff,
    bcol, bvals: tilecast.disco.lines), bit for bit the CSR transpose's result. CPU only.
    tile: (nv, lat_block) of the forward kernel, for this op and its gradient's gradient."""
    _check_line_layout(troff, boff, bcol, bvals)
    _check_device("x", x, (boff, bcol, bvals))
    return disco_contraction(x, roff, col, vals, troff, tcol, tvals, kernel_size, nlat_out,
                             nlon_out, tile)


@torch.library.custom_op("tilecast::disco_lines_transpose_contraction", mutates_args=(),
                         device_types=("cpu",))
def disco_lines_transpose_contraction(y: Tensor, roff: Tensor, col: Tensor, vals: Tensor,
                                      troff: Tensor, tcol: Tensor, tvals: Tensor, boff: Tensor,
                                      bcol: Tensor, bvals: Tensor, nlat_in: int, nlon_in: int,
                                      backward_tile: Optional[list[int]] = None) -> Tensor:
    """disco_transpose_contraction on the line-blocked kernel (native.transpose_lines), bit
    for bit the CSR kernel's result, from psi's transpose in that layout (boff, bcol, bvals:
    tilecast.disco.lines). CPU only. Its gradient is disco_lines_contraction (the CSR forward
    kernel) on psi's six tensors; backward_tile: that kernel's (nv, lat_block)."""
    psi = (roff, col, vals, troff, tcol, tvals)
    shape = _transpose_shape(y, psi, nlat_in, nlon_in)
    _check_line_layout(troff, boff, bcol, bvals)
    _check_dtype("y", y)
    _check_device("y", y, (*psi, boff, bcol, bvals))
    if y.numel() == 0:
        return y.new_zeros(shape)
    return native.transpose_lines(y.contiguous(), _index(boff), _index(bcol), _values(bvals),
                                  nlat_in, nlon_in)


@disco_lines_contraction.register_fake
def _(x, roff, col, vals, troff, tcol, tvals, boff, bcol, bvals, kernel_size, nlat_out, nlon_out,
      tile=None):
    _check_line_layout(troff, boff, bcol, bvals)
    return x.new_empty(_contraction_shape(x, (roff, col, vals, troff, tcol, tvals), kernel_size,
                                          nlat_out, nlon_out))


@disco_lines_transpose_contraction.register_fake
def _(y, roff, col, vals, troff, tcol, tvals, boff, bcol, bvals, nlat_in, nlon_in,
      backward_tile=None):
    _check_line_layout(troff, boff, bcol, bvals)
    return y.new_empty(_transpose_shape(y, (roff, col, vals, troff, tcol, tvals), nlat_in, nlon_in))


def _save_psi_and_lines(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:10])   # psi's six tensors, then boff, bcol, bvals
    ctx.in_shape = tuple(inputs[0].shape)
    ctx.tile = inputs[-1]


def _lines_contraction_backward(ctx, grad):
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = disco_lines_transpose_contraction(grad, *ctx.saved_tensors, *ctx.in_shape[-2:],
                                                   ctx.tile)
    return (grad_x,) + (None,) * 13


def _lines_transpose_backward(ctx, grad):
    grad_y = None
    if ctx.needs_input_grad[0]:
        grad_y = disco_lines_contraction(grad, *ctx.saved_tensors, *ctx.in_shape[-3:], ctx.tile)
    return (grad_y,) + (None,) * 12


disco_lines_contraction.register_autograd(_lines_contraction_backward,
                                          setup_context=_save_psi_and_lines)
disco_lines_transpose_contraction.register_autograd(_lines_transpose_backward,
                                                    setup_context=_save_psi_and_lines)


@torch.library.impl("tilecast::disco_lines_contraction", "AutocastCPU")
def _(x, roff, col, vals, troff, tcol, tvals, boff, bcol, bvals, kernel_size, nlat_out, nlon_out,
      tile=None):
    with torch.amp.autocast("cpu", enabled=False):
        return disco_lines_contraction(x.float(), roff, col, vals.float(), troff, tcol,
                                       tvals.float(), boff, bcol, bvals.float(), kernel_size,
                                       nlat_out, nlon_out, tile)


@torch.library.impl("tilecast::disco_lines_transpose_contraction", "AutocastCPU")
def _(y, roff, col, vals, troff, tcol, tvals, boff, bcol, bvals, nlat_in, nlon_in,
      backward_tile=None):
    with torch.amp.autocast("cpu", enabled=False):
        return disco_lines_transpose_contraction(y.float(), roff, col, vals.float(), troff, tcol,
                                                 tvals.float(), boff, bcol, bvals.float(),
                                                 nlat_in, nlon_in, backward_tile)


def _on_cpu(name: str, tensor: Tensor) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; the line-blocked transpose runs on the "
                         "CPU (the CSR ops run on both devices)")


def disco_contraction_lines(x: Tensor, roff: Tensor, col: Tensor, vals: Tensor, troff: Tensor,
                            tcol: Tensor, tvals: Tensor, kernel_size: int, nlat_out: int,
                            nlon_out: int, lines: LineBlocked,
                            tile: Optional[list[int]] = None) -> Tensor:
    """disco_lines_contraction with psi's transpose given as its LineBlocked layout (CPU):
    disco_contraction, differentiable through the line-blocked transpose. tile: the forward
    kernel's (nv, lat_block)."""
    _on_cpu("x", x)
    return disco_lines_contraction(x, roff, col, vals, troff, tcol, tvals, *lines.tensors(),
                                   kernel_size, nlat_out, nlon_out, tile)


def disco_transpose_contraction_lines(y: Tensor, roff: Tensor, col: Tensor, vals: Tensor,
                                      troff: Tensor, tcol: Tensor, tvals: Tensor, nlat_in: int,
                                      nlon_in: int, lines: LineBlocked,
                                      backward_tile: Optional[list[int]] = None) -> Tensor:
    """disco_lines_transpose_contraction with psi's transpose given as its LineBlocked layout
    (CPU): disco_transpose_contraction on the line-blocked kernel, differentiable.
    backward_tile: the gradient's forward kernel's (nv, lat_block)."""
    _on_cpu("y", y)
    return disco_lines_transpose_contraction(y, roff, col, vals, troff, tcol, tvals,
                                             *lines.tensors(), nlat_in, nlon_in, backward_tile)


# ------------------------------------------------------------------ the kpacked forward
@torch.library.custom_op("tilecast::disco_kpacked_contraction", mutates_args=(),
                         device_types=("cpu",))
def disco_kpacked_contraction(x: Tensor, idx: Tensor, vals: Tensor, offset: Tensor,
                              kernel_size: int, nlat_out: int, nlon_out: int, ho_begin: int,
                              ho_count: int, tile: Optional[list[int]] = None) -> Tensor:
    """Output latitudes [ho_begin, ho_begin + ho_count) of disco_contraction, from psi in the
    kpacked layout (tilecast.disco.kpacked): x (B, C, nlat_in, nlon_in) -> (B, C, K,
    ho_count, nlon_out). CPU only; computed in float32, returned in x's dtype. No autograd of
    its own: disco_contraction_kpacked pairs it with the CSR backward. tile: (kreg, nv,
    lat_block) of the kernel, None: the library's choice."""
    _kpacked_shape(x, idx, vals, offset, kernel_size, nlat_out, nlon_out, ho_begin, ho_count)
    _check_dtype("x", x)
    _check_device("x", x, (idx, vals, offset))
    return native.kpacked_contraction(x.contiguous(), _index(idx), _values(vals), _index(offset),
                                      kernel_size, nlat_out, nlon_out, ho_begin, ho_count,
                                      **_tile_kwargs(x, tile))


def _kpacked_shape(x: Tensor, idx: Tensor, vals: Tensor, offset: Tensor, kernel_size: int,
                   nlat_out: int, nlon_out: int, ho_begin: int, ho_count: int) -> tuple[int, ...]:
    if x.dim() != 4:
        raise ValueError(f"x must be (B, C, nlat_in, nlon_in), got shape {tuple(x.shape)}")
    if nlon_out < 1 or x.shape[-1] % nlon_out != 0:
        raise ValueError(f"x's nlon_in ({x.shape[-1]}) must be a multiple of nlon_out ({nlon_out})")
    if offset.numel() != nlat_out + 1 or idx.dim() != 2 or idx.shape[1] != 2 \
            or vals.dim() != 2 or vals.shape[0] != idx.shape[0] or vals.shape[1] < kernel_size:
        raise ValueError(f"kpacked psi does not fit K={kernel_size}, nlat_out={nlat_out}: offset "
                         f"{tuple(offset.shape)}, idx {tuple(idx.shape)}, vals {tuple(vals.shape)} "
                         f"(need [nlat_out + 1], [nbr, 2], [nbr, K_PAD >= K])")
    if not (0 <= ho_begin and ho_count >= 1 and ho_begin + ho_count <= nlat_out):
        raise ValueError(f"output latitudes {ho_begin}+{ho_count} outside 0..{nlat_out}")
    return (x.shape[0], x.shape[1], kernel_size, ho_count, nlon_out)


@disco_kpacked_contraction.register_fake
def _(x, idx, vals, offset, kernel_size, nlat_out, nlon_out, ho_begin, ho_count, tile=None):
    return x.new_empty(_kpacked_shape(x, idx, vals, offset, kernel_size, nlat_out, nlon_out,
                                      ho_begin, ho_count))


@torch.library.impl("tilecast::disco_kpacked_contraction", "AutocastCPU")
def _(x, idx, vals, offset, kernel_size, nlat_out, nlon_out, ho_begin, ho_count, tile=None):
    with torch.amp.autocast("cpu", enabled=False):
        return disco_kpacked_contraction(x.float(), idx, vals.float(), offset, kernel_size,
                                         nlat_out, nlon_out, ho_begin, ho_count, tile)


class _DiscoKpackedFn(torch.autograd.Function):
    """The kpacked forward paired with the transpose contraction as its backward: the CSR
    one, or the line-blocked one (disco_lines_transpose_contraction) where `lines` holds psi's
    transpose in that layout. The two directions run different kernels, so the pairing is an
    autograd.Function (the seed's rule)."""

    @staticmethod
    def forward(ctx, x, idx, vals, offset, roff, col, csr_vals, troff, tcol, tvals,
                kernel_size, nlat_out, nlon_out, tile, backward_tile, lines):
        ctx.save_for_backward(roff, col, csr_vals, troff, tcol, tvals)
        ctx.in_shape = tuple(x.shape)
        ctx.backward_tile, ctx.lines = backward_tile, lines
        return disco_kpacked_contraction(x, idx, vals, offset, kernel_size, nlat_out, nlon_out,
                                         0, nlat_out, tile)

    @staticmethod
    def backward(ctx, grad):
        grad_x = None
        if ctx.needs_input_grad[0]:
            if ctx.lines is not None and grad.device.type == "cpu":
                grad_x = disco_lines_transpose_contraction(grad, *ctx.saved_tensors,
                                                           *ctx.lines.tensors(),
                                                           *ctx.in_shape[-2:])
            else:
                grad_x = disco_transpose_contraction(grad.contiguous(), *ctx.saved_tensors,
                                                     *ctx.in_shape[-2:], ctx.backward_tile)
        return (grad_x,) + (None,) * 15


def disco_contraction_kpacked(x: Tensor, idx: Tensor, vals: Tensor, offset: Tensor,
                              roff: Tensor, col: Tensor, csr_vals: Tensor, troff: Tensor,
                              tcol: Tensor, tvals: Tensor, kernel_size: int, nlat_out: int,
                              nlon_out: int, tile: Optional[list[int]] = None,
                              backward_tile: Optional[list[int]] = None,
                              lines: Optional[LineBlocked] = None) -> Tensor:
    """disco_contraction through the kpacked kernel, differentiable: the gradient runs the
    transpose contraction, the CSR kernel on psi's six CSR tensors (roff ... tvals), or with
    `lines` (psi's transpose in the line-blocked layout, tilecast.disco.lines; CPU) the
    line-blocked kernel, bit for bit the same result. tile: the kpacked kernel's (kreg, nv,
    lat_block); backward_tile: the CSR transpose's (bt, nv, lat_block), for the CSR kernel
    only (give one or `lines`, not both)."""
    if lines is not None and backward_tile is not None:
        raise ValueError("backward_tile names a CSR transpose tile, lines asks for the "
                         "line-blocked transpose: give one of them")
    return _DiscoKpackedFn.apply(x, idx, vals, offset, roff, col, csr_vals, troff, tcol, tvals,
                                 kernel_size, nlat_out, nlon_out, tile, backward_tile, lines)
