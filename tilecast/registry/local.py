"""The registry in a local directory: exclusive directory renames and O_APPEND history.

    <root>/<model>/versions/<N>/...     claimed by one os.rename of a complete temp directory
    <root>/<model>/aliases/<alias>      replaced through a temp file and os.replace
    <root>/<model>/history.jsonl        one line per alias move, a single O_APPEND write

A version is assembled in a temp directory inside `versions/` and claimed with one
`os.rename` onto `versions/<N>`; a name already taken makes the rename fail (the directory
is never empty) and the next number is tried, so concurrent publishers never overwrite each
other and readers only ever see complete versions and whole alias files. The logic above the
storage (names, gate, rollback) is tilecast.registry.api's; this module only stores.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from tilecast.registry.base import HISTORY_FILE, MAX_CLAIM_ATTEMPTS, NAME_RE, TEMP_PREFIX, RegistryError


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
                      if NAME_RE.match(p.name) and (p / "versions").is_dir())

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
        return (self._model_dir(model) / "aliases" / alias).read_text()

    def history_texts(self, model: str, alias: str | None = None) -> list[str]:
        """The alias moves as JSON texts, oldest first (callers filter by alias)."""
        try:
            return (self._model_dir(model) / HISTORY_FILE).read_text().splitlines()
        except FileNotFoundError:
            return []

    def local_copy(self, model: str, number: int, cache_dir=None) -> Path:
        """The version's own directory: nothing to download."""
        return self.version_location(model, number)

    # -- writing --------------------------------------------------------------------------

    def write_alias(self, model: str, alias: str, number: int) -> None:
        """Replace the alias file atomically (temp file + fsync + os.replace)."""
        aliases_dir = self._model_dir(model) / "aliases"
        aliases_dir.mkdir(parents=True, exist_ok=True)
        fd, temp_name = tempfile.mkstemp(prefix=TEMP_PREFIX + alias + "-", dir=aliases_dir)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(f"{number}\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp_name, aliases_dir / alias)
        except BaseException:
            try:
                os.unlink(temp_name)
            except FileNotFoundError:
                pass
            raise

    def append_move(self, model: str, entry: dict) -> None:
        """Append one JSON line; a single O_APPEND write, so concurrent writers never
        interleave."""
        line = (json.dumps(entry, sort_keys=True) + "\n").encode()
        fd = os.open(self._model_dir(model) / HISTORY_FILE,
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def stage(self, model: str) -> "LocalStage":
        return LocalStage(self, model)


class LocalStage:
    """A version being assembled in a temp directory inside versions/; `commit` renames it
    onto the first free number, `discard` removes whatever was not committed."""

    def __init__(self, store: LocalStore, model: str):
        self.versions_dir = store._versions_dir(model)
        self.versions_dir.mkdir(parents=True, exist_ok=True)
        self.temp_dir: Path | None = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX,
                                                           dir=self.versions_dir))
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
                shutil.copytree(path, target)
            elif path.is_file():
                shutil.copyfile(path, target)
            else:
                raise RegistryError(f"artifact source {path} for {str(name)!r} does not exist")
        else:
            raise RegistryError(f"artifact {str(name)!r}: expected a Path, bytes or str, "
                                f"got {type(source).__name__}")

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
