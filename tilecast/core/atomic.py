"""Atomic file writes: a temp file in the target's directory, fsync, then os.replace.

A reader sees either the old file or the complete new one, never a half-written file, and a
failed write leaves no temp file behind.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically; the parent directory must exist. Returns the path."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist; "
                                "create it first")
    temp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    # os.open with 0o666 lets the umask decide permissions (mkstemp would force 0600)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `path` atomically (see atomic_write_bytes)."""
    return atomic_write_bytes(path, text.encode(encoding))


def atomic_write_json(path: str | Path, obj: Any, indent: int = 2) -> Path:
    """Write `obj` as JSON (NaN/inf rejected, numpy scalars and arrays converted) atomically."""
    text = json.dumps(obj, indent=indent, sort_keys=False, allow_nan=False, default=_json_default)
    return atomic_write_text(path, text + "\n")


def _json_default(value: Any) -> Any:
    """numpy scalars/arrays and paths as plain JSON values; anything else is a TypeError."""
    if hasattr(value, "tolist"):          # numpy scalar or array
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"value {value!r} of type {type(value).__name__} is not JSON serializable")
