"""Foreign import: CK tile-engine grouped-conv benchmark CSVs into tilecast's parquet dataset.

Each CSV row is one kernel measured on one problem. The direction, dtype and ndim come from
the kernel name (parsed by the grouped-conv families' one parser); the problem from the shape
columns. Rows are keyed on the family's `dims_key` (the full dims tuple); `problem_idx` is an
artifact of generation order and is dropped (the seed's lesson). Repeated measurements of one
(dims_key, kernel) become one record with every latency kept as a sample. A file with missing
columns or kernel names no family knows is rejected whole, before anything is written.
"""
from __future__ import annotations

import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import pandas as pd

from tilecast.core.config import PROBLEM_SETS
from tilecast.stages.convert import ConvertSummary, records_frame, write_parquet
from tilecast.core.dataset import SCHEMA_VERSION, DatasetError
from tilecast.families import get_family
from tilecast.families.base import FamilyError
from tilecast.families.grouped_conv_kernels import parse_kernel_name

CK_COLUMNS = ("kernel", "problem_idx", "N", "C", "K", "G", "Di", "Hi", "Wi", "Z", "Y", "X",
              "stride_d", "stride_h", "stride_w", "pad_d", "pad_h", "pad_w", "dilation_d",
              "dilation_h", "dilation_w", "latency_ms", "tflops", "non_zero")
SHAPE_COLUMNS = CK_COLUMNS[2:21]
HARDWARE = "ck-tile-engine"
TRUE_VALUES, FALSE_VALUES = {"true", "1", "1.0", "yes"}, {"false", "0", "0.0", "no"}


def _truth(value, where: str) -> bool:
    text = str(value).strip().lower()
    if text in TRUE_VALUES:
        return True
    if text in FALSE_VALUES:
        return False
    raise DatasetError(f"{where}: non_zero={value!r} is not a boolean (true/false/1/0)")


def _read(path: Path) -> pd.DataFrame:
    if not path.exists():
        raise DatasetError(f"CK tile-engine CSV {path} does not exist")
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise DatasetError(f"{path}: empty file; expected a CK tile-engine benchmark CSV") from None
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


def _records(path: Path, frame: pd.DataFrame, problem_set: str) -> list[dict]:
    """One record per (family, dims_key, kernel), every latency of it kept as a sample."""
    run_id = f"ck-csv:{path.name}"
    written = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
    groups: dict[tuple[str, str, str], dict] = {}
    for line, row in zip(frame.index, frame.itertuples(index=False)):
        where = f"{path} row {line + 2}"     # header is line 1
        cfg = parse_kernel_name(row.kernel)
        family = get_family(f"grouped_conv_{cfg.direction}")
        # a blank depth field of a 2D row takes the 2D default (Di = Z = 1, ...)
        shape = {c: getattr(row, c) for c in SHAPE_COLUMNS if not pd.isna(getattr(row, c))}
        try:
            problem = family.problem({**shape, "direction": cfg.direction, "dtype": cfg.dtype,
                                      "ndim": cfg.ndim_spatial})
        except FamilyError as err:
            raise DatasetError(f"{where}: {err}") from None
        key = (family.name, family.dims_key(problem), row.kernel)
        entry = groups.setdefault(key, {"family": family, "problem": problem, "config": cfg,
                                        "latencies_s": [], "bad": [], "source_tflops": []})
        latency_s = float(row.latency_ms) / 1e3
        if latency_s > 0 and latency_s != float("inf"):
            entry["latencies_s"].append(latency_s)
        if not _truth(row.non_zero, where):
            entry["bad"].append(line + 2)
        entry["source_tflops"].append(float(row.tflops))
    records = []
    for (family_name, dims_key, kernel), entry in groups.items():
        family, problem, samples = entry["family"], entry["problem"], entry["latencies_s"]
        status, reason = "ok", ""
        if entry["bad"]:
            status, reason = "wrong_result", (f"tile engine reported an all-zero output "
                                              f"(non_zero false, CSV rows {entry['bad']})")
        elif not samples:
            status, reason = "crashed", "no positive finite latency_ms in the CSV"
        record = {
            "schema_version": SCHEMA_VERSION, "timing": "imported", "run_id": run_id,
            "time": written, "git_sha": None,
            "hardware": HARDWARE, "family": family_name, "problem_set": problem_set,
            "dims_key": dims_key, **family.problem_dict(problem), "kernel": kernel,
            "role": "candidate", "phase": "screen", "status": status, "reason": reason,
            "samples_s": samples, "reps_per_sample": 0, "median_s": None, "mad_s": None,
            "tflops": None, "gbps": None, "max_error": None, "threads": None,
            "source_tflops": statistics.median(entry["source_tflops"]),
        }
        for field, value in family.config_dict(entry["config"]).items():
            record.setdefault(field, value)   # problem fields (direction, dtype) are equal
        if status == "ok":
            median_s = statistics.median(samples)
            record.update(median_s=median_s,
                          mad_s=statistics.median(abs(s - median_s) for s in samples),
                          tflops=family.flops(problem) / median_s / 1e12,
                          gbps=family.bytes_moved(problem) / median_s / 1e9)
        records.append(record)
    return records


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
    frames = [(path, _read(path)) for path in paths]
    records = [r for path, frame in frames for r in _records(path, frame, problem_set)]
    frame = records_frame(records, ", ".join(map(str, paths)))
    write_parquet(frame, Path(out_parquet))
    return ConvertSummary(out_path=Path(out_parquet), rows=len(frame),
                          problems=frame[["family", "dims_key"]].drop_duplicates().shape[0],
                          kernels=frame["kernel"].nunique(),
                          statuses=frame["status"].value_counts().to_dict())
