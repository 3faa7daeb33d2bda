"""Any table (CSV, or parquet, told apart by its magic bytes; either may be gzipped) read
through a YAML mapping that names its columns:

    problem: [m, n, k]                    # problem dimension columns (may be empty)
    config: [tile_m, tile_n, algo]        # configuration parameter columns
    time: {column: latency, unit: ms}     # s, ms, us, ns
    device: {column: gpu}                 # or {value: A100}; or none, and --device
    status: {column: state, ok: [ok, success]}   # optional

A column is numeric when every value is a number (or true/false), else categorical. With a
status mapping, a row whose status is not one of `ok` is not timed: its status is the value
itself where that is one of tilecast's (core.dataset.STATUS_TABLE: build_failed, unsupported,
wrong_result, timeout, crashed; the older names invalid, compile_failed and runtime_failed are
read as unsupported, build_failed and crashed), else `failed`, and the value is kept as the
reason. Rows are named by CSV line (the header is line 1) or parquet row
index. The mapping is checked whole first (TableMapping: unknown or missing keys, a unit that
is not one of the four, a column named twice), each message naming the file and the key.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Literal, Mapping, Sequence

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tilecast.core.dataset import LEGACY_STATUSES
from tilecast.table.dataset import STATUSES, TableDataError, TableSchema
from tilecast.table.formats.common import (SECONDS_PER_UNIT, Imported, RawFile, check_names,
                                           numbers, read_csv_text, read_raw, require_columns,
                                           source_entry, typed_column)

FORMAT = "table"
# the status values a row may give as they are (finish_frame renames the older ones)
NAMED_FAILURES = frozenset(STATUSES) - {"ok"} | frozenset(LEGACY_STATUSES)
WHAT = "a CSV or parquet table"
PARQUET_MAGIC = b"PAR1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TimeMapping(_Strict):
    column: str = Field(min_length=1)
    unit: Literal[tuple(SECONDS_PER_UNIT)]


class DeviceMapping(_Strict):
    column: str | None = Field(default=None, min_length=1)
    value: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _one_of(self) -> "DeviceMapping":
        if (self.column is None) == (self.value is None):
            raise ValueError("give exactly one of column (a column naming each row's device) "
                             "and value (the device of every row)")
        return self


class StatusMapping(_Strict):
    column: str = Field(min_length=1)
    ok: list[str] = Field(min_length=1)


class TableMapping(_Strict):
    """Which columns of a table are what (see the module docstring)."""
    problem: list[str] = Field(default_factory=list)
    config: list[str] = Field(min_length=1)
    time: TimeMapping
    device: DeviceMapping | None = None
    status: StatusMapping | None = None

    @model_validator(mode="after")
    def _each_column_once(self) -> "TableMapping":
        roles = [(name, "problem") for name in self.problem] + \
                [(name, "config") for name in self.config] + [(self.time.column, "time")]
        roles += [(self.device.column, "device")] if self.device and self.device.column else []
        roles += [(self.status.column, "status")] if self.status else []
        seen: dict[str, str] = {}
        for name, role in roles:
            if name in seen:
                raise ValueError(f"column {name!r} is both {seen[name]} and {role}; a column has "
                                 "one role")
            seen[name] = role
        return self


def validate_mapping(document: object, where: str) -> TableMapping:
    """`document` as a TableMapping; TableDataError listing each problem as `where: key: what`."""
    try:
        return TableMapping.model_validate(document)
    except ValidationError as err:
        problems = []
        for item in err.errors(include_url=False):
            key = ".".join(str(part) for part in item["loc"]) or "(top level)"
            message = item["msg"].removeprefix("Value error, ")
            if item["type"] not in ("missing", "value_error"):
                message += f", got {item.get('input')!r}"
            problems.append(f"key {key}: {message}")
        raise TableDataError(f"{where}: " + "; ".join(problems)) from None


def load_mapping(path: str | Path) -> dict:
    """The mapping in YAML file `path`, checked; TableDataError naming the file and the key."""
    import yaml

    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise TableDataError(f"cannot read mapping {path}: {err.strerror or err}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise TableDataError(f"mapping {path} is not valid YAML: {err}") from None
    if not isinstance(document, dict):
        raise TableDataError(f"mapping {path}: expected keys problem, config, time (and device, "
                             f"status), got {type(document).__name__}")
    return validate_mapping(document, f"mapping {path}").model_dump()


def read(paths: Sequence[Path], *, mapping: Mapping | None, device: str | None) -> Imported:
    """The rows of the tables `paths`, read through `mapping` (see the module docstring)."""
    if not mapping:
        raise TableDataError("--from table needs --mapping MAP.yaml naming the problem, "
                             "configuration, time and device columns")
    spec = validate_mapping(dict(mapping), "mapping")
    check_names(spec.problem + spec.config, Path("the mapping"))
    frames, sources = [], []
    for path in paths:
        raw = read_raw(path)
        frame, lines = _table(raw)
        frames.append(_rows(raw, frame, lines, spec, device))
        sources.append(source_entry(raw, FORMAT, frames[-1]["status"]))
    frame = pd.concat(frames, ignore_index=True)
    problem = tuple(typed_column(frame, name) for name in spec.problem)
    config = tuple(typed_column(frame, name) for name in spec.config)
    return Imported(schema=TableSchema(problem=problem, config=config),
                    rows=frame.to_dict("records"), sources=sources)


def _table(raw: RawFile) -> tuple[pd.DataFrame, pd.Series]:
    """The table in `raw` and the name of each row (CSV line or parquet row index)."""
    if raw.data.startswith(PARQUET_MAGIC):
        try:
            frame = pd.read_parquet(io.BytesIO(raw.data))
        except (OSError, ValueError) as err:
            raise TableDataError(f"{raw.path}: not a readable parquet file ({err})") from None
        if frame.empty:
            raise TableDataError(f"{raw.path}: a parquet table without rows")
        frame = frame.reset_index(drop=True)
        frame.columns = [str(c).strip() for c in frame.columns]
        return frame, pd.Series(range(len(frame)), index=frame.index)
    frame = read_csv_text(raw, WHAT)
    return frame, pd.Series(range(2, 2 + len(frame)), index=frame.index)


def _rows(raw: RawFile, frame: pd.DataFrame, lines: pd.Series, spec: TableMapping,
          device: str | None) -> pd.DataFrame:
    needed = spec.problem + spec.config + [spec.time.column]
    needed += [spec.device.column] if spec.device and spec.device.column else []
    needed += [spec.status.column] if spec.status else []
    require_columns(frame, needed, raw.path, "the mapping's table")
    out = pd.DataFrame(index=frame.index)
    for name in spec.problem + spec.config:
        text = frame[name].astype(str).str.strip()
        blank = (text == "") | frame[name].isna()
        if blank.any():
            raise TableDataError(f"{raw.path}: column {name}: blank at row(s) "
                                 f"{list(lines[blank][:5])}")
        out[name] = text
    ok = pd.Series(True, index=frame.index)
    out["status"], out["reason"] = "ok", ""
    if spec.status:
        value = frame[spec.status.column].astype(str).str.strip()
        ok = value.isin(spec.status.ok)
        out["status"] = value.where(value.isin(NAMED_FAILURES), "failed").mask(ok, "ok")
        out["reason"] = (spec.status.column + "=" + value).where(~ok, "")
    out["median_s"] = float("nan")    # one measurement a row: its time
    if ok.any():
        seconds = numbers(frame[ok], spec.time.column, raw.path, lines[ok], positive=True)
        out.loc[ok, "median_s"] = seconds * SECONDS_PER_UNIT[spec.time.unit]
    out["device"] = _devices(raw, frame, lines, spec, device)
    out["source"] = str(raw.path)
    out["row"] = lines.astype(str)
    return out


def _devices(raw: RawFile, frame: pd.DataFrame, lines: pd.Series, spec: TableMapping,
             device: str | None) -> pd.Series:
    if spec.device and spec.device.value:
        return pd.Series(spec.device.value, index=frame.index)
    if spec.device:
        labels = frame[spec.device.column].astype(str).str.strip()
        labels = labels.mask((labels == "") | frame[spec.device.column].isna(), device or "")
        if (labels == "").any():
            raise TableDataError(f"{raw.path}: column {spec.device.column}: no device at row(s) "
                                 f"{list(lines[labels == ''][:5])}; fill it in or give --device")
        return labels
    if not device:
        raise TableDataError(f"{raw.path}: the mapping names no device (device: {{column: ...}} "
                             "or {value: ...}); give one there or --device NAME")
    return pd.Series(device, index=frame.index)

