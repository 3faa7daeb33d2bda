"""Which CPU DISCO kernel to run for a contraction, from a published performance model.

`choose_variant(registry, problem)` asks the registry's `disco_forward` (or `disco_backward`)
model through the Dispatcher and returns the chosen kernel as a plain dict: `entry` names the
tilecast.disco.native function that runs it (`contraction` or `kpacked_contraction` forward,
`transpose_contraction` backward) and `tile` is that function's `tile` argument ((nv,
lat_block), (kreg, nv, lat_block) or (bt, nv, lat_block)). Dispatchers are kept per (registry,
model, alias) for the life of the process (`clear_cache` forgets them, e.g. after a publish),
so a module that asks once per shape pays the registry read once.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from tilecast.core.family import FamilyError
from tilecast.registry.base import RegistryError

log = logging.getLogger("tilecast.runtime.disco.selector")

#: registry model name -> the family whose kernels it chooses among
MODELS = {"disco_forward": "forward", "disco_backward": "backward"}


class SelectorError(ValueError):
    """The registry cannot answer: an unknown model, no registry there, or a bad problem."""


_lock = threading.Lock()
_dispatchers: dict[tuple[str, str, str], Any] = {}


def clear_cache() -> None:
    """Forget the loaded dispatchers (the next call reads the registry again)."""
    with _lock:
        _dispatchers.clear()


def _dispatcher(registry, model: str, alias):
    # here, not at the top: the dispatcher imports lightgbm, which DiscoConvS2 without a
    # registry (and `import tilecast.disco`) must not
    from tilecast.runtime.dispatch import Dispatcher

    key = (str(registry), model, str(alias))
    with _lock:
        found = _dispatchers.get(key)
    if found is not None:
        return found
    try:
        found = Dispatcher.from_registry(registry, model, alias)
    except (RegistryError, FileNotFoundError, OSError) as err:
        raise SelectorError(f"cannot load model {model!r} (alias {alias!r}) from registry "
                            f"{str(registry)!r}: {err}; publish one with `tilecast run` on a "
                            "config with the disco families (configs/disco.yaml)") from None
    with _lock:
        _dispatchers[key] = found
    return found


def problem_fields(x_shape, in_shape, out_shape, kernel_shape=(3, 3), basis_type="harmonic",
                   grid_in="equiangular", grid_out="equiangular", theta_cutoff=None,
                   dtype="fp32") -> dict:
    """The problem mapping for a contraction of x (B, C, nlat_in, nlon_in) as DiscoConvS2
    runs it: in_shape / out_shape (nlat, nlon), its basis and grids, and x's dtype (a torch
    dtype or 'fp32' / 'bf16' / 'fp16')."""
    precision = {"torch.float32": "fp32", "torch.bfloat16": "bf16",
                 "torch.float16": "fp16"}.get(str(dtype), str(dtype))
    batch, channels = int(x_shape[0]), int(x_shape[1])
    return {"batch": batch, "channels": channels, "nlat_in": int(in_shape[0]),
            "nlon_in": int(in_shape[1]), "nlat_out": int(out_shape[0]),
            "nlon_out": int(out_shape[1]), "kernel_shape": kernel_shape, "basis": basis_type,
            "grid_in": grid_in, "grid_out": grid_out, "theta_cutoff": theta_cutoff,
            "precision": precision}


def choose_variant(registry, problem, model: str = "disco_forward",
                   alias: str | int = "production") -> dict | None:
    """The kernel the published `model` predicts fastest for `problem`.

    registry: a registry root (path or fsspec URL). problem: a mapping of the disco families'
    problem fields (problem_fields() builds one), a 'k=v,...' string or a DiscoProblem.
    model: 'disco_forward' or 'disco_backward'. Returns {"kernel", "direction", "variant",
    "isa", "bt", "nv", "lat_block", "kreg", "entry", "tile", "predicted_tflops", "model",
    "version"}: run it as getattr(tilecast.disco.native, entry)(..., tile=tile) (a kpacked
    kernel on psi's kpacked layout);
    predicted_tflops is None when no candidate applied (the static best is returned then, where
    it applies; None is returned where it does not either: the module's own choice runs).
    SelectorError on an unknown model, a registry without it, or a problem the family rejects.
    """
    if model not in MODELS:
        raise SelectorError(f"unknown DISCO model {model!r}; valid: {', '.join(MODELS)}")
    dispatcher = _dispatcher(registry, model, alias)
    from tilecast.runtime.dispatch import NoKernelError   # loaded with the dispatcher above

    if dispatcher.family.name != model:
        raise SelectorError(f"model {model!r} in {str(registry)!r} is a {dispatcher.family.name} "
                            f"model, not a DISCO contraction model")
    try:
        ranking = dispatcher.ranking(problem)
    except NoKernelError as err:
        # every candidate's channel tile is wider than batch * channels (its slots compute
        # padding): the module runs its own choice, as without a registry
        log.warning("%s; the DISCO module runs its own kernel choice", err)
        return None
    except (FamilyError, TypeError) as err:
        raise SelectorError(f"model {model!r} cannot rank problem {problem!r}: {err}") from None
    name = ranking.kernels[0]
    config = dispatcher.family.parse_name(name)
    predicted = ranking.tflops[0]
    return {"kernel": name, **dispatcher.family.config_dict(config),
            "entry": config.runtime_entry(), "tile": config.tile(),
            "predicted_tflops": None if ranking.fallback_reason else float(predicted),
            "model": model, "version": dispatcher.version}
