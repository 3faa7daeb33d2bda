"""The model registry: immutable numbered versions and small alias pointer files.

Layout (DESIGN.md, Data contracts):

    <root>/<model>/versions/<N>/...     N = 1, 2, ...; created exclusively, never rewritten
    <root>/<model>/aliases/<alias>      text file holding one version number
    <root>/<model>/history.jsonl        one line per alias move (what `rollback` undoes)

A version is assembled in a temp directory inside `versions/` and claimed with one
`os.rename` onto `versions/<N>`; a name already taken makes the rename fail and the next
number is tried, so concurrent publishers never overwrite each other. Aliases are replaced
through a temp file in the same directory and `os.replace`. Readers therefore only ever see
complete versions and whole alias files.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Callable, Mapping, Sequence

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
PRODUCTION = "production"
CANDIDATE = "candidate"
METRICS_FILE = "metrics.json"
HISTORY_FILE = "history.jsonl"
PROMOTION_FILE = "promotion.json"
RESERVED_FILES = (METRICS_FILE, PROMOTION_FILE)  # written by publish itself
TEMP_PREFIX = ".tmp-"

# Default promotion gate: the new model may lose at most this much against production.
MEAN_EFFICIENCY_TOLERANCE = 0.005
P10_EFFICIENCY_TOLERANCE = 0.02
_FLOAT_SLACK = 1e-12  # so a figure exactly on the threshold passes despite rounding
MAX_CLAIM_ATTEMPTS = 10_000

# gate(production metrics or None, new metrics) -> (promote?, reason with the figures)
Gate = Callable[[dict | None, dict], tuple[bool, str]]


class RegistryError(Exception):
    """A registry operation failed; the message names the model, version, alias or file."""


@dataclass(frozen=True)
class PublishResult:
    """What publish() did: the version claimed, whether the gate promoted it and why."""
    version: int
    promoted: bool
    reason: str
    path: Path
    aliases: tuple[str, ...] = ()


# -- names and paths ----------------------------------------------------------------------


def _check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not NAME_RE.match(value) or value in (".", ".."):
        raise RegistryError(f"invalid {what} name {value!r}: use letters, digits, '_', '.', '-'")
    return value


def _model_dir(root, model: str) -> Path:
    return Path(root) / _check_name(model, "model")


def _versions_dir(root, model: str) -> Path:
    return _model_dir(root, model) / "versions"


def _aliases_dir(root, model: str) -> Path:
    return _model_dir(root, model) / "aliases"


def _version_number(version) -> int:
    """A version number from an int or a decimal string; RegistryError otherwise."""
    if isinstance(version, bool):
        raise RegistryError(f"invalid version {version!r}: expected a positive integer")
    if isinstance(version, int):
        number = version
    elif isinstance(version, str) and version.strip().isdigit():
        number = int(version.strip())
    else:
        raise RegistryError(f"invalid version {version!r}: expected a positive integer")
    if number < 1:
        raise RegistryError(f"invalid version {version!r}: expected a positive integer")
    return number


# -- reading --------------------------------------------------------------------------------


def list_models(root) -> list[str]:
    """Names of the models under `root` (those with a versions/ directory), sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if NAME_RE.match(p.name) and (p / "versions").is_dir())


def list_versions(root, model: str) -> list[int]:
    """The claimed version numbers of `model`, ascending; [] when it has none."""
    versions_dir = _versions_dir(root, model)
    if not versions_dir.is_dir():
        return []
    return sorted(int(p.name) for p in versions_dir.iterdir()
                  if p.name.isdigit() and not p.name.startswith("0") and p.is_dir())


def version_path(root, model: str, version) -> Path:
    """The directory of an existing version; RegistryError naming it when absent."""
    number = _version_number(version)
    path = _versions_dir(root, model) / str(number)
    if not path.is_dir():
        known = list_versions(root, model)
        raise RegistryError(f"model {model!r} has no version {number} (no directory {path}); "
                            f"existing versions: {known or 'none'}")
    return path


def list_aliases(root, model: str) -> dict[str, int | None]:
    """Every alias of `model` and the version it holds (None when the file is unreadable)."""
    aliases_dir = _aliases_dir(root, model)
    if not aliases_dir.is_dir():
        return {}
    found: dict[str, int | None] = {}
    for path in sorted(aliases_dir.iterdir()):
        if path.name.startswith(TEMP_PREFIX) or not NAME_RE.match(path.name):
            continue
        try:
            found[path.name] = _version_number(path.read_text().strip())
        except (OSError, RegistryError):
            found[path.name] = None
    return found


def read_alias(root, model: str, alias: str) -> int:
    """The version `alias` points at; RegistryError when the alias is missing, corrupt or
    points at a version that does not exist (the message names both)."""
    _check_name(alias, "alias")
    path = _aliases_dir(root, model) / alias
    try:
        text = path.read_text()
    except FileNotFoundError:
        known = sorted(list_aliases(root, model))
        raise RegistryError(f"model {model!r} has no alias {alias!r} (no file {path}); "
                            f"existing aliases: {known or 'none'}") from None
    except OSError as err:
        raise RegistryError(f"cannot read alias file {path}: {err}") from None
    try:
        number = _version_number(text.strip())
    except RegistryError:
        raise RegistryError(f"alias file {path} holds {text.strip()!r}, "
                            f"not a version number") from None
    if not (_versions_dir(root, model) / str(number)).is_dir():
        raise RegistryError(f"alias {alias!r} of model {model!r} points at version {number}, "
                            f"which does not exist (no directory "
                            f"{_versions_dir(root, model) / str(number)})")
    return number


def resolve(root, model: str, alias_or_version: str | int = PRODUCTION) -> Path:
    """The directory of a version given as an alias ("production") or a number (3, "3")."""
    if isinstance(alias_or_version, int) or (
            isinstance(alias_or_version, str) and alias_or_version.strip().isdigit()):
        return version_path(root, model, alias_or_version)
    return version_path(root, model, read_alias(root, model, alias_or_version))


def read_metrics(root, model: str, version) -> dict:
    """metrics.json of one version; RegistryError naming the file when missing or corrupt."""
    path = version_path(root, model, version) / METRICS_FILE
    try:
        metrics = json.loads(path.read_text())
    except FileNotFoundError:
        raise RegistryError(f"version {version} of model {model!r} has no {METRICS_FILE} "
                            f"(no file {path})") from None
    except (OSError, ValueError) as err:
        raise RegistryError(f"cannot read {path}: {err}") from None
    if not isinstance(metrics, dict):
        raise RegistryError(f"{path} holds a {type(metrics).__name__}, expected an object")
    return metrics


# -- writing --------------------------------------------------------------------------------


def set_alias(root, model: str, alias: str, version, *, why: str = "") -> int | None:
    """Point `alias` at an existing version, atomically (temp file + os.replace), and log
    the move in history.jsonl. Returns the version the alias held before (None if new)."""
    _check_name(alias, "alias")
    number = _version_number(version)
    version_path(root, model, number)
    aliases_dir = _aliases_dir(root, model)
    aliases_dir.mkdir(parents=True, exist_ok=True)
    previous = list_aliases(root, model).get(alias)
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
    _log_move(root, model, {"alias": alias, "version": number, "previous": previous,
                            "why": why})
    return previous


def _log_move(root, model: str, entry: dict) -> None:
    """Append one JSON line; a single O_APPEND write, so concurrent writers never interleave."""
    entry = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), **entry}
    line = (json.dumps(entry, sort_keys=True) + "\n").encode()
    fd = os.open(_model_dir(root, model) / HISTORY_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def alias_history(root, model: str, alias: str | None = None) -> list[dict]:
    """The alias moves of `model`, oldest first (only `alias`'s when given); a torn last line
    (a writer killed mid-write) is skipped."""
    path = _model_dir(root, model) / HISTORY_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    moves = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and (alias is None or entry.get("alias") == alias):
            moves.append(entry)
    return moves


def promote(root, model: str, version, alias: str = PRODUCTION) -> int | None:
    """Point `alias` (production by default) at `version` by hand; returns the previous one."""
    return set_alias(root, model, alias, version, why="promote")


def _alias_stack(root, model: str, alias: str) -> list[int]:
    """The versions the alias went through, replayed from history: a move pushes, a rollback
    pops, so repeated rollbacks walk further back instead of bouncing between two versions."""
    stack: list[int] = []
    for move in alias_history(root, model, alias):
        if str(move.get("why", "")).startswith("rollback"):
            if stack:
                stack.pop()
            if not stack or stack[-1] != move.get("version"):
                stack.append(move.get("version"))
        else:
            stack.append(move.get("version"))
    return stack


def rollback(root, model: str, alias: str = PRODUCTION) -> int:
    """Move `alias` back to the version it held before its current one (skipping versions
    that no longer exist); returns that version. RegistryError when there is none."""
    current = read_alias(root, model, alias)
    existing = set(list_versions(root, model))
    stack = _alias_stack(root, model, alias)
    while stack and stack[-1] == current:
        stack.pop()
    earlier = [v for v in stack if v in existing and v != current]
    if not earlier:
        raise RegistryError(f"alias {alias!r} of model {model!r} (at version {current}) has no "
                            f"earlier version to roll back to")
    set_alias(root, model, alias, earlier[-1], why=f"rollback from {current}")
    return earlier[-1]


def _metric(metrics: Mapping, key: str, where: str) -> float:
    try:
        value = float(metrics[key])
    except KeyError:
        raise RegistryError(f"{where} lacks {key!r}") from None
    except (TypeError, ValueError):
        raise RegistryError(f"{where} field {key!r}={metrics[key]!r} is not a number") from None
    if math.isnan(value):
        raise RegistryError(f"{where} field {key!r} is NaN")
    return value


def default_gate(production: dict | None, new: dict) -> tuple[bool, str]:
    """Promote when there is no production model yet, else iff the new model's mean
    efficiency is within MEAN_EFFICIENCY_TOLERANCE and its P10 efficiency within
    P10_EFFICIENCY_TOLERANCE of production's. The reason states the figures."""
    new_mean = _metric(new, "mean_efficiency", "new metrics")
    new_p10 = _metric(new, "p10_efficiency", "new metrics")
    if production is None:
        return True, (f"no usable production version; promoting (mean_efficiency {new_mean:.4f}, "
                      f"p10_efficiency {new_p10:.4f})")
    prod_mean = _metric(production, "mean_efficiency", "production metrics")
    prod_p10 = _metric(production, "p10_efficiency", "production metrics")
    mean_floor = prod_mean - MEAN_EFFICIENCY_TOLERANCE
    p10_floor = prod_p10 - P10_EFFICIENCY_TOLERANCE
    mean_ok = new_mean >= mean_floor - _FLOAT_SLACK
    p10_ok = new_p10 >= p10_floor - _FLOAT_SLACK
    checks = [
        f"mean_efficiency {new_mean:.4f} {'>=' if mean_ok else '<'} production "
        f"{prod_mean:.4f} - {MEAN_EFFICIENCY_TOLERANCE} = {mean_floor:.4f}",
        f"p10_efficiency {new_p10:.4f} {'>=' if p10_ok else '<'} production "
        f"{prod_p10:.4f} - {P10_EFFICIENCY_TOLERANCE} = {p10_floor:.4f}",
    ]
    if mean_ok and p10_ok:
        return True, "promoted: " + "; ".join(checks)
    failed = [c for c, ok in zip(checks, (mean_ok, p10_ok)) if not ok]
    return False, "not promoted: " + "; ".join(failed)


def _relative_name(name: str) -> PurePosixPath:
    rel = PurePosixPath(name)
    if (not name or rel.is_absolute() or any(part in ("", ".", "..") for part in rel.parts)
            or "\\" in name):
        raise RegistryError(f"invalid artifact file name {name!r}: use a relative path "
                            "without '..'")
    return rel


def _write_file(target: Path, source) -> None:
    """Copy a Path (file or directory), or write bytes / str (UTF-8 text) into `target`."""
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
            raise RegistryError(f"artifact source {path} for {target.name!r} does not exist")
    else:
        raise RegistryError(f"artifact {target.name!r}: expected a Path, bytes or str, "
                            f"got {type(source).__name__}")


def _production_baseline(root, model: str) -> tuple[int | None, dict | None]:
    """(version, metrics) of the current production model; (None, None) when none is set or
    it is unusable (an alias pointing at a missing version, unreadable metrics): a publish
    must still be able to replace a broken production."""
    if not (_aliases_dir(root, model) / PRODUCTION).exists():
        return None, None
    try:
        version = read_alias(root, model, PRODUCTION)
        return version, read_metrics(root, model, version)
    except RegistryError:
        return None, None


def _claim(temp_dir: Path, versions_dir: Path, root, model: str) -> int:
    """Rename temp_dir onto the next free versions/<N>; a taken N makes rename fail
    (the directory is never empty), and N + 1 is tried."""
    number = max(list_versions(root, model), default=0) + 1
    for _ in range(MAX_CLAIM_ATTEMPTS):
        try:
            os.rename(temp_dir, versions_dir / str(number))
            return number
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY) and not isinstance(
                    err, FileExistsError):
                raise
        number += 1
    raise RegistryError(f"could not claim a version number for model {model!r} in "
                        f"{versions_dir} after {MAX_CLAIM_ATTEMPTS} attempts")


def publish(root, model: str, files: Mapping[str, Path | bytes | str], *,
            metrics: dict,
            aliases_if_promoted: Sequence[str] = (PRODUCTION,),
            gate: Gate | None = None) -> PublishResult:
    """Register the artifact `files` (name -> Path to copy, bytes, or str text) as the next
    version of `model`, with `metrics` written as metrics.json.

    The gate compares `metrics` with the production version's metrics.json (None when no
    production alias exists yet) and its decision is written into promotion.json before
    the version is claimed. A promoted version gets every alias in `aliases_if_promoted`,
    one that is not gets the alias "candidate". On any failure before the claim, nothing
    is left behind."""
    gate = gate or default_gate
    aliases = tuple(_check_name(a, "alias") for a in aliases_if_promoted)
    names = {name: _relative_name(name) for name in files}
    reserved = sorted(set(RESERVED_FILES) & {str(rel) for rel in names.values()})
    if reserved:
        raise RegistryError(f"artifact file(s) {reserved} are written by publish itself "
                            f"(metrics.json from the metrics argument); do not pass them")
    if not isinstance(metrics, Mapping):
        raise RegistryError(f"metrics must be a dict, got {type(metrics).__name__}")

    baseline_version, baseline_metrics = _production_baseline(root, model)
    promoted, reason = gate(baseline_metrics, dict(metrics))
    promoted = bool(promoted)
    new_aliases = aliases if promoted else (CANDIDATE,)

    versions_dir = _versions_dir(root, model)
    versions_dir.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=versions_dir))
    try:
        for name, source in files.items():
            _write_file(temp_dir / names[name], source)
        (temp_dir / METRICS_FILE).write_text(json.dumps(dict(metrics), indent=2, sort_keys=True))
        promotion = {
            "promoted": promoted, "reason": reason, "aliases": list(new_aliases),
            "baseline_alias": PRODUCTION, "baseline_version": baseline_version,
            "published_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        (temp_dir / PROMOTION_FILE).write_text(json.dumps(promotion, indent=2))
        version = _claim(temp_dir, versions_dir, root, model)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise

    path = versions_dir / str(version)
    for alias in new_aliases:
        try:
            set_alias(root, model, alias, version,
                      why="publish: " + ("promoted" if promoted else "not promoted"))
        except (OSError, RegistryError) as err:
            # The version is claimed and stays (versions are never rewritten or reused).
            raise RegistryError(f"version {version} of model {model!r} was written to {path} "
                                f"but alias {alias!r} could not be set: {err}") from err
    return PublishResult(version=version, promoted=promoted, reason=reason, path=path,
                         aliases=new_aliases)
