"""The registry in a local directory: exclusive directory renames, O_APPEND history, flock.

    <root>/<model>/versions/<N>/...     claimed by one os.rename of a complete temp directory
    <root>/<model>/aliases/<alias>      replaced through a temp file and os.replace
    <root>/<model>/history.jsonl        one line per alias move, a single O_APPEND write
    <root>/<model>/.lock                flock'ed around every alias move and its history line

A version is assembled in a temp directory inside `versions/` and claimed with one
`os.rename` onto `versions/<N>`; a name already taken makes the rename fail (the directory
is never empty) and the next number is tried, so concurrent publishers never overwrite each
other and readers only ever see complete versions and whole alias files. An alias move
(read the old value, replace the file, append the history line) runs under an exclusive
`flock` of the model's lock file, so concurrent moves serialise and the alias always agrees
with the history's last entry; the kernel drops the lock when its holder dies.

Temporaries are named `.tmp-<host>+<pid>+...`: the next publish removes those of a writer
that was killed (this host, process gone) or that are older than STALE_TEMP_S, and readers
never take them for versions or aliases. Everything is created with the mode the umask
allows. The logic above the storage (names, gate, rollback) is tilecast.registry.api's.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from tilecast.core.atomic import atomic_write_bytes, make_temp_dir
from tilecast.registry import integrity
from tilecast.registry.base import (HISTORY_FILE, MAX_CLAIM_ATTEMPTS, MODEL_RE, NAME_RE,
                                    STALE_TEMP_S, TEMP_PREFIX, RegistryError)

LOCK_FILE = ".lock"
OWNER_SEPARATOR = "+"   # neither in host names nor in registry names: the name parses back


def _owner_prefix() -> str:
    """The start of every temporary this process creates: `.tmp-<host>+<pid>+`."""
    return f"{TEMP_PREFIX}{socket.gethostname()}{OWNER_SEPARATOR}{os.getpid()}{OWNER_SEPARATOR}"


def _writer_gone(name: str) -> bool:
    """Whether a temporary's name says it belongs to a process of this host that is gone."""
    host, sep, rest = name[len(TEMP_PREFIX):].partition(OWNER_SEPARATOR)
    pid = rest.partition(OWNER_SEPARATOR)[0]
    if not sep or host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:   # alive, another user's
        return False
    return False


def sweep_temporaries(directory: Path, now: float | None = None) -> list[str]:
    """Remove the temporaries in `directory` whose writer is gone or that are older than
    STALE_TEMP_S; returns their names. Best effort: one that cannot be removed stays."""
    now = time.time() if now is None else now
    try:
        entries = [entry for entry in os.scandir(directory) if entry.name.startswith(TEMP_PREFIX)]
    except OSError:
        return []
    swept = []
    for entry in entries:
        try:
            stale = now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S
            if not (stale or _writer_gone(entry.name)):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            swept.append(entry.name)
        except OSError:
            continue
    return swept


class LocalStore:
    """A registry rooted at a local directory (which need not exist until a publish)."""

    remote = False

    def __init__(self, root: Path):
        self.root = Path(root)
        self.location = str(self.root)

    # -- places, for callers and for messages -------------------------------------------

    def _model_dir(self, model: str) -> Path:
        return self.root / model

    def _versions_dir(self, model: str) -> Path:
        return self._model_dir(model) / "versions"

    def version_location(self, model: str, number: int) -> Path:
        return self._versions_dir(model) / str(number)

    def version_ref(self, model: str, number: int) -> str:
        return f"directory {self.version_location(model, number)}"

    def file_ref(self, model: str, number: int, name: str) -> str:
        return str(self.version_location(model, number) / name)

    def alias_ref(self, model: str, alias: str) -> str:
        return str(self._model_dir(model) / "aliases" / alias)

    # -- reading --------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if MODEL_RE.match(p.name) and (p / "versions").is_dir())

    def version_numbers(self, model: str) -> list[int]:
        versions_dir = self._versions_dir(model)
        if not versions_dir.is_dir():
            return []
        return sorted(int(p.name) for p in versions_dir.iterdir()
                      if p.name.isdigit() and not p.name.startswith("0") and p.is_dir())

    def has_version(self, model: str, number: int) -> bool:
        return self.version_location(model, number).is_dir()

    def read_file(self, model: str, number: int, name: str) -> bytes:
        """The bytes of one file of a version; FileNotFoundError when it has none."""
        return (self.version_location(model, number) / name).read_bytes()

    def alias_names(self, model: str) -> list[str]:
        aliases_dir = self._model_dir(model) / "aliases"
        if not aliases_dir.is_dir():
            return []
        return sorted(p.name for p in aliases_dir.iterdir()
                      if not p.name.startswith(TEMP_PREFIX) and NAME_RE.match(p.name))

    def read_alias_text(self, model: str, alias: str) -> str:
        """The alias file's text; FileNotFoundError when the alias does not exist."""
        return (self._model_dir(model) / "aliases" / alias).read_text(errors="replace")

    def history_texts(self, model: str, alias: str | None = None) -> list[str]:
        """The alias moves as JSON texts, oldest first (callers filter by alias)."""
        try:
            data = (self._model_dir(model) / HISTORY_FILE).read_bytes()
        except FileNotFoundError:
            return []
        return data.decode("utf-8", errors="replace").splitlines()

    def local_copy(self, model: str, number: int, cache_dir=None, check=None) -> Path:
        """The version's own directory (nothing to download), after `check(directory)`."""
        directory = self.version_location(model, number)
        if check is not None:
            check(directory)
        return directory

    # -- writing --------------------------------------------------------------------------

    @contextmanager
    def locked(self, model: str):
        """Hold the model's alias lock (an exclusive flock of <model>/.lock) for the block."""
        path = self._model_dir(model) / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:
            fd = None  # another user's lock file: flock needs only a read descriptor
        except OSError as err:
            raise RegistryError(f"cannot open the alias lock {path}: {err}") from None
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as err:
                raise RegistryError(f"cannot open the alias lock {path}: {err}; aliases can "
                                    f"only be moved in a registry you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def write_alias(self, model: str, alias: str, number: int) -> None:
        """Replace the alias file atomically (temp file + fsync + os.replace)."""
        aliases_dir = self._model_dir(model) / "aliases"
        aliases_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(aliases_dir / alias, f"{number}\n".encode(),
                           temp_prefix=_owner_prefix())

    def append_move(self, model: str, entry: dict) -> None:
        """Append one JSON line; a single O_APPEND write, so a reader never sees a line of
        two writers interleaved. A line torn by a killed writer is ended first, so it costs
        only itself, not this entry too."""
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        fd = os.open(self._model_dir(model) / HISTORY_FILE,
                     os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            os.write(fd, line)
        finally:
            os.close(fd)

    def write_version_file(self, model: str, number: int, name: str, data: bytes) -> None:
        """Add a file to a claimed version (its owner only: promotion.json, written last)."""
        atomic_write_bytes(self.version_location(model, number) / name, data,
                           temp_prefix=_owner_prefix())

    def stage(self, model: str) -> "LocalStage":
        return LocalStage(self, model)


class LocalStage:
    """A version being assembled in a temp directory inside versions/; `commit` renames it
    onto the first free number, `discard` removes whatever was not committed."""

    def __init__(self, store: LocalStore, model: str):
        self.versions_dir = store._versions_dir(model)
        self.versions_dir.mkdir(parents=True, exist_ok=True)
        for leftovers in (self.versions_dir, store._model_dir(model) / "aliases"):
            sweep_temporaries(leftovers)
        self.temp_dir: Path | None = make_temp_dir(self.versions_dir, _owner_prefix())
        self.model = model

    def add(self, name: PurePosixPath, source) -> None:
        """Copy a Path (file or directory), or write bytes / str (UTF-8 text), as `name`."""
        target = self.temp_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, (bytes, bytearray, memoryview)):
            target.write_bytes(bytes(source))
        elif isinstance(source, str):
            target.write_text(source, encoding="utf-8")
        elif isinstance(source, os.PathLike):
            path = Path(source)
            if path.is_dir():
                _copy_tree(path, target)
            elif path.is_file():
                shutil.copyfile(path, target)  # contents only: the umask sets the mode
            else:
                raise RegistryError(f"artifact source {path} for {str(name)!r} does not exist")
        else:
            raise RegistryError(f"artifact {str(name)!r}: expected a Path, bytes or str, "
                                f"got {type(source).__name__}")

    def digests(self) -> dict[str, tuple[str, int]]:
        """(sha256, bytes) of every file staged so far, by relative POSIX name."""
        return {path.relative_to(self.temp_dir).as_posix(): integrity.digest_file(path)
                for path in sorted(self.temp_dir.rglob("*")) if path.is_file()}

    def commit(self, first_number: int) -> int:
        """Rename the temp directory onto versions/<N> for the first free N >= first_number;
        a taken N makes the rename fail and N + 1 is tried."""
        number = first_number
        for _ in range(MAX_CLAIM_ATTEMPTS):
            try:
                os.rename(self.temp_dir, self.versions_dir / str(number))
                self.temp_dir = None
                return number
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY) and not isinstance(
                        err, FileExistsError):
                    raise
            number += 1
        raise RegistryError(f"could not claim a version number for model {self.model!r} in "
                            f"{self.versions_dir} after {MAX_CLAIM_ATTEMPTS} attempts")

    def discard(self) -> None:
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


def _copy_tree(source: Path, target: Path) -> None:
    """Copy a directory's files (contents only, like shutil.copyfile): shutil.copytree would
    copy the source's modes too, a private workdir's 0700 included."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
        elif path.is_file():
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)
