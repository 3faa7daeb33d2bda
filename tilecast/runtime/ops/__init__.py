"""torch entry points that run the dispatched kernel: GEMM, grouped convolution and DISCO.

    dispatcher = Dispatcher.from_registry("registry", "gemm")
    c = ops.gemm(a, b, dispatcher=dispatcher)              # or kernel="gemm_fp32_avx512_..."
    y = ops.grouped_conv(x, w, padding=1, groups=4, kernel={"forward": "grouped_conv_...", ...})
    ops.disco_contraction, ops.DiscoConvS2, ...            # tilecast.disco's ops, tilecast.runtime.disco's modules

A call's kernel is the `kernel` named, else the dispatcher's choice for the call's problem
(`dispatcher.select`), else an error. It runs in this process: tilecast.runtime.kernel_library
compiles the benchmarked variant once as a shared library and keeps it loaded. Each op is a
torch custom op taking kernel names as strings (`tilecast::gemm`, `tilecast::grouped_conv`,
`tilecast::grouped_conv_bwd_data`, `tilecast::grouped_conv_bwd_weight`) with a fake
implementation and autograd; the gradients run through the same ops, on kernels chosen when
the forward call is made (the dispatcher's choice for the gradient's own problem).
Importing registers the ops; nothing is compiled before a kernel's first call.
"""
from __future__ import annotations

from tilecast.runtime.disco.conv import DiscoConvS2, DiscoConvTransposeS2
from tilecast.disco.ops import disco_contraction, disco_transpose_contraction
from tilecast.runtime.ops.gemm_ops import gemm, gemm_into, gemm_op
from tilecast.runtime.ops.grouped_conv_ops import (grouped_conv, grouped_conv_bwd_data_op,
                               grouped_conv_bwd_weight_op, grouped_conv_op)

__all__ = ["DiscoConvS2", "DiscoConvTransposeS2", "disco_contraction",
           "disco_transpose_contraction", "gemm", "gemm_into", "gemm_op", "grouped_conv",
           "grouped_conv_bwd_data_op", "grouped_conv_bwd_weight_op", "grouped_conv_op"]
