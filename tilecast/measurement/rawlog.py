"""Raw benchmark records as JSON lines: appended one record at a time and flushed, so a kill
loses at most the line being written.

A kill mid-write leaves a torn last line (no newline at its end): reading drops it with a
note, and the next writer cuts it off before appending, so it never ends up in the middle.
Any other unreadable line is damage a crash cannot cause: reading it is an error naming the
file and the lines, unless the caller asks to skip such lines (and is told how many).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from tilecast.core.dataset import DatasetError

log = logging.getLogger("tilecast.measurement.rawlog")

# How many bad line numbers an error message lists before "...".
SHOWN_LINES = 10


class RawLogError(DatasetError):
    """A raw record file that cannot be used: unreadable, or corrupt beyond a torn last line."""


@dataclass
class RawLog:
    """What one raw file held: its records, the torn last line dropped (its number, or None)
    and the corrupt lines skipped (only when the reader asked to skip them)."""
    path: Path
    records: list[dict] = field(default_factory=list)
    torn_line: int | None = None
    skipped_lines: list[int] = field(default_factory=list)


def _parse(line: bytes) -> dict | None:
    """The record on one line, or None when it is not a JSON object in UTF-8."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _last_line_start(handle, end: int, chunk: int = 1 << 16) -> int:
    """Offset of the first byte after the last newline before `end` (0 if there is none)."""
    position = end
    while position > 0:
        start = max(0, position - chunk)
        handle.seek(start)
        found = handle.read(position - start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        position = start
    return 0


def drop_torn_tail(path: Path) -> int:
    """Cut a torn last line (no newline, not a record) off `path`; returns the bytes removed.
    A last record that only lacks its newline gets one instead."""
    with open(path, "rb+") as handle:
        end = handle.seek(0, os.SEEK_END)
        if end == 0:
            return 0
        handle.seek(end - 1)
        if handle.read(1) == b"\n":
            return 0
        start = _last_line_start(handle, end)
        handle.seek(start)
        if _parse(handle.read()) is not None:
            handle.write(b"\n")
            return 0
        handle.truncate(start)
    log.info("%s: cut off a torn last line (%d bytes), the record being written when an "
             "earlier run was killed; it is measured again", path, end - start)
    return end - start


class RawWriter:
    """Append-only JSONL writer; use as a context manager (fsync on close)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None

    def __enter__(self) -> "RawWriter":
        if self.path.exists():
            drop_torn_tail(self.path)  # else our first record would follow it on its line
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
        self._file.flush()

    def __exit__(self, *exc) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:SHOWN_LINES]))
    return shown + (f", ... ({len(numbers)} in all)" if len(numbers) > SHOWN_LINES else "")


def read_log(path: Path, skip_corrupt: bool = False) -> RawLog:
    """Every record of a JSONL file (see the module docstring); a missing file has none.
    A corrupt line before the last one is a RawLogError naming the file and its lines,
    unless `skip_corrupt` (then they are left out and listed in `skipped_lines`)."""
    path = Path(path)
    result = RawLog(path)
    if not path.exists():
        return result
    if path.is_dir():
        raise RawLogError(f"raw benchmark file {path} is a directory, not a JSON-lines file")
    corrupt = []
    try:
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                record = _parse(line)
                if record is not None:
                    result.records.append(record)
                elif line.endswith(b"\n"):
                    corrupt.append(number)
                else:
                    result.torn_line = number
    except OSError as err:
        raise RawLogError(f"cannot read raw benchmark file {path}: {err.strerror or err}") from None
    if result.torn_line is not None:
        log.info("%s: dropped the torn last line %d, the record being written when a run was "
                 "killed", path, result.torn_line)
    if corrupt and not skip_corrupt:
        raise RawLogError(
            f"{path}: {len(corrupt)} corrupt line(s) before the end (line(s) {_lines(corrupt)}): "
            f"not JSON records; a kill only tears the last line, so the file was damaged "
            f"otherwise: repair or delete those lines, or read it skipping them (skip_corrupt)")
    if corrupt:
        log.warning("%s: skipped %d corrupt line(s): %s", path, len(corrupt), _lines(corrupt))
        result.skipped_lines = corrupt
    return result


def read_records(path: Path, skip_corrupt: bool = False) -> list[dict]:
    """The records of `read_log(path, skip_corrupt)`."""
    return read_log(path, skip_corrupt).records
