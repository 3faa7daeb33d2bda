"""PyTorch Inductor AutoHeuristic data files: line 1 the JSON metadata (heuristic `name`,
`shared_memory`, `device_capa`, `numerical_features`, `categorical_features`), line 2 the CSV
header (the features, then `choice` and `feedback`), then one line per measured choice.

Problem columns are the feature columns in header order: categorical when the metadata lists
them as categorical features (or their values are not numbers), else numeric (True/False as
1/0). The one configuration column is `choice` (categorical). `feedback` is the choice's time
in milliseconds (Inductor's benchmarker's unit); `inf` marks a choice that failed to run:
`crashed`. AutoHeuristic appends a line every time it sees an input, so one (features,
choice) can appear many times in a file: the lines become one row, with the median time as
AutoHeuristic's own trainer takes it, every time as `samples_s`.

The metadata names no device (only compute capability and shared memory). The device is
--device, else the directory of AutoHeuristic's default log path
(`.../autoheuristic/<device name, spaces as _>/<heuristic>.txt`); else the import is refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from tilecast.table.dataset import Column, TableDataError, TableSchema
from tilecast.table.formats.common import (Imported, RawFile, as_numeric_column, check_names,
                                           collapse_rows, numbers, read_csv_text, read_raw,
                                           same_columns, source_entry, union_columns)

FORMAT = "autoheuristic"
WHAT = "an AutoHeuristic data file (a JSON metadata line, then CSV with choice and feedback)"
CHOICE, FEEDBACK = "choice", "feedback"
MS = 1e-3
# the first data line: line 1 is the metadata, line 2 the header
FIRST_LINE = 3
LOG_DIR = "autoheuristic"


def read(paths: Sequence[Path], *, mapping: Mapping | None, device: str | None) -> Imported:
    """The rows of AutoHeuristic data files `paths` (see the module docstring)."""
    if mapping:
        raise TableDataError("--mapping is not used with --from autoheuristic: the files name "
                             "their own features")
    frames, sources, features, categorical, heuristics = [], [], {}, set(), {}
    for path in paths:
        raw = read_raw(path)
        metadata = _metadata(raw)
        frame = read_csv_text(raw, WHAT, skip_lines=1)
        if list(frame.columns[-2:]) != [CHOICE, FEEDBACK]:
            raise TableDataError(f"{raw.path}: the header's last columns are "
                                 f"{list(frame.columns[-2:])}, not ['{CHOICE}', '{FEEDBACK}']; "
                                 f"expected {WHAT}")
        features[raw.path] = tuple(frame.columns[:-2])
        check_names(features[raw.path], raw.path)
        categorical.update(metadata.get("categorical_features") or [])
        heuristics[raw.path] = (metadata.get("name"),)
        frames.append(_rows(raw, frame, _device(raw.path, metadata, device)))
        sources.append(source_entry(raw, FORMAT, frames[-1]["status"]))
    # files of one heuristic whose features differ (a column one device's run lacks) combine
    names, partial, notes = union_columns(features)
    same_columns(heuristics, "heuristic name (metadata 'name')")
    frame = pd.concat(frames, ignore_index=True)
    problem = []
    for name in names:
        present = frame[name].notna()
        numeric = None if name in categorical else as_numeric_column(frame.loc[present, name])
        if numeric is None:
            frame[name] = frame[name].where(present, "").astype(str).str.strip()
        else:
            frame[name] = pd.to_numeric(frame[name].where(present), errors="coerce")
            frame.loc[present, name] = numeric
        problem.append(Column(name, "categorical" if numeric is None else "numeric",
                              name in partial))
    schema = TableSchema(problem=tuple(problem), config=(Column(CHOICE, "categorical"),))
    frame = collapse_rows(frame, ["device", *names, CHOICE])
    return Imported(schema=schema, rows=frame.to_dict("records"), sources=sources,
                    notes=notes)


def _metadata(raw: RawFile) -> dict:
    first = raw.text(WHAT).split("\n", 1)[0].strip()
    try:
        metadata = json.loads(first)
    except json.JSONDecodeError:
        metadata = None
    if not isinstance(metadata, dict):
        raise TableDataError(f"{raw.path}: line 1 is not a JSON object (AutoHeuristic's "
                             f"metadata); expected {WHAT}")
    return metadata


def _device(path: Path, metadata: dict, device: str | None) -> str:
    """--device, else the device directory of AutoHeuristic's default log path."""
    if device:
        return device
    parent = path.resolve().parent
    if parent.parent.name == LOG_DIR and parent.name:
        return parent.name.replace("_", " ")
    capability = metadata.get("device_capa")
    known = (f" (compute capability {'.'.join(map(str, capability))}, "
             f"{metadata.get('shared_memory')} bytes of shared memory)"
             if isinstance(capability, list) else "")
    raise TableDataError(f"{path}: AutoHeuristic data names no device{known}; give --device "
                         "NAME, the GPU the data was collected on")


def _rows(raw: RawFile, frame: pd.DataFrame, label: str) -> pd.DataFrame:
    lines = pd.Series(range(FIRST_LINE, FIRST_LINE + len(frame)), index=frame.index)
    feedback = numbers(frame, FEEDBACK, raw.path, lines, positive=True, allow_inf=True)
    failed = feedback == float("inf")
    blank_choice = frame[CHOICE].str.strip() == ""
    if blank_choice.any():
        raise TableDataError(f"{raw.path}: column {CHOICE}: blank at row(s) "
                             f"{list(lines[blank_choice][:5])}")
    out = frame.copy()
    out[CHOICE] = frame[CHOICE].str.strip()
    out["device"] = label
    out["time_s"] = feedback.where(~failed) * MS   # one measurement a row: collapse_rows
    out["status"] = failed.map({True: "crashed", False: "ok"})
    out["reason"] = failed.map({True: "feedback inf: the choice failed to run", False: ""})
    out["source"] = str(raw.path)
    out["row"] = lines.astype(str)
    return out.drop(columns=[FEEDBACK])

