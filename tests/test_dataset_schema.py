"""The one dataset schema (tilecast.core.columns): benchmark records and imported table rows
spell every shared measurement column alike, and a table dataset written before (version 1:
`time_s`, `repeats`, `spread`) reads as version 2, trains and publishes."""
from __future__ import annotations

import hashlib
import json
import math

import pandas as pd
import pytest

from test_table_model import DEVICES, PROBLEMS, SCHEMA, make_rows
from tilecast.cli import main
from tilecast.core import columns
from tilecast.core.dataset import RECORD_COLUMNS
from tilecast.table.dataset import (MANIFEST_FILE, ROW_COLUMNS, ROWS_FILE, VERSION,
                                    TableDataError, finish_frame, read_dataset)
from tilecast.table.train import data_hash

ROUNDS = "20"
THREADS = "1"     # see test_table_model.THREADS


def test_records_and_table_rows_share_the_one_definition():
    names = columns.MEASUREMENT_NAMES
    assert names == ("dims_key", "kernel", "status", "reason", "samples_s", "median_s", "mad_s")
    # every shared concept is in both, spelled alike, and nothing else is named in both
    assert set(RECORD_COLUMNS) & set(ROW_COLUMNS) == set(names)
    assert [c for c in RECORD_COLUMNS if c in names] == list(names)
    assert [c for c in ROW_COLUMNS if c in names] == list(names)
    # the machine: a record's hardware fingerprint, a table row's device name, never both
    assert "hardware" in RECORD_COLUMNS and "device" not in RECORD_COLUMNS
    assert "device" in ROW_COLUMNS and "hardware" not in ROW_COLUMNS
    for column in columns.MEASUREMENT_COLUMNS + columns.MACHINE_COLUMNS:
        assert column.meaning and (column.unit == "s") == column.name.endswith("_s")
    assert columns.meaning("mad_s").unit == "s"
    with pytest.raises(KeyError, match="no measurement column 'time_s'; valid: dims_key, "
                                       "kernel, status"):
        columns.meaning("time_s")


def _write_version_1(path) -> pd.DataFrame:
    """A version-1 dataset directory as tilecast wrote one before the one schema: the time in
    `time_s`, `repeats` and `spread` (max/min), one status in the older vocabulary. Its rows."""
    current = finish_frame(make_rows(), SCHEMA)
    old = current.drop(columns=["samples_s", "mad_s"]).rename(columns={"median_s": "time_s"})
    old["repeats"] = 1
    old["spread"] = 1.0
    ok = old.index[old["status"] == "ok"]
    old.loc[ok[:3], "repeats"] = 3          # three rows merged measurements of one slot
    old.loc[ok[:3], "spread"] = 1.2
    failed = old.index[old["status"] == "build_failed"]
    old.loc[failed, "status"] = "compile_failed"
    order = ["device", "device_label", "dims_key", "kernel", "time_s", "status", "reason",
             "repeats", "spread", "source", "row"]
    old = old[order + [c for c in old.columns if c not in order]]
    path.mkdir()
    old.to_parquet(path / ROWS_FILE, index=False)
    manifest = {"format": "tilecast-table-dataset", "version": 1, "name": "old",
                "created": "2026-11-01T00:00:00+00:00", "rows": len(old), **SCHEMA.to_json(),
                "devices": {}, "problems": int(old["dims_key"].nunique()),
                "configurations": int(old["kernel"].nunique()),
                "sources": [{"file": "synthetic", "format": "test"}]}
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    return old


def test_a_version_1_dataset_reads_as_version_2(tmp_path):
    old = _write_version_1(tmp_path / "ds")
    dataset = read_dataset(tmp_path / "ds")
    frame = dataset.frame
    assert dataset.manifest["version"] == VERSION == 2 and dataset.manifest["upgraded_from"] == 1
    assert list(frame.columns[:len(ROW_COLUMNS)]) == list(ROW_COLUMNS)
    assert not {"time_s", "repeats", "spread"} & set(frame.columns)
    assert len(frame) == len(old)
    pd.testing.assert_series_equal(frame["median_s"], old["time_s"], check_names=False)
    assert set(frame["status"]) == {"ok", "unsupported", "build_failed"}
    single = (old["repeats"] == 1) & (old["status"] == "ok")
    # a row of one measurement: its time is its one sample, MAD 0
    assert all(samples == [t] for samples, t in zip(frame["samples_s"][single],
                                                    old["time_s"][single]))
    assert (frame["mad_s"][single] == 0.0).all()
    # a row of several: version 1 kept no samples, so none and no MAD; a failed row neither
    several = old["repeats"] == 3
    assert all(samples == [] for samples in frame["samples_s"][several])
    assert frame["mad_s"][several].isna().all() and frame["median_s"][several].notna().all()
    assert frame["mad_s"][old["status"] != "ok"].isna().all()
    # the hash a model trained on it recorded (version 1 hashed `time_s`) is its hash still
    rows = old.assign(status=frame["status"])[["device", "dims_key", "kernel", "status",
                                               "time_s"]].astype(str)
    rows = rows.sort_values(["device", "dims_key", "kernel"])
    assert data_hash(frame) == hashlib.sha256(rows.to_csv(index=False).encode()).hexdigest()


def test_a_version_1_dataset_trains_and_publishes(tmp_path):
    _write_version_1(tmp_path / "ds")
    workdir, registry_root = tmp_path / "work", tmp_path / "registry"
    assert main(["train", "--dataset", str(tmp_path / "ds"), "--workdir", str(workdir),
                 "--rounds", ROUNDS, "--threads", THREADS]) == 0
    manifest = json.loads((workdir / "models" / "table" / "train_manifest.json").read_text())
    assert manifest["devices"] == sorted(DEVICES)
    assert manifest["out_of_fold"]["n_problems"] == len(DEVICES) * len(PROBLEMS)
    assert manifest["data_hash"] == data_hash(read_dataset(tmp_path / "ds").frame)
    assert main(["publish", "--workdir", str(workdir), "--registry", str(registry_root),
                 "--model", "mm"]) == 0
    assert (registry_root / "mm" / "aliases").is_dir()


def test_an_unknown_dataset_version_names_the_readable_ones(tmp_path):
    _write_version_1(tmp_path / "ds")
    manifest = json.loads((tmp_path / "ds" / MANIFEST_FILE).read_text())
    (tmp_path / "ds" / MANIFEST_FILE).write_text(json.dumps({**manifest, "version": 7}))
    with pytest.raises(TableDataError, match="not a tilecast-table-dataset manifest of a "
                                             r"version this tilecast reads \(1, 2\): format "
                                             "'tilecast-table-dataset', version 7"):
        read_dataset(tmp_path / "ds")


def test_a_version_2_row_holds_its_samples_and_their_mad():
    rows = [{"m": 64, "n": 64, "k": 512, "tile_m": 16, "tile_n": 16, "vec": 1, "layout": "row",
             "device": "T4", "status": "ok", "median_s": 2.0, "samples_s": [1.0, 2.0, 4.0]},
            {"m": 64, "n": 64, "k": 512, "tile_m": 32, "tile_n": 16, "vec": 1, "layout": "row",
             "device": "T4", "status": "ok", "median_s": 3.0},
            {"m": 64, "n": 64, "k": 512, "tile_m": 64, "tile_n": 16, "vec": 1, "layout": "row",
             "device": "T4", "status": "crashed", "median_s": math.nan}]
    frame = finish_frame(rows, SCHEMA)
    assert list(frame["samples_s"]) == [[1.0, 2.0, 4.0], [3.0], []]
    assert frame["mad_s"].iloc[0] == 1.0 and frame["mad_s"].iloc[1] == 0.0
    assert math.isnan(frame["mad_s"].iloc[2])
