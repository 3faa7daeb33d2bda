"""Convert stage: bad raw files are rejected with a message naming them; parquet round-trips;
the output never replaces an input (or any file that is not a dataset); a record read twice
is one row."""
from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faults import note_case, note_records
from tilecast.core import dataset, stats
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


def _raw(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_output_is_never_one_of_the_inputs(tmp_path):
    """`convert W/bench/gemm.jsonl --out W/bench/gemm.jsonl` once replaced the raw log that a
    resumed run depends on with parquet: by the same path, a symlink or a hard link."""
    raw = _raw(tmp_path / "gemm.jsonl", _record(), _record(kernel="k2"))
    before = raw.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(raw)
    os.link(raw, tmp_path / "hard.jsonl")
    for out in (raw, tmp_path / "." / "gemm.jsonl", tmp_path / "link.jsonl", tmp_path / "hard.jsonl"):
        with pytest.raises(DatasetError, match="is the input .*gemm.jsonl; writing the dataset "
                                               "there would replace it"):
            convert_raw([raw], out)
        note_case("clear")
    with pytest.raises(DatasetError, match="is the input"):   # the link given as the input
        convert_raw([tmp_path / "link.jsonl"], raw)
    note_case("clear")
    assert raw.read_bytes() == before and (tmp_path / "link.jsonl").is_symlink()


def test_an_existing_file_that_is_not_a_dataset_is_not_replaced(tmp_path):
    raw = _raw(tmp_path / "gemm.jsonl", _record())
    other_log = _raw(tmp_path / "conv.jsonl", _record(kernel="conv"))
    with pytest.raises(DatasetError, match="exists and is not a parquet file"):
        convert_raw([raw], other_log)
    note_case("clear")
    assert dataset.load(convert_raw([raw], tmp_path / "out.parquet").out_path).shape[0] == 1
    # a dataset it wrote is replaced: converting again after more records is the normal case
    _raw(raw, _record(), _record(kernel="k2"))
    assert convert_raw([raw], tmp_path / "out.parquet").rows == 2
    assert json.loads(other_log.read_text())["kernel"] == "conv"


def test_repeated_records_become_one_row_and_are_counted(tmp_path, caplog):
    """The same file given twice, or a record copied into a second file, is read once; two
    measurements of one slot at different times (a re-measurement) both stay."""
    first = _raw(tmp_path / "a.jsonl", _record(), _record(kernel="k2"),
                 _record(phase="confirm", time="2026-01-01T00:01:00"))
    second = _raw(tmp_path / "b.jsonl", _record(kernel="k2"),
                  _record(kernel="k2", time="2026-01-02T00:00:00", samples_s=[3e-6]))
    with caplog.at_level("WARNING", logger="tilecast.stages.convert"):
        summary = convert_raw([first, first, second], tmp_path / "out.parquet")
    assert summary.duplicates_dropped == 4 and summary.rows == 4
    assert "dropped 4 repeated record(s)" in caplog.text
    frame = dataset.load(tmp_path / "out.parquet")
    slots = frame.groupby(["run_id", "time", "dims_key", "kernel", "phase"]).size()
    note_records(lost=4 - len(slots), duplicated=int((slots - 1).sum()))
    assert len(slots) == 4 and slots.max() == 1
    assert sorted(frame.loc[frame["kernel"] == "k2", "time"]) == ["2026-01-01T00:00:00",
                                                                   "2026-01-02T00:00:00"]


def test_a_slot_measured_under_two_protocols_is_scored_on_the_latest(tmp_path):
    """A raw file resumed after a protocol change holds both protocols' records of a pair:
    the final table takes the latest protocol's and never pools the two."""
    import pandas as pd

    old = dict(protocol_hash="aaaa", build_key="b1")
    new = dict(protocol_hash="bbbb", build_key="b1", time="2026-01-02T00:00:00")
    frame = pd.DataFrame([
        _record(samples_s=[1.0] * 3, median_s=1.0, tflops=3.0, **old),
        _record(phase="confirm", samples_s=[1.0] * 3, median_s=1.0, tflops=3.0,
                **{**old, "time": "2026-01-01T00:01:00"}),
        _record(samples_s=[2.0] * 3, median_s=2.0, tflops=1.5, **new),
        _record(kernel="k2", samples_s=[4.0], median_s=4.0, tflops=0.75, **old)])
    final = dataset.final_table(frame).set_index("kernel")
    assert final.at["k1", "protocol_hash"] == "bbbb" and final.at["k1", "median_s"] == 2.0
    assert final.at["k1", "phase"] == "screen"            # the old confirm is not pooled
    assert final.at["k2", "protocol_hash"] == "aaaa"      # measured once: its record stands
    rebuilt = frame.assign(build_key=["b1", "b1", "b2", "b1"], protocol_hash="aaaa")
    assert dataset.final_table(rebuilt).set_index("kernel").at["k1", "median_s"] == 2.0


def test_a_raw_log_corrupt_before_its_last_line_is_an_error_unless_skipped(tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(_record()) + "\n{garbage\n" + json.dumps(_record(kernel="k2"))
                   + "\n[1, 2]\n" + json.dumps(_record(kernel="k3")) + "\n")
    with pytest.raises(DatasetError, match=r"raw.jsonl: 2 corrupt line\(s\) before the end "
                                           r"\(line\(s\) 2, 4\)"):
        convert_raw([raw], tmp_path / "out.parquet")
    note_case("clear")
    assert not (tmp_path / "out.parquet").exists()
    summary = convert_raw([raw], tmp_path / "out.parquet", skip_corrupt=True)
    assert (summary.rows, summary.skipped_lines) == (3, 2)


# -- the one repeat collapser ----------------------------------------------------------------

def test_collapse_repeats_known_answer():
    """Slots in first-seen order; usable times are the samples; a failed row or no usable
    time leaves the slot without a median, MAD or spread."""
    measurements = pd.DataFrame({
        "k": ["a", "b", "a", "c", "a", "b", "a"],
        "time_s": [1.0, 2.0, 4.0, math.nan, -1.0, 4.0, 2.0],
        "status": ["ok", "ok", "ok", "ok", "ok", "wrong_result", "ok"]})
    slots = dataset.collapse_repeats(measurements, ["k"]).set_index("k")
    assert list(slots.index) == ["a", "b", "c"]
    a, b, c = (slots.loc[key] for key in "abc")
    assert (a["first"], a["rows"], a["failed"], a["samples_s"]) == (0, [0, 2, 4, 6], [],
                                                                     [1.0, 4.0, 2.0])
    assert (a["median_s"], a["mad_s"], a["spread"]) == (2.0, 1.0, 4.0)
    assert (b["rows"], b["failed"], b["samples_s"]) == ([1, 5], [5], [2.0, 4.0])
    assert (c["rows"], c["failed"], c["samples_s"]) == ([3], [], [])
    for slot in (b, c):
        assert math.isnan(slot["median_s"]) and math.isnan(slot["mad_s"]) \
            and math.isnan(slot["spread"])


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.one_of(st.floats(1e-6, 1.0),
                                                               st.just(float("nan"))),
                          st.booleans()), min_size=1, max_size=40))
@settings(max_examples=80, deadline=None)
def test_collapse_repeats_is_the_statistics_of_each_slot(measurements):
    frame = pd.DataFrame({"k": [k for k, _, _ in measurements],
                          "time_s": [t for _, t, _ in measurements],
                          "status": ["ok" if ok else "crashed" for _, _, ok in measurements]})
    slots = dataset.collapse_repeats(frame, ["k"])
    assert list(slots["k"]) == list(dict.fromkeys(frame["k"]))
    for slot in slots.itertuples():
        rows = frame[frame["k"] == slot.k]
        samples = [t for t in rows["time_s"] if math.isfinite(t)]
        assert slot.rows == list(rows.index) and slot.samples_s == samples
        assert slot.failed == list(rows.index[rows["status"] != "ok"])
        if samples and not slot.failed:
            assert slot.median_s == stats.median(samples)
            assert slot.mad_s == stats.mad(samples)
            assert slot.spread == max(samples) / min(samples)
        else:
            assert math.isnan(slot.median_s) and math.isnan(slot.spread)
