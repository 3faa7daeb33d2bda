"""Foreign import: CK tile-engine grouped-conv benchmark CSVs into tilecast's parquet dataset.

Each CSV row is one kernel measured on one problem, read by the one parser of such a CSV
(convert_ck_rows, which `tilecast import --from ck-csv` reads with too). The direction, dtype
and ndim come from the kernel name (parsed by the grouped-conv families' one parser); the
problem from the shape columns. Rows are keyed on the family's `dims_key` (the full dims tuple); `problem_idx` is an
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
from tilecast.core import dataset
from tilecast.core.dataset import SCHEMA_VERSION, DatasetError
from tilecast.stages.convert import (ConvertSummary, check_output, drop_repeats, records_frame,
                                     write_parquet)
from tilecast.families import get_family
from tilecast.core.family import FamilyError
from tilecast.stages.convert_ck_rows import (CK_COLUMNS, SHAPE_COLUMNS, ConvCsv, parse_conv_csv,
                                             read_conv_csv, rows_named)

__all__ = ["CK_COLUMNS", "HARDWARE", "convert_ck_csv"]   # CK_COLUMNS: the parser's, for callers

log = logging.getLogger("tilecast.stages.convert_ck")

HARDWARE = "ck-tile-engine"


def _records(parsed: ConvCsv, problem_set: str) -> tuple[list[dict], int]:
    """One record per (family, dims_key, kernel), its repeats collapsed as everywhere
    (dataset.collapse_repeats: every usable latency kept as a sample, a row with non_zero
    false failing the slot); and how many rows had no usable latency (reported here, with
    their line numbers)."""
    path = parsed.path
    run_id = f"ck-csv:{path.name}"
    written = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
    slots: dict[tuple[str, str, str], dict] = {}
    measurements: list[dict] = []              # one per CSV row, in the file's order
    for row in parsed.rows.itertuples(index=False):
        cfg = parsed.configs[row.kernel]
        family = get_family(f"grouped_conv_{cfg.direction}")
        # a blank field is left to the family's default (a 2D row's depth fields: the parser)
        shape = {c: getattr(row, c) for c in SHAPE_COLUMNS if getattr(row, c) is not None}
        try:
            problem = family.problem({**shape, "direction": cfg.direction, "dtype": cfg.dtype,
                                      "ndim": cfg.ndim_spatial})
        except (FamilyError, TypeError, ValueError) as err:
            raise DatasetError(f"{path} row {row.line}: bad shape field ({err})") from None
        key = (family.name, family.dims_key(problem), row.kernel)
        slot = slots.setdefault(key, {"id": len(slots), "family": family, "problem": problem,
                                      "config": cfg, "source_tflops": []})
        measurements.append({"slot": slot["id"], "line": row.line, "time_s": row.latency_s,
                             "status": "ok" if row.non_zero else "wrong_result"})
        if not math.isnan(row.source_tflops):
            slot["source_tflops"].append(row.source_tflops)
    unusable = parsed.unusable()
    if len(unusable) == len(parsed.rows):
        raise DatasetError(f"{path}: no row has a usable latency_ms (a positive number of "
                           f"milliseconds): rows {rows_named(unusable)}; no file written")
    if unusable:
        log.warning("%s: %d row(s) without a usable latency_ms (not a positive finite number) "
                    "left out: CSV line(s) %s", path, len(unusable), rows_named(unusable))
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
    for parsed in [parse_conv_csv(path, read_conv_csv(path)) for path in paths]:
        file_records, file_bad = _records(parsed, problem_set)
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
