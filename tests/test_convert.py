"""Convert stage: bad raw files are rejected with a message naming them; parquet round-trips."""
from __future__ import annotations

import json

import pytest

from tilecast import dataset
from tilecast.convert import convert_raw
from tilecast.dataset import DatasetError, RECORD_COLUMNS


def _record(**over):
    base = {c: None for c in RECORD_COLUMNS}
    base.update(schema_version=1, run_id="r", time="2026-01-01T00:00:00", git_sha="x",
                hardware="h", family="gemm", problem_set="train", dims_key="m=1,n=1,k=1",
                kernel="k1", role="candidate", phase="screen", status="ok", reason="",
                samples_s=[1e-6, 2e-6], reps_per_sample=10, median_s=1.5e-6, mad_s=5e-7,
                tflops=1e-6, gbps=0.01, max_error=0.0, threads=2, m=1, n=1, k=1)
    base.update(over)
    return base


def test_empty_file_is_rejected_with_its_name(tmp_path):
    raw = tmp_path / "empty.jsonl"
    raw.write_text("")
    with pytest.raises(DatasetError, match="empty.jsonl: no benchmark records"):
        convert_raw([raw], tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()
    with pytest.raises(DatasetError, match="does not exist"):
        convert_raw([tmp_path / "missing.jsonl"], tmp_path / "out.parquet")


def test_truncated_tail_is_skipped_and_the_rest_converted(tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(_record()) + "\n" + json.dumps(_record(kernel="k2"))[:40])
    summary = convert_raw([raw], tmp_path / "out.parquet")
    assert summary.rows == 1
    frame = dataset.load(tmp_path / "out.parquet")
    assert list(frame["samples_s"][0]) == [1e-6, 2e-6]


def test_unknown_status_and_missing_columns_are_named(tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(_record(status="exploded")) + "\n")
    with pytest.raises(DatasetError, match="unknown status value.*exploded"):
        convert_raw([raw], tmp_path / "out.parquet")
    broken = _record()
    del broken["median_s"]
    raw.write_text(json.dumps(broken) + "\n")
    with pytest.raises(DatasetError, match="median_s"):
        convert_raw([raw], tmp_path / "out.parquet")


def test_final_table_prefers_confirmed_measurements():
    import pandas as pd

    frame = pd.DataFrame([_record(tflops=2.0, median_s=1.0),
                          _record(phase="confirm", tflops=1.5, median_s=1.3)])
    final = dataset.final_table(frame)
    assert len(final) == 1 and final["tflops"].iloc[0] == 1.5
