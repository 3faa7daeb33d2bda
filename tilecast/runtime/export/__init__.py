"""`tilecast export`: a published model version as a selector in C (or JSON) that picks what
tilecast.runtime.dispatch.Dispatcher.select picks, with no Python and no LightGBM.

    selector = export.load(root, "gemm", "production")   # checksums verified first
    paths = export.write(selector, out_dir, "c")         # tilecast_gemm.h, tilecast_gemm.c

The C form holds the kernel table, the feature formulas (the engine's own graphs,
tilecast.features.<family>.formulas, as statements: tilecast.runtime.export.program; a
family's EXPORTERS module adds its arguments, validation and applicability key), the forest
as flat arrays (tilecast.runtime.export.forest) and the selection rules
(tilecast.runtime.export.selector); the JSON form holds the same tables, the formulas as
statements over an operation table. Families: GEMM and the three grouped-conv directions.

A table model (tilecast import + tilecast train --dataset) exports one device's selector
(tilecast.runtime.export.table, which says why one device per export; its C form is
tilecast.runtime.export.table_c): `load(root, model, device=D)`, the files named
tilecast_<model>_<device>.*; it picks what TableDispatcher.select(problem, device=D) picks.
"""
from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path

from tilecast.core.atomic import atomic_write_text
from tilecast.core import kinds
from tilecast.runtime.export import c_source, table, table_c
from tilecast.runtime.export.selector import ExportError, Selector, build
from tilecast.runtime.export.table import TableSelector

__all__ = ["EXPORTERS", "FORMATS", "ExportError", "Selector", "TableSelector", "load", "write"]

#: family -> the module holding its formulas and problem fields: the families export handles
EXPORTERS = {"gemm": "tilecast.runtime.export.gemm",
             **{f"grouped_conv_{direction}": "tilecast.runtime.export.grouped_conv"
                for direction in ("forward", "bwd_data", "bwd_weight")}}
#: --format -> what it writes
#: (a table model's files are named tilecast_<model>_<device>.*)
FORMATS = {"c": "tilecast_<model>.h and tilecast_<model>.c",
           "json": "tilecast_<model>.json"}


def exporter(family: str):
    """The exporter module of `family`; ExportError naming the families there are."""
    if family not in EXPORTERS:
        raise ExportError(f"family {family!r} cannot be exported; tilecast export supports "
                          f"the families {', '.join(EXPORTERS)} (another family needs its "
                          "feature formulas in tilecast.runtime.export)")
    return import_module(EXPORTERS[family])


def load(root, model: str, alias_or_version: str | int = "production",
         shortlist: int | None = None, device: str | None = None) -> Selector | TableSelector:
    """The selector of a registry version. The version's files are verified against its
    checksums before anything is read (RegistryError naming a damaged file); ExportError
    for a family or a model the exported selector cannot reproduce. `shortlist=K`: the
    selector picks what Dispatcher(shortlist=K) picks (RegistryError for a version
    without shortlist.json). `device`: a table model's device (tilecast.runtime.export.table;
    None: its only training device); ExportError for another model."""
    from tilecast.registry import api as registry
    from tilecast.runtime.dispatch import Dispatcher

    model = registry.serving_name(root, model)
    version = registry.resolve_version(root, model, alias_or_version)
    path = registry.local_copy(root, model, version)
    spec = _feature_spec(path)
    if kinds.of_spec(spec).name == "table":
        from tilecast.table.dispatch import TableDispatcher

        if shortlist is not None:
            raise ExportError(f"version {version} of model {model!r} is a table model, which "
                              "has no shortlist; export it without --shortlist")
        return table.build(TableDispatcher.from_directory(path, model=model, version=version),
                           device)
    if device is not None:
        raise ExportError(f"--device {device}: model {model!r} is not a table model; it "
                          "chooses for the machine it was trained on, so export it without "
                          "--device")
    family = spec.get("family") if spec is not None else None
    if isinstance(family, str):
        exporter(family)  # a family export does not handle fails here, before loading it
    dispatcher = Dispatcher.from_directory(path, model=model, version=version,
                                           shortlist=shortlist)
    return build(dispatcher, exporter(dispatcher.family.name))


def _feature_spec(path: Path) -> dict | None:
    """feature_spec.json as a dict, or None when it cannot be read (the Dispatcher then names
    what is wrong with it)."""
    try:
        spec = json.loads((path / "feature_spec.json").read_text())
    except (OSError, ValueError):
        return None
    return spec if isinstance(spec, dict) else None


def render(selector: Selector | TableSelector, fmt: str) -> dict[str, str]:
    """{file name: text} of a format of FORMATS."""
    if isinstance(selector, TableSelector):
        stem = table_c.file_stem(selector)
        if fmt == "c":
            return {f"{stem}.h": table_c.render_header(selector),
                    f"{stem}.c": table_c.render_source(selector)}
    else:
        stem = c_source.file_stem(selector)
    if fmt == "c":
        validation = exporter(selector.family).c_validation()
        return {f"{stem}.h": c_source.render_header(selector),
                f"{stem}.c": c_source.render_source(selector, validation)}
    if fmt == "json":
        return {f"{stem}.json": json.dumps(selector.to_json(), allow_nan=False,
                                           separators=(",", ":")) + "\n"}
    raise ValueError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")


def write(selector: Selector | TableSelector, out_dir, fmt: str = "c") -> list[Path]:
    """Write a format of FORMATS into `out_dir` (made if missing), each file atomically."""
    files = render(selector, fmt)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [atomic_write_text(out_dir / name, text) for name, text in files.items()]
