"""The measurement store's record schema: a dataset row of any family as one fixed arrow schema.

A store holds every family's records in one pyarrow dataset, so the family-specific columns
(problem fields, kernel config fields, the harness's extras) travel as JSON text: `problem`
(the family's problem fields) and `extra` (every other column of the dataset row). The rest
are the dataset's common columns (tilecast.core.dataset.RECORD_COLUMNS) plus what makes a
record a store's: its `hardware_class`, the store schema version and a `record_id` that is
the same wherever and however often the record is written (a hash of convert's
RECORD_IDENTITY), so that a record appended twice is read once.

`to_table` and `to_frame` are inverses on a dataset frame: the dataset frame a night's
convert stage wrote comes back from the store with the same columns and values.
"""
from __future__ import annotations

import hashlib
import json
import math

import pandas as pd
import pyarrow as pa

from tilecast.core import dataset
from tilecast.stages.convert import RECORD_IDENTITY

# 1: the first layout (STORE.json, records/class=/family=/night=/<digest>.parquet)
STORE_VERSION = 1

# columns of the dataset row stored as they are (the rest go to `extra`)
_TEXT = ("run_id", "time", "git_sha", "hardware", "family", "problem_set", "dims_key", "kernel",
         "role", "phase", "status", "reason", "timing", "protocol_hash", "build_key")
_FLOAT = ("median_s", "mad_s", "tflops", "gbps", "max_error", "reps_per_sample")
_INT = ("threads",)

SCHEMA = pa.schema(
    [("store_version", pa.int16()), ("record_id", pa.string()), ("hardware_class", pa.string())]
    + [(c, pa.string()) for c in _TEXT]
    + [(c, pa.float64()) for c in _FLOAT]
    + [(c, pa.int64()) for c in _INT]
    + [("samples_s", pa.list_(pa.float64())), ("problem", pa.string()), ("extra", pa.string())])
COLUMNS = tuple(SCHEMA.names)

# what makes a measurement itself: convert's identity of a record
IDENTITY = RECORD_IDENTITY


class RecordError(ValueError):
    """Records that cannot go into (or come out of) a store as they are."""


def _digest(values) -> str:
    return hashlib.sha256("\x1f".join(values).encode()).hexdigest()[:32]


def record_id(row: dict) -> str:
    """The id of one measurement: the same for every copy of it, in any file or store."""
    return _digest(str(row.get(c)) for c in IDENTITY)


def _plain(value):
    """A JSON-ready value: numpy scalars and arrays made plain, NaN as None."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _json_rows(frame: pd.DataFrame, names: list[str]) -> list[str]:
    """Each row's `names` columns as JSON text (keys sorted, NaN as null)."""
    names = sorted(names)
    return [json.dumps(dict(zip(names, map(_plain, row))), default=str)
            for row in frame[names].itertuples(index=False, name=None)]


def to_table(frame: pd.DataFrame, problem_fields: tuple[str, ...], hardware_class: str) -> pa.Table:
    """A dataset frame of one family (tilecast.core.dataset's columns plus the family's) as
    store rows of `hardware_class`, in the store's SCHEMA."""
    missing = [c for c in dataset.RECORD_COLUMNS if c not in frame.columns]
    missing += [f for f in problem_fields if f not in frame.columns]
    if missing:
        raise RecordError(f"records lack column(s) {missing}; a store takes converted "
                          "benchmark records (tilecast convert)")
    families = sorted(set(frame["family"].astype(str)))
    if len(families) > 1:
        raise RecordError(f"records of several families {families}: append one family at a time")
    known = set(_TEXT) | set(_FLOAT) | set(_INT) | {"samples_s", "schema_version"}
    extra_columns = [c for c in frame.columns if c not in known and c not in problem_fields]
    frame = frame.reset_index(drop=True)
    # str() of each value as it is (None -> "None", as record_id does for a row): pandas'
    # astype(str) leaves a missing value missing under its string dtype
    identity = zip(*([str(v) for v in frame[c].astype(object)] for c in IDENTITY))
    columns: dict[str, object] = {
        "store_version": [STORE_VERSION] * len(frame),
        "record_id": [_digest(row) for row in identity],
        "hardware_class": [hardware_class] * len(frame)}
    for c in _TEXT:
        values = frame[c].astype(object)
        columns[c] = [None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
                      for v in values]
    for c in _FLOAT:
        columns[c] = pa.array(pd.to_numeric(frame[c], errors="coerce").astype("float64"),
                              from_pandas=True)   # NaN as null
    for c in _INT:
        columns[c] = pd.array(pd.to_numeric(frame[c], errors="coerce"), dtype="Int64")
    columns["samples_s"] = [[float(x) for x in v] if isinstance(v, (list, tuple)) or
                            hasattr(v, "tolist") else [] for v in frame["samples_s"]]
    columns["problem"] = _json_rows(frame, list(problem_fields))
    columns["extra"] = _json_rows(frame, extra_columns)
    return pa.table(columns, schema=SCHEMA)


def to_frame(table: pa.Table) -> pd.DataFrame:
    """Store rows as a dataset frame: the common columns, the problem fields and the extras
    as columns again (`hardware_class` and `record_id` kept beside them)."""
    frame = table.drop_columns(["problem", "extra", "store_version"]).to_pandas()
    frame["samples_s"] = [list(v) if v is not None else [] for v in frame["samples_s"]]
    frame["schema_version"] = dataset.SCHEMA_VERSION
    for name in ("problem", "extra"):
        expanded = pd.DataFrame.from_records([json.loads(t) if t else {} for t in
                                              table.column(name).to_pylist()], index=frame.index)
        for column in expanded.columns:
            if column not in frame.columns:
                frame[column] = expanded[column]
    return frame
