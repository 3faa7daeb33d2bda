"""Atomic file writes: a temp file in the target's directory, fsync, then os.replace.

A reader sees either the old file or the complete new one, never a half-written file, and a
failed write leaves no temp file behind. Everything created here gets the mode the umask
allows (0644 / 0755 under umask 022): tempfile's mkstemp and mkdtemp force 0600 / 0700,
which would make a shared directory (a model registry) unreadable to everyone else.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

TEMP_SUFFIX_CHARS = 12   # hex characters of randomness in a temporary's name
MAX_TEMP_ATTEMPTS = 100


def atomic_write_bytes(path: str | Path, data: bytes, *, temp_prefix: str = ".") -> Path:
    """Write `data` to `path` atomically; the parent directory must exist. Returns the path.
    The temp file is `<temp_prefix><name>.<pid>.<random>.tmp` beside the target, so a caller
    can recognise (and sweep) what a killed writer left."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist; "
                                "create it first")
    temp = path.parent / (f"{temp_prefix}{path.name}.{os.getpid()}."
                          f"{uuid.uuid4().hex[:TEMP_SUFFIX_CHARS]}.tmp")
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


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8", *,
                      temp_prefix: str = ".") -> Path:
    """Write `text` to `path` atomically (see atomic_write_bytes)."""
    return atomic_write_bytes(path, text.encode(encoding), temp_prefix=temp_prefix)


def atomic_write_json(path: str | Path, obj: Any, indent: int = 2) -> Path:
    """Write `obj` as JSON (NaN/inf rejected, numpy scalars and arrays converted) atomically."""
    text = json.dumps(obj, indent=indent, sort_keys=False, allow_nan=False, default=_json_default)
    return atomic_write_text(path, text + "\n")


def make_temp_dir(parent: str | Path, prefix: str) -> Path:
    """A new empty directory `<parent>/<prefix><random>` whose mode follows the umask
    (tempfile.mkdtemp forces 0700); the parent must exist."""
    parent = Path(parent)
    for _ in range(MAX_TEMP_ATTEMPTS):
        candidate = parent / f"{prefix}{uuid.uuid4().hex[:TEMP_SUFFIX_CHARS]}"
        try:
            os.mkdir(candidate, 0o777)
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary directory {prefix}* in {parent} "
                          f"after {MAX_TEMP_ATTEMPTS} attempts")


def _json_default(value: Any) -> Any:
    """numpy scalars/arrays and paths as plain JSON values; anything else is a TypeError."""
    if hasattr(value, "tolist"):          # numpy scalar or array
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"value {value!r} of type {type(value).__name__} is not JSON serializable")
