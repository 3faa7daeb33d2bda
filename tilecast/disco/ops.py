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

The kernels compute in float32: float32, bfloat16 and float16 inputs are accepted, the
16-bit ones converted to float32 in registers as they are read, the result rounded to the
input's dtype (nearest even) as it is written. float64 is refused (tilecast.disco.reference
computes in float64).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import cuda, native

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


@torch.library.custom_op("tilecast::disco_contraction", mutates_args=(),
                         device_types=tuple(BACKENDS))
def disco_contraction(x: Tensor, roff: Tensor, col: Tensor, vals: Tensor, troff: Tensor,
                      tcol: Tensor, tvals: Tensor, kernel_size: int, nlat_out: int,
                      nlon_out: int) -> Tensor:
    """Every basis filter of psi at every output point: x (B, C, nlat_in, nlon_in) ->
    (B, C, kernel_size, nlat_out, nlon_out). Computed in float32, returned in x's dtype."""
    psi = (roff, col, vals, troff, tcol, tvals)
    shape = _contraction_shape(x, psi, kernel_size, nlat_out, nlon_out)
    _check_dtype("x", x)
    _check_device("x", x, psi)
    if x.numel() == 0:
        return x.new_zeros(shape)
    return BACKENDS[x.device.type].contraction(x.contiguous(), _index(roff), _index(col),
                                               _values(vals), kernel_size, nlat_out, nlon_out)


@torch.library.custom_op("tilecast::disco_transpose_contraction", mutates_args=(),
                         device_types=tuple(BACKENDS))
def disco_transpose_contraction(y: Tensor, roff: Tensor, col: Tensor, vals: Tensor,
                                troff: Tensor, tcol: Tensor, tvals: Tensor, nlat_in: int,
                                nlon_in: int) -> Tensor:
    """The adjoint of disco_contraction: y (B, C, K, nlat_out, nlon_out) ->
    (B, C, nlat_in, nlon_in). Computed in float32, returned in y's dtype."""
    psi = (roff, col, vals, troff, tcol, tvals)
    shape = _transpose_shape(y, psi, nlat_in, nlon_in)
    _check_dtype("y", y)
    _check_device("y", y, psi)
    if y.numel() == 0:
        return y.new_zeros(shape)
    return BACKENDS[y.device.type].transpose_contraction(y.contiguous(), _index(troff),
                                                         _index(tcol), _values(tvals), nlat_in,
                                                         nlon_in)


@disco_contraction.register_fake
def _(x, roff, col, vals, troff, tcol, tvals, kernel_size, nlat_out, nlon_out):
    shape = _contraction_shape(x, (roff, col, vals, troff, tcol, tvals), kernel_size, nlat_out,
                               nlon_out)
    return x.new_empty(shape)


@disco_transpose_contraction.register_fake
def _(y, roff, col, vals, troff, tcol, tvals, nlat_in, nlon_in):
    return y.new_empty(_transpose_shape(y, (roff, col, vals, troff, tcol, tvals), nlat_in, nlon_in))


def _save_psi(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:7])
    ctx.in_shape = tuple(inputs[0].shape)


def _contraction_backward(ctx, grad):
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = disco_transpose_contraction(grad, *ctx.saved_tensors, *ctx.in_shape[-2:])
    return (grad_x,) + (None,) * 9


def _transpose_backward(ctx, grad):
    grad_y = None
    if ctx.needs_input_grad[0]:
        grad_y = disco_contraction(grad, *ctx.saved_tensors, *ctx.in_shape[-3:])
    return (grad_y,) + (None,) * 8


disco_contraction.register_autograd(_contraction_backward, setup_context=_save_psi)
disco_transpose_contraction.register_autograd(_transpose_backward, setup_context=_save_psi)


@torch.library.impl("tilecast::disco_contraction", "AutocastCPU")
def _(x, roff, col, vals, troff, tcol, tvals, kernel_size, nlat_out, nlon_out):
    with torch.amp.autocast("cpu", enabled=False):
        return disco_contraction(x.float(), roff, col, vals.float(), troff, tcol, tvals.float(),
                                 kernel_size, nlat_out, nlon_out)


@torch.library.impl("tilecast::disco_transpose_contraction", "AutocastCPU")
def _(y, roff, col, vals, troff, tcol, tvals, nlat_in, nlon_in):
    with torch.amp.autocast("cpu", enabled=False):
        return disco_transpose_contraction(y.float(), roff, col, vals.float(), troff, tcol,
                                           tvals.float(), nlat_in, nlon_in)


def _autocast_cuda(tensor: Tensor) -> Tensor:
    """tensor in CUDA autocast's dtype; float64 stays (autocast leaves it, and the kernels
    refuse it with a pointer to the reference)."""
    return tensor if tensor.dtype == torch.float64 else tensor.to(torch.get_autocast_dtype("cuda"))


@torch.library.impl("tilecast::disco_contraction", "AutocastCUDA")
def _(x, roff, col, vals, troff, tcol, tvals, kernel_size, nlat_out, nlon_out):
    with torch.amp.autocast("cuda", enabled=False):
        return disco_contraction(_autocast_cuda(x), roff, col, vals.float(), troff, tcol,
                                 tvals.float(), kernel_size, nlat_out, nlon_out)


@torch.library.impl("tilecast::disco_transpose_contraction", "AutocastCUDA")
def _(y, roff, col, vals, troff, tcol, tvals, nlat_in, nlon_in):
    with torch.amp.autocast("cuda", enabled=False):
        return disco_transpose_contraction(_autocast_cuda(y), roff, col, vals.float(), troff,
                                           tcol, tvals.float(), nlat_in, nlon_in)
