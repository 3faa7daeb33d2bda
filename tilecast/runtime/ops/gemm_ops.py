"""`tilecast::gemm`: C = A @ B on a tilecast GEMM kernel, with a fake implementation and
autograd, and `gemm`, the entry point that picks the kernel (tilecast.runtime.ops)."""
from __future__ import annotations

import torch
from torch import Tensor

from tilecast.families import get_family
from tilecast.runtime.ops.choice import load_kernel, needs_custom_op, select

GEMM = get_family("gemm")
GEMM_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}   # tensor dtype -> family dtype


def _strided_layout(t: Tensor) -> tuple[str, int, int] | None:
    """(layout, row stride, column stride) when the kernel can read `t` in place: row-major or
    column-major with any leading dimension (a transposed view is column-major); else None."""
    rows, cols = t.shape
    row_stride, col_stride = t.stride()
    if (cols == 1 or col_stride == 1) and (rows == 1 or row_stride >= cols):
        return "row", row_stride if rows > 1 else cols, 1
    if (rows == 1 or row_stride == 1) and (cols == 1 or col_stride >= rows):
        return "col", 1, col_stride if cols > 1 else rows
    return None


def operand_layout(t: Tensor) -> str:
    """The operand layout the kernel sees: anything not strided alike is copied row-major."""
    strided = _strided_layout(t)
    return strided[0] if strided is not None else "row"


def _check_gemm(a: Tensor, b: Tensor) -> None:
    for label, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{label} is on {t.device}; tilecast's GEMM kernels run on the CPU")
        if t.dim() != 2:
            raise ValueError(f"{label} must be a 2D matrix, got shape {tuple(t.shape)}")
        if t.dtype not in GEMM_DTYPES:
            raise ValueError(f"{label} has dtype {t.dtype}; the GEMM kernels take "
                             f"{' or '.join(map(str, GEMM_DTYPES))}")
    if a.dtype != b.dtype:
        raise ValueError(f"a is {a.dtype} and b is {b.dtype}; the GEMM kernels take one dtype")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply: a has "
                         f"{a.shape[1]} columns, b has {b.shape[0]} rows")


def _gemm_problem(m: int, n: int, k: int, dtype: torch.dtype, layout_a: str, layout_b: str):
    """The family's problem, or None for an empty product (no kernel runs)."""
    if min(m, n, k) == 0:
        return None
    return GEMM.problem({"m": m, "n": n, "k": k, "dtype": GEMM_DTYPES[dtype],
                         "layout_a": layout_a, "layout_b": layout_b})


def _operand(t: Tensor) -> tuple[Tensor, int, int]:
    strided = _strided_layout(t)
    if strided is None:
        t = t.contiguous()
        return t, t.shape[1], 1
    return t, strided[1], strided[2]


@torch.library.custom_op("tilecast::gemm", mutates_args=(), device_types="cpu")
def gemm_op(a: Tensor, b: Tensor, kernel: str, kernel_grad_a: str, kernel_grad_b: str) -> Tensor:
    """a (m, k) @ b (k, n) -> (m, n) float32 on the GEMM kernel `kernel`; the gradients run
    on `kernel_grad_a` / `kernel_grad_b` ("" where none is needed)."""
    return _product(a, b, kernel)


def _product(a: Tensor, b: Tensor, kernel: str) -> Tensor:
    """gemm_op's body: a new (m, n) float32 output, filled by `kernel`."""
    _check_gemm(a, b)
    return gemm_into(torch.empty(a.shape[0], b.shape[1], dtype=torch.float32), a, b, kernel)


def _run(a: Tensor, b: Tensor, kernel: str, kernel_grad_a: str, kernel_grad_b: str) -> Tensor:
    """gemm_op, or its body where no one needs the op (choice.needs_custom_op)."""
    if needs_custom_op((a, b), torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return gemm_op(a, b, kernel, kernel_grad_a, kernel_grad_b)
    return _product(a, b, kernel)


@gemm_op.register_fake
def _(a, b, kernel, kernel_grad_a, kernel_grad_b):
    _check_gemm(a, b)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)


def _gemm_setup(ctx, inputs, output) -> None:
    a, b, _, kernel_grad_a, kernel_grad_b = inputs
    ctx.save_for_backward(a, b)
    ctx.kernels = (kernel_grad_a, kernel_grad_b)


def _gemm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    kernel_grad_a, kernel_grad_b = ctx.kernels
    grad = grad.to(a.dtype)  # the kernels take one input dtype (bf16 inputs: a bf16 gradient)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = gemm_op(grad, b.t(), *(kernel_grad_a,) * 3).to(a.dtype)
    if ctx.needs_input_grad[1]:
        grad_b = gemm_op(a.t(), grad, *(kernel_grad_b,) * 3).to(b.dtype)
    return grad_a, grad_b, None, None, None


gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup)


def gemm_into(out: Tensor, a: Tensor, b: Tensor, kernel: str) -> Tensor:
    """out = a (m, k) @ b (k, n) on the GEMM kernel `kernel`, written in place: out is a float32
    (m, n) CPU matrix whose rows may lie apart (unit column stride, any row stride: rows of a
    larger tensor). Not differentiable (an out= call); operands as for `gemm`. Returns out."""
    _check_gemm(a, b)
    (m, k), n = a.shape, b.shape[1]
    if not isinstance(out, Tensor) or out.dtype != torch.float32 or out.device.type != "cpu":
        raise ValueError("out must be a float32 CPU tensor")
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out has shape {tuple(out.shape)}; a {tuple(a.shape)} @ b "
                         f"{tuple(b.shape)} is ({m}, {n})")
    if (n > 1 and out.stride(1) != 1) or (m > 1 and out.stride(0) < n):
        raise ValueError(f"out's strides {out.stride()} are not rows of unit column stride")
    problem = _gemm_problem(m, n, k, a.dtype, operand_layout(a), operand_layout(b))
    if problem is None:
        return out.zero_()
    run = load_kernel(GEMM, kernel, problem)
    (a, a_rows, a_cols), (b, b_rows, b_cols) = _operand(a), _operand(b)
    ldc = out.stride(0) if m > 1 else n
    run(a.data_ptr(), a_rows, a_cols, b.data_ptr(), b_rows, b_cols, out.data_ptr(), ldc, m, n, k,
        torch.get_num_threads())
    return out


def gemm(a: Tensor, b: Tensor, *, dispatcher=None, kernel: str | None = None) -> Tensor:
    """a (m, k) @ b (k, n) on a tilecast GEMM kernel, returned as float32 (m, n).

    a and b: CPU tensors of one dtype, float32 or bfloat16 (bf16 variants: fp32 accumulation).
    A row- or column-major operand (e.g. a transposed view), with any leading dimension, is
    read in place; other strides are copied first. The kernel is `kernel` if given, else
    `dispatcher.select` for the problem (m, n, k, dtype, layouts), else a ValueError.
    Differentiable: the gradients grad @ b^T and a^T @ grad run on the same kernel, or on the
    dispatcher's choice for their own shapes."""
    _check_gemm(a, b)
    (m, k), n = a.shape, b.shape[1]
    if kernel is not None:
        if not isinstance(kernel, str):
            raise TypeError(f"kernel must be a kernel name (str), got {type(kernel).__name__}")
        return _run(a, b, kernel, kernel, kernel)
    if dispatcher is None:
        raise ValueError("no GEMM kernel: pass kernel='<name>' or dispatcher=<a gemm Dispatcher> "
                         "(e.g. tilecast.Dispatcher.from_registry('registry', 'gemm'))")
    grad_enabled = torch.is_grad_enabled()
    # the gradients' problems as the backward will pose them: grad (m, n) row-major
    problems = (_gemm_problem(m, n, k, a.dtype, operand_layout(a), operand_layout(b)),
                _gemm_problem(m, k, n, a.dtype, "row", operand_layout(b.t()))
                if grad_enabled and a.requires_grad else None,
                _gemm_problem(k, n, m, a.dtype, operand_layout(a.t()), "row")
                if grad_enabled and b.requires_grad else None)
    names = ["" if problem is None else select(GEMM, dispatcher, problem) for problem in problems]
    return _run(a, b, *names)
