"""The paths and names a user gives on the command line, checked before any work starts.

A missing, unreadable or binary file, or a directory given as a file, is named here as a
CliError (one line, exit status 2) instead of failing later inside a stage.
"""
from __future__ import annotations

import codecs
import os
import stat
from pathlib import Path

from tilecast.cli.errors import CliError

CHUNK_BYTES = 1 << 20


def _check_text(handle, path: Path, what: str) -> None:
    """CliError unless the open file is UTF-8 text without NUL bytes (a binary file)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    while chunk := handle.read(CHUNK_BYTES):
        nul = chunk.find(b"\0")
        if nul >= 0:
            raise CliError(f"{what} {path} is a binary file (a NUL byte at offset "
                           f"{offset + nul}), expected text")
        pending = len(decoder.getstate()[0])
        try:
            decoder.decode(chunk)
        except UnicodeDecodeError as err:
            raise CliError(f"{what} {path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} "
                           f"at offset {offset - pending + err.start})") from None
        offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise CliError(f"{what} {path} is not UTF-8 text (it ends inside a character)") from None


def user_file(value: str | Path, what: str, *, text: bool = False) -> Path:
    """`value` as a file the user named (`what` says which in messages): CliError when it
    does not exist, is not a regular file, cannot be read or, with `text`, is not UTF-8 text."""
    path = Path(value)
    try:
        with open(path, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise CliError(f"{what} {path} is not a regular file")
            if text:
                _check_text(handle, path, what)
            else:
                handle.read(1)
    except FileNotFoundError:
        raise CliError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise CliError(f"{what} {path} is a directory, expected a file") from None
    except PermissionError:
        raise CliError(f"{what} {path} is not readable (permission denied)") from None
    except OSError as err:
        raise CliError(f"{what} {path} cannot be read: {err.strerror or err}") from None
    return path


def user_dir(value: str | Path, what: str, *, must_exist: bool = False,
             writable: bool = False) -> Path:
    """`value` as a directory the user named: CliError when it is something else, when it
    does not exist (with `must_exist`), or when it (or, not made yet, the directory it would
    be made in) cannot be written (with `writable`)."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise CliError(f"{what} {path} is a file, expected a directory")
    if not path.exists() and must_exist:
        raise CliError(f"{what} {path} does not exist")
    if writable:
        _check_writable(path, what)
    return path


def user_output(value: str | Path, what: str) -> Path:
    """`value` as a file the command writes: CliError when it is a directory or when the
    directory it goes in cannot be written."""
    path = Path(value)
    if path.is_dir():
        raise CliError(f"{what} {path} is a directory; name the file to write")
    _check_writable(path.parent, what)
    return path


def _check_writable(path: Path, what: str) -> None:
    """CliError unless `path`, or the nearest directory above it that exists, is writable."""
    existing = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise CliError(f"{what} {path}: {existing} is a file, not a directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise CliError(f"{what} {path}: {existing} is not writable (permission denied)")


CONFIG_SUFFIXES = (".yaml", ".yml", ".json")  # tilecast.config.CONFIG_SUFFIXES


def config_arg(value: str | Path) -> str:
    """A --config value: a path (one that exists, has a directory part or a YAML/JSON suffix)
    is checked as a text file; a bare name (`quick`) is left to the loader, which looks it
    up in configs/ and lists the names there when it is not one."""
    path = Path(value)
    if path.exists() or len(path.parts) > 1 or path.suffix in CONFIG_SUFFIXES:
        user_file(path, "config", text=True)
    return str(value)


def default_workdir(config: str | Path) -> str:
    """The workdir of a run given no --workdir: work/<the config's name>, the name being a
    shipped config's (`nightly`) or a config file's stem (`configs/repeat.yaml` -> repeat)."""
    name = Path(config).stem if Path(config).suffix in CONFIG_SUFFIXES else Path(config).name
    return str(Path("work") / name)


def registry_root(value: str | Path, *, must_exist: bool = True) -> str:
    """A --registry value: a local path must be a directory (and exist, for a command that
    reads it); a URL is left to its store, which names it in its own errors."""
    from tilecast.registry.api import is_url

    if not is_url(value):
        path = Path(value)
        if path.exists() and not path.is_dir():
            raise CliError(f"registry {path} is a file; --registry names a directory or a URL")
        if must_exist and not path.exists():
            raise CliError(f"registry {path} does not exist; --registry names a directory "
                           "(default ./registry) or a URL such as s3://bucket/prefix")
    return str(value)
