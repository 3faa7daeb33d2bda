"""DISCO's torch modules: DiscoConvS2 and DiscoConvTransposeS2 (each input's kernels as a
published selector chose them, `selector`; the channel mix on the fastest GEMM, `mix`; the
contraction and mix as one kernel, `fused`) and their distributed forms over latitude bands
(`distributed`, `exchange`). The math and the kernels they run are tilecast.disco's."""
from tilecast.runtime.disco.conv import DiscoConvS2, DiscoConvTransposeS2
from tilecast.runtime.disco.distributed import DistributedDiscoConvS2, DistributedDiscoConvTransposeS2

__all__ = ["DiscoConvS2", "DiscoConvTransposeS2", "DistributedDiscoConvS2",
           "DistributedDiscoConvTransposeS2"]
