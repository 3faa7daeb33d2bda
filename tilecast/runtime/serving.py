"""Keep answering when the registry misbehaves: the last good model, else a static kernel.

`serve` loads a registry alias's Dispatcher, or, when the registry is unreachable or the
version does not load, a StaticDispatcher that answers every query with a kernel the caller
names (e.g. a library's default) and says why. `refresh` moves a running service to the
alias's current version only when that version loads; otherwise the last good dispatcher
keeps serving and the error is kept on it (`last_reload_error`) and logged.
"""
from __future__ import annotations

import logging
import math

from tilecast.runtime.dispatch import Dispatcher, Ranking
from tilecast.registry.api import RegistryError, read_alias

logger = logging.getLogger(__name__)

# What loading a version can raise besides RegistryError: a vanished or unreadable file.
LOAD_ERRORS = (RegistryError, OSError, ValueError)


class StaticDispatcher:
    """The Dispatcher query interface answering `kernel` for every problem, with the reason."""

    def __init__(self, model: str, kernel: str, reason: str):
        self.model, self.version, self.static_best = model, None, kernel
        self.kernels = (kernel,)
        self.last_fallback_reason = reason
        self.last_reload_error: str | None = reason
        self._ranking = Ranking((kernel,), (math.nan,), reason)

    def ranking(self, problem) -> Ranking:
        return self._ranking

    def select(self, problem) -> str:
        return self._ranking.best

    def rank(self, problem, k: int = 5) -> list[tuple[str, float]]:
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        return [(self._ranking.best, math.nan)]

    def predict(self, problem) -> dict[str, float]:
        return {}

    def select_json(self, problem) -> dict:
        return {"kernel": self._ranking.best, "predicted_tflops": None, "model": self.model,
                "version": None, "fallback": self.last_fallback_reason}


def serve(root, model: str, alias: str = "production", *, fallback_kernel: str | None = None,
          **options):
    """The alias's Dispatcher from the registry at `root` (a path or an fsspec URL; options
    such as `cache_dir` go to Dispatcher.from_registry); a StaticDispatcher on
    `fallback_kernel` (logged) when it cannot be loaded and a fallback is given, else the
    loading error."""
    try:
        dispatcher = Dispatcher.from_registry(root, model, alias, **options)
    except LOAD_ERRORS as err:
        if fallback_kernel is None:
            raise
        reason = (f"model {model!r} alias {alias!r} in registry {root} cannot be loaded "
                  f"({err}); serving the static kernel {fallback_kernel!r}")
        logger.warning(reason)
        return StaticDispatcher(model, fallback_kernel, reason)
    dispatcher.last_reload_error = None
    return dispatcher


def refresh(current, root, model: str, alias: str = "production", **options):
    """The dispatcher for the alias's current version. `current` itself when that is the
    version it serves, or when the new version cannot be loaded (then `current` keeps
    serving, and `current.last_reload_error` says why)."""
    try:
        version = read_alias(root, model, alias)
        if version == getattr(current, "version", None):
            return current
        fresh = Dispatcher.from_registry(root, model, version, **options)
    except LOAD_ERRORS as err:
        current.last_reload_error = (f"refresh of model {model!r} alias {alias!r} failed "
                                     f"({err}); still serving version "
                                     f"{getattr(current, 'version', None)}")
        logger.warning(current.last_reload_error)
        return current
    fresh.last_reload_error = None
    return fresh
