"""Convert stage: raw benchmark records (JSON lines), or a team's own records in the documented
schema (tilecast.stages.records), into the schema-versioned parquet dataset.

Rows are keyed on `dims_key` (never on a row or problem index). An empty input, or one whose
records lack required columns, is rejected with a message naming the file; the parquet file is
written to a temp path and moved into place, so a crash never leaves a half-written dataset.
The output is never one of the inputs (nor any other existing file that is not parquet: a raw
log is what a resumed run depends on), and a record read twice (the same file given twice,
or copied into two files) becomes one row, with the count reported.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd

from tilecast.core.dataset import PHASES, RECORD_COLUMNS, ROLES, SCHEMA_VERSION, STATUSES, TIMINGS, DatasetError
from tilecast.measurement.rawlog import read_log

log = logging.getLogger("tilecast.stages.convert")

# Raw records of these older schema versions still convert: what each lacks, filled in.
# Neither knows the protocol or binary that made it (version 3): a resumed run re-measures them.
_UNKNOWN_ORIGIN = {"protocol_hash": None, "build_key": None}
UPGRADES = {1: {"timing": "isolated", **_UNKNOWN_ORIGIN}, 2: dict(_UNKNOWN_ORIGIN)}

# One measurement: a run's record of a slot (problem, kernel or peer, phase), taken at one
# time by one protocol and binary. Records agreeing on all of these are repeats of one.
RECORD_IDENTITY = ("run_id", "time", "family", "dims_key", "kernel", "role", "phase",
                   "protocol_hash", "build_key")

PARQUET_MAGIC = b"PAR1"


@dataclass(frozen=True)
class ConvertSummary:
    """What a conversion wrote, and what it left out (repeated records, corrupt lines of a
    raw log read with skip_corrupt, bad rows of a foreign CSV)."""
    out_path: Path
    rows: int
    problems: int
    kernels: int
    statuses: dict
    duplicates_dropped: int = 0
    skipped_lines: int = 0
    bad_rows: int = 0


def check_output(out_path: Path, inputs: Sequence[Path]) -> None:
    """Refuse an output that is one of the inputs (by resolved path or by inode: a symlink or
    hard link to one counts), or an existing file that is not parquet (a raw log, a CSV):
    writing the dataset there would destroy data."""
    out_path = Path(out_path)
    target = out_path.resolve()
    for source in inputs:
        source = Path(source)
        same = source.resolve() == target
        if not same and out_path.exists() and source.exists():
            same = os.path.samefile(source, out_path)
        if same:
            raise DatasetError(f"convert: the output {out_path} is the input {source}; writing "
                               f"the dataset there would replace it: choose another --out "
                               f"(a new .parquet path)")
    if out_path.is_dir():
        raise DatasetError(f"convert: the output {out_path} is a directory; give a file path "
                           f"ending in .parquet")
    if out_path.exists() and out_path.stat().st_size:
        with open(out_path, "rb") as handle:
            head = handle.read(len(PARQUET_MAGIC))
        if head != PARQUET_MAGIC:
            raise DatasetError(f"convert: the output {out_path} exists and is not a parquet "
                               f"file (a raw log or CSV?); convert only replaces a dataset it "
                               f"wrote: choose another --out or remove that file first")


def drop_repeats(records: list[dict], source: str) -> tuple[list[dict], int]:
    """The records with each measurement once (RECORD_IDENTITY; the last copy kept) and how
    many repeats were dropped, with a warning when there were any."""
    kept: dict[tuple, dict] = {}
    for record in records:
        identity = tuple(str(record.get(column)) for column in RECORD_IDENTITY)
        kept.pop(identity, None)   # re-inserted: the last copy, at its place in the input
        kept[identity] = record
    dropped = len(records) - len(kept)
    if dropped:
        log.warning("%s: dropped %d repeated record(s) (the same run, time, problem, kernel "
                    "and phase read more than once, e.g. one file given twice)", source, dropped)
    return list(kept.values()), dropped


def records_frame(records: list[dict], source: str) -> pd.DataFrame:
    """Validate raw records and make a DataFrame in the dataset schema."""
    if not records:
        raise DatasetError(f"{source}: no benchmark records (empty or unreadable file); "
                           "run the benchmark stage first")
    records = _upgraded(records, source)
    frame = pd.DataFrame.from_records(records)
    missing = [c for c in RECORD_COLUMNS if c not in frame.columns]
    if missing:
        raise DatasetError(f"{source}: records lack column(s) {missing}")
    for column, allowed in (("status", STATUSES), ("phase", PHASES), ("role", ROLES),
                            ("timing", TIMINGS)):
        bad = sorted(set(frame[column].dropna()) - set(allowed))
        if bad:
            raise DatasetError(f"{source}: unknown {column} value(s) {bad}; valid: {list(allowed)}")
    versions = sorted(set(frame["schema_version"]), key=str)
    if versions != [SCHEMA_VERSION]:
        raise DatasetError(f"{source}: schema version(s) {versions}, expected {SCHEMA_VERSION}")
    for column in ("median_s", "mad_s", "tflops", "gbps", "max_error"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    for column in ("samples_s", "disturbed_samples_s", "round_medians_s", "window_factors",
                   "window_probes_us"):
        # all but the first are absent in older records
        if column in frame.columns:
            frame[column] = frame[column].apply(
                lambda v: [float(x) for x in v] if isinstance(v, list) else [])
    return frame


def _upgraded(records: list[dict], source: str) -> list[dict]:
    """Records of an older schema version (UPGRADES) brought to this one, with a warning."""
    old = {r.get("schema_version") for r in records} & set(UPGRADES)
    if not old:
        return records
    count = sum(r.get("schema_version") in UPGRADES for r in records)
    log.warning("%s: %d record(s) of schema version(s) %s upgraded to version %d (filled "
                "in: %s); they do not say which protocol made them, so a resumed run measures "
                "their pairs again", source, count, sorted(old), SCHEMA_VERSION,
                "; ".join(f"v{v}: {fill}" for v, fill in sorted(UPGRADES.items()) if v in old))
    return [{**r, **UPGRADES[r["schema_version"]], "schema_version": SCHEMA_VERSION}
            if r.get("schema_version") in UPGRADES else r for r in records]


def write_parquet(frame: pd.DataFrame, out_path: Path) -> None:
    """Atomic parquet write: temp file in the same directory, then os.replace."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)


def convert_raw(raw_paths: Sequence[Path], out_path: Path,
                skip_corrupt: bool = False) -> ConvertSummary:
    """Raw JSONL files -> one parquet dataset; see the module docstring. A raw log corrupt
    before its last line is an error (rawlog.RawLogError) unless `skip_corrupt`, which leaves
    those lines out and counts them in the summary."""
    raw_paths = [Path(path) for path in raw_paths]
    check_output(out_path, raw_paths)
    records: list[dict] = []
    skipped = 0
    for path in raw_paths:
        if not path.exists():
            raise DatasetError(f"raw benchmark file {path} does not exist")
        raw = read_log(path, skip_corrupt)
        records.extend(raw.records)
        skipped += len(raw.skipped_lines)
    return _write_records(records, raw_paths, out_path, skipped_lines=skipped)


def convert_records(paths: Sequence[Path], out_path: Path) -> ConvertSummary:
    """A team's records files (JSON lines or CSV in the schema of docs/guide/records.md,
    checked row by row: tilecast.stages.records) -> one parquet dataset, as convert_raw
    writes from tilecast's own raw records; nothing is written when any row is bad."""
    from tilecast.stages.records import read_team_records

    paths = [Path(path) for path in paths]
    check_output(out_path, paths)
    records: list[dict] = []
    for path in paths:
        if not path.exists():
            raise DatasetError(f"records file {path} does not exist")
        records.extend(read_team_records(path))
    return _write_records(records, paths, out_path)


def _write_records(records: list[dict], paths: Sequence[Path], out_path: Path,
                   skipped_lines: int = 0) -> ConvertSummary:
    """Records read from `paths` -> the parquet dataset at `out_path` (repeats dropped), and
    what it holds."""
    source = ", ".join(map(str, paths))
    records, dropped = drop_repeats(records, source)
    frame = records_frame(records, source)
    write_parquet(frame, out_path)
    return ConvertSummary(out_path=Path(out_path), rows=len(frame),
                          problems=frame["dims_key"].nunique(),
                          kernels=frame.loc[frame["role"] == "candidate", "kernel"].nunique(),
                          statuses=frame["status"].value_counts().to_dict(),
                          duplicates_dropped=dropped, skipped_lines=skipped_lines)
