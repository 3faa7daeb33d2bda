"""`tilecast::grouped_conv` and its `_bwd_data` / `_bwd_weight` gradients on tilecast's
grouped-conv kernels, with fake implementations and autograd, and `grouped_conv`, the entry
point that picks the kernels (tilecast.runtime.ops). The ops take torch's layouts; the kernels' NDHWGC
/ GKZYXC / NDHWGK are torch's channels-last orders of the same tensors."""
from __future__ import annotations

import ctypes
import functools
from typing import Any, Mapping

import torch
from torch import Tensor

from tilecast.families import get_family
from tilecast.families.grouped_conv import JOB_FIELDS, geometry_reason
from tilecast.spaces.grouped_conv import DIRECTIONS
from tilecast.runtime.ops.choice import load_kernel, needs_custom_op, select

CONV = {direction: get_family(f"grouped_conv_{direction}") for direction in DIRECTIONS}


def _spatial_values(value, spatial: int, label: str) -> list[int]:
    values = [value] * spatial if isinstance(value, int) else list(value)
    if len(values) != spatial or not all(isinstance(v, int) for v in values):
        raise ValueError(f"{label} must be an int or {spatial} ints for a {spatial}D "
                         f"convolution, got {value!r}")
    return values


def _check_conv(**tensors: Tensor) -> None:
    spatial = None
    for label, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu" or t.dtype != torch.float32:
            raise ValueError(f"{label} is {t.dtype} on {t.device}; the grouped-conv kernels take "
                             "torch.float32 on the CPU")
        if t.dim() not in (4, 5) or spatial not in (None, t.dim()):
            raise ValueError(f"{label} has shape {tuple(t.shape)}; 2D convolutions take 4D "
                             "tensors, 3D convolutions 5D ones (N, C, [D,] H, W)")
        spatial = t.dim()


def _conv_problem(direction: str, input_size, weight_size, stride, padding, dilation,
                  groups: int):
    """The direction's family problem for torch-layout sizes: input (N, G*C, [D,] H, W),
    weight (G*K, C, [Z,] Y, X). ValueError names what does not fit. Built once per
    distinct call (_problem_of): validating the sizes into a problem took longer than a small
    layer's kernel."""
    return _problem_of(direction, tuple(int(v) for v in input_size),
                       tuple(int(v) for v in weight_size), tuple(stride), tuple(padding),
                       tuple(dilation), groups)


@functools.lru_cache(maxsize=1024)
def _problem_of(direction: str, input_size: tuple, weight_size: tuple, stride: tuple,
                padding: tuple, dilation: tuple, groups: int):
    """_conv_problem's body, memoised (a rejected call raises each time: lru_cache keeps
    results only)."""
    batch, channels, *size = (int(v) for v in input_size)
    out_channels, per_group, *taps = (int(v) for v in weight_size)
    spatial = len(size)
    if groups < 1 or channels % groups or out_channels % groups or channels // groups != per_group:
        raise ValueError(f"input {tuple(input_size)} and weight {tuple(weight_size)} do not fit "
                         f"groups={groups}: the input's channels and the weight's first dim "
                         "must be multiples of groups, and the weight's second dim must be "
                         "input channels / groups")
    if len(taps) != spatial:
        raise ValueError(f"input {tuple(input_size)} and weight {tuple(weight_size)} differ in "
                         "spatial dims")
    geometry = {"stride": stride, "pad": padding, "dilation": dilation}
    axes = "dhw"[3 - spatial:]
    values = {"ndim": spatial, "N": batch, "G": groups, "C": per_group,
              "K": out_channels // groups,
              **{f"{axis.upper()}i": v for axis, v in zip(axes, size)},
              **dict(zip("ZYX"[3 - spatial:], taps)),
              **{f"{name}_{axis}": v for name, seq in geometry.items() for axis, v in zip(axes, seq)}}
    problem = CONV[direction].problem(values)
    reason = geometry_reason(problem)
    if reason is not None:
        raise ValueError(f"input {tuple(input_size)}, weight {tuple(weight_size)}, stride "
                         f"{stride}, padding {padding}, dilation {dilation}: {reason}")
    return problem


def _output_size(problem) -> list[int]:
    out = problem.output_dims()[3 - problem.ndim:]
    return [problem.N, problem.G * problem.K, *out]


def _check_size(label: str, t: Tensor, expected: list[int]) -> None:
    if list(t.shape) != expected:
        raise ValueError(f"{label} has shape {tuple(t.shape)}; this convolution needs "
                         f"{tuple(expected)}")


@functools.lru_cache(maxsize=1024)
def _job_shape(problem) -> ctypes.Array:
    """The problem's shape as the kernels' entry reads it (JOB_FIELDS; never written)."""
    return (ctypes.c_longlong * len(JOB_FIELDS))(*(getattr(problem, f) for f in JOB_FIELDS))


def _run_conv(direction: str, name: str, problem, in1: Tensor, in2: Tensor,
              out_size: list[int]) -> Tensor:
    """The kernel on in1 and in2 in torch's layouts; the result (out_size) in torch's. The
    library's torch entry converts to and from the kernel's channels-last layouts in the one
    call (a dozen torch ops around the kernel had taken 1.5-2x a small layer's time)."""
    run = load_kernel(CONV[direction], name, problem)
    first, second = in1.contiguous(), in2.contiguous()
    out = torch.empty(out_size, dtype=torch.float32)
    run.run_torch_layouts(_job_shape(problem), first.data_ptr(), second.data_ptr(),
                          out.data_ptr(), torch.get_num_threads())
    return out


@torch.library.custom_op("tilecast::grouped_conv", mutates_args=(), device_types="cpu")
def grouped_conv_op(x: Tensor, w: Tensor, stride: list[int], padding: list[int],
                    dilation: list[int], groups: int, kernel: str, kernel_bwd_data: str,
                    kernel_bwd_weight: str) -> Tensor:
    """conv2d / conv3d (no bias) of x (N, G*C, [D,] H, W) with w (G*K, C, [Z,] Y, X) on the
    forward kernel `kernel`; the gradients run on the bwd kernels ("" where none is needed)."""
    return _forward(x, w, stride, padding, dilation, groups, kernel)


def _forward(x: Tensor, w: Tensor, stride: list[int], padding: list[int], dilation: list[int],
             groups: int, kernel: str, checked: bool = False) -> Tensor:
    """grouped_conv_op's body: the forward on `kernel` (x and w not checked again when
    `checked`)."""
    if not checked:
        _check_conv(x=x, w=w)
    problem = _conv_problem("forward", x.shape, w.shape, stride, padding, dilation, groups)
    return _run_conv("forward", kernel, problem, x, w, _output_size(problem))


@torch.library.custom_op("tilecast::grouped_conv_bwd_data", mutates_args=(), device_types="cpu")
def grouped_conv_bwd_data_op(grad_output: Tensor, w: Tensor, input_size: list[int],
                             stride: list[int], padding: list[int], dilation: list[int],
                             groups: int, kernel: str) -> Tensor:
    """The gradient of grouped_conv with respect to its input (of size `input_size`)."""
    _check_conv(grad_output=grad_output, w=w)
    problem = _conv_problem("bwd_data", input_size, w.shape, stride, padding, dilation, groups)
    _check_size("grad_output", grad_output, _output_size(problem))
    return _run_conv("bwd_data", kernel, problem, grad_output, w, list(input_size))


@torch.library.custom_op("tilecast::grouped_conv_bwd_weight", mutates_args=(),
                         device_types="cpu")
def grouped_conv_bwd_weight_op(x: Tensor, grad_output: Tensor, weight_size: list[int],
                               stride: list[int], padding: list[int], dilation: list[int],
                               groups: int, kernel: str) -> Tensor:
    """The gradient of grouped_conv with respect to its weight (of size `weight_size`)."""
    _check_conv(x=x, grad_output=grad_output)
    problem = _conv_problem("bwd_weight", x.shape, weight_size, stride, padding, dilation, groups)
    _check_size("grad_output", grad_output, _output_size(problem))
    return _run_conv("bwd_weight", kernel, problem, x, grad_output, list(weight_size))


@grouped_conv_op.register_fake
def _(x, w, stride, padding, dilation, groups, kernel, kernel_bwd_data, kernel_bwd_weight):
    _check_conv(x=x, w=w)
    problem = _conv_problem("forward", x.shape, w.shape, stride, padding, dilation, groups)
    return x.new_empty(_output_size(problem))


@grouped_conv_bwd_data_op.register_fake
def _(grad_output, w, input_size, stride, padding, dilation, groups, kernel):
    return grad_output.new_empty(input_size)


@grouped_conv_bwd_weight_op.register_fake
def _(x, grad_output, weight_size, stride, padding, dilation, groups, kernel):
    return x.new_empty(weight_size)


def _conv_setup(ctx, inputs, output) -> None:
    x, w, stride, padding, dilation, groups, _, kernel_bwd_data, kernel_bwd_weight = inputs
    ctx.save_for_backward(x, w)
    ctx.geometry = (stride, padding, dilation, groups)
    ctx.kernels = (kernel_bwd_data, kernel_bwd_weight)


def _conv_backward(ctx, grad):
    x, w = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = grouped_conv_bwd_data_op(grad, w, list(x.shape), *ctx.geometry, ctx.kernels[0])
    if ctx.needs_input_grad[1]:
        grad_w = grouped_conv_bwd_weight_op(x, grad, list(w.shape), *ctx.geometry,
                                            ctx.kernels[1])
    return (grad_x, grad_w) + (None,) * 7


grouped_conv_op.register_autograd(_conv_backward, setup_context=_conv_setup)


def _per_direction(value, label: str) -> dict[str, Any]:
    """A mapping direction -> value, or a single value for the forward direction."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        return {"forward": value}
    unknown = sorted(set(value) - set(DIRECTIONS))
    if unknown:
        raise ValueError(f"unknown direction(s) {unknown} in {label}; valid: "
                         f"{', '.join(DIRECTIONS)}")
    return dict(value)


def grouped_conv(x: Tensor, w: Tensor, *, stride=1, padding=0, dilation=1, groups: int = 1,
                 dispatcher=None, kernel=None) -> Tensor:
    """torch.nn.functional.conv2d / conv3d (no bias) on tilecast's grouped-conv kernels.

    Takes and returns torch's layouts, float32 on the CPU: x (N, G*C, [D,] H, W), w (G*K, C,
    [Z,] Y, X) -> (N, G*K, [Do,] Ho, Wo); they are converted to the kernels' NDHWGC / GKZYXC
    / NDHWGK and back. stride, padding and dilation are ints or one per spatial dim.
    `kernel` and `dispatcher` each are one value for the forward direction or a mapping
    {"forward" | "bwd_data" | "bwd_weight": value}; per direction a kernel name wins over a
    dispatcher (a grouped_conv_<direction> Dispatcher). Gradients need the bwd_data kernel
    when x requires grad and the bwd_weight kernel when w does, chosen at this call."""
    _check_conv(x=x, w=w)
    spatial = x.dim() - 2
    geometry = [_spatial_values(value, spatial, label) for label, value in
                (("stride", stride), ("padding", padding), ("dilation", dilation))]
    kernels, dispatchers = _per_direction(kernel, "kernel"), _per_direction(dispatcher, "dispatcher")
    grad_enabled = torch.is_grad_enabled()
    needed = {"forward": True, "bwd_data": grad_enabled and x.requires_grad,
              "bwd_weight": grad_enabled and w.requires_grad}
    names = {}
    for direction, need in needed.items():
        if not need:
            names[direction] = ""
        elif direction in kernels:
            names[direction] = kernels[direction]
        elif direction in dispatchers:
            problem = _conv_problem(direction, x.shape, w.shape, *geometry, groups)
            names[direction] = select(CONV[direction], dispatchers[direction], problem)
        else:
            why = "" if direction == "forward" else \
                f" ({'x' if direction == 'bwd_data' else 'w'} requires grad)"
            raise ValueError(f"no {direction} kernel{why}: pass kernel={{'{direction}': "
                             f"'<name>'}} or dispatcher={{'{direction}': <a grouped_conv_"
                             f"{direction} Dispatcher>}}")
    if not needs_custom_op((x, w), needed["bwd_data"] or needed["bwd_weight"]):
        return _forward(x, w, *geometry, groups, names["forward"], checked=True)
    return grouped_conv_op(x, w, *geometry, groups, names["forward"], names["bwd_data"],
                           names["bwd_weight"])
