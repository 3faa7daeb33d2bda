"""DISCO convolutions on the sphere: the filter tensor psi, pure-torch reference convolutions,
and the fast path's custom ops over compiled CPU and CUDA kernels. The torch modules that run
them (DiscoConvS2, DiscoConvTransposeS2 and their distributed forms, which follow a published
selector's choices) stand above this package, beside the other ops: tilecast.runtime.disco.

compute_psi builds the sparse filter tensor that fast contraction kernels consume; the functions
of `reference` are the slow, obviously correct convolutions those kernels are tested against.
Importing registers the tilecast:: ops; the kernels compile on first use (native.py, and
cuda.py with nvcc on the first call with CUDA tensors).
"""
from __future__ import annotations

from tilecast.disco.basis import BASES, FilterBasis, HarmonicBasis, PiecewiseLinearBasis, get_basis
from tilecast.disco.csr import DiscoCSR, csr_from_psi
from tilecast.disco.grids import GRIDS, default_theta_cutoff, latitudes, longitudes
from tilecast.disco.psi import CUTOFF_WIDENING, NORM_MODES, Psi, compute_psi
from tilecast.disco.reference import disco_contraction, disco_conv, disco_transpose_contraction, disco_transpose_conv

__all__ = [
    "BASES", "CUTOFF_WIDENING", "DiscoCSR", "FilterBasis",
    "GRIDS", "HarmonicBasis", "NORM_MODES", "PiecewiseLinearBasis", "Psi", "compute_psi",
    "csr_from_psi", "default_theta_cutoff", "disco_contraction",
    "disco_conv", "disco_transpose_contraction", "disco_transpose_conv", "get_basis", "latitudes",
    "longitudes",
]

#: the modules that moved up to tilecast.runtime.disco (this package is their math and kernels)
MOVED = ("DiscoConvS2", "DiscoConvTransposeS2", "DistributedDiscoConvS2",
         "DistributedDiscoConvTransposeS2")


def __getattr__(name: str):
    if name in MOVED:
        raise AttributeError(f"tilecast.disco.{name} is now tilecast.runtime.disco.{name} "
                             f"(from tilecast.runtime.disco import {name})")
    raise AttributeError(f"module 'tilecast.disco' has no attribute {name!r}")
