"""`tilecast import`: other people's measurements into one dataset directory.

The format's reader (tilecast.table.formats) reads every file; each device label a file gives
(or --device) is resolved to its canonical name in the hardware table (tilecast.table.devices,
plus --devices files), the label kept as `device_label`; the rows are checked and keyed by
`finish_frame`. When --out already holds a dataset, the new rows are merged into it (same
problem and configuration columns; a file already imported there, or a row repeating one, is
refused). The directory is written whole by `write_dataset`: a failed import, at any step,
leaves --out as it was.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from tilecast.table import formats
from tilecast.table.dataset import (MANIFEST_FILE, TableDataError, TableDataset, finish_frame,
                                    merge, read_dataset, write_dataset)

log = logging.getLogger("tilecast.table.import")


@dataclass(frozen=True)
class ImportSummary:
    """What one import did: the rows it added (per device: ok and not ok), the problems and
    configurations among them, the dataset's size after it, the seconds it took."""
    out: Path
    files: int
    rows: int
    per_device: dict[str, dict[str, int]]
    problems: int
    configurations: int
    total_rows: int
    merged: bool
    seconds: float
    notes: tuple[str, ...] = ()


    def line(self) -> str:
        """The one-line summary the command prints."""
        devices = ", ".join(f"{device} {counts['ok']} ok / {counts['failed']} failed"
                            for device, counts in self.per_device.items())
        merged = f"; {self.out} now holds {self.total_rows} rows" if self.merged else ""
        notes = "".join(f"; {note}" for note in self.notes)
        return (f"imported {self.rows} rows from {self.files} file(s) into {self.out} in "
                f"{self.seconds:.2f} s: {devices}; {self.problems} problems, "
                f"{self.configurations} configurations{merged}{notes}")


def import_files(source: str, paths: Sequence[str | Path], out: str | Path, *,
                 mapping_path: str | Path | None = None, device: str | None = None,
                 devices_files: Sequence[str | Path] = ()) -> ImportSummary:
    """Read `paths` as format `source`, resolve their devices, and write (or extend) the
    dataset directory `out`; TableDataError (nothing written) on any bad input."""
    started = time.perf_counter()
    paths, out = [Path(p) for p in paths], Path(out)
    if not paths:
        raise TableDataError("no input files given")
    module = formats.reader(source)
    mapping = _mapping(module, source, mapping_path)
    log.info("reading %d file(s) as %s", len(paths), source)
    imported = module.read(paths, mapping=mapping, device=device)
    rows = _resolve_devices(imported.rows, devices_files)
    frame = finish_frame(rows, imported.schema)
    added, sources, name, schema = frame, imported.sources, None, imported.schema
    notes = list(imported.notes)
    old = read_dataset(out) if (out / MANIFEST_FILE).is_file() else None
    if old is not None:
        _refuse_reimport(old, sources, out)
        frame, schema, became = merge(old, frame, imported.schema)
        for column in became:
            where = "the dataset's rows" if column not in old.schema.problem_names else \
                "this import's rows"
            notes.append(f"problem column {column} is missing in {where}")
        sources = list(old.manifest.get("sources", [])) + list(sources)
        name = old.manifest.get("name")
    for note in notes:
        log.warning("import: %s", note)
    write_dataset(out, frame, schema, sources, name=name)
    per_device = {}
    for device_name, statuses in added.groupby("device", sort=True)["status"]:
        counts = Counter(statuses)
        per_device[device_name] = {"ok": counts["ok"], "failed": len(statuses) - counts["ok"]}
    return ImportSummary(out=out, files=len(paths), rows=len(added), per_device=per_device,
                         problems=added["dims_key"].nunique(),
                         configurations=added["kernel"].nunique(), total_rows=len(frame),
                         merged=old is not None, seconds=time.perf_counter() - started,
                         notes=tuple(notes))


def _mapping(module, source: str, mapping_path: str | Path | None) -> Mapping | None:
    """The checked mapping for a format that takes one; TableDataError when a format needs
    one and none is given, or one is given to a format that takes none."""
    load = getattr(module, "load_mapping", None)
    if mapping_path is not None and load is None:
        raise TableDataError(f"--mapping is for --from table; --from {source} names its own "
                             "columns")
    if mapping_path is None and load is not None:
        raise TableDataError(f"--from {source} needs --mapping MAP.yaml naming the problem, "
                             "configuration, time and device columns")
    return load(mapping_path) if load is not None else None


def _resolve_devices(rows: list[dict], devices_files: Sequence[str | Path]) -> list[dict]:
    """`rows` with `device` the canonical name of each label and `device_label` the label;
    TableDataError (naming a file that uses it) for a label the hardware table lacks."""
    from tilecast.table.devices import DeviceTable

    table = DeviceTable.load(extra=[Path(p) for p in devices_files])
    canonical = {}
    for row in rows:
        label = row["device"]
        if label not in canonical:
            try:
                canonical[label] = table.resolve(label)
            except TableDataError as err:
                raise TableDataError(f"{row['source']}: {err}") from None
        row["device_label"] = label
        row["device"] = canonical[label]
    return rows


def _refuse_reimport(old: TableDataset, sources: Sequence[dict], out: Path) -> None:
    """TableDataError when a file with rows was already imported into `out` (same sha256)."""
    imported = {entry.get("sha256"): entry.get("path") for entry in old.manifest.get("sources", [])
                if entry.get("rows")}
    for entry in sources:
        if entry["rows"] and entry["sha256"] in imported:
            raise TableDataError(f"{entry['path']} was already imported into {out} (as "
                                 f"{imported[entry['sha256']]}); its rows are there")
