"""Native (C++) fast paths for run-time dispatch, each beside its Python reference.

forest.cpp evaluates a LightGBM forest (tilecast.runtime.native.forest); gemm_features.cpp fills the
GEMM engine's feature matrix (tilecast.runtime.native.gemm_features) with formulas generated from
the engine's own (tilecast.runtime.native.codegen); tilecast.runtime.native.scoring puts
them together for the Dispatcher. Libraries are compiled on first use into a content-hash
cache (tilecast.runtime.native.library); when that fails, the caller keeps its Python path.
"""
from __future__ import annotations

from tilecast.runtime.native.gemm_features import NativeGemmFeatures

# (engine name, engine version) -> the native feature filler written for exactly that engine;
# any other engine (or version) uses its numpy `combine`.
FEATURE_FILLERS = {("gemm", 2): NativeGemmFeatures}


def feature_filler(engine, kernel_matrix):
    """The native feature filler for `engine` and its candidates' kernel matrix. LookupError
    when none is registered for the engine's name and version; NativeBuildError or
    EngineMismatch when the registered one cannot be used."""
    key = (engine.name, engine.version)
    if key not in FEATURE_FILLERS:
        raise LookupError(f"no native features for engine {engine.name!r} version "
                          f"{engine.version}; native: "
                          f"{', '.join(f'{n} v{v}' for n, v in FEATURE_FILLERS)}")
    return FEATURE_FILLERS[key](engine, kernel_matrix)
