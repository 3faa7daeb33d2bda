"""The DISCO problems of the seed (DISCO_KERNEL_DEV.md) that the benchmarks measure: one
mapping of DiscoConvS2 constructor arguments per name, shared by benchmarks/disco.py (CPU,
vs torch-harmonics) and benchmarks/disco_cuda_device.py (a lent accelerator)."""
from __future__ import annotations

import torch

_COMMON = dict(theta_cutoff=0.017, kernel_shape=(3, 3), basis_type="harmonic",
               basis_norm_mode="mean")

CONFIGS = {
    "self_256x360x720": dict(in_channels=256, out_channels=256, in_shape=(360, 720),
                             out_shape=(360, 720), grid_in="legendre-gauss",
                             grid_out="legendre-gauss", **_COMMON),
    "self_512x360x720": dict(in_channels=512, out_channels=512, in_shape=(360, 720),
                             out_shape=(360, 720), grid_in="legendre-gauss",
                             grid_out="legendre-gauss", **_COMMON),
    "down_73x721x1440": dict(in_channels=80, out_channels=512, in_shape=(721, 1440),
                             out_shape=(360, 720), grid_in="equiangular",
                             grid_out="legendre-gauss", **_COMMON),
}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
