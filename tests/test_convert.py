"""Convert stage: bad raw files are rejected with a message naming them; parquet round-trips."""
from __future__ import annotations

import json

import pytest

from tilecast.core import dataset
from tilecast.stages.convert import convert_raw
from tilecast.core.dataset import DatasetError, RECORD_COLUMNS


def _record(**over):
    base = {c: None for c in RECORD_COLUMNS}
    base.update(schema_version=dataset.SCHEMA_VERSION, timing="isolated", run_id="r", time="2026-01-01T00:00:00", git_sha="x",
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


def test_version_1_records_convert_as_isolated_with_a_warning(tmp_path, caplog):
    old = _record(schema_version=1)
    del old["timing"]  # version 1 had no such field
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(old) + "\n" + json.dumps(_record(kernel="k2", timing="interleaved")) + "\n")
    with caplog.at_level("WARNING", logger="tilecast.stages.convert"):
        convert_raw([raw], tmp_path / "out.parquet")
    assert "1 record(s) of schema version(s) [1] upgraded" in caplog.text
    frame = dataset.load(tmp_path / "out.parquet").set_index("kernel")
    assert frame.loc["k1", "timing"] == "isolated" and frame.loc["k2", "timing"] == "interleaved"
    assert set(frame["schema_version"]) == {dataset.SCHEMA_VERSION}
    raw.write_text(json.dumps(_record(schema_version=7)) + "\n")
    with pytest.raises(DatasetError, match=r"schema version\(s\) \[7\]"):
        convert_raw([raw], tmp_path / "out.parquet")
    raw.write_text(json.dumps(_record(timing="guessed")) + "\n")
    with pytest.raises(DatasetError, match="unknown timing value.*guessed"):
        convert_raw([raw], tmp_path / "out.parquet")


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


def test_final_table_pools_a_finalists_screen_and_confirm_samples():
    import pandas as pd

    # screen [1, 1, 1, 1], confirm [3, 3, 3] (a slow spell): pooled median 1, not 3
    frame = pd.DataFrame([
        _record(samples_s=[1.0] * 4, tflops=2.0, gbps=4.0, median_s=1.0),
        _record(phase="confirm", samples_s=[3.0] * 3, tflops=2.0 / 3, gbps=4.0 / 3, median_s=3.0,
                time="2026-01-01T00:01:00"),
        _record(kernel="k2", samples_s=[2.0, 2.0], tflops=1.0, median_s=2.0)])
    final = dataset.final_table(frame).set_index("kernel")
    assert len(final) == 2 and final.at["k1", "phase"] == "confirm"
    assert final.at["k1", "median_s"] == 1.0 and final.at["k1", "tflops"] == pytest.approx(2.0)
    assert final.at["k1", "gbps"] == pytest.approx(4.0) and final.at["k1", "mad_s"] == 0.0
    assert final.at["k2", "median_s"] == 2.0  # a kernel measured once keeps its record
    # a failed confirmation is final: no pooling with the earlier ok samples
    failed = pd.DataFrame([_record(samples_s=[1.0], tflops=2.0, median_s=1.0),
                           _record(phase="confirm", status="crashed", samples_s=[], tflops=None,
                                   median_s=None)])
    assert dataset.final_table(failed)["status"].tolist() == ["crashed"]
