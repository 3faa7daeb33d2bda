"""Foreign import: CK tile-engine grouped-conv benchmark CSVs into tilecast's parquet dataset.

Each CSV row is one kernel measured on one problem. The direction, dtype and ndim come from
the kernel name (parsed by the grouped-conv families' one parser); the problem from the shape
columns. Rows are keyed on the family's `dims_key` (the full dims tuple); `problem_idx` is an
artifact of generation order and is dropped (the seed's lesson). Repeated measurements of one
(dims_key, kernel) become one record with every latency kept as a sample. A file that is not
CSV text, has missing columns, kernel names no family knows, a malformed shape or non_zero
field, or no usable latency at all is rejected whole, before anything is written. A single
row whose latency_ms is not a positive finite number (NaN, negative, `fast`) is left out and
reported with its line number; a kernel left without any latency is recorded `crashed`.
"""
from __future__ import annotations

import logging
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import pandas as pd

from tilecast.config import PROBLEM_SETS
from tilecast.stages.convert import (ConvertSummary, check_output, drop_repeats, records_frame,
                                     write_parquet)
from tilecast.core import dataset
from tilecast.core.dataset import SCHEMA_VERSION, DatasetError
from tilecast.families import get_family
from tilecast.families.base import FamilyError
from tilecast.families.grouped_conv_kernels import parse_kernel_name

log = logging.getLogger("tilecast.stages.convert_ck")

CK_COLUMNS = ("kernel", "problem_idx", "N", "C", "K", "G", "Di", "Hi", "Wi", "Z", "Y", "X",
              "stride_d", "stride_h", "stride_w", "pad_d", "pad_h", "pad_w", "dilation_d",
              "dilation_h", "dilation_w", "latency_ms", "tflops", "non_zero")
SHAPE_COLUMNS = CK_COLUMNS[2:21]
HARDWARE = "ck-tile-engine"
TRUE_VALUES, FALSE_VALUES = {"true", "1", "1.0", "yes"}, {"false", "0", "0.0", "no"}
# How many bad rows a message lists before "...".
SHOWN_ROWS = 10


def _truth(value, where: str) -> bool:
    text = str(value).strip().lower()
    if text in TRUE_VALUES:
        return True
    if text in FALSE_VALUES:
        return False
    raise DatasetError(f"{where}: non_zero={value!r} is not a boolean (true/false/1/0)")


def _number(value) -> float:
    """A CSV field as a float; NaN when it is not a number (`fast`, blank)."""
    number = pd.to_numeric(value, errors="coerce")
    return float(number) if pd.notna(number) else math.nan


def _shape_value(value):
    """A shape field as the family expects it: a whole number as an int (a column with blank
    2D depth fields is read as floats: 1.0); anything else unchanged, for the family to
    reject by name."""
    number = _number(value)
    return int(number) if math.isfinite(number) and number.is_integer() else value


def _read(path: Path) -> pd.DataFrame:
    if not path.exists():
        raise DatasetError(f"CK tile-engine CSV {path} does not exist")
    expected = "expected a CK tile-engine benchmark CSV"
    if path.is_dir():
        raise DatasetError(f"{path} is a directory; {expected}")
    try:
        with open(path, "rb") as handle:
            head = handle.read(1 << 16)
    except OSError as err:
        raise DatasetError(f"cannot read {path}: {err.strerror or err}") from None
    nul = head.find(b"\0")
    if nul >= 0:
        raise DatasetError(f"{path}: binary data (a NUL byte at offset {nul}), not CSV text; "
                           f"{expected}")
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise DatasetError(f"{path}: empty file; {expected}") from None
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
                           f"offset {err.start}); {expected}") from None
    except pd.errors.ParserError as err:
        raise DatasetError(f"{path}: not a well-formed CSV ({str(err).strip()}); "
                           f"{expected}") from None
    missing = [c for c in CK_COLUMNS if c not in frame.columns]
    if missing:
        raise DatasetError(f"{path}: missing column(s) {missing}; a CK tile-engine grouped-conv "
                           f"CSV has {', '.join(CK_COLUMNS)}")
    if frame.empty:
        raise DatasetError(f"{path}: no benchmark rows")
    names = frame["kernel"].astype(str)
    unknown: dict[str, str] = {}
    for name in dict.fromkeys(names):
        try:
            parse_kernel_name(name)
        except FamilyError as err:
            unknown[name] = str(err)
    if unknown:
        shown = list(unknown)[:5]
        raise DatasetError(f"{path}: {len(unknown)} unknown kernel name(s), e.g. {shown} "
                           f"(first: {unknown[shown[0]]}); no file written")
    return frame.drop(columns="problem_idx")


def _rows(lines: list[tuple[int, object]]) -> str:
    shown = ", ".join(f"{line} ({value})" for line, value in lines[:SHOWN_ROWS])
    return shown + (f", ... ({len(lines)} in all)" if len(lines) > SHOWN_ROWS else "")


def _records(path: Path, frame: pd.DataFrame, problem_set: str) -> tuple[list[dict], int]:
    """One record per (family, dims_key, kernel), its repeats collapsed as everywhere
    (dataset.collapse_repeats: every usable latency kept as a sample, a row with non_zero
    false failing the slot); and how many rows had no usable latency (reported here, with
    their line numbers)."""
    run_id = f"ck-csv:{path.name}"
    written = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
    slots: dict[tuple[str, str, str], dict] = {}
    measurements: list[dict] = []              # one per CSV row, in the file's order
    unusable: list[tuple[int, object]] = []    # (CSV line, latency_ms as written)
    for line, row in zip(frame.index, frame.itertuples(index=False)):
        where = f"{path} row {line + 2}"     # header is line 1
        cfg = parse_kernel_name(row.kernel)
        family = get_family(f"grouped_conv_{cfg.direction}")
        # a blank depth field of a 2D row takes the 2D default (Di = Z = 1, ...)
        shape = {c: _shape_value(getattr(row, c)) for c in SHAPE_COLUMNS
                 if not pd.isna(getattr(row, c))}
        try:
            problem = family.problem({**shape, "direction": cfg.direction, "dtype": cfg.dtype,
                                      "ndim": cfg.ndim_spatial})
        except (FamilyError, TypeError, ValueError) as err:
            raise DatasetError(f"{where}: bad shape field ({err})") from None
        key = (family.name, family.dims_key(problem), row.kernel)
        slot = slots.setdefault(key, {"id": len(slots), "family": family, "problem": problem,
                                      "config": cfg, "source_tflops": []})
        latency_s = _number(row.latency_ms) / 1e3
        if not (latency_s > 0 and math.isfinite(latency_s)):
            unusable.append((line + 2, row.latency_ms))
        measurements.append({"slot": slot["id"], "line": line + 2, "time_s": latency_s,
                             "status": "ok" if _truth(row.non_zero, where) else "wrong_result"})
        source_tflops = _number(row.tflops)
        if math.isfinite(source_tflops):
            slot["source_tflops"].append(source_tflops)
    if len(unusable) == len(frame):
        raise DatasetError(f"{path}: no row has a usable latency_ms (a positive number of "
                           f"milliseconds): rows {_rows(unusable)}; no file written")
    if unusable:
        log.warning("%s: %d row(s) without a usable latency_ms (not a positive finite number) "
                    "left out: CSV line(s) %s", path, len(unusable), _rows(unusable))
    rows = pd.DataFrame(measurements)
    lines = rows["line"].to_numpy()
    records = []
    for ((family_name, dims_key, kernel), slot), collapsed in zip(
            slots.items(), dataset.collapse_repeats(rows, ["slot"]).itertuples()):
        family, problem, samples = slot["family"], slot["problem"], collapsed.samples_s
        status, reason = "ok", ""
        if collapsed.failed:
            status, reason = "wrong_result", (f"tile engine reported an all-zero output "
                                              f"(non_zero false, CSV rows "
                                              f"{lines[collapsed.failed].tolist()})")
        elif not samples:
            status, reason = "crashed", (f"no positive finite latency_ms in the CSV (rows "
                                         f"{lines[collapsed.rows].tolist()})")
        record = {
            "schema_version": SCHEMA_VERSION, "timing": "imported", "run_id": run_id,
            "time": written, "git_sha": None,
            "hardware": HARDWARE, "family": family_name, "problem_set": problem_set,
            "dims_key": dims_key, **family.problem_dict(problem), "kernel": kernel,
            "role": "candidate", "phase": "screen", "status": status, "reason": reason,
            "samples_s": samples, "reps_per_sample": 0, "median_s": None, "mad_s": None,
            "tflops": None, "gbps": None, "max_error": None, "threads": None,
            "protocol_hash": None, "build_key": None,
            "source_tflops": (statistics.median(slot["source_tflops"])
                              if slot["source_tflops"] else None),
        }
        for field, value in family.config_dict(slot["config"]).items():
            record.setdefault(field, value)   # problem fields (direction, dtype) are equal
        if status == "ok":
            median_s = collapsed.median_s
            record.update(median_s=median_s, mad_s=collapsed.mad_s,
                          tflops=family.flops(problem) / median_s / 1e12,
                          gbps=family.bytes_moved(problem) / median_s / 1e9)
        records.append(record)
    return records, len(unusable)


def convert_ck_csv(in_csv: str | Path | Sequence[str | Path], out_parquet: str | Path,
                   problem_set: str = "train") -> ConvertSummary:
    """Tile-engine CSV(s) -> one parquet dataset in tilecast's schema (see the module
    docstring). TFLOP/s and GB/s are recomputed from tilecast's FLOP and byte counts (the
    CSV's own figure is kept as `source_tflops`). Every file is validated before any write."""
    if problem_set not in PROBLEM_SETS:
        raise DatasetError(f"unknown problem set {problem_set!r}; valid: {', '.join(PROBLEM_SETS)}")
    paths = [Path(in_csv)] if isinstance(in_csv, (str, Path)) else [Path(p) for p in in_csv]
    if not paths:
        raise DatasetError("no CK tile-engine CSV given")
    check_output(Path(out_parquet), paths)
    records, bad_rows = [], 0
    for path, frame in [(path, _read(path)) for path in paths]:
        file_records, file_bad = _records(path, frame, problem_set)
        records.extend(file_records)
        bad_rows += file_bad
    source = ", ".join(map(str, paths))
    records, dropped = drop_repeats(records, source)
    frame = records_frame(records, source)
    write_parquet(frame, Path(out_parquet))
    return ConvertSummary(out_path=Path(out_parquet), rows=len(frame),
                          problems=frame[["family", "dims_key"]].drop_duplicates().shape[0],
                          kernels=frame["kernel"].nunique(),
                          statuses=frame["status"].value_counts().to_dict(),
                          duplicates_dropped=dropped, bad_rows=bad_rows)
