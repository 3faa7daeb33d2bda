"""The channel/basis mix of a DISCO convolution as matrix products on tilecast GEMM kernels.

The mix (weight (C_out, C_in * K) times the contraction's (C_in * K, pixels)) is most of a
DISCO layer's arithmetic: 306 of self_256x360x720's 356 GFLOP. tilecast's own GEMM variants
run its shapes faster than torch's sgemm on the CPUs the pipeline measured (the GEMM family's
benchmark, and `benchmarks/disco.py --mix`, print both), so the fused path runs it on them.

`MixGemm(kernel)` computes a @ b for 2D float32 CPU tensors on the tilecast GEMM kernel
`kernel` (a name of the GEMM family, or a gemm Dispatcher from a registry, which picks per
shape); row- or column-major operands with any leading dimension are read in place and
`out=` may be a row-major view with any row stride (a block of the output's rows), written in
place. Anything else (other dtypes or devices, a shape the kernel cannot run) goes to
torch.matmul. `default_mix()` is the mix a module gets without being told: the measured
kernel where the CPU has AVX-512 (kernels are compiled on first use, as tilecast.disco.native
is), else torch.matmul.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch
from torch import Tensor

#: the GEMM variant the mix runs without a registry: the best on the nightly's large shapes
#: (m, n, k >= 256) on the AVX-512 CPU it was measured on (mean efficiency 0.97 there)
DEFAULT_KERNEL = "gemm_fp32_avx512_4x64_mc96_nc2048_kc512_park_pa1_pf0"


def _layout(t: Tensor) -> Optional[tuple[str, int, int]]:
    """(layout, row stride, column stride) of a 2D tensor the kernel reads in place."""
    from ..ops.gemm_ops import _strided_layout

    return _strided_layout(t)


class MixGemm:
    """a @ b on a tilecast GEMM kernel; see the module docstring."""

    def __init__(self, kernel: Union[str, object]):
        self.kernel = kernel
        self._choices: dict[tuple, Optional[str]] = {}

    def __repr__(self) -> str:
        return f"MixGemm({self.kernel if isinstance(self.kernel, str) else 'dispatcher'!r})"

    def _choose(self, m: int, n: int, k: int, layout_a: str, layout_b: str) -> Optional[str]:
        """The kernel for this shape, or None when it cannot run it."""
        key = (m, n, k, layout_a, layout_b)
        if key not in self._choices:
            from ..families import get_family

            gemm = get_family("gemm")
            problem = gemm.problem({"m": m, "n": n, "k": k, "dtype": "fp32",
                                    "layout_a": layout_a, "layout_b": layout_b})
            name = self.kernel if isinstance(self.kernel, str) else self.kernel.select(problem)
            reason = gemm.unsupported_reason(gemm.parse_name(name), problem)
            self._choices[key] = None if reason else name
        return self._choices[key]

    def __call__(self, a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """a (m, k) @ b (k, n) -> (m, n), into `out` when given."""
        from .. import kernel_library
        from ..families import get_family

        eligible = (a.dim() == b.dim() == 2 and a.dtype == b.dtype == torch.float32
                    and a.device.type == b.device.type == "cpu" and min(*a.shape, b.shape[1]) > 0)
        strided_a, strided_b = (_layout(a), _layout(b)) if eligible else (None, None)
        strided_out = None
        if out is not None:
            strided_out = _layout(out) if out.dtype == torch.float32 else None
            if strided_out is not None and strided_out[0] != "row":
                strided_out = None
        name = None
        if strided_a is not None and strided_b is not None and (out is None or strided_out):
            name = self._choose(a.shape[0], b.shape[1], a.shape[1], strided_a[0], strided_b[0])
        if name is None:
            product = torch.matmul(a, b)
            return product if out is None else out.copy_(product)
        (m, k), n = a.shape, b.shape[1]
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
            ldc = n
        else:
            ldc = strided_out[1]
        run = kernel_library.load(get_family("gemm"), name)
        run(a.data_ptr(), strided_a[1], strided_a[2], b.data_ptr(), strided_b[1], strided_b[2],
            out.data_ptr(), ldc, m, n, k, torch.get_num_threads())
        return out


@functools.lru_cache(maxsize=1)
def _cpu_has_avx512() -> bool:
    from ..hardware import profile

    return "avx512f" in profile()["flags"]


def default_mix() -> Optional[MixGemm]:
    """The mix of a module told nothing: DEFAULT_KERNEL where the CPU has AVX-512, else None
    (torch.matmul)."""
    return MixGemm(DEFAULT_KERNEL) if _cpu_has_avx512() else None


def resolve(mix_kernel: Union[str, object]) -> Optional[MixGemm]:
    """A module's `mix_kernel` argument as a MixGemm, or None for torch.matmul: "auto"
    (default_mix), "torch", a GEMM kernel name (FamilyError when the family does not know it)
    or a gemm Dispatcher."""
    if mix_kernel == "auto":
        return default_mix()
    if mix_kernel == "torch" or mix_kernel is None:
        return None
    if isinstance(mix_kernel, str):
        from ..families import get_family

        get_family("gemm").parse_name(mix_kernel)  # an unknown name fails here, not mid-forward
        return MixGemm(mix_kernel)
    if not callable(getattr(mix_kernel, "select", None)):
        raise TypeError(f"mix_kernel must be 'auto', 'torch', a GEMM kernel name or a gemm "
                        f"Dispatcher, got {type(mix_kernel).__name__}")
    return MixGemm(mix_kernel)
