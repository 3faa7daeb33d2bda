"""Convert stage: raw benchmark records (JSON lines) into the schema-versioned parquet dataset.

Rows are keyed on `dims_key` (never on a row or problem index). An empty input, or one whose
records lack required columns, is rejected with a message naming the file; the parquet file is
written to a temp path and moved into place, so a crash never leaves a half-written dataset.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd

from tilecast.core.dataset import PHASES, RECORD_COLUMNS, ROLES, SCHEMA_VERSION, STATUSES, TIMINGS, DatasetError
from tilecast.core.rawlog import read_records

log = logging.getLogger("tilecast.stages.convert")

# Raw records of these older schema versions still convert: what each lacks, filled in.
UPGRADES = {1: {"timing": "isolated"}}


@dataclass(frozen=True)
class ConvertSummary:
    out_path: Path
    rows: int
    problems: int
    kernels: int
    statuses: dict


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
    versions = sorted(set(frame["schema_version"]))
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
    log.warning("%s: %d record(s) of schema version(s) %s upgraded to version %d (%s)", source,
                count, sorted(old), SCHEMA_VERSION,
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


def convert_raw(raw_paths: Sequence[Path], out_path: Path) -> ConvertSummary:
    """Raw JSONL files -> one parquet dataset; see the module docstring."""
    records: list[dict] = []
    for path in raw_paths:
        if not Path(path).exists():
            raise DatasetError(f"raw benchmark file {path} does not exist")
        records.extend(read_records(Path(path)))
    frame = records_frame(records, ", ".join(map(str, raw_paths)))
    write_parquet(frame, out_path)
    return ConvertSummary(out_path=Path(out_path), rows=len(frame),
                          problems=frame["dims_key"].nunique(),
                          kernels=frame.loc[frame["role"] == "candidate", "kernel"].nunique(),
                          statuses=frame["status"].value_counts().to_dict())
