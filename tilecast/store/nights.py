"""Nights into a store, and what a store holds: the functions behind `tilecast run --store` and
`tilecast store add|summary`.

A night's records are its converted dataset (W/data/<family>.parquet, or its raw log when it
was never converted), tagged with the hardware class it was measured on. A workdir written
since stores existed names its class in W/hardware.json; an older one is matched by the
fingerprint its records carry against this host's profile at their thread count, and
otherwise needs the class given by hand.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from tilecast.core import dataset, hardware
from tilecast.stages import layout
from tilecast.store import records as store_records
from tilecast.store.store import Store, StoreError

HARDWARE_FILE = "hardware.json"   # W/hardware.json: the profile the night measured with


@dataclass(frozen=True)
class Appended:
    """What one append of a night's family added to a store."""
    family: str
    hardware_class: str
    night: str
    records: int
    files: int

    def line(self) -> str:
        return (f"{self.family}: {self.records} records of night {self.night} "
                f"({self.hardware_class}) in {self.files} new file(s)")


def write_hardware(workdir: Path, profile: dict) -> None:
    """Record the profile a workdir's night measures with (W/hardware.json)."""
    from tilecast.core.atomic import atomic_write_json

    Path(workdir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(workdir) / HARDWARE_FILE, profile)


def append_frame(store: Store, frame: pd.DataFrame, family, hardware_class: str) -> Appended:
    """Append a family's dataset frame (one or more nights) to `store` as `hardware_class`."""
    table = store_records.to_table(frame, tuple(family.problem_fields), hardware_class)
    files = store.append(table)
    nights = sorted(set(frame["run_id"].astype(str)))
    return Appended(family.name, hardware_class, ",".join(nights), len(frame), len(files))


def _class_of(workdir: Path, frame: pd.DataFrame, hardware_class: str | None) -> str:
    if hardware_class:
        if not hardware.CLASS_RE.match(hardware_class):
            raise StoreError(f"hardware class {hardware_class!r} is not a class id (lower-case "
                             "letters, digits, '.', '-')")
        return hardware_class
    saved = workdir / HARDWARE_FILE
    if saved.is_file():
        try:
            named = json.loads(saved.read_text())["hardware_class"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise StoreError(f"{saved} does not name a hardware class ({type(err).__name__}: "
                             f"{err}); give the class by hand (--hardware-class)") from None
        if not isinstance(named, str) or not hardware.CLASS_RE.match(named):
            raise StoreError(f"{saved}: hardware_class {named!r} is not a class id")
        return named
    fingerprints = sorted(set(frame["hardware"].astype(str)))
    threads = sorted(set(int(t) for t in frame["threads"].dropna()))
    profiles = [hardware.profile(t) for t in threads]
    here = {p["fingerprint"]: p["hardware_class"] for p in profiles}
    if len(fingerprints) == 1 and fingerprints[0] in here:
        return here[fingerprints[0]]
    raise StoreError(f"{workdir}: its records were measured on hardware {fingerprints} "
                     f"(thread counts {threads}), not this host's, and it has no "
                     f"{HARDWARE_FILE}: give the class they were measured on "
                     "(--hardware-class)")


def add_workdir(store: Store, workdir: str | Path,
                hardware_class: str | None = None) -> list[Appended]:
    """Every family a workdir measured, as nights of `store` (created when new)."""
    from tilecast.families import get_family
    from tilecast.stages.convert import drop_repeats, records_frame
    from tilecast.measurement.rawlog import read_records

    workdir = Path(workdir)
    work = layout.Workdir(workdir)
    raw_logs = sorted((workdir / "bench").glob("*.jsonl"))
    if not raw_logs:
        raise StoreError(f"{workdir}: no benchmark records (bench/*.jsonl): not a workdir of "
                         "a run that measured")
    store.create()
    added = []
    for raw in raw_logs:
        name = raw.stem
        data = work.dataset(name)
        if data.is_file():
            frame = dataset.load(data)
        else:
            records, _ = drop_repeats(read_records(raw), str(raw))
            frame = records_frame(records, str(raw))
        for family_name, rows in frame.groupby("family", sort=True):
            family = get_family(family_name)
            added.append(append_frame(store, rows, family,
                                      _class_of(workdir, rows, hardware_class)))
    return added


def read_frame(store: Store, hardware_class: str, family: str, night: str | None = None
               ) -> pd.DataFrame:
    """One class's records of one family (of one night where given) as a dataset frame
    (tilecast.store.records.to_frame)."""
    return store_records.to_frame(store.read(hardware_class, family, night=night))


def summary(store: Store) -> list[dict]:
    """Per hardware class: its nights, problems (family, dims_key), candidate kernels (peers
    left out), records and the time of its last record; classes in name order. Read from
    the files' footers (each says what it holds), not from the records."""
    by_class: dict[str, list] = {}
    for part, held in store.footers():
        by_class.setdefault(part.hardware_class, []).append((part, held))
    out = []
    for hardware_class, items in sorted(by_class.items()):
        parts = [part for part, _ in items]
        out.append({"hardware_class": hardware_class,
                    "nights": len({part.night for part in parts}),
                    "families": sorted({part.family for part in parts}),
                    "problems": len({(part.family, key) for part, held in items
                                     for key in held["problems"]}),
                    "kernels": len({k for _, held in items for k in held["kernels"]}),
                    "records": sum(held["records"] for _, held in items) - store.repeats(parts),
                    "last_night": max(held["last_time"] for _, held in items)})
    return out


def summary_lines(rows: list[dict]) -> list[str]:
    """`tilecast store summary`'s table."""
    if not rows:
        return ["the store holds no records yet"]
    lines = [f"{'hardware class':<40} {'nights':>6} {'problems':>8} {'kernels':>7} "
             f"{'records':>10}  last night"]
    for row in rows:
        lines.append(f"{row['hardware_class']:<40} {row['nights']:>6} {row['problems']:>8} "
                     f"{row['kernels']:>7} {row['records']:>10}  {row['last_night']}")
    return lines

