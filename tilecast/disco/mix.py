"""The channel mix's matrix products, on torch's matmul or on a tilecast GEMM kernel.

A DISCO convolution spends most of its FLOPs in the channel/basis mix: per batch element and
group, weight (M, C * K) @ slab (C * K, rows * nlon). `Mixer` runs those products. Without a
GEMM choice it calls torch (torch.mm with out=, addmm_), as before. With one (a GEMM kernel
name, or a dispatcher of the gemm family such as
`Dispatcher.from_registry("registry", "gemm")`), float32 products on the CPU run on that
kernel: the dispatcher is asked once per product shape (m, n, k and the operands' layouts),
and the product is written straight into the output's rows (tilecast.runtime.ops.gemm_into).
Other dtypes and devices stay on torch.

Whether the kernel beats torch's sgemm at the mix's shapes is a measurement
(`benchmarks/disco.py --mix-gemm`), which is why torch stays the default.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor


def _check_choice(gemm: Any) -> None:
    if gemm is None or (isinstance(gemm, str) and gemm):
        return
    if not callable(getattr(gemm, "select", None)):
        raise TypeError("mix_gemm must be None, a GEMM kernel name or a gemm dispatcher (with "
                        f".select), got {type(gemm).__name__}")
    family = getattr(gemm, "family", None)
    if family is not None and family.name != "gemm":
        raise ValueError(f"mix_gemm's dispatcher picks {family.name} kernels; the mix needs "
                         "a gemm dispatcher")


class Mixer:
    """The mix's products: torch's, or the GEMM kernel `gemm` names or chooses (module
    docstring). `kernels` records the kernel run for each product shape."""

    def __init__(self, gemm: Any = None):
        _check_choice(gemm)
        self.gemm = gemm
        self.kernels: dict[tuple, str] = {}

    def __deepcopy__(self, memo) -> "Mixer":
        # a module's copy shares the kernel choice (a dispatcher holds a loaded model)
        return Mixer(self.gemm)

    def __repr__(self) -> str:
        return f"Mixer({'torch' if self.gemm is None else self.gemm!r})"

    def kernel_for(self, a: Tensor, b: Tensor) -> Optional[str]:
        """The GEMM kernel that runs a @ b, or None where torch runs it."""
        if (self.gemm is None or a.dtype != torch.float32 or b.dtype != torch.float32
                or a.device.type != "cpu" or b.device.type != "cpu"):
            return None
        from tilecast.runtime.ops import gemm_ops  # the ops import this package

        key = (a.shape[0], b.shape[1], a.shape[1], gemm_ops.operand_layout(a),
               gemm_ops.operand_layout(b))
        if key not in self.kernels:
            if isinstance(self.gemm, str):
                self.kernels[key] = self.gemm
            else:
                m, n, k, layout_a, layout_b = key
                problem = gemm_ops.GEMM.problem({"m": m, "n": n, "k": k, "dtype": "fp32",
                                                 "layout_a": layout_a, "layout_b": layout_b})
                self.kernels[key] = self.gemm.select(problem)
        return self.kernels[key]

    def mm(self, a: Tensor, b: Tensor, out: Tensor) -> None:
        """out = a @ b, out a matrix of rows with unit column stride (written in place)."""
        kernel = self.kernel_for(a, b)
        if kernel is None or out.dtype != torch.float32:
            torch.mm(a, b, out=out)
            return
        from tilecast.runtime.ops import gemm_ops

        gemm_ops.gemm_into(out, a, b, kernel)

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """a (G, M, K) @ b (B, G, K, N) -> (B, G, M, N), as torch.matmul broadcasts them."""
        if self.kernel_for(a[0], b[0, 0]) is None:
            return torch.matmul(a, b)
        batch, groups = b.shape[:2]
        out = torch.empty(batch, groups, a.shape[1], b.shape[-1], dtype=torch.float32)
        for i in range(batch):
            for g in range(groups):
                self.mm(a[g], b[i, g], out[i, g])
        return out

    def addmm_(self, total: Tensor, a: Tensor, b: Tensor) -> None:
        """total += a @ b (the kernels write, so the product goes through a buffer)."""
        if self.kernel_for(a, b) is None or total.dtype != torch.float32:
            total.addmm_(a, b)
            return
        product = torch.empty(total.shape, dtype=torch.float32)
        self.mm(a, b, product)
        total += product


#: the mix on torch's matmul
TORCH = Mixer()
