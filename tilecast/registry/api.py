"""The model registry: immutable numbered versions, alias pointers and their history.

Layout (DESIGN.md, Data contracts), the same under a local path and under a URL:

    <root>/<model>/versions/<N>/...     N = 1, 2, ...; created exclusively, never rewritten
    <root>/<model>/aliases/<alias>      one version number as text
    history of alias moves              what `rollback` replays

`root` is a local path (the default, tilecast.registry.local: a version is claimed by one
`os.rename` of a complete temp directory, history is `history.jsonl`), or an fsspec URL such
as `s3://bucket/prefix` or `memory://name` (tilecast.registry.remote: a version is claimed
with a create-if-absent object and becomes visible when its `.complete` marker is written;
each history entry is its own numbered object). `file://` URLs are local paths. Everything
above storage (names, the gate, promotion, rollback) is here and shared by both, so the
semantics are the same: readers only see complete versions and whole alias values, and two
concurrent publishers never get the same number.

Integrity: every version carries `checksums.json` (tilecast.registry.integrity), and
`local_copy`, which every loader goes through, verifies it first. Alias moves run under the
store's per-model lock (`flock` locally, a ticket of conditional writes remotely), so an
alias and the history's last entry always agree. Publish goes: stage the files and the
checksums, claim the number, move the aliases, write promotion.json last; a publish killed
at any point leaves no version that claims a promotion that did not happen.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Callable, Mapping, Sequence

from tilecast.registry import integrity
from tilecast.registry.base import (  # noqa: F401 - the registry's names, re-exported
    CANDIDATE, CHECKSUMS_FILE, CLAIM_FILE, COMPLETE_FILE, FLOAT_SLACK, HISTORY_FILE,
    MAX_CLAIM_ATTEMPTS, MEAN_TOLERANCE, METRICS_FILE, MODEL_RE, NAME_RE, P10_TOLERANCE,
    PRODUCTION, PROMOTION_FILE, RESERVED_FILES, STALE_TEMP_S, TEMP_PREFIX, RegistryError,
    relative_name)
from tilecast.registry.local import LocalStore
from tilecast.registry.remote import open_store

logger = logging.getLogger(__name__)

# gate(production metrics or None, new metrics) -> (promote?, reason with the figures)
Gate = Callable[[dict | None, dict], tuple[bool, str]]


@dataclass(frozen=True)
class PublishResult:
    """What publish() did: the version claimed, whether the gate promoted it and why.
    `path` is the version's directory (a Path) or, on a remote registry, its URL."""
    version: int
    promoted: bool
    reason: str
    path: Path | str
    aliases: tuple[str, ...] = ()


# -- roots ----------------------------------------------------------------------------------


def is_url(root) -> bool:
    """True for a 'scheme://...' string (or fsspec chain 'a::b://...'); Paths are local."""
    return isinstance(root, str) and "://" in root


def normalize_root(root) -> Path | str:
    """A registry root as callers should keep it: a resolved Path for a local path or a
    file:// URL, the URL itself (trailing '/' removed) for any other fsspec URL."""
    store = _store(root)
    return store.location if store.remote else store.root.resolve()


def is_remote(root) -> bool:
    """Whether `root` is an object store (a URL that is not file://)."""
    return _store(root).remote


def _store(root):
    """The storage backend of `root`: LocalStore for paths and file:// URLs, ObjectStore for
    other fsspec URLs (RegistryError naming the URL when its scheme has no implementation)."""
    if is_url(root):
        return open_store(root)
    if not isinstance(root, (str, os.PathLike)):
        raise RegistryError(f"registry root must be a path or a URL, got "
                            f"{type(root).__name__} {root!r}")
    return LocalStore(Path(root))


# -- names ----------------------------------------------------------------------------------


def _check_name(value: str, what: str) -> str:
    pattern = MODEL_RE if what == "model" else NAME_RE
    if not isinstance(value, str) or not pattern.match(value) or value in (".", ".."):
        extra = " (and '@<hardware class>')" if what == "model" else ""
        raise RegistryError(f"invalid {what} name {value!r}: use letters, digits, '_', '.', "
                            f"'-'{extra}")
    return value


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


def _is_number(alias_or_version) -> bool:
    return isinstance(alias_or_version, int) or (
        isinstance(alias_or_version, str) and alias_or_version.strip().isdigit())


# -- reading --------------------------------------------------------------------------------


def list_models(root) -> list[str]:
    """Names of the models under `root` (those with a versions/ directory), sorted."""
    return _store(root).model_names()


def serving_name(root, model: str, host: str | None = None) -> str:
    """The registered model that serves `model` on hardware class `host` (default: this
    host's, at the thread count its kernels will run with): tilecast.registry.classes. A
    classless table model (imported measurements of other devices) is served as it is."""
    from tilecast.registry import classes
    from tilecast.core import kinds

    names = list_models(root)
    if classes.split(model)[1] is None and model in names and not classes.classes(names, model):
        try:
            version = resolve_version(root, model, PRODUCTION)
            spec = json.loads(read_version_file(root, model, version, "feature_spec.json"))
            if not kinds.of_spec(spec).hardware_classes:
                return model
        except (RegistryError, ValueError):
            pass   # the loader reports what is wrong with the version
    return classes.serving_model(names, model, host or classes.host_class(), str(root))


def list_versions(root, model: str) -> list[int]:
    """The complete version numbers of `model`, ascending; [] when it has none."""
    return _store(root).version_numbers(_check_name(model, "model"))


def _require_version(store, root, model: str, version) -> int:
    number = _version_number(version)
    if not store.has_version(model, number):
        known = list_versions(root, model)
        raise RegistryError(f"model {model!r} has no version {number} (no "
                            f"{store.version_ref(model, number)}); existing versions: "
                            f"{known or 'none'}")
    return number


def version_path(root, model: str, version) -> Path | str:
    """The directory (a Path; on a remote registry, the URL) of an existing version;
    RegistryError naming it when absent."""
    store = _store(root)
    number = _require_version(store, root, _check_name(model, "model"), version)
    return store.version_location(model, number)


def list_aliases(root, model: str) -> dict[str, int | None]:
    """Every alias of `model` and the version it holds (None when the value is unreadable)."""
    store = _store(root)
    return {alias: _alias_value(store, _check_name(model, "model"), alias)
            for alias in store.alias_names(model)}


def _alias_value(store, model: str, alias: str) -> int | None:
    """The number an alias holds; None when it is missing or unreadable."""
    try:
        return _version_number(store.read_alias_text(model, alias).strip())
    except (OSError, RegistryError):
        return None


def read_alias(root, model: str, alias: str) -> int:
    """The version `alias` points at; RegistryError when the alias is missing, corrupt or
    points at a version that does not exist (the message names both)."""
    store = _store(root)
    _check_name(model, "model")
    _check_name(alias, "alias")
    where = store.alias_ref(model, alias)
    try:
        text = store.read_alias_text(model, alias)
    except FileNotFoundError:
        known = sorted(list_aliases(root, model))
        raise RegistryError(f"model {model!r} has no alias {alias!r} (no file {where}); "
                            f"existing aliases: {known or 'none'}") from None
    except OSError as err:
        raise RegistryError(f"cannot read alias file {where}: {err}") from None
    try:
        number = _version_number(text.strip())
    except RegistryError:
        raise RegistryError(f"alias file {where} holds {text.strip()!r}, "
                            f"not a version number") from None
    if not store.has_version(model, number):
        raise RegistryError(f"alias {alias!r} of model {model!r} points at version {number}, "
                            f"which does not exist (no {store.version_ref(model, number)})")
    return number


def resolve_version(root, model: str, alias_or_version: str | int = PRODUCTION) -> int:
    """The number of an existing version given as an alias ("production") or a number."""
    if _is_number(alias_or_version):
        return _require_version(_store(root), root, _check_name(model, "model"),
                                alias_or_version)
    return read_alias(root, model, alias_or_version)


def resolve(root, model: str, alias_or_version: str | int = PRODUCTION) -> Path | str:
    """The directory (on a remote registry, the URL) of a version given as an alias
    ("production") or a number (3, "3")."""
    return version_path(root, model, resolve_version(root, model, alias_or_version))


def local_copy(root, model: str, alias_or_version: str | int = PRODUCTION, *,
               cache_dir=None) -> Path:
    """A local directory holding the version's files, named after its number, verified
    against the version's checksums: the version itself in a local registry; on a remote
    registry, a copy downloaded once into the cache (tilecast.registry.cache; `cache_dir`
    overrides where). RegistryError naming the file when one is missing or damaged; a
    version published before checksums were kept is returned with a warning."""
    number = resolve_version(root, model, alias_or_version)
    store = _store(root)
    where = f"version {number} of model {model!r} at {store.version_location(model, number)}"

    def check(directory: Path) -> None:
        if integrity.verify_directory(directory, where) is None:
            logger.warning("%s has no %s (published before checksums were kept): loading it "
                           "without an integrity check; publish it again to add one", where,
                           CHECKSUMS_FILE)

    return store.local_copy(model, number, cache_dir, check)


def read_version_file(root, model: str, version, name: str) -> bytes:
    """The bytes of one file of a version; RegistryError naming it when missing."""
    store = _store(root)
    number = _require_version(store, root, _check_name(model, "model"), version)
    try:
        return store.read_file(model, number, str(relative_name(name)))
    except FileNotFoundError:
        raise RegistryError(f"version {number} of model {model!r} has no {name} "
                            f"(no file {store.file_ref(model, number, name)})") from None
    except OSError as err:
        raise RegistryError(f"cannot read {store.file_ref(model, number, name)}: {err}") from None


def read_metrics(root, model: str, version) -> dict:
    """metrics.json of one version; RegistryError naming the file when missing or corrupt."""
    text = read_version_file(root, model, version, METRICS_FILE)
    where = _store(root).file_ref(model, _version_number(version), METRICS_FILE)
    try:
        metrics = json.loads(text)
    except ValueError as err:
        raise RegistryError(f"cannot read {where}: {err}") from None
    if not isinstance(metrics, dict):
        raise RegistryError(f"{where} holds a {type(metrics).__name__}, expected an object")
    return metrics


# -- writing --------------------------------------------------------------------------------


def set_alias(root, model: str, alias: str, version, *, why: str = "") -> int | None:
    """Point `alias` at an existing version, atomically (a local temp file + os.replace, or
    one object PUT), and log the move in the history, both under the model's lock. Returns
    the version the alias held before (None if new), as read under that lock."""
    store = _store(root)
    _check_name(model, "model")
    _check_name(alias, "alias")
    number = _require_version(store, root, model, version)
    with store.locked(model):
        return _move_alias(store, model, alias, number, why)


def _move_alias(store, model: str, alias: str, number: int, why: str) -> int | None:
    """Move `alias` to `number` and log it; the caller holds the model's lock. The alias is
    written before its history entry, so a writer killed between the two leaves an alias
    the history does not know yet: logged here, before this move, as a repair."""
    previous = _alias_value(store, model, alias)
    try:
        last = _last_move(store, model, alias)
        if previous is not None and last is not None and last.get("version") != previous:
            _log_move(store, model, {
                "alias": alias, "version": previous, "previous": last.get("version"),
                "why": f"repair: the alias held {previous} but the history ended at "
                       f"{last.get('version')} (a move was interrupted)"})
        store.write_alias(model, alias, number)
        _log_move(store, model, {"alias": alias, "version": number, "previous": previous,
                                 "why": why})
    except OSError as err:
        raise RegistryError(f"cannot move alias {alias!r} of model {model!r} "
                            f"({store.alias_ref(model, alias)}): {err}") from None
    return previous


def _log_move(store, model: str, entry: dict) -> None:
    """Record one alias move; never interleaved with a concurrent writer's (see the stores)."""
    store.append_move(model, {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              **entry})


def _parse_moves(texts, alias: str | None) -> list[dict]:
    """The JSON history entries among `texts` (of `alias` when given); a torn or unreadable
    entry (a writer killed mid-write) is skipped."""
    moves = []
    for text in texts:
        try:
            entry = json.loads(text)
        except ValueError:
            continue
        if isinstance(entry, dict) and (alias is None or entry.get("alias") == alias):
            moves.append(entry)
    return moves


def _last_move(store, model: str, alias: str) -> dict | None:
    if store.remote:  # one object, not the whole history
        moves = _parse_moves(store.history_texts(model, alias, tail=1), alias)
    else:
        moves = _parse_moves(store.history_texts(model, alias), alias)
    return moves[-1] if moves else None


def alias_history(root, model: str, alias: str | None = None) -> list[dict]:
    """The alias moves of `model`, oldest first (only `alias`'s when given); a torn or
    unreadable entry (a writer killed mid-write) is skipped."""
    return _parse_moves(_store(root).history_texts(_check_name(model, "model"), alias), alias)


def promote(root, model: str, version, alias: str = PRODUCTION) -> int | None:
    """Point `alias` (production by default) at `version` by hand; returns the previous one."""
    return set_alias(root, model, alias, version, why="promote")


def promotion_stack(moves: Sequence[Mapping]) -> list[int]:
    """The versions an alias was promoted to, replayed from its history, most recent last,
    each once: a move puts its version on top (taking it from lower down if it was there),
    a rollback also takes off the version it rolled back from. So a rollback goes to the
    version promoted before the current one, and repeated rollbacks walk further back
    (after promotes of 3, 2, 3: 3 -> 2 -> whatever came before, never back to 3)."""
    stack: list[int] = []
    for move in moves:
        version = move.get("version")
        if not isinstance(version, int):
            continue
        if str(move.get("why", "")).startswith("rollback") and move.get("previous") in stack:
            stack.remove(move.get("previous"))
        if version in stack:
            stack.remove(version)
        stack.append(version)
    return stack


def rollback(root, model: str, alias: str = PRODUCTION) -> int:
    """Move `alias` back to the version promoted before its current one (skipping versions
    that no longer exist), under the model's lock; returns that version. RegistryError when
    there is none."""
    store = _store(root)
    read_alias(root, model, alias)  # checks the names and that there is something to move
    with store.locked(model):
        current = read_alias(root, model, alias)
        existing = set(list_versions(root, model))
        earlier = [v for v in promotion_stack(alias_history(root, model, alias))
                   if v in existing and v != current]
        if not earlier:
            raise RegistryError(f"alias {alias!r} of model {model!r} (at version {current}) "
                                f"has no earlier version to roll back to")
        _move_alias(store, model, alias, earlier[-1], f"rollback from {current}")
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
    efficiency is within MEAN_TOLERANCE and its P10 efficiency within
    P10_TOLERANCE of production's. The reason states the figures."""
    new_mean = _metric(new, "mean_efficiency", "new metrics")
    new_p10 = _metric(new, "p10_efficiency", "new metrics")
    if production is None:
        return True, (f"no usable production version; promoting (mean_efficiency {new_mean:.4f}, "
                      f"p10_efficiency {new_p10:.4f})")
    prod_mean = _metric(production, "mean_efficiency", "production metrics")
    prod_p10 = _metric(production, "p10_efficiency", "production metrics")
    mean_floor = prod_mean - MEAN_TOLERANCE
    p10_floor = prod_p10 - P10_TOLERANCE
    mean_ok = new_mean >= mean_floor - FLOAT_SLACK
    p10_ok = new_p10 >= p10_floor - FLOAT_SLACK
    checks = [
        f"mean_efficiency {new_mean:.4f} {'>=' if mean_ok else '<'} production "
        f"{prod_mean:.4f} - {MEAN_TOLERANCE} = {mean_floor:.4f}",
        f"p10_efficiency {new_p10:.4f} {'>=' if p10_ok else '<'} production "
        f"{prod_p10:.4f} - {P10_TOLERANCE} = {p10_floor:.4f}",
    ]
    if mean_ok and p10_ok:
        return True, "promoted: " + "; ".join(checks)
    failed = [c for c, ok in zip(checks, (mean_ok, p10_ok)) if not ok]
    return False, "not promoted: " + "; ".join(failed)


def _production_baseline(root, model: str, held: int | None) -> tuple[int | None, dict | None]:
    """(version, metrics) of the production version `held` (the alias's value); (None, None)
    when none is set or it is unusable (an alias pointing at a missing version, unreadable
    metrics): a publish must still be able to replace a broken production."""
    if held is None:
        return None, None
    try:
        return held, read_metrics(root, model, held)
    except RegistryError:
        return None, None


def publish(root, model: str, files: Mapping[str, Path | bytes | str], *,
            metrics: dict,
            aliases_if_promoted: Sequence[str] = (PRODUCTION,),
            gate: Gate | None = None) -> PublishResult:
    """Register the artifact `files` (name -> Path to copy, bytes, or str text) as the next
    version of `model`, with `metrics` written as metrics.json and the sha256 of every file
    as checksums.json.

    The gate compares `metrics` with the production version's metrics.json (None when no
    production alias exists yet). A promoted version gets every alias in
    `aliases_if_promoted`, one that is not gets the alias "candidate"; if production moved
    while this version was being published, the gate's comparison is stale and the version
    becomes a candidate too (the reason says so). The decision is written as promotion.json
    last, after the aliases moved. On any failure before the claim, nothing is left behind;
    a publish killed after it leaves a version without promotion.json that no alias moved
    to (on a remote registry, a failure before the claim's .complete marker leaves an
    invisible version whose number is not reused)."""
    gate = gate or default_gate
    store = _store(root)
    _check_name(model, "model")
    aliases = tuple(_check_name(a, "alias") for a in aliases_if_promoted)
    names = {name: relative_name(name) for name in files}
    reserved = sorted(set(RESERVED_FILES) & {str(rel) for rel in names.values()})
    if reserved:
        raise RegistryError(f"artifact file(s) {reserved} are written by publish itself "
                            f"(metrics.json from the metrics argument); do not pass them")
    if not isinstance(metrics, Mapping):
        raise RegistryError(f"metrics must be a dict, got {type(metrics).__name__}")

    held = _alias_value(store, model, PRODUCTION)
    baseline_version, baseline_metrics = _production_baseline(root, model, held)
    promoted, reason = gate(baseline_metrics, dict(metrics))
    promoted = bool(promoted)

    stage = store.stage(model)
    try:
        for name, source in files.items():
            stage.add(names[name], source)
        stage.add(PurePosixPath(METRICS_FILE),
                  json.dumps(dict(metrics), indent=2, sort_keys=True))
        stage.add(PurePosixPath(CHECKSUMS_FILE), integrity.manifest_text(stage.digests()))
        # The first number to try comes from a listing that may be stale by the time of the
        # claim; the claim itself is what guarantees a number is never taken twice.
        version = stage.commit(max(list_versions(root, model), default=0) + 1)
    finally:
        stage.discard()

    path = store.version_location(model, version)
    try:
        with store.locked(model):
            now_held = _alias_value(store, model, PRODUCTION)
            if promoted and now_held != held:
                promoted = False
                reason = (f"not promoted: production moved from version {held} to "
                          f"{now_held} while version {version} was being published, so the "
                          f"gate compared it with a version that is no longer production; "
                          f"publish again or promote it by hand [gate: {reason}]")
            new_aliases = aliases if promoted else (CANDIDATE,)
            for alias in new_aliases:
                _move_alias(store, model, alias, version,
                            "publish: " + ("promoted" if promoted else "not promoted"))
    except RegistryError as err:
        # The version is claimed and stays (versions are never rewritten or reused).
        raise RegistryError(f"version {version} of model {model!r} was written to {path} "
                            f"but its aliases could not be set: {err}") from err
    promotion = {
        "promoted": promoted, "reason": reason, "aliases": list(new_aliases),
        "baseline_alias": PRODUCTION, "baseline_version": baseline_version,
        "published_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        store.write_version_file(model, version, PROMOTION_FILE,
                                 json.dumps(promotion, indent=2).encode())
    except (OSError, RegistryError) as err:
        raise RegistryError(f"version {version} of model {model!r} was published to {path} "
                            f"and its aliases {list(new_aliases)} moved, but "
                            f"{PROMOTION_FILE} could not be written: {err}") from err
    return PublishResult(version=version, promoted=promoted, reason=reason, path=path,
                         aliases=new_aliases)
