"""`tilecast export` of a table model (tilecast import + tilecast train --dataset): one
device's selector, picking what TableDispatcher.select(problem, device) picks.

One device per export. A table model's answer is a device's: its device features, the
configurations that failed there, which calibration (a training device's or a new one's)
sets the incumbent guard's margin, which reference devices its reference features come from
and whether the guard spares a problem measured there. Exported for one device, all of that is
constants, and the C takes the problem alone, as a kernel selector built into one program
for one machine does; a program for several devices includes one selector per device
(`tilecast export --device D`, the file named after the model and the device). The default
is the model's only training device; any device the model's device entries or the device
tables know can be named, a device the model never saw answered from its features as the
dispatcher answers it. `candidates=` (ranking only the configurations a caller offers) is
not exported: the selector ranks every configuration allowed on the device; nor are the
confidence and the shortlist an unsure answer carries (TableDispatcher.choice): the selector
returns the pick.

What the selector holds (TableSelector): the problem's columns (numeric: a double, NaN for a
partial column left out; categorical: the code of the value among the model's categories,
-1 for a value the model never saw), the feature vector's formulas per model feature
(FEATURE_OPS, derived from the engine's blocks and checked against its feature names), the
per-configuration constants, the two boosters and the prior (tilecast.table.model.MEMBERS,
PRIOR) with categorical splits (tilecast.runtime.export.table_forest), and the reference
tables: the measured problems' log2 dimensions and categories, the summaries of the other
devices' measurements per (problem, configuration) and the ideal gaps' values, so the nearest
measured problem is searched as Reference.grid searches it (the same squares in the same
order, the first of equal ones).

Exactness. Every feature is computed in float64 as numpy computes it and rounded to float32,
the dispatcher's feature matrix, so a split decides as LightGBM decides. The one function the
C library and numpy compute differently is log2 (numpy's SIMD log2 differs from glibc's in
the last bit on about 1 value in 20,000): a dimension's log2 is looked up in the interval of
arguments whose numpy log2 is each measured problem's value (found here with numpy), so a
measured value, and whether a problem was measured, is exactly numpy's; only a value no
measured problem has takes the C library's log2, which can move a feature only where a double
lies within an ulp of a float32 rounding boundary, or a nearest-problem choice only between
two problems equally near. A model whose formulation is not "efficiency" is refused: its
efficiencies are exp or sigmoid of a score, which the C library computes as numpy may not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from tilecast.runtime.export import table_forest
from tilecast.runtime.export.forest import ForestError, _largest_where
from tilecast.runtime.export.selector import ExportError

FORMAT = "tilecast-table-selector"
FORMAT_VERSION = 1
INVALID_PROBLEM = -1
SUMMARIES = 7          # ref:near .. ref:devices, tilecast.table.reference._summaries
#: feature op -> its operands (numeric/categorical: an input's index; tile: a column of
#: `tiles`; config: a column of `config`); every value is rounded to float32
FEATURE_OPS = {
    "unused": (), "const": ("value",), "x": ("numeric",), "log2": ("numeric",),
    "mul": ("numeric", "numeric"), "ratio": ("numeric", "numeric"), "log2_size": (),
    "code": ("categorical",), "config": ("config",), "tile_ratio": ("numeric", "tile"),
    "tile_fit": ("numeric", "tile"), "waves": ("numeric", "tile", "numeric", "tile"),
    "tail": ("numeric", "tile", "numeric", "tile"), "ref": ("summary",),
    "ref_problem_distance": (), "ref_gap": ("parameter",)}


@dataclass
class TableSelector:
    """Everything the exported table selector holds; see the module docstring."""
    model: str
    version: int
    device: str
    inputs: list[dict]            # {"name", "kind", "partial", "categories"}, schema order
    kernels: list[str]            # the model's candidates, sorted (the dispatcher's key order)
    allowed: list[int]            # those that may be chosen on the device
    incumbent: int                # kernel index, -1 for none
    margin: float                 # the guard's margin on this device (inf: always the incumbent)
    exempt_measured: bool         # whether a problem measured on the device skips the guard
    features: list[list]          # per model feature: [op, *operands] (FEATURE_OPS)
    config: list[list[float]]     # per kernel: its float32 configuration features
    tiles: list[list[float]]      # per kernel: its tile sizes (fit and wave features)
    units: float                  # the device's compute units (wave features)
    forests: list[table_forest.TableForest]
    prior: int                    # the feature averaged with the members
    reference: dict = field(default_factory=dict)
    family: str = "table"

    def to_json(self) -> dict:
        """The JSON form (non-finite numbers as "nan", "inf", "-inf"): the tables the C holds.
        To select, follow tilecast.runtime.export.table_c's selection function."""
        document = {name: getattr(self, name) for name in (
            "model", "version", "device", "inputs", "kernels", "allowed", "incumbent",
            "margin", "exempt_measured", "features", "config", "tiles", "units", "prior",
            "reference")}
        document["forests"] = [forest.to_json() for forest in self.forests]
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **_encode(document)}

    @classmethod
    def from_json(cls, document: Mapping) -> "TableSelector":
        if document.get("format") != FORMAT or document.get("format_version") != FORMAT_VERSION:
            raise ExportError(f"not a {FORMAT} version {FORMAT_VERSION} document (format "
                              f"{document.get('format')!r} version "
                              f"{document.get('format_version')!r})")
        values = _decode({k: v for k, v in document.items()
                          if k not in ("format", "format_version")})
        values["forests"] = [table_forest.TableForest.from_json(f) for f in values["forests"]]
        return cls(**values)


def _encode(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value):
    if value in ("nan", "inf", "-inf") and isinstance(value, str):
        return float(value)
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _f32(values) -> list[float]:
    return np.asarray(values, dtype=np.float64).astype(np.float32).astype(np.float64).tolist()


def build(dispatcher, device: str | None = None) -> TableSelector:
    """The TableSelector of a loaded TableDispatcher for `device` (None: the model's only
    training device). ExportError, in one line, for a device the model and the device tables
    do not know, a model trained on several devices without `device`, a formulation other
    than "efficiency", or a device where every configuration failed."""
    from tilecast.runtime.query import ProblemError
    from tilecast.table import ideal
    from tilecast.table.devices import UnknownDeviceError
    from tilecast.table.model import MEMBERS, PRIOR
    from tilecast.table.reference import NAMES

    table_model = dispatcher.table_model
    label = f"version {dispatcher.version} of table model {dispatcher.model!r}"
    try:
        name, device_table = dispatcher.device(device)
    except UnknownDeviceError:
        raise ExportError(f"{label} knows no device {device!r}: name one of its training "
                          f"devices ({', '.join(table_model.training_devices)}) or another "
                          f"device of its stored entries ({len(table_model.devices.names())}) "
                          "or the hardware tables (tilecast.table.devices)") from None
    except ProblemError:
        raise ExportError(f"{label} was trained on {len(table_model.training_devices)} "
                          f"devices ({', '.join(table_model.training_devices)}); name the "
                          "one to export with --device") from None
    if table_model.formulation != "efficiency":
        raise ExportError(f"{label} has formulation {table_model.formulation!r}, whose "
                          "efficiencies are exp or sigmoid of a score that the C library can "
                          "compute differently from numpy; export supports 'efficiency' "
                          "(the default of tilecast train)")
    kernels = table_model.candidates()
    allowed = table_model.allowed(name)
    if not allowed:
        raise ExportError(f"{label}: every configuration failed on {name} in its training "
                          "data: there is nothing to choose there")
    trained = name in table_model.training_devices
    calibration = dispatcher.calibrations.for_device(trained)
    incumbent = table_model.incumbent
    try:
        forests = [table_forest.convert(table_model.boosters[member].dump_model())
                   for member in MEMBERS]
    except ForestError as err:
        raise ExportError(f"{label}: {err}") from None
    engine = table_model.features
    features, config, tiles, units = _formulas(engine, table_model, name, device_table, label)
    features += [["ref", i] for i in range(SUMMARIES)]
    reference, near_distance = _reference(table_model, name, device_table, kernels)
    features += [["const", near_distance], ["ref_problem_distance"]]
    gaps = len(reference["ideal_values"][0]) if reference.get("ideal_values") else 0
    features += [["ref_gap", j] if j < gaps else ["const", math.nan]
                 for j in range(ideal.MAX_PARAMETERS)]
    if len(features) != len(engine.names) + len(NAMES):
        raise ExportError(f"{label}: its reference features are not the ones "
                          "tilecast.runtime.export.table computes; update the exporter")
    prior = len(engine.names) + NAMES.index(PRIOR)
    read = set().union(*(forest.features() for forest in forests)) | {prior}
    features = [f if i in read else ["unused"] for i, f in enumerate(features)]
    return TableSelector(
        model=dispatcher.model, version=dispatcher.version or 0, device=name,
        inputs=[{"name": c.name, "kind": c.kind, "partial": bool(c.partial),
                 "categories": (list(engine.categories_.get(c.name, []))
                                if c.kind == "categorical" else None)}
                for c in table_model.schema.problem],
        kernels=kernels, allowed=[kernels.index(k) for k in allowed],
        incumbent=kernels.index(incumbent) if incumbent in kernels else -1,
        margin=math.inf if calibration is None else float(calibration.margin),
        exempt_measured=bool(incumbent is not None and trained and calibration is not None
                             and calibration.margin > 0),
        features=features, config=config, tiles=tiles, units=units, forests=forests,
        prior=prior, reference=reference)


def _formulas(engine, table_model, device: str, device_table, label: str):
    """(feature ops of the engine's names, per-kernel float32 config features, per-kernel
    tiles, the device's compute units): TableFeatures' blocks as FEATURE_OPS. ExportError
    when the names they make are not the engine's (the engine changed)."""
    from tilecast.table.features import COMPUTE_UNITS

    schema, blocks = table_model.schema, engine.blocks
    numeric = {c.name: i for i, c in enumerate(schema.problem) if c.kind == "numeric"}
    categorical = {c.name: i for i, c in enumerate(schema.problem) if c.kind == "categorical"}
    ops: list[tuple[str, list]] = []
    for p in blocks.problem_numeric:
        ops += [(p, ["x", numeric[p]]), (f"log2({p})", ["log2", numeric[p]])]
    for a, b in blocks.problem_pairs:
        ops += [(f"{a}*{b}", ["mul", numeric[a], numeric[b]]),
                (f"{a}/{b}", ["ratio", numeric[a], numeric[b]])]
    if blocks.problem_numeric:
        ops.append(("log2(size)", ["log2_size"]))
    ops += [(c, ["code", categorical[c]]) for c in blocks.problem_categorical]
    ops += [(n, ["config", i]) for i, n in enumerate(engine.config_names)]
    configs = table_model.candidate_configs()
    tile_columns: list[np.ndarray] = []
    tile_of: dict[str, int] = {}
    part_tiles = engine._part_tiles({c: configs[c].to_numpy() for _, c, _ in engine.part_fits_})
    for tile_name, values in [(c, configs[c].to_numpy(dtype=np.float64))
                              for _, c in blocks.fit_pairs] + list(part_tiles.items()):
        if tile_name not in tile_of:
            tile_of[tile_name] = len(tile_columns)
            tile_columns.append(np.asarray(values, dtype=np.float64))
    fits = [(p, c) for p, c in blocks.fit_pairs] + [(p, f"{c}.{q}")
                                                    for p, c, q in engine.part_fits_]
    for p, tile in fits:
        ops += [(f"{p}/{tile}", ["tile_ratio", numeric[p], tile_of[tile]]),
                (f"fit({p},{tile})", ["tile_fit", numeric[p], tile_of[tile]])]
    device_row = engine.device_features([device], device_table)[0]
    ops += [(n, ["const", v]) for n, v in zip(engine.device_names, _f32(device_row))]
    for a, b in engine.wave_pairs:
        (pa, ca, qa), (pb, cb, qb) = engine.part_fits_[a], engine.part_fits_[b]
        operands = [numeric[pa], tile_of[f"{ca}.{qa}"], numeric[pb], tile_of[f"{cb}.{qb}"]]
        ops += [(f"waves({pa},{pb})", ["waves", *operands]),
                (f"tail({pa},{pb})", ["tail", *operands])]
    if [n for n, _ in ops] != list(engine.names):
        raise ExportError(f"{label}: its features are not the ones tilecast.runtime.export."
                          "table computes (the table feature engine changed); update the "
                          "exporter's formulas")
    config = engine.config_features({c: configs[c].to_numpy() for c in schema.config_names})
    units = 1.0
    if engine.wave_names:
        units = float(np.exp2(device_row[device_table.FEATURE_NAMES.index(COMPUTE_UNITS)]))
    tiles = (np.column_stack(tile_columns).tolist() if tile_columns
             else [[] for _ in range(len(configs))])
    return ([op for _, op in ops], [_f32(row) for row in config], tiles, units)


def _reference(table_model, device: str, device_table, kernels: list[str]):
    """(the reference tables of the device's reference features, ref:near_distance): what
    Reference.grid reads for a problem on `device`, for every measured problem."""
    from tilecast.table import ideal
    from tilecast.table.devices import CATEGORICAL, CATEGORY_GAP, feature_distance
    from tilecast.table.reference import _summaries

    ref, engine, schema = table_model.reference, table_model.features, table_model.schema
    if ref is None:
        return {}, math.nan
    document = {
        "scale": ref._problem_scale.tolist(), "category_gap_squared": CATEGORY_GAP ** 2,
        "values": ref.problem_values.tolist(),
        "labels": _label_codes(engine, schema, ref.problem_labels),
        "log2_intervals": _intervals(ref.problem_values),
        "measured_here": (np.flatnonzero(ref._measured[ref.devices.index(device)]).tolist()
                          if device in ref.devices else []),
        "usable": []}
    others = np.array([d != device for d in ref.devices], dtype=bool)
    if not others.any():      # no other device measured anything: ref:devices 0, the rest NaN
        return document, math.nan
    vector = device_table.features(device)
    distances = np.array([feature_distance(vector, v, ref.scale)
                          for v in ref.device_vectors[others]])
    order = np.argsort(distances, kind="stable")
    refs, distances = np.flatnonzero(others)[order], distances[order]
    weights = (1.0 / (1.0 + distances) ** 2).astype(np.float32)
    columns = np.array([ref._kernel_index.get(k, -1) for k in kernels])
    known = np.flatnonzero(columns >= 0)
    problems = len(ref.problem_values)
    cells = np.full((problems, len(kernels), SUMMARIES), np.nan, dtype=np.float32)
    cells[:, :, SUMMARIES - 1] = 0.0
    picked = np.ix_(refs, np.arange(problems), columns[known])
    cells[:, known, :] = _summaries(ref.efficiency[picked], ref._ranks[picked], weights)
    rows, index = np.unique(cells.reshape(-1, SUMMARIES).view(np.uint32), axis=0,
                            return_inverse=True)
    document.update({
        "usable": np.flatnonzero(ref._measured[refs].any(axis=0)).tolist(),
        "summary_rows": rows.view(np.float32).astype(np.float64).tolist(),
        "summary_index": index.reshape(problems, len(kernels)).tolist()})
    values, ideals = ref._ideals(schema)
    if values.shape[1]:
        predicted, _ = ideal.predict(ideals[refs], ref.device_vectors[refs], vector, ref.scale,
                                     ~CATEGORICAL)
        predicted = np.clip(predicted, values.min(axis=0), values.max(axis=0))
        ideal_values = np.full((len(kernels), values.shape[1]), np.nan)
        ideal_values[known] = values[columns[known]]
        document["ideal_values"] = ideal_values.tolist()
        document["ideal_predicted"] = predicted.tolist()
    return document, float(np.float32(distances[0]))


def _label_codes(engine, schema, labels: np.ndarray) -> list[list[int]]:
    """The measured problems' categories as the engine's codes (every stored label is one:
    the categories are fitted on the same rows)."""
    names = [c.name for c in schema.problem if c.kind == "categorical"]
    codes = [[engine._codes[n].get(str(v), -2) for n, v in zip(names, row)] for row in labels]
    if any(-2 in row for row in codes):
        raise ExportError("a measured problem's category is none of the model's categories; "
                          "retrain the model")
    return codes


def _intervals(values: np.ndarray) -> list[list[list[float]]]:
    """Per numeric column, sorted [lo, hi, v]: the arguments x (|dimension| + 1) whose numpy
    log2 is v, for each distinct measured value v (the module docstring's exactness)."""
    out = []
    for column in np.asarray(values, dtype=np.float64).T:
        distinct = np.unique(column[np.isfinite(column)])
        below = _largest_where(lambda x: np.log2(x) < distinct, len(distinct))
        high = _largest_where(lambda x: np.log2(x) <= distinct, len(distinct))
        low = np.nextafter(below, np.inf)
        if len(distinct) and not (np.all(np.log2(low) == distinct)
                                  and np.all(np.log2(high) == distinct)):
            raise ExportError("numpy's log2 is not monotone around a measured problem's "
                              "dimension here; the exported selector cannot match it")
        out.append([[float(a), float(b), float(v)] for a, b, v in zip(low, high, distinct)])
    return out
