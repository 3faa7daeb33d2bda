"""The kinds of model a registry version can hold, in one table: which dispatcher loads it
and what it answers.

    family   a kernel family's model (GEMM, grouped conv, DISCO): trained on this machine's
             measurements, published per hardware class, scores its own candidates (with an
             optional shortlist); tilecast.runtime.dispatch.Dispatcher
    table    a model of imported measurements (tilecast import; tilecast.table): answers per
             named device and ranks the candidates a caller offers; published without a
             hardware class; tilecast.table.dispatch.TableDispatcher

A version's feature_spec.json says its kind: "kind", else its "family" (a table model's
is "table"; a kernel family's names the family). The dispatchers are named by module path
and imported when a version of theirs is loaded, so this table imports none of them (and
loading a GEMM model imports nothing of the table family).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class ModelKind:
    name: str
    dispatcher: str            # "module:Class", whose load(path, model=, version=, **options)
    per_device: bool           # select/rank take device= and candidates=
    hardware_classes: bool     # published as <model>@<class> (tilecast.registry.classes)
    shortlist: bool            # a version may carry shortlist.json

    def dispatcher_class(self) -> Any:
        module, _, name = self.dispatcher.partition(":")
        return getattr(importlib.import_module(module), name)


KINDS = {kind.name: kind for kind in (
    ModelKind("family", "tilecast.runtime.dispatch:Dispatcher", per_device=False,
              hardware_classes=True, shortlist=True),
    ModelKind("table", "tilecast.table.dispatch:TableDispatcher", per_device=True,
              hardware_classes=False, shortlist=False),
)}
DEFAULT = "family"


def of_spec(feature_spec: Any) -> ModelKind:
    """The kind of a version from its feature_spec.json (module docstring): its "kind", else
    a "family" that names a kind, else a kernel family's model."""
    if not isinstance(feature_spec, Mapping):
        return KINDS[DEFAULT]
    name = feature_spec.get("kind") or feature_spec.get("family")
    return KINDS.get(name, KINDS[DEFAULT]) if isinstance(name, str) else KINDS[DEFAULT]
