"""CK tile-engine benchmark CSVs, in the three layouts the tile engine writes (told apart by
their header, LAYOUTS):

- `profiler`: what a tile-engine benchmark binary appends with `-csv_filename` (GEMM and its
  variants): `rocm_version, device_name, <problem columns>, name, latency(ms), tflops(TFlops),
  bandwidth(GB/s), metric`. Every column between `device_name` and `name` is a problem column
  (split_k, m, n, k, strides, dtypes, layouts for GEMM; other ops have their own), the device
  is `device_name` (--device where it is blank), the time `latency(ms)`. A zero latency is
  refused: old tile engines printed two decimals, and a kernel under 5 us became 0.00.
- `sweep`: the CSV of the tile engine's Python sweep (`export_csv`): `name`, `problem` (a dict
  of the problem's fields, as Python prints it), `time_ms`; a `time_ms` of 0 is the sweep's mark
  of a kernel that gave no result: `failed`. --device names the device.
- `grouped-conv`: the grouped-convolution benchmark's CSV, read by the one parser of it
  (tilecast.stages.convert_ck_rows, which `tilecast convert --from ck-csv` uses too). Problem
  columns: direction, dtype and ndim from the kernel name, then the shape columns (a 2D
  kernel's blank depth fields take the 2D values); `non_zero` false (an all-zero output) is
  `wrong_result`; a latency that is not a positive number refuses the file. --device names
  the device.

The configuration is the kernel's name, `kernel_name`, followed by the parameters it encodes
when every name of the import parses: for GEMM (`<op>_<dtype>_<layout>_<pipeline>_<epilogue>_
<scheduler>_<pad_m>_<pad_n>_<pad_k>_<persistent>_<tile>_<warps>_<warp tile>`) pipeline,
epilogue, scheduler, the pads and persistence (0/1) and the nine tile sizes; for grouped conv
the tile engine's block, tile_m, tile_n, pipeline, wave_mode, has_dsb, has_si. A configuration
measured several times (the files are appended to) becomes one row: every time as `samples_s`,
their median as `median_s`.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pandas as pd

from tilecast.table.dataset import Column, TableDataError, TableSchema
from tilecast.table.formats.common import (Imported, RawFile, check_names, collapse_rows,
                                           log, named_rows, numbers, read_csv_text, read_raw,
                                           same_columns, source_entry, typed_column)

FORMAT = "ck-csv"
WHAT = "a CK tile-engine benchmark CSV"
MS = 1e-3
KERNEL = "kernel_name"
FIRST_LINE = 2      # line 1 is the header

GEMM_NAME_RE = re.compile(
    r"^(?P<op>[a-z_]+?)_(?P<dtype>[a-z0-9]+)_(?P<layout>[rc]{3,4})_(?P<traits>[a-z0-9_]+)"
    r"_(?P<pad_m>True|False)_(?P<pad_n>True|False)_(?P<pad_k>True|False)"
    r"_(?P<persistent>True|False)_(?P<tile_m>\d+)x(?P<tile_n>\d+)x(?P<tile_k>\d+)"
    r"_(?P<warp_m>\d+)x(?P<warp_n>\d+)x(?P<warp_k>\d+)"
    r"_(?P<warp_tile_m>\d+)x(?P<warp_tile_n>\d+)x(?P<warp_tile_k>\d+)$")
GEMM_EPILOGUES = ("cshuffle", "default")
GEMM_SCHEDULERS = ("intrawave", "interwave", "default")
GEMM_FLAGS = ("pad_m", "pad_n", "pad_k", "persistent")
GEMM_TILES = ("tile_m", "tile_n", "tile_k", "warp_m", "warp_n", "warp_k", "warp_tile_m",
              "warp_tile_n", "warp_tile_k")
GEMM_CONFIG = (("pipeline", "categorical"), ("epilogue", "categorical"),
               ("scheduler", "categorical"),
               *((name, "numeric") for name in GEMM_FLAGS + GEMM_TILES))
CONV_CONFIG = (("block", "numeric"), ("tile_m", "numeric"), ("tile_n", "numeric"),
               ("pipeline", "categorical"), ("wave_mode", "categorical"),
               ("has_dsb", "numeric"), ("has_si", "numeric"))


@dataclass(frozen=True)
class Parsed:
    """One file's rows before the configuration columns are decided."""
    frame: pd.DataFrame                  # problem columns (text), kernel_name, device, ...
    problem: tuple[str, ...]
    grammar: str                         # which name grammar the kernel names follow


@dataclass(frozen=True)
class Layout:
    name: str
    required: tuple[str, ...]
    read: Callable[[RawFile, pd.DataFrame, str | None], Parsed]


def read(paths: Sequence[Path], *, mapping: Mapping | None, device: str | None) -> Imported:
    """The rows of CK tile-engine CSVs `paths` (see the module docstring)."""
    if mapping:
        raise TableDataError("--mapping is not used with --from ck-csv: the tile engine's "
                             "columns are known")
    parsed, sources = [], []
    for path in paths:
        raw = read_raw(path)
        frame = read_csv_text(raw, WHAT)
        layout = _layout(raw.path, frame)
        one = layout.read(raw, frame, device)
        parsed.append(one)
        sources.append(source_entry(raw, f"{FORMAT}-{layout.name}", one.frame["status"]))
    problem = same_columns({p: one.problem for p, one in zip(paths, parsed)}, "problem columns")
    same_columns({p: (one.grammar,) for p, one in zip(paths, parsed)}, "kind of kernel")
    frame = pd.concat([one.frame for one in parsed], ignore_index=True)
    problem = tuple(typed_column(frame, name) for name in problem)
    config_columns, config = _config(frame, parsed[0].grammar)
    frame = pd.concat([frame, config], axis=1)
    frame = collapse_rows(frame, ["device", *(c.name for c in problem), KERNEL])
    schema = TableSchema(problem=problem, config=config_columns)
    return Imported(schema=schema, rows=frame.to_dict("records"), sources=sources)


def _layout(path: Path, frame: pd.DataFrame) -> Layout:
    for layout in LAYOUTS:
        if all(column in frame.columns for column in layout.required):
            return layout
    expected = "; ".join(f"{l.name}: {', '.join(l.required)}" for l in LAYOUTS)
    raise TableDataError(f"{path}: header {list(frame.columns)[:8]}... is none of the tile "
                         f"engine's CSV layouts ({expected}); expected {WHAT}")


def _lines(frame: pd.DataFrame) -> pd.Series:
    return pd.Series(range(FIRST_LINE, FIRST_LINE + len(frame)), index=frame.index)


def _kernel_names(raw: RawFile, frame: pd.DataFrame, column: str) -> pd.Series:
    names = frame[column].astype(str).str.strip()
    blank = names == ""
    if blank.any():
        raise TableDataError(f"{raw.path}: column {column}: blank kernel name at row(s) "
                             f"{list(_lines(frame)[blank][:5])}")
    return names


def _devices(raw: RawFile, frame: pd.DataFrame, column: str | None, device: str | None,
             layout: str) -> pd.Series:
    """The device label of each row: the CSV's `column` where it has one, else --device."""
    labels = (frame[column].astype(str).str.strip() if column
              else pd.Series("", index=frame.index))
    labels = labels.mask(labels == "", device or "")
    if (labels == "").any():
        rows = list(_lines(frame)[labels == ""][:5])
        where = f" (blank device_name at row(s) {rows})" if column else ""
        raise TableDataError(f"{raw.path}: a CK tile-engine {layout} CSV names no device"
                             f"{where}; give --device NAME")
    return labels


def _problem_frame(raw: RawFile, frame: pd.DataFrame, names: Sequence[str]) -> pd.DataFrame:
    """The problem columns `names` of `frame` as stripped text (kinds are decided once every
    file is read); TableDataError naming blank fields."""
    check_names(names, raw.path)
    out = pd.DataFrame(index=frame.index)
    for name in names:
        text = frame[name].astype(str).str.strip()
        if (text == "").any():
            raise TableDataError(f"{raw.path}: column {name}: blank at row(s) "
                                 f"{list(_lines(frame)[text == ''][:5])}")
        out[name] = text
    return out


def _finish(raw, frame, problem_frame, names, labels, time_s, status, reason) -> pd.DataFrame:
    out = problem_frame.copy()
    out[KERNEL] = names
    out["device"] = labels
    out["time_s"] = time_s
    out["status"] = status
    out["reason"] = reason
    out["source"] = str(raw.path)
    out["row"] = _lines(frame).astype(str)
    return out


# -- the layouts ---------------------------------------------------------------------------

def _read_profiler(raw: RawFile, frame: pd.DataFrame, device: str | None) -> Parsed:
    columns = list(frame.columns)
    if "name" not in columns:
        raise TableDataError(f"{raw.path}: no name column: this tile engine's CSV records only "
                             "the best kernel's time of each problem, not which kernel; rerun "
                             "with a tile engine that writes `name`")
    start, end = columns.index("device_name") + 1, columns.index("name")
    if end <= start:
        raise TableDataError(f"{raw.path}: the problem columns lie between device_name and name,"
                             " but name comes first")
    problem = tuple(columns[start:end])
    problem_frame = _problem_frame(raw, frame, problem)
    latency = numbers(frame, "latency(ms)", raw.path, _lines(frame))
    zero = latency <= 0
    if zero.any():
        raise TableDataError(f"{raw.path}: column latency(ms): not a positive time at row(s) "
                             f"{list(_lines(frame)[zero][:5])} (a tile engine that printed two "
                             "decimals writes 0.00 for a kernel under 5 us; rerun with a newer "
                             "one)")
    out = _finish(raw, frame, problem_frame, _kernel_names(raw, frame, "name"),
                  _devices(raw, frame, "device_name", device, "profiler"), latency * MS,
                  "ok", "")
    return Parsed(out, problem, "gemm")


def _read_sweep(raw: RawFile, frame: pd.DataFrame, device: str | None) -> Parsed:
    problems, names = [], None
    for line, text in zip(_lines(frame), frame["problem"]):
        try:
            problem = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            problem = None
        if not isinstance(problem, dict) or not problem:
            raise TableDataError(f"{raw.path} row {line}: column problem: {text[:60]!r} is not "
                                 "a dict of the problem's fields")
        if names is None:
            names = tuple(str(k) for k in problem)
        elif tuple(str(k) for k in problem) != names:
            raise TableDataError(f"{raw.path} row {line}: column problem: fields "
                                 f"{list(problem)} differ from the first row's {list(names)}")
        problems.append({str(k): str(v) for k, v in problem.items()})
    problem_frame = _problem_frame(raw, pd.DataFrame(problems, index=frame.index), names)
    time_ms = numbers(frame, "time_ms", raw.path, _lines(frame))
    if (time_ms < 0).any():
        raise TableDataError(f"{raw.path}: column time_ms: negative at row(s) "
                             f"{list(_lines(frame)[time_ms < 0][:5])}")
    failed = time_ms == 0
    out = _finish(raw, frame, problem_frame, _kernel_names(raw, frame, "name"),
                  _devices(raw, frame, None, device, "sweep"), (time_ms * MS).where(~failed),
                  failed.map({True: "failed", False: "ok"}),
                  failed.map({True: "time_ms 0: the sweep got no result", False: ""}))
    return Parsed(out, problem, "gemm")


def _read_grouped_conv(raw: RawFile, frame: pd.DataFrame, device: str | None) -> Parsed:
    from tilecast.core.dataset import DatasetError
    from tilecast.spaces.grouped_conv import TileEngineConvConfig
    from tilecast.stages.convert_ck_rows import SHAPE_COLUMNS, parse_conv_csv

    try:   # the one parser of these CSVs, which `tilecast convert --from ck-csv` reads with
        parsed = parse_conv_csv(raw.path, frame)
    except DatasetError as err:
        raise TableDataError(str(err).removesuffix("; no file written")) from None
    own = [name for name, cfg in parsed.configs.items()
           if not isinstance(cfg, TileEngineConvConfig)]
    if own:
        raise TableDataError(f"{raw.path}: column kernel: {own[0]!r} is one of tilecast's own "
                             "kernels, not the tile engine's; use `tilecast convert`")
    rows = parsed.rows.set_index(frame.index)
    unusable = parsed.unusable()
    if unusable:
        raise TableDataError(f"{raw.path}: column latency_ms: not a positive number at row(s) "
                             f"{named_rows(*zip(*unusable))}")
    configs = [parsed.configs[name] for name in rows["kernel"]]
    derived = pd.DataFrame({"direction": [cfg.direction for cfg in configs],
                            "dtype": [cfg.dtype for cfg in configs],
                            "ndim": [str(cfg.ndim_spatial) for cfg in configs]},
                           index=frame.index)
    shapes = rows[list(SHAPE_COLUMNS)].map(lambda value: "" if value is None else str(value))
    problem = ("direction", "dtype", "ndim", *SHAPE_COLUMNS)
    problem_frame = _problem_frame(raw, pd.concat([derived, shapes], axis=1), problem)
    wrong = ~rows["non_zero"]
    # a wrong result's latency is kept as a sample, as convert_ck keeps it (core.columns:
    # samples_s); its slot fails, so no time of it counts (collapse_rows)
    out = _finish(raw, frame, problem_frame, rows["kernel"],
                  _devices(raw, frame, None, device, "grouped-conv"),
                  rows["latency_s"], wrong.map({True: "wrong_result", False: "ok"}),
                  wrong.map({True: "all-zero output (non_zero false)", False: ""}))
    return Parsed(out, problem, "grouped-conv")


# a layout is recognised by a few of its columns; its reader asks for the rest by name
LAYOUTS = (
    Layout("profiler", ("device_name", "latency(ms)"), _read_profiler),
    Layout("sweep", ("name", "problem", "time_ms"), _read_sweep),
    Layout("grouped-conv", ("kernel", "latency_ms"), _read_grouped_conv),
)


# -- configuration columns from kernel names ------------------------------------------------

def gemm_fields(name: str) -> dict | None:
    """The configuration fields a tile-engine GEMM kernel name spells, None when it does not
    follow the grammar (the module docstring)."""
    match = GEMM_NAME_RE.match(name)
    if not match:
        return None
    g = match.groupdict()
    pipeline, _, rest = g["traits"].rpartition("_")
    pipeline, _, epilogue = pipeline.rpartition("_")
    scheduler = rest
    if not pipeline or epilogue not in GEMM_EPILOGUES or scheduler not in GEMM_SCHEDULERS:
        return None
    return {"pipeline": pipeline, "epilogue": epilogue, "scheduler": scheduler,
            **{f: int(g[f] == "True") for f in GEMM_FLAGS},
            **{f: int(g[f]) for f in GEMM_TILES}}


def conv_fields(name: str) -> dict:
    """The configuration fields of a tile-engine grouped-conv kernel name."""
    from tilecast.spaces.grouped_conv import parse_kernel_name

    cfg = parse_kernel_name(name)
    return {"block": cfg.block, "tile_m": cfg.tile_m, "tile_n": cfg.tile_n,
            "pipeline": cfg.pipeline, "wave_mode": cfg.wave_mode or "none",
            "has_dsb": int(cfg.has_dsb), "has_si": int(cfg.has_si)}


# grammar -> (fields of one kernel name or None, the columns they fill)
NAME_GRAMMARS = {"gemm": (gemm_fields, GEMM_CONFIG),
                 "grouped-conv": (conv_fields, CONV_CONFIG)}


def _config(frame: pd.DataFrame, grammar: str) -> tuple[tuple[Column, ...], pd.DataFrame]:
    """The configuration columns: kernel_name, and the parameters the names encode when every
    name parses."""
    parse, columns = NAME_GRAMMARS[grammar]
    fields = {name: parse(name) for name in dict.fromkeys(frame[KERNEL])}
    unparsed = [name for name, value in fields.items() if value is None]
    if unparsed:
        log.info("%d kernel name(s) do not follow the %s grammar (e.g. %r): the configuration "
                 "is the kernel name alone", len(unparsed), grammar, unparsed[0])
        return (Column(KERNEL, "categorical"),), pd.DataFrame(index=frame.index)
    values = pd.DataFrame([fields[name] for name in frame[KERNEL]], index=frame.index)
    return ((Column(KERNEL, "categorical"),) + tuple(Column(n, k) for n, k in columns),
            values[[n for n, _ in columns]])
