"""What the format readers share: the reader's answer (Imported), time units, reading a file's
bytes (gzip detected by its magic bytes) and CSV text with one-line errors, and collapsing the
repeated measurements a tool appends to one row each (core.dataset.collapse_repeats).

A reader reports each bad value with its file, row (a line number or a cache key) and column;
nothing here writes anything.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import logging
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from tilecast.core.dataset import collapse_repeats
from tilecast.table.dataset import SHOWN, Column, TableDataError, TableSchema

log = logging.getLogger("tilecast.table.import")

# seconds per unit; the one table every reader and the mapping's `time.unit` use
SECONDS_PER_UNIT = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class Imported:
    """What a reader found in its files: the schema, one row per (device label, problem,
    configuration) in `finish_frame`'s form, and one `sources` entry per file."""
    schema: TableSchema
    rows: list[dict]
    sources: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # said once at import (the summary line)


def seconds_per(unit: Any, where: str) -> float:
    """Seconds in one `unit` ("ms" -> 1e-3); TableDataError naming `where` and the valid units."""
    key = str(unit).strip()
    key = "us" if key in ("µs", "μs") else key
    if key not in SECONDS_PER_UNIT:
        raise TableDataError(f"{where}: unknown time unit {unit!r}; valid: "
                             f"{', '.join(SECONDS_PER_UNIT)}")
    return SECONDS_PER_UNIT[key]


@dataclass(frozen=True)
class RawFile:
    """A file's bytes as read (for its sha256) and as its format sees them (gunzipped)."""
    path: Path
    raw: bytes
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    def text(self, what: str) -> str:
        """The content as UTF-8 text; TableDataError when it is binary or another encoding."""
        nul = self.data.find(b"\0")
        if nul >= 0:
            raise TableDataError(f"{self.path}: binary data (a NUL byte at offset {nul}), "
                                 f"not {what}")
        try:
            return self.data.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            raise TableDataError(f"{self.path}: not UTF-8 text (byte 0x{err.object[err.start]:02x}"
                                 f" at offset {err.start}); expected {what}") from None


def read_raw(path: str | Path) -> RawFile:
    """The bytes of `path`, gunzipped when they start with gzip's magic bytes; TableDataError
    when it cannot be read, is empty, or is a damaged gzip file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise TableDataError(f"cannot read {path}: {err.strerror or err}") from None
    data = raw
    if raw.startswith(GZIP_MAGIC):
        try:
            data = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as err:
            raise TableDataError(f"{path}: a damaged gzip file ({err})") from None
    if not data.strip():
        raise TableDataError(f"{path}: empty file")
    return RawFile(path, raw, data)


def source_entry(raw: RawFile, fmt: str, statuses: Iterable[str]) -> dict:
    """The manifest's record of one file (path, format, sha256, how many rows it holds and how
    many are `ok`), logged as the file's progress line."""
    statuses = list(statuses)
    ok = sum(1 for status in statuses if status == "ok")
    log.info("%s: %d rows (%d ok, %d failed or invalid) read as %s", raw.path, len(statuses), ok,
             len(statuses) - ok, fmt)
    return {"path": str(raw.path), "format": fmt, "sha256": raw.sha256, "rows": len(statuses),
            "ok": ok}


def read_csv_text(raw: RawFile, what: str, *, skip_lines: int = 0) -> pd.DataFrame:
    """The CSV in `raw` (after `skip_lines` lines) with stripped column names, every field a
    string (the reader decides what is a number); TableDataError for empty or malformed CSV."""
    text = raw.text(what)
    try:
        frame = pd.read_csv(io.StringIO(text), skiprows=skip_lines, dtype=str,
                            keep_default_na=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        raise TableDataError(f"{raw.path}: no CSV header; expected {what}") from None
    except pd.errors.ParserError as err:
        raise TableDataError(f"{raw.path}: not a well-formed CSV ({str(err).strip()}); "
                             f"expected {what}") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    repeated = sorted({c for c in frame.columns if list(frame.columns).count(c) > 1})
    if repeated:
        raise TableDataError(f"{raw.path}: column(s) {repeated} appear twice in the header")
    if frame.empty:
        raise TableDataError(f"{raw.path}: a header but no rows; expected {what}")
    return frame


def require_columns(frame: pd.DataFrame, columns: Sequence[str], path: Path, what: str) -> None:
    """TableDataError naming the columns of `columns` that `frame` lacks."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise TableDataError(f"{path}: missing column(s) {missing}; {what} has "
                             f"{', '.join(columns)}")


def named_rows(lines: Sequence[Any], values: Sequence[Any]) -> str:
    """`line ('value'), ...` of at most SHOWN rows, then how many more."""
    shown = ", ".join(f"{line} ({value!r})" for line, value in list(zip(lines, values))[:SHOWN])
    return shown + (f" and {len(lines) - SHOWN} more" if len(lines) > SHOWN else "")


def numbers(frame: pd.DataFrame, column: str, path: Path, lines: pd.Series, *,
            positive: bool = False, allow_inf: bool = False) -> pd.Series:
    """Column `column` as floats: TableDataError naming the rows whose field is blank or not a
    number, NaN, infinite (unless `allow_inf`), or (with `positive`) not above zero."""
    text = frame[column].astype(str).str.strip()
    values = pd.to_numeric(text.str.replace(r"^(?i:inf(inity)?)$", "inf", regex=True),
                           errors="coerce")
    bad = values.isna() | (np.isinf(values) & (not allow_inf))
    if positive:
        bad |= values <= 0
    if bad.any():
        rule = "a positive number" if positive else "a number"
        raise TableDataError(f"{path}: column {column}: not {rule} at row(s) "
                             f"{named_rows(list(lines[bad]), list(text[bad]))}")
    return values.astype(float)


def as_numeric_column(values: pd.Series) -> pd.Series | None:
    """`values` (strings) as numbers when every one is a number or True/False (as 1/0), else
    None (a categorical column)."""
    text = values.astype(str).str.strip()
    truth = {"true": 1, "false": 0}
    lowered = text.str.lower()
    mapped = lowered.map(truth)
    numeric = pd.to_numeric(text.where(mapped.isna(), mapped.astype(str)), errors="coerce")
    if numeric.isna().any() or not np.isfinite(numeric).all():
        return None
    whole = (numeric == np.floor(numeric)).all() and (np.abs(numeric) < 2**53).all()
    return numeric.astype(np.int64) if whole else numeric.astype(float)


def typed_column(frame: pd.DataFrame, name: str) -> Column:
    """Make column `name` of `frame` numeric where every value is a number (or true/false);
    its Column, numeric or categorical."""
    numeric = as_numeric_column(frame[name])
    if numeric is not None:
        frame[name] = numeric
    return Column(name, "categorical" if numeric is None else "numeric")


def collapse_rows(frame: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """One dataset row per distinct `keys` (the columns naming device, problem and
    configuration) of a frame with one measurement a row (`time_s`, its one time; `status`,
    `reason`, `row`): a tool that appends each run to its file records one configuration
    several times. The repeats collapse as everywhere in tilecast
    (core.dataset.collapse_repeats): `samples_s` holds the group's usable times, an `ok`
    group's `median_s` is their median (table.dataset.measured adds their MAD); a group with
    any failed row keeps the first failure's status and reason (a configuration that failed
    once is not safe to choose). `row` lists the rows merged."""
    frame = frame.reset_index(drop=True)
    slots = collapse_repeats(frame, keys)
    failure = [failed[0] if failed else first
               for first, failed in zip(slots["first"], slots["failed"])]
    out = frame.iloc[slots["first"].to_numpy()].reset_index(drop=True)
    out["status"] = frame["status"].to_numpy()[failure]
    out["reason"] = frame["reason"].to_numpy()[failure]
    out["median_s"] = slots["median_s"].to_numpy()
    out["samples_s"] = list(slots["samples_s"])
    out = out.drop(columns="time_s")
    named = frame["row"].astype(str).to_numpy()
    out["row"] = [",".join(named[rows]) for rows in slots["rows"]]
    return out


def check_names(names: Sequence[str], path: Path) -> None:
    """TableDataError naming `path` when a column name is empty or one of the dataset's own
    (device, kernel, median_s, ...: table.dataset.ROW_COLUMNS)."""
    for name in names:
        try:
            Column(name, "categorical")
        except TableDataError as err:
            raise TableDataError(f"{path}: {err}") from None


def union_columns(found: dict[Path, tuple]) -> tuple[tuple, set, list[str]]:
    """Every column some file of `found` has (the first file's order, then each new one where
    first seen), the ones some file lacks (partial: missing in that file's rows), and one
    note per file that lacks any."""
    names: list = []
    for columns in found.values():
        names += [c for c in columns if c not in names]
    partial, notes = set(), []
    for path, columns in found.items():
        lacking = [c for c in names if c not in columns]
        if lacking:
            partial.update(lacking)
            notes.append(f"{path.name} has no column {', '.join(lacking)}: missing in its rows")
    return tuple(names), partial, notes


def same_columns(found: dict[Path, tuple], what: str) -> tuple:
    """The one column tuple every file of `found` has; TableDataError naming two that differ."""
    items = list(found.items())
    first_path, first = items[0]
    for path, columns in items[1:]:
        if columns != first:
            raise TableDataError(f"{path} and {first_path} differ in their {what} ({list(columns)}"
                                 f" against {list(first)}); import them into separate datasets")
    return first
