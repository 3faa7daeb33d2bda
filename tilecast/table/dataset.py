"""An imported dataset: other people's measurements, one row per (device, problem, configuration).

`tilecast import` writes one directory: `measurements.parquet` (the rows) and `dataset.json`
(the manifest: which columns are problem dimensions, which are configuration parameters, what
kind each is, the devices, the source files). The table family, its training, evaluation and
dispatch read it through `read_dataset`; nothing else writes it but `write_dataset`.

Row columns (ROW_COLUMNS) are fixed: the measurement columns every measurement row shares
(tilecast.core.columns: dims_key, kernel, status, reason, samples_s, median_s, mad_s, spelled
and meant as in a benchmark record) between the `device` (and its label) and where the row
came from (`source`, `row`). Version 1 spelled the time `time_s` and kept `repeats` and
`spread` (max/min) instead of the samples and their MAD; it reads, renamed (`upgrade_v1`).
The problem and configuration columns are named by the source (a Kernel Tuner tunable
parameter, an AutoHeuristic feature, a mapped table column) and must not collide with the
fixed ones or each other. `dims_key` and `kernel` are the canonical
`name=value,...` spellings of the problem and the configuration (`key_of`), so one
configuration is one string everywhere (a dataset row, a model's candidate list, a dispatcher's
answer). A directory is written whole into a temporary sibling and renamed into place: a
failed or killed import leaves the previous dataset (or nothing) behind, never half of one.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from tilecast.core import stats
from tilecast.core.atomic import atomic_write_json, make_temp_dir
from tilecast.core.columns import MEASUREMENT_NAMES
from tilecast.core.dataset import TABLE_STATUSES, current_statuses

FORMAT = "tilecast-table-dataset"
# 2: the measurement columns are core.columns' (time_s -> median_s; samples_s and mad_s
# instead of repeats and spread); a version-1 directory reads through `upgrade_v1`
VERSION = 2
READABLE_VERSIONS = (1, VERSION)
ROWS_FILE = "measurements.parquet"
MANIFEST_FILE = "dataset.json"

# What happened to one configuration on one device: tilecast's one vocabulary
# (core.dataset.STATUS_TABLE), the names a table row may hold. `ok` is the only status whose
# time counts; the others are kept so that a model never chooses what failed there.
STATUSES = TABLE_STATUSES
KINDS = ("numeric", "categorical")

ROW_COLUMNS = ("device", "device_label") + MEASUREMENT_NAMES + ("source", "row")
# Version 1's spellings of the measurement columns (`upgrade_v1` reads them).
V1_RENAMED = {"time_s": "median_s"}
# how many offending rows a message names before "..."
SHOWN = 5


class TableDataError(ValueError):
    """Bad input for an import or a damaged dataset: the message names the file, the row and
    the column where it can, and what is allowed."""


@dataclass(frozen=True)
class Column:
    """One problem or configuration column: `numeric` (ints, floats, booleans as 0/1) or
    `categorical` (strings). `partial`: a problem column some sources lack; their rows hold
    it missing (NaN, or "" when categorical), and a query may leave it out."""
    name: str
    kind: str
    partial: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TableDataError(f"column {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if not self.name or self.name in ROW_COLUMNS:
            raise TableDataError(f"column name {self.name!r} is empty or one of tilecast's own "
                                 f"({', '.join(ROW_COLUMNS)}); rename it in the mapping")


@dataclass(frozen=True)
class TableSchema:
    """Which columns describe the problem and which the configuration, in key order."""
    problem: tuple[Column, ...]
    config: tuple[Column, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.problem + self.config]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise TableDataError(f"column(s) {repeated} named twice among the problem and "
                                 "configuration columns; each column is one or the other")
        if not self.config:
            raise TableDataError("no configuration columns: nothing to choose between")

    @property
    def problem_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.problem)

    @property
    def config_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.config)

    def to_json(self) -> dict:
        def column(c: Column) -> dict:
            return {"name": c.name, "kind": c.kind, **({"partial": True} if c.partial else {})}

        return {"problem": [column(c) for c in self.problem],
                "config": [column(c) for c in self.config]}

    def union(self, other: "TableSchema") -> tuple["TableSchema", list[str]]:
        """The schema of both sets of rows: every problem column of either (this one's order
        first), partial where one of them lacks it, and the configuration columns, which must
        agree; the columns that became partial. TableDataError for a column of two kinds or
        configurations that differ."""
        if self.config_names != other.config_names:
            raise TableDataError(f"configuration columns {list(self.config_names)} and "
                                 f"{list(other.config_names)} differ: their choices are not "
                                 "the same kind of thing; import them into separate datasets")
        mine, theirs = {c.name: c for c in self.problem}, {c.name: c for c in other.problem}
        columns, became = [], []
        for name in list(mine) + [n for n in theirs if n not in mine]:
            a, b = mine.get(name), theirs.get(name)
            if a is not None and b is not None and a.kind != b.kind:
                raise TableDataError(f"problem column {name!r} is {a.kind} in one source and "
                                     f"{b.kind} in the other: make its values agree (numbers "
                                     "in both, or words in both) before importing")
            partial = a is None or b is None or a.partial or b.partial
            if partial and not ((a is not None and a.partial) or (b is not None and b.partial)):
                became.append(name)
            columns.append(Column(name, (a or b).kind, partial))
        config = tuple(Column(c.name, c.kind) for c in self.config)
        return TableSchema(problem=tuple(columns), config=config), became

    @classmethod
    def from_json(cls, document: Mapping) -> "TableSchema":
        return cls(problem=tuple(Column(**c) for c in document.get("problem", [])),
                   config=tuple(Column(**c) for c in document["config"]))


def infer_kind(values: Iterable[Any]) -> str:
    """`numeric` when every present value is a number or boolean (or a string spelling one),
    else `categorical`."""
    for value in values:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if isinstance(value, (bool, int, float, np.integer, np.floating)):
            continue
        try:
            float(str(value))
        except ValueError:
            return "categorical"
    return "numeric"


def _spell(value: Any) -> str:
    """One value as it appears in a key: whole numbers without a fraction (64, never 64.0),
    other numbers by repr, strings with `%`, `,` and `=` escaped."""
    if isinstance(value, (bool, np.bool_)):
        return str(int(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)
    text = str(value)
    return text.replace("%", "%25").replace(",", "%2C").replace("=", "%3D")


def key_of(names: Sequence[str], values: Mapping[str, Any]) -> str:
    """The canonical `name=value,...` key of `values` in the order of `names` ("-" when there
    are no names: a dataset of one problem)."""
    if not names:
        return "-"
    return ",".join(f"{name}={_spell(values[name])}" for name in names)


def parse_key(key: str, columns: Sequence[Column]) -> dict[str, Any]:
    """The values of a key written by `key_of` (numbers as int or float, strings unescaped);
    TableDataError when its names are not `columns`' in order."""
    if key == "-" and not columns:
        return {}
    parts = [part.split("=", 1) for part in key.split(",")] if key else []
    names = [part[0] for part in parts]
    if names != [c.name for c in columns] or any(len(part) != 2 for part in parts):
        raise TableDataError(f"key {key!r} does not spell the columns "
                             f"{[c.name for c in columns]} in order as name=value,...")
    values = {}
    for column, (name, text) in zip(columns, parts):
        text = text.replace("%3D", "=").replace("%2C", ",").replace("%25", "%")
        if column.kind == "numeric":
            number = float(text)
            values[name] = int(number) if number.is_integer() and "." not in text else number
        else:
            values[name] = text
    return values


@dataclass
class TableDataset:
    """An imported dataset in memory: its rows, schema and manifest."""
    frame: pd.DataFrame
    schema: TableSchema
    manifest: dict = field(default_factory=dict)

    @property
    def devices(self) -> list[str]:
        return sorted(self.frame["device"].unique())

    def ok(self) -> pd.DataFrame:
        """The rows whose time counts."""
        return self.frame[self.frame["status"] == "ok"]


def _not_given(value: Any) -> bool:
    """Whether one row's `samples_s` was not given: None, or the NaN a frame holds for a row
    whose dict lacked it."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _samples(value: Any) -> list[float]:
    """The usable times (positive, finite) of one row's `samples_s`, as a list of floats."""
    if _not_given(value):
        return []
    return [float(t) for t in value if math.isfinite(float(t)) and float(t) > 0]


def measured(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with its measurement columns' types and meanings fixed (core.columns):
    `median_s` a float, `samples_s` the usable times given (a row not given any holds its
    one time when it has one: the source's one measurement), `mad_s` their MAD
    (core.stats.mad), NaN for a row that is not ok or has no sample. The one place a table
    row's samples and spread are derived."""
    frame = frame.copy()
    frame["median_s"] = pd.to_numeric(frame["median_s"], errors="coerce").astype(float)
    given = frame["samples_s"] if "samples_s" in frame.columns else [None] * len(frame)
    samples = []
    for value, median_s in zip(given, frame["median_s"]):
        usable = _samples(value)
        if _not_given(value) and math.isfinite(median_s) and median_s > 0:
            usable = [float(median_s)]
        samples.append(usable)
    frame["samples_s"] = samples
    ok = (frame["status"] == "ok").to_numpy()
    frame["mad_s"] = [stats.mad(values) if values and good else math.nan
                      for values, good in zip(samples, ok)]
    return frame


def upgrade_v1(frame: pd.DataFrame) -> pd.DataFrame:
    """A version-1 dataset's rows with version 2's measurement columns: `time_s` renamed
    `median_s` (V1_RENAMED); `repeats` and `spread` (max/min) dropped, since version 1 kept
    no samples: a row of one measurement (`repeats` 0 or 1) holds its time as its one sample
    (MAD 0), a row of several holds none (its MAD NaN). The one place a version-1 dataset's
    columns are read."""
    frame = frame.rename(columns=V1_RENAMED)
    single = frame["repeats"].fillna(0).astype(int) <= 1 if "repeats" in frame.columns \
        else pd.Series(True, index=frame.index)
    frame["samples_s"] = [None if one else [] for one in single]
    return measured(frame.drop(columns=[c for c in ("repeats", "spread") if c in frame.columns]))


def finish_frame(rows: Sequence[Mapping[str, Any]], schema: TableSchema) -> pd.DataFrame:
    """The dataset frame of `rows` (dicts with the problem and configuration columns, `device`,
    `median_s`, `status`, and optionally `device_label`, `reason`, `samples_s`, `source`,
    `row`): keys computed, types fixed, samples and their MAD filled in (`measured`), statuses
    of the old vocabulary renamed (core.dataset.current_statuses), checked by `check_frame`."""
    frame = pd.DataFrame(list(rows))
    if frame.empty:
        raise TableDataError("no measurements: the input holds no rows")
    defaults = {"device_label": None, "reason": "", "samples_s": None, "source": "", "row": ""}
    for name, default in defaults.items():
        if name not in frame.columns:
            frame[name] = default
    frame["device_label"] = frame["device_label"].fillna(frame["device"])
    for column in schema.problem + schema.config:
        if column.name not in frame.columns:
            if not column.partial:
                raise TableDataError(f"rows lack the column {column.name!r}")
            frame[column.name] = math.nan
        if column.kind == "numeric":
            frame[column.name] = pd.to_numeric(frame[column.name], errors="raise")
        else:
            values = frame[column.name]
            frame[column.name] = values.where(values.notna(), "").astype(str) \
                if column.partial else values.astype(str)
    records = frame[list(schema.problem_names + schema.config_names)].to_dict("records")
    frame["dims_key"] = [key_of(schema.problem_names, r) for r in records]
    frame["kernel"] = [key_of(schema.config_names, r) for r in records]
    for name in ("device", "device_label", "status", "reason", "source", "row"):
        frame[name] = frame[name].astype(str)
    frame["status"] = current_statuses(frame["status"])
    frame = measured(frame)
    order = list(ROW_COLUMNS) + [n for n in schema.problem_names + schema.config_names]
    frame = frame[order]
    check_frame(frame, schema)
    return frame.reset_index(drop=True)


def _where(frame: pd.DataFrame, mask) -> str:
    rows = frame[mask]
    shown = [f"{r.source} row {r.row}" for r in rows.head(SHOWN).itertuples()]
    more = f" and {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
    return "; ".join(shown) + more


def check_frame(frame: pd.DataFrame, schema: TableSchema) -> None:
    """TableDataError naming the rows when a status is unknown, an `ok` time is missing, NaN,
    zero or negative, a problem or configuration value is missing, or one (device, problem,
    configuration) appears twice."""
    bad_status = ~frame["status"].isin(STATUSES)
    if bad_status.any():
        raise TableDataError(f"unknown status {sorted(set(frame['status'][bad_status]))} at "
                             f"{_where(frame, bad_status)}; valid: {', '.join(STATUSES)}")
    times = frame["median_s"]
    bad_time = (frame["status"] == "ok") & ~(np.isfinite(times) & (times > 0))
    if bad_time.any():
        raise TableDataError(f"column time: not a positive finite number at "
                             f"{_where(frame, bad_time)}")
    for column in schema.problem + schema.config:
        values = frame[column.name]
        missing = values.isna() | (values.astype(str).str.strip() == "") \
            if column.kind == "categorical" else ~np.isfinite(values.astype(float))
        if column.partial:   # missing where a source lacks it: only an infinity is wrong
            missing = values.isna() & False if column.kind == "categorical" \
                else np.isinf(values.astype(float))
        if missing.any():
            raise TableDataError(f"column {column.name}: missing or not a finite value at "
                                 f"{_where(frame, missing)}")
    repeated = frame.duplicated(["device", "dims_key", "kernel"], keep=False)
    if repeated.any():
        raise TableDataError("the same configuration of the same problem on the same device "
                             f"appears more than once: {_where(frame, repeated)}")


def read_dataset(path: str | Path) -> TableDataset:
    """The dataset in directory `path`, checked; TableDataError saying what is wrong. A dataset
    written before the one status vocabulary reads with its statuses renamed
    (core.dataset.current_statuses: `compile_failed` is `build_failed`, ...), a version-1
    dataset with its measurement columns renamed (`upgrade_v1`; its manifest, in memory, then
    says version 2 and `upgraded_from` 1)."""
    path = Path(path)
    manifest_path, rows_path = path / MANIFEST_FILE, path / ROWS_FILE
    if not manifest_path.is_file() or not rows_path.is_file():
        raise TableDataError(f"{path} is not an imported dataset (no {MANIFEST_FILE} and "
                             f"{ROWS_FILE}); create one with `tilecast import`")
    try:
        manifest = json.loads(manifest_path.read_text())
        schema = TableSchema.from_json(manifest)
    except (ValueError, KeyError, TypeError) as err:
        raise TableDataError(f"{manifest_path} is damaged: {err}") from None
    version = manifest.get("version")
    if manifest.get("format") != FORMAT or version not in READABLE_VERSIONS:
        raise TableDataError(f"{manifest_path} is not a {FORMAT} manifest of a version this "
                             f"tilecast reads ({', '.join(map(str, READABLE_VERSIONS))}): format "
                             f"{manifest.get('format')!r}, version {version!r}")
    try:
        frame = pd.read_parquet(rows_path)
    except (OSError, ValueError) as err:
        raise TableDataError(f"{rows_path} is not a readable parquet file: {err}") from None
    stored = tuple(V1_RENAMED.get(c, c) for c in frame.columns) if version == 1 \
        else tuple(frame.columns)
    missing = [c for c in ROW_COLUMNS + schema.problem_names + schema.config_names
               if c not in stored and not (version == 1 and c in ("samples_s", "mad_s"))]
    if missing:
        raise TableDataError(f"{rows_path} lacks columns {missing}")
    if len(frame) != manifest.get("rows"):
        raise TableDataError(f"{rows_path} holds {len(frame)} rows, its manifest says "
                             f"{manifest.get('rows')}: the dataset is damaged; import again")
    frame["status"] = current_statuses(frame["status"])
    if version == 1:
        frame = upgrade_v1(frame)
        manifest = {**manifest, "version": VERSION, "upgraded_from": 1}
    else:
        frame["samples_s"] = [_samples(value) for value in frame["samples_s"]]
    order = list(ROW_COLUMNS) + [c for c in frame.columns if c not in ROW_COLUMNS]
    frame = frame[order]
    check_frame(frame, schema)
    return TableDataset(frame=frame, schema=schema, manifest=manifest)


def merge(old: TableDataset, frame: pd.DataFrame,
          schema: TableSchema) -> tuple[pd.DataFrame, TableSchema, list[str]]:
    """`old`'s rows followed by `frame`'s, under the union of their schemas (TableSchema.union:
    a problem column one side lacks is missing there), and the columns that became partial;
    TableDataError when the configuration columns differ, a column has two kinds, or
    (through check_frame) a new row repeats an old one."""
    union, became = old.schema.union(schema)
    both = pd.concat([old.frame, frame], ignore_index=True)
    if union != old.schema or union != schema:
        both = finish_frame(both.drop(columns=["dims_key", "kernel"]).to_dict("records"), union)
    check_frame(both, union)
    return both, union, became


def write_dataset(path: str | Path, frame: pd.DataFrame, schema: TableSchema,
                  sources: Sequence[Mapping[str, Any]], *, name: str | None = None) -> Path:
    """Write the dataset directory `path` whole: into a temporary sibling, then renamed into
    place (an existing dataset there is replaced only once the new one is complete). `path`
    must not be a non-empty directory that is not a dataset, nor a file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise TableDataError(f"--out {path} is a file; give a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / MANIFEST_FILE).is_file():
        raise TableDataError(f"--out {path} is a non-empty directory that is not an imported "
                             "dataset; give a new or empty directory")
    check_frame(frame, schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = make_temp_dir(path.parent, f".{path.name}.importing.")
    try:
        frame.to_parquet(staging / ROWS_FILE, index=False)
        counts = frame.groupby("device")["status"].value_counts().unstack(fill_value=0)
        manifest = {
            "format": FORMAT, "version": VERSION, "name": name or path.name,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "rows": int(len(frame)), **schema.to_json(),
            "devices": {device: {s: int(n) for s, n in row.items()}
                        for device, row in counts.iterrows()},
            "problems": int(frame["dims_key"].nunique()),
            "configurations": int(frame["kernel"].nunique()),
            "sources": list(sources),
        }
        atomic_write_json(staging / MANIFEST_FILE, manifest)
        _swap_into_place(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def _swap_into_place(staging: Path, path: Path) -> None:
    """Rename the complete `staging` directory to `path`; an old directory there is moved
    aside first and removed only after the new one is in place."""
    if not path.exists():
        os.rename(staging, path)
        return
    aside = make_temp_dir(path.parent, f".{path.name}.old.")
    os.rmdir(aside)
    os.rename(path, aside)
    try:
        os.rename(staging, path)
    except BaseException:
        os.rename(aside, path)
        raise
    shutil.rmtree(aside, ignore_errors=True)
