"""The registry on an object store through fsspec (`s3://bucket/prefix`, `memory://name`).

An object store has no rename and no append, so the local registry's tricks do not carry
over. Layout under the root URL:

    <model>/versions/<N>/.claim         {"token", "host", "pid", "claimed_at"}: N is taken
    <model>/versions/<N>/<files>        the artifact files, metrics.json, promotion.json
    <model>/versions/<N>/.complete      {"token", "files": {name: bytes}, "completed_at"}
    <model>/aliases/<alias>             the version number as text
    <model>/history/<S>-<alias>.json    one alias move per object, S = 1, 2, ...
    <model>/lock/<G>, <G>.released      the alias lock's tickets, G = 1, 2, ...

Claiming N is one create-if-absent write of `versions/<N>/.claim`: on S3 a PUT with
`If-None-Match: *` (s3fs `pipe_file(mode="create")`). S3 decides the condition atomically with
the write, so of any number of publishers putting the same key at most one succeeds; the
others get 412 Precondition Failed (FileExistsError here) and try N + 1, or 409
ConditionalRequestConflict while the winner's PUT is still in flight, and retry the same key.
Nothing ever overwrites or deletes a claim, so N has at most one owner, and only the owner
writes under versions/<N>/. A PUT whose success answer was lost and is retried by the client
gets 412 and moves on: N is then burned (never completed), still never shared. A weaker
scheme would not do: writing a claim and reading it back is last-writer-wins (both
publishers can read back their own token before the other's write lands), and a lock
object with a lease needs a create-if-absent of its own plus trusted clocks.

The owner writes every file, then `.complete` (with the files' sizes, used to check
downloads). Readers list and resolve only versions with `.complete`; S3 PUTs are atomic per
object and reads and listings are strongly consistent, so a reader never sees half a version.
After claiming, the publisher reads its claim back and checks that no `.complete` exists yet:
on a server that honours `If-None-Match` neither check can fail, on one that silently
ignores it publishing stops there instead of overwriting a version.

An alias is one small object replaced by a single PUT (readers see the old or the new
number). A history entry is its own object whose sequence number S is claimed the same way
as N, so two concurrent moves are both kept (rewriting one history.jsonl would lose one).

An alias move (read the old value, PUT the alias, add the history entry) runs under the
model's lock, so the alias always agrees with the history's last entry and the old value
a move reports is the one it replaced. The lock is a sequence of tickets claimed with the
same create-if-absent: holding it means having created `lock/<G>` for the highest G while
`lock/<G-1>` was released (`lock/<G-1>.released` exists); of concurrent claimers of G at
most one succeeds. Nothing is deleted, so a ticket number is never reused (no ABA). A
holder that died leaves its ticket unreleased: a waiter that has seen the same ticket held
for LOCK_STALE_S by its own clock (no clocks are compared between machines) claims G + 1
over it. Moves take milliseconds; a holder paused longer than that is the one case two
moves could overlap.

Only backends whose create-if-absent is atomic can be written (ATOMIC_CREATE); any fsspec
backend can be read. Credentials and endpoints come from the backend's usual environment
(for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, ...).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

from tilecast.registry import cache, integrity
from tilecast.registry.base import (CLAIM_FILE, COMPLETE_FILE, MAX_CLAIM_ATTEMPTS, MODEL_RE,
                                    NAME_RE, RegistryError, relative_name)
from tilecast.registry.local import LocalStore

logger = logging.getLogger(__name__)

# protocol -> the lock that makes its create-if-absent atomic (None: the server does)
ATOMIC_CREATE: dict[str, threading.Lock | None] = {
    "s3": None,                   # PUT with If-None-Match: *, decided by S3
    "s3a": None,
    "memory": threading.Lock(),   # one process's dict: check-and-write under a lock
}
CONFLICT_RETRIES = 6              # 409 ConditionalRequestConflict: same key again, backing off
CONFLICT_BACKOFF_S = 0.05
HISTORY_DIGITS = 10
LOCK_DIR = "lock"
RELEASED_SUFFIX = ".released"
LOCK_STALE_S = 30.0               # a ticket held this long (as one waiter sees it) was abandoned
LOCK_POLL_S = (0.01, 0.2)         # a waiter's first and longest pause between looks
INSTALL_HINTS = {"s3": "pip install 'tilecast[s3]'", "s3a": "pip install 'tilecast[s3]'"}


def open_store(url: str):
    """The store for a registry URL: a LocalStore for file:// (a local path keeps its
    stronger guarantees), an ObjectStore otherwise. RegistryError naming the URL when fsspec
    has no implementation for its scheme."""
    # fsspec would add to every `import tilecast.runtime.dispatch`; only a URL registry needs it
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem   # fsspec: remote only

    scheme = url.split("://", 1)[0].split("::")[-1]
    try:
        # no listings cache: a long-lived reader (serving.refresh) must see new versions
        fs, path = url_to_fs(url, use_listings_cache=False)
    except ImportError as err:
        hint = INSTALL_HINTS.get(scheme, f"install the fsspec implementation of {scheme}://")
        raise RegistryError(f"registry {url}: no fsspec implementation of {scheme}:// is "
                            f"installed ({err}); {hint}") from None
    except ValueError as err:
        raise RegistryError(f"registry {url}: fsspec cannot open this URL ({err})") from None
    if isinstance(fs, LocalFileSystem):
        return LocalStore(Path(path))
    return ObjectStore(fs, path.rstrip("/"), url.rstrip("/"))


def storage_errors() -> tuple[type[BaseException], ...]:
    """OSError, plus botocore's errors once s3fs has loaded it: s3fs translates S3's error
    answers into OSErrors but lets connection errors (EndpointConnectionError) through."""
    errors: list[type[BaseException]] = [OSError]
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None:
        errors += [botocore.BotoCoreError, botocore.ClientError]
    return tuple(errors)


def _is_conflict(err: BaseException) -> bool:
    """S3's 409 ConditionalRequestConflict (a concurrent conditional PUT of the same key is
    in flight), which s3fs passes on as a plain OSError caused by the ClientError."""
    for candidate in (err, err.__cause__):
        response = getattr(candidate, "response", None)
        if isinstance(response, dict) and \
                response.get("Error", {}).get("Code") == "ConditionalRequestConflict":
            return True
    return False


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class ObjectStore:
    """A registry under an fsspec URL; see the module docstring for layout and claiming."""

    remote = True

    def __init__(self, fs, path: str, url: str):
        self.fs, self.path, self.location = fs, path, url
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.protocols = tuple(protocols)
        self._errors = storage_errors()

    # -- places ---------------------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return "/".join([self.path, *parts])

    def _url(self, *parts: str) -> str:
        return "/".join([self.location, *parts])

    def version_location(self, model: str, number: int) -> str:
        return self._url(model, "versions", str(number))

    def version_ref(self, model: str, number: int) -> str:
        return f"complete marker {self._url(model, 'versions', str(number), COMPLETE_FILE)}"

    def file_ref(self, model: str, number: int, name: str) -> str:
        return self._url(model, "versions", str(number), name)

    def alias_ref(self, model: str, alias: str) -> str:
        return self._url(model, "aliases", alias)

    # -- errors ---------------------------------------------------------------------------

    def _error(self, what: str, err: BaseException) -> RegistryError:
        return RegistryError(f"registry {self.location}: cannot {what}: "
                             f"{type(err).__name__}: {err}")

    @contextmanager
    def _io(self, what: str):
        """Storage errors as RegistryError naming the URL; FileNotFoundError and
        FileExistsError pass, callers give them their meaning."""
        try:
            yield
        except (FileNotFoundError, FileExistsError):
            raise
        except self._errors as err:
            raise self._error(what, err) from err

    def _check_container(self) -> None:
        """On a bucket store (root_marker ''), the URL's first component is the bucket; an
        empty listing under a missing bucket is an error, not an empty registry."""
        bucket = self.path.split("/", 1)[0]
        if self.fs.root_marker != "" or not bucket:
            return
        with self._io(f"reach bucket {bucket!r}"):
            try:
                found = self.fs.exists(bucket)
            except FileNotFoundError:
                found = False
        if not found:
            raise RegistryError(
                f"registry {self.location} is unreachable: bucket {bucket!r} does not exist "
                f"or cannot be seen with these credentials; check the URL and the endpoint "
                f"and credentials in the environment (e.g. AWS_ENDPOINT_URL, AWS_PROFILE)")

    def _children(self, *parts: str) -> list[str]:
        """Names directly under a prefix; [] when there is none (in an existing bucket)."""
        prefix = self._key(*parts)
        with self._io(f"list {self._url(*parts)}"):
            try:
                entries = self.fs.ls(prefix, detail=False)
            except FileNotFoundError:
                entries = []
        names = sorted({PurePosixPath(e.rstrip("/")).name for e in entries
                        if e.strip("/") != prefix.strip("/")})
        if not names:
            self._check_container()
        return names

    def _files(self, *parts: str) -> list[str]:
        """Every object under a prefix, relative to it; [] when there is none."""
        prefix = self._key(*parts).strip("/") + "/"
        with self._io(f"list {self._url(*parts)}"):
            try:
                found = self.fs.find(prefix)
            except FileNotFoundError:
                found = []
        relative = [key.strip("/")[len(prefix):] for key in found
                    if key.strip("/").startswith(prefix)]
        if not relative:
            self._check_container()
        return relative

    # -- reading --------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        names = [name for name in self._children() if MODEL_RE.match(name)]
        with self._io(f"list {self.location}"):
            return [name for name in names if self.fs.isdir(self._key(name, "versions"))]

    def version_numbers(self, model: str) -> list[int]:
        numbers = set()
        for rel in self._files(model, "versions"):
            head, _, tail = rel.partition("/")
            if tail == COMPLETE_FILE and head.isdigit() and not head.startswith("0"):
                numbers.add(int(head))
        return sorted(numbers)

    def has_version(self, model: str, number: int) -> bool:
        marker = self._key(model, "versions", str(number), COMPLETE_FILE)
        with self._io(f"read {self.version_ref(model, number)}"):
            return self.fs.isfile(marker)

    def read_file(self, model: str, number: int, name: str) -> bytes:
        with self._io(f"read {self.file_ref(model, number, name)}"):
            return self.fs.cat_file(self._key(model, "versions", str(number), name))

    def alias_names(self, model: str) -> list[str]:
        return [name for name in self._children(model, "aliases") if NAME_RE.match(name)]

    def read_alias_text(self, model: str, alias: str) -> str:
        with self._io(f"read {self.alias_ref(model, alias)}"):
            data = self.fs.cat_file(self._key(model, "aliases", alias))
        return data.decode("utf-8", errors="replace")

    def _history_entries(self, model: str) -> list[tuple[int, str, str]]:
        """(sequence number, alias, object name) of every history entry, in order."""
        entries = []
        for name in self._children(model, "history"):
            seq, _, rest = name.partition("-")
            if seq.isdigit() and rest.endswith(".json"):
                entries.append((int(seq), rest[:-len(".json")], name))
        return sorted(entries)

    def history_texts(self, model: str, alias: str | None = None,
                      tail: int | None = None) -> list[str]:
        """The moves (of `alias` when given; only the last `tail` of them when given) as
        JSON texts, oldest first."""
        names = [name for _, entry_alias, name in self._history_entries(model)
                 if alias is None or entry_alias == alias]
        if tail is not None:
            names = names[-tail:] if tail > 0 else []
        if not names:
            return []
        keys = [self._key(model, "history", name) for name in names]
        with self._io(f"read {self._url(model, 'history')}"):
            found = self.fs.cat(keys, on_error="omit")  # one batch, concurrent where possible
        by_name = {PurePosixPath(key).name: data for key, data in found.items()}
        return [by_name[name].decode("utf-8", errors="replace")
                for name in names if name in by_name]

    def _manifest(self, model: str, number: int) -> dict:
        """The version's .complete marker: {"token": str, "files": {name: bytes}}."""
        url = self._url(model, "versions", str(number), COMPLETE_FILE)
        try:
            manifest = json.loads(self.read_file(model, number, COMPLETE_FILE))
        except FileNotFoundError:
            raise RegistryError(f"model {model!r} has no version {number} "
                                f"(no complete marker {url})") from None
        except ValueError as err:
            raise RegistryError(f"corrupt complete marker {url}: {err}") from None
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict) or not isinstance(manifest.get("token"), str) or \
                not all(isinstance(size, int) for size in files.values()):
            raise RegistryError(f"corrupt complete marker {url}: expected "
                                f'{{"token": str, "files": {{name: bytes}}}}')
        for name in files:
            relative_name(name)  # a marker must not write outside the cache directory
        return manifest

    def local_copy(self, model: str, number: int, cache_dir=None, check=None) -> Path:
        """The version downloaded once into the cache (tilecast.registry.cache), keyed by
        URL, model, version and the publisher's token: immutable, so never re-fetched unless
        `check(directory)` (the checksums) finds the cached copy damaged."""
        manifest = self._manifest(model, number)

        def download(name: str, target: Path) -> None:
            url = self.file_ref(model, number, name)
            with self._io(f"download {url}"):
                try:
                    self.fs.get_file(self._key(model, "versions", str(number), name),
                                     str(target))
                except FileNotFoundError:
                    raise RegistryError(f"version {number} of model {model!r} lists {name} "
                                        f"in its complete marker, but {url} is missing") from None

        key = (self.location, model, number, manifest["token"])
        return cache.materialize(key, str(number), manifest["files"], download,
                                 cache_dir=cache_dir, check=check)

    # -- writing --------------------------------------------------------------------------

    def _create_lock(self):
        """The lock of the first protocol whose create-if-absent is atomic; RegistryError
        for a backend tilecast cannot claim numbers on."""
        for protocol in self.protocols:
            if protocol in ATOMIC_CREATE:
                return ATOMIC_CREATE[protocol] or nullcontext()
        raise RegistryError(
            f"registry {self.location}: cannot write to {self.protocols[0]}:// registries: "
            f"claiming version numbers needs an atomic create-if-absent, which tilecast knows "
            f"for {', '.join(p + '://' for p in ATOMIC_CREATE)} only (reading works)")

    def _create_exclusive(self, key: str, data: bytes) -> None:
        """Write `data` at `key` only if nothing is there; FileExistsError when something is."""
        lock = self._create_lock()
        for attempt in range(CONFLICT_RETRIES + 1):
            try:
                with lock:
                    self.fs.pipe_file(key, data, mode="create")
                return
            except FileExistsError:
                raise
            except self._errors as err:
                if not _is_conflict(err) or attempt == CONFLICT_RETRIES:
                    raise self._error(f"create {key}", err) from err
            time.sleep(CONFLICT_BACKOFF_S * 2 ** attempt)

    def claim_version(self, model: str, first_number: int, token: str) -> int:
        """The first N >= first_number whose .claim this call created (see module docstring)."""
        claim = json.dumps({"token": token, "host": socket.gethostname(), "pid": os.getpid(),
                            "claimed_at": _now()}).encode()
        number = first_number
        for _ in range(MAX_CLAIM_ATTEMPTS):
            try:
                self._create_exclusive(self._key(model, "versions", str(number), CLAIM_FILE),
                                       claim)
            except FileExistsError:
                number += 1
                continue
            self._verify_claim(model, number, token)
            return number
        raise RegistryError(f"could not claim a version number for model {model!r} in "
                            f"{self._url(model, 'versions')} after {MAX_CLAIM_ATTEMPTS} attempts")

    def _verify_claim(self, model: str, number: int, token: str) -> None:
        """Our token in the claim and no .complete yet, else the store ignored the condition."""
        base = ("versions", str(number))
        with self._io(f"read back the claim of version {number}"):
            try:
                held = json.loads(self.fs.cat_file(self._key(model, *base, CLAIM_FILE)))
            except (FileNotFoundError, ValueError):
                held = None
            complete = self.fs.isfile(self._key(model, *base, COMPLETE_FILE))
        if complete or not isinstance(held, dict) or held.get("token") != token:
            raise RegistryError(
                f"registry {self.location} does not honour create-if-absent writes: the claim "
                f"of version {number} of model {model!r} ({self._url(model, *base)}) is not "
                f"this publisher's{' and the version is complete' if complete else ''}; "
                f"refusing to write into it (the server must support PUT with If-None-Match: *)")

    @contextmanager
    def locked(self, model: str):
        """Hold the model's alias lock (see the module docstring) for the block."""
        self._create_lock()  # writes only where publishing is possible
        ticket = self._acquire(model)
        try:
            yield
        finally:
            self._release(model, ticket)

    def _tickets(self, model: str) -> tuple[int, bool]:
        """(highest ticket number, 0 when none; whether that ticket is released)."""
        names = self._children(model, LOCK_DIR)
        numbers = [int(name) for name in names if name.isdigit()]
        top = max(numbers, default=0)
        return top, top == 0 or f"{top:0{HISTORY_DIGITS}d}{RELEASED_SUFFIX}" in names

    def _acquire(self, model: str) -> int:
        """Claim the next ticket once the current one is released or abandoned."""
        holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "acquired_at": _now()}).encode()
        watched, since, pause = None, time.monotonic(), LOCK_POLL_S[0]
        while True:
            top, released = self._tickets(model)
            if top != watched:
                watched, since = top, time.monotonic()
            if released or time.monotonic() - since > LOCK_STALE_S:
                if not released:
                    logger.warning("registry %s: alias lock ticket %d of model %r held for "
                                   "over %.0f s; taking the lock over", self.location, top,
                                   model, LOCK_STALE_S)
                try:
                    self._create_exclusive(self._key(model, LOCK_DIR,
                                                     f"{top + 1:0{HISTORY_DIGITS}d}"), holder)
                    return top + 1
                except FileExistsError:
                    continue  # another mover took it: look again at once
            time.sleep(pause)
            pause = min(pause * 2, LOCK_POLL_S[1])

    def _release(self, model: str, ticket: int) -> None:
        """Mark the ticket released; a failure only makes the next mover wait LOCK_STALE_S."""
        key = self._key(model, LOCK_DIR, f"{ticket:0{HISTORY_DIGITS}d}{RELEASED_SUFFIX}")
        try:
            self.fs.pipe_file(key, _now().encode())
        except self._errors as err:
            logger.warning("registry %s: could not release alias lock ticket %d of model %r "
                           "(%s); the next move waits %.0f s for it", self.location, ticket,
                           model, err, LOCK_STALE_S)

    def write_alias(self, model: str, alias: str, number: int) -> None:
        self._create_lock()  # writes only where publishing is possible
        with self._io(f"write {self.alias_ref(model, alias)}"):
            self.fs.pipe_file(self._key(model, "aliases", alias), f"{number}\n".encode())

    def append_move(self, model: str, entry: dict) -> None:
        """One new history object, its sequence number claimed like a version number."""
        data = json.dumps(entry, sort_keys=True).encode()
        seq = max((s for s, _, _ in self._history_entries(model)), default=0) + 1
        for _ in range(MAX_CLAIM_ATTEMPTS):
            name = f"{seq:0{HISTORY_DIGITS}d}-{entry['alias']}.json"
            try:
                self._create_exclusive(self._key(model, "history", name), data)
                return
            except FileExistsError:
                seq += 1
        raise RegistryError(f"could not append to the history {self._url(model, 'history')} "
                            f"after {MAX_CLAIM_ATTEMPTS} attempts")

    def write_version_file(self, model: str, number: int, name: str, data: bytes) -> None:
        """Add a file to a complete version (its owner only: promotion.json, written last)."""
        with self._io(f"write {self.file_ref(model, number, name)}"):
            self.fs.pipe_file(self._key(model, "versions", str(number), name), data)

    def stage(self, model: str) -> "ObjectStage":
        return ObjectStage(self, model)

    def _remove_quietly(self, keys: list[str]) -> None:
        """Best effort: what a failed publish wrote (its claim stays, the number is burned)."""
        if keys:
            try:
                self.fs.rm(keys)
            except self._errors:
                pass


class ObjectStage:
    """A version collected in memory (sources checked, nothing written); `commit` claims a
    number, writes the files, then the .complete marker."""

    def __init__(self, store: ObjectStore, model: str):
        store._create_lock()  # refuse before anything is read or written
        self.store, self.model = store, model
        self.uploads: list[tuple[str, bytes | Path]] = []

    def add(self, name: PurePosixPath, source) -> None:
        """Queue a Path (file or directory), or bytes / str (UTF-8 text), as `name`."""
        if isinstance(source, (bytes, bytearray, memoryview)):
            self.uploads.append((str(name), bytes(source)))
        elif isinstance(source, str):
            self.uploads.append((str(name), source.encode("utf-8")))
        elif isinstance(source, os.PathLike):
            path = Path(source)
            if path.is_dir():
                self.uploads += [(str(name / f.relative_to(path).as_posix()), f)
                                 for f in sorted(path.rglob("*")) if f.is_file()]
            elif path.is_file():
                self.uploads.append((str(name), path))
            else:
                raise RegistryError(f"artifact source {path} for {str(name)!r} does not exist")
        else:
            raise RegistryError(f"artifact {str(name)!r}: expected a Path, bytes or str, "
                                f"got {type(source).__name__}")

    def digests(self) -> dict[str, tuple[str, int]]:
        """(sha256, bytes) of every file queued so far, by relative POSIX name."""
        return {name: integrity.digest_file(payload) if isinstance(payload, Path)
                else integrity.digest_bytes(payload) for name, payload in self.uploads}

    def commit(self, first_number: int) -> int:
        store, model = self.store, self.model
        token = uuid.uuid4().hex
        number = store.claim_version(model, first_number, token)
        written: list[str] = []
        try:
            sizes: dict[str, int] = {}
            for name, payload in self.uploads:
                key = store._key(model, "versions", str(number), name)
                with store._io(f"write {store.file_ref(model, number, name)}"):
                    if isinstance(payload, Path):
                        sizes[name] = payload.stat().st_size
                        store.fs.put_file(str(payload), key)
                    else:
                        sizes[name] = len(payload)
                        store.fs.pipe_file(key, payload)
                written.append(key)
            manifest = {"token": token, "files": sizes, "completed_at": _now()}
            store._create_exclusive(store._key(model, "versions", str(number), COMPLETE_FILE),
                                    json.dumps(manifest, indent=2, sort_keys=True).encode())
        except BaseException as err:
            store._remove_quietly(written)
            if isinstance(err, (OSError, RegistryError)):
                raise RegistryError(f"version {number} of model {model!r} was claimed at "
                                    f"{store.version_location(model, number)} but could not be "
                                    f"completed ({err}); it stays invisible and its number is "
                                    f"not reused") from err
            raise
        return number

    def discard(self) -> None:
        self.uploads = []
