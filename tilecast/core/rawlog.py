"""Raw benchmark records as JSON lines: appended one record at a time and flushed, so a crash
loses at most the line being written, and read back tolerating exactly that truncated line."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("tilecast.core.rawlog")


class RawLogError(ValueError):
    """A raw record file that cannot be used (corrupt beyond a truncated last line)."""


class RawWriter:
    """Append-only JSONL writer; use as a context manager (fsync on close)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None

    def __enter__(self) -> "RawWriter":
        self._file = open(self.path, "a", encoding="utf-8")
        # a previous crash may have left a partial last line: start ours on a fresh line
        if self._file.tell() > 0:
            with open(self.path, "rb") as existing:
                existing.seek(-1, os.SEEK_END)
                if existing.read(1) != b"\n":
                    self._file.write("\n")
        return self

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
        self._file.flush()

    def __exit__(self, *exc) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def read_records(path: Path) -> list[dict]:
    """All complete records of a JSONL file. Unparseable lines (a truncated tail after a crash)
    are skipped with a warning naming the file and line; a missing file is an empty list."""
    path = Path(path)
    if not path.exists():
        return []
    records, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                bad.append(number)
                continue
            if not isinstance(record, dict):
                bad.append(number)
                continue
            records.append(record)
    if bad:
        log.warning("%s: skipped %d unreadable line(s) (first: line %d), e.g. a record "
                    "truncated by a crash", path, len(bad), bad[0])
    return records
