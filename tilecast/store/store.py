"""The measurement store: every record every night measured, on any machine, kept for good.

A store is a directory or an fsspec URL (`s3://bucket/prefix`), laid out as

    STORE.json                                     {"format": "tilecast-store", "version": N}
    records/class=<C>/family=<F>/night=<R>/<D>.parquet
    classes/<C>.json                               the class's hardware profile
    fleet/<R>/...                                  a night over a fleet: its shards' leases

one immutable parquet file per append, where C is the hardware class
(tilecast.core.hardware.hardware_class), F the family, R the night's run id and D a digest of
the record ids the file holds. Files are never rewritten or deleted, so there is nothing for
concurrent writers to lose: each writes its own file, and no manifest is shared. A file
becomes visible whole or not at all: locally it is written under a dot-name and renamed
(os.replace), on an object store it is one PUT. A writer killed mid-append leaves at most a
dot-named temporary, which every reader ignores and `store check` lists. Appending the same
records again writes the same name (same digest): a retried append duplicates nothing, and a
record that reaches two files (a night appended by `run --store` and again by `store add`)
is read once, by its record id.

Reading skips, with a warning naming it, any file it cannot use (damaged, foreign, of
another layout); `check` lists them all. A store of a newer version than this tilecast
reads is an error naming both versions.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tilecast.core.atomic import atomic_write_bytes
from tilecast.core.dataset import DatasetError
from tilecast.registry.remote import storage_errors
from tilecast.store import records as store_records

log = logging.getLogger("tilecast.store")

MARKER_FILE = "STORE.json"
FORMAT = "tilecast-store"
RECORDS_DIR = "records"
CLASSES_DIR = "classes"        # classes/<class>.json: the class's hardware profile
METADATA_KEY = b"tilecast.store_version"
# each file's footer also says what it holds (records, problems, candidate kernels, last
# time), so that `store summary` reads footers, not 10 M rows
SUMMARY_KEY = b"tilecast.summary"
PART_RE = re.compile(r"^[0-9a-f]{32}\.parquet$")
PARTITIONS = ("class", "family", "night")
PARTITION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
READ_THREADS = 8              # files read at once (an object store's latency per file dominates)
STALE_TEMP_S = 3600.0         # a temporary this old was left by a killed writer


class StoreError(DatasetError):
    """A store that cannot be used: unreachable, unwritable, foreign, or of a newer version."""


@dataclass(frozen=True)
class Part:
    """One file of the store, with the partition values its path names."""
    path: str
    hardware_class: str
    family: str
    night: str

    @property
    def night_dir(self) -> tuple[str, str, str]:
        return self.hardware_class, self.family, self.night


@dataclass(frozen=True)
class Damage:
    """A file `check` found unusable, and why."""
    path: str
    why: str


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Store:
    """A measurement store at a local path or fsspec URL (see the module docstring)."""

    def __init__(self, location: str | Path):
        self.location = str(location)
        self.fs, self.root, self.local = _filesystem(self.location)

    # -- paths ----------------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def __repr__(self) -> str:
        return f"Store({self.location!r})"

    # -- opening --------------------------------------------------------------------------

    def version(self) -> int | None:
        """The store's layout version from STORE.json; None when there is no store here."""
        marker = self._path(MARKER_FILE)
        try:
            if not self.fs.exists(marker):
                if self.fs.exists(self._path(RECORDS_DIR)):
                    raise StoreError(f"store {self.location}: {RECORDS_DIR}/ without "
                                     f"{MARKER_FILE}; not a tilecast store (or a damaged one)")
                return None
            document = json.loads(self.fs.cat_file(marker))
        except StoreError:
            raise
        except (*storage_errors(), ValueError) as err:
            raise StoreError(f"store {self.location}: cannot read {MARKER_FILE}: "
                             f"{_reason(err)}") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            found = document.get("format") if isinstance(document, dict) else document
            raise StoreError(f"store {self.location}: {MARKER_FILE} is not a tilecast store's "
                             f"(format {found!r}, expected {FORMAT!r})")
        version = document.get("version")
        if not isinstance(version, int) or version > store_records.STORE_VERSION:
            raise StoreError(f"store {self.location} is of layout version {version}; this "
                             f"tilecast reads version {store_records.STORE_VERSION}: upgrade "
                             "tilecast to read it")
        return version

    def require(self) -> "Store":
        """This store, when one exists here; StoreError otherwise."""
        if self.version() is None:
            raise StoreError(f"store {self.location} does not exist (no {MARKER_FILE}); a run "
                             "with --store creates it, or `tilecast store add`")
        return self

    def create(self) -> "Store":
        """Make the store here if there is none, and check it can be written: a probe file
        is written and removed, so an unwritable store fails now, before a night measures."""
        existing = self.version()
        try:
            if existing is None:
                self.fs.makedirs(self.root, exist_ok=True)
                self._write(self._path(MARKER_FILE), json.dumps(
                    {"format": FORMAT, "version": store_records.STORE_VERSION,
                     "created": _now()}).encode() + b"\n")
            probe = self._path(f".probe-{uuid.uuid4().hex}")
            self._write(probe, b"")
            self.fs.rm_file(probe)
        except storage_errors() as err:
            raise StoreError(f"store {self.location} cannot be written: {_reason(err)}") from None
        return self

    # -- writing --------------------------------------------------------------------------

    def _write(self, path: str, data: bytes) -> None:
        """Whole or nothing: a dot-named temporary renamed into place locally, one PUT on an
        object store."""
        if not self.local:
            self.fs.pipe_file(path, data)
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)   # `.<name>.<pid>.<random>.tmp`, then os.replace

    def append(self, table: pa.Table) -> list[str]:
        """Append store rows (tilecast.store.records.SCHEMA) as one file per (class, family,
        night); returns the files written. Appending the same rows again writes nothing new."""
        if table.schema.remove_metadata() != store_records.SCHEMA:
            raise StoreError("append: rows are not in the store's schema (use "
                             "tilecast.store.records.to_table)")
        self.require()
        written = []
        keys = ("hardware_class", "family", "run_id")
        columns = [table.column(k).to_pylist() for k in keys]
        slices: dict[tuple, list[int]] = defaultdict(list)
        for index, key in enumerate(zip(*columns)):
            slices[key].append(index)
        for (hardware_class, family, night), rows in sorted(slices.items()):
            for name, value in (("class", hardware_class), ("family", family), ("night", night)):
                if not isinstance(value, str) or not PARTITION_RE.match(value):
                    raise StoreError(f"append: {name} {value!r} cannot name a store partition "
                                     "(letters, digits, '.', '_', '-')")
            part = table.take(pa.array(rows))
            ids = sorted(part.column("record_id").to_pylist())
            digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:32]
            path = self._path(RECORDS_DIR, f"class={hardware_class}", f"family={family}",
                              f"night={night}", f"{digest}.parquet")
            buffer = io.BytesIO()
            metadata = {METADATA_KEY: str(store_records.STORE_VERSION).encode(),
                        SUMMARY_KEY: json.dumps(_part_summary(part)).encode()}
            pq.write_table(part.replace_schema_metadata(metadata), buffer, compression="zstd")
            try:
                if self.fs.exists(path):
                    continue
                self._write(path, buffer.getvalue())
            except storage_errors() as err:
                raise StoreError(f"store {self.location}: cannot append {path}: "
                                 f"{_reason(err)}") from None
            written.append(path)
        return written

    # -- small documents beside the records ------------------------------------------------
    # A class's hardware profile (classes/<class>.json) and a fleet night's leases
    # (fleet/<night>/...): JSON written whole or not at all, never under records/.

    def put_json(self, relative: str, document: dict) -> None:
        """Write `document` at `relative` (a '/'-separated path under the store) whole."""
        path = self._path(*_relative(relative))
        try:
            self._write(path, json.dumps(document, indent=1, sort_keys=True).encode() + b"\n")
        except storage_errors() as err:
            raise StoreError(f"store {self.location}: cannot write {relative}: "
                             f"{_reason(err)}") from None

    def get_json(self, relative: str) -> dict | None:
        """The document at `relative`; None when there is none. One that is not a JSON
        object is an error naming it."""
        path = self._path(*_relative(relative))
        try:
            if not self.fs.exists(path):
                return None
            document = json.loads(self.fs.cat_file(path))
        except (*storage_errors(), ValueError) as err:
            raise StoreError(f"store {self.location}: cannot read {relative}: "
                             f"{_reason(err)}") from None
        if not isinstance(document, dict):
            raise StoreError(f"store {self.location}: {relative} is not a JSON object")
        return document

    def list_names(self, relative: str) -> list[str]:
        """Names directly under the folder `relative` (documents and folders; temporaries
        left out); [] when there is no such folder."""
        path = self._path(*_relative(relative))
        try:
            if not self.fs.exists(path):
                return []
            entries = self.fs.ls(path, detail=False)
        except storage_errors() as err:
            raise StoreError(f"store {self.location}: cannot list {relative}: "
                             f"{_reason(err)}") from None
        names = (str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return sorted(n for n in names if not n.startswith("."))

    def list_json(self, relative: str) -> list[str]:
        """Names of the documents (*.json) directly under the folder `relative`."""
        return [n for n in self.list_names(relative) if n.endswith(".json")]

    def put_profile(self, profile: dict) -> None:
        """Keep a class's hardware profile (what a model of the class computes its hardware
        features from, on any machine); the first writer's stays."""
        relative = f"{CLASSES_DIR}/{profile['hardware_class']}.json"
        if self.get_json(relative) is None:
            self.put_json(relative, profile)

    def profile(self, hardware_class: str) -> dict | None:
        """The hardware profile kept for `hardware_class`, or None."""
        return self.get_json(f"{CLASSES_DIR}/{hardware_class}.json")

    # -- listing and reading --------------------------------------------------------------

    def _listing(self) -> tuple[list[Part], list[Damage]]:
        """Every record file, and every other file under records/ (foreign or left over)."""
        base = self._path(RECORDS_DIR)
        try:
            paths = sorted(self.fs.find(base)) if self.fs.exists(base) else []
        except storage_errors() as err:
            raise StoreError(f"store {self.location}: cannot list {RECORDS_DIR}/: "
                             f"{_reason(err)}") from None
        parts, others = [], []
        for path in paths:
            relative = path[len(base.rstrip("/")) + 1:].split("/")
            name = relative[-1]
            if name.startswith(".") and name.endswith(".tmp"):
                others.append(Damage(path, "a temporary a killed writer left (never read)"))
                continue
            values = [p.partition("=") for p in relative[:-1]]
            if (len(values) != 3 or [v[0] for v in values] != list(PARTITIONS)
                    or not PART_RE.match(name)):
                others.append(Damage(path, "a foreign file (not a part of this layout)"))
                continue
            parts.append(Part(path, *(v[2] for v in values)))
        return parts, others

    def parts(self, hardware_class: str | None = None, family: str | None = None,
              night: str | None = None) -> list[Part]:
        """The record files, of one class, family and night where given."""
        parts, _ = self._listing()
        return [p for p in parts if (hardware_class is None or p.hardware_class == hardware_class)
                and (family is None or p.family == family)
                and (night is None or p.night == night)]

    def _check_version(self, part: Part, version: bytes | None) -> None:
        if version is None:
            raise ValueError("no tilecast store version in its metadata: a foreign parquet file")
        if int(version) > store_records.STORE_VERSION:
            raise StoreError(f"store {self.location}: {part.path} is of store version "
                             f"{int(version)}; this tilecast reads version "
                             f"{store_records.STORE_VERSION}: upgrade tilecast to read it")

    def _read_part(self, part: Part, columns: list[str] | None) -> pa.Table:
        with self.fs.open(part.path, "rb") as handle:
            table = pq.read_table(handle, columns=columns)
        self._check_version(part, (table.schema.metadata or {}).get(METADATA_KEY))
        return table

    def read(self, hardware_class: str | None = None, family: str | None = None,
             columns: Iterable[str] | None = None, night: str | None = None) -> pa.Table:
        """The store's records (of one class and family where given), each once: a damaged or
        foreign file is skipped with a warning naming it. All files are read as one arrow
        dataset (threaded); only when that fails are they read one by one, to find and skip
        the ones that cannot be read."""
        self.require()
        wanted = list(dict.fromkeys([*(columns or store_records.COLUMNS), "record_id"]))
        parts = self.parts(hardware_class, family, night)
        if not parts:
            return store_records.SCHEMA.empty_table().select(wanted)
        try:
            table = self._dataset(parts).to_table(columns=wanted)
        except (*storage_errors(), ValueError, pa.ArrowException):
            tables = self._read_parts(parts, wanted)
            if not tables:
                return store_records.SCHEMA.empty_table().select(wanted)
            table = pa.concat_tables(tables)
        return _unique_records(table, parts)

    def _dataset(self, parts: list[Part]):
        import pyarrow.dataset as ds
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        filesystem = None if self.local else PyFileSystem(FSSpecHandler(self.fs))
        return ds.dataset([p.path for p in parts], schema=store_records.SCHEMA, format="parquet",
                          filesystem=filesystem)

    def footers(self, hardware_class: str | None = None) -> list[tuple[Part, dict]]:
        """(part, what its footer says it holds: records, problems, kernels, last_time) for
        every readable record file (of one class where given); a file whose footer cannot
        be read is skipped with a warning naming it."""
        self.require()

        def footer(part: Part):
            try:
                with self.fs.open(part.path, "rb") as handle:
                    metadata = pq.read_metadata(handle).metadata or {}
                self._check_version(part, metadata.get(METADATA_KEY))
                return part, json.loads(metadata[SUMMARY_KEY])
            except StoreError:
                raise
            except (*storage_errors(), ValueError, KeyError, pa.ArrowException) as err:
                log.warning("store %s: skipped %s, whose footer cannot be read (%s); `tilecast "
                            "store check` lists such files", self.location, part.path,
                            _reason(err))
                return None
        parts = self.parts(hardware_class)
        with ThreadPoolExecutor(1 if self.local else READ_THREADS) as pool:
            return [f for f in pool.map(footer, parts) if f is not None]

    def repeats(self, parts: list[Part]) -> int:
        """How many records of `parts` are copies of another record of them (only nights
        with more than one file can hold any)."""
        per_dir = defaultdict(list)
        for part in parts:
            per_dir[part.night_dir].append(part)
        shared = [p for group in per_dir.values() if len(group) > 1 for p in group]
        if not shared:
            return 0
        ids = pa.concat_tables(self._read_parts(shared, ["record_id"])).column("record_id")
        return len(ids) - len(set(ids.to_pylist()))

    def _read_parts(self, parts: list[Part], columns) -> list[pa.Table]:
        def read(part: Part):
            try:
                return self._read_part(part, columns)
            except StoreError:
                raise
            except (*storage_errors(), ValueError, pa.ArrowException) as err:
                log.warning("store %s: skipped %s, which cannot be read (%s); `tilecast store "
                            "check` lists such files", self.location, part.path, _reason(err))
                return None
        if self.local or len(parts) < 2:
            results = [read(p) for p in parts]
        else:
            with ThreadPoolExecutor(READ_THREADS) as pool:
                results = list(pool.map(read, parts))
        return [t for t in results if t is not None]

    def check(self) -> list[Damage]:
        """Every file of the store that a reader skips or that is out of place: damaged,
        foreign, of another layout, rows of another class/family/night than its path says,
        temporaries of killed writers. An empty list is a sound store."""
        self.require()
        parts, damage = self._listing()
        for part in parts:
            try:
                table = self._read_part(part, ["hardware_class", "family", "run_id"])
            except (*storage_errors(), ValueError, pa.ArrowException, StoreError) as err:
                damage.append(Damage(part.path, f"unreadable: {_reason(err)}"))
                continue
            for column, expected in (("hardware_class", part.hardware_class),
                                     ("family", part.family), ("run_id", part.night)):
                values = set(table.column(column).to_pylist())
                foreign = sorted(map(str, values - {expected}))
                if foreign:
                    damage.append(Damage(part.path, f"holds {column} {foreign[:3]} in the "
                                                    f"partition of {expected!r}"))
                    break
        return sorted(damage, key=lambda d: d.path)


def _relative(relative: str) -> list[str]:
    """The segments of a path under the store: names of letters, digits, '.', '_', '-' (no
    '..', nothing under records/)."""
    parts = [p for p in str(relative).split("/") if p]
    if (not parts or parts[0] in (RECORDS_DIR, MARKER_FILE)
            or any(p in (".", "..") or not PARTITION_RE.match(p) for p in parts)):
        raise StoreError(f"store: {relative!r} cannot name a document beside the records")
    return parts


def _unique_records(table: pa.Table, parts: list[Part]) -> pa.Table:
    """`table` with each record id once. Files are immutable and named by their record ids,
    so repeats can only come from two files of one night's directory: a store with one file
    a night is not searched at all (a 10 M-record store is not hashed whole)."""
    nights = [p.night_dir for p in parts]
    if len(set(nights)) == len(nights):
        return table
    ids = table.column("record_id").to_pylist()
    seen, keep = set(), []
    for index, rid in enumerate(ids):
        if rid not in seen:
            seen.add(rid)
            keep.append(index)
    return table if len(keep) == len(ids) else table.take(pa.array(keep))


def _part_summary(part: pa.Table) -> dict:
    """What a file holds, for its footer (SUMMARY_KEY)."""
    candidates = part.filter(pc.equal(part.column("role"), "candidate"))
    return {"records": part.num_rows,
            "problems": sorted(pc.unique(part.column("dims_key")).to_pylist()),
            "kernels": sorted(pc.unique(candidates.column("kernel")).to_pylist()),
            "last_time": pc.max(part.column("time")).as_py()}


def _reason(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    return getattr(err, "strerror", None) or text


def _filesystem(location: str):
    """(fs, root path, is local) for a store location: a plain path, file:// or any fsspec URL."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    if "://" not in location:
        location = os.path.abspath(location)
    try:
        fs, root = url_to_fs(location, use_listings_cache=False)
    except ImportError as err:
        scheme = location.split("://", 1)[0]
        hint = "pip install 'tilecast[s3]'" if scheme in ("s3", "s3a") else \
            f"install the fsspec implementation of {scheme}://"
        raise StoreError(f"store {location}: no fsspec implementation of {scheme}:// is "
                         f"installed ({err}); {hint}") from None
    except ValueError as err:
        raise StoreError(f"store {location}: fsspec cannot open this URL ({err})") from None
    return fs, root, isinstance(fs, LocalFileSystem)
