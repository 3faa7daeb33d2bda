"""Foreign import of CK tile-engine grouped-conv CSVs: rows keyed on the dims tuple (never on
problem_idx), columns named as the seed, bad files rejected whole with the offenders named,
single rows without a usable latency left out and reported with their line numbers."""
from __future__ import annotations

import csv

import pandas as pd
import pytest

from faults import note_case, note_records
from tilecast.core import dataset
from tilecast.cli import main
from tilecast.stages.convert_ck import CK_COLUMNS, convert_ck_csv
from tilecast.core.dataset import DatasetError
from tilecast.families import get_family
from tilecast.table.dataset import TableDataError, read_dataset
from tilecast.table.importing import import_files

FWD_2D = "grouped_conv_forward_bf16_2d_64x64x64_compv3_intrawave_dsb_si"
FWD_2D_MEM = "grouped_conv_forward_bf16_2d_256x128x128_mem_interwave"
FWD_3D = "grouped_conv_forward_fp16_3d_128x64x32_basic_async_v1_interwave_si"
BWD_W = "grouped_conv_bwd_weight_bf16_2d_64x64x64_compv4"
SHAPE_2D = dict(N=2, C=64, K=128, G=1, Di=1, Hi=28, Wi=28, Z=1, Y=3, X=3, stride_d=1, stride_h=1,
                stride_w=1, pad_d=0, pad_h=1, pad_w=1, dilation_d=1, dilation_h=1, dilation_w=1)
SHAPE_3D = dict(N=1, C=16, K=32, G=4, Di=8, Hi=14, Wi=14, Z=3, Y=3, X=3, stride_d=1, stride_h=2,
                stride_w=2, pad_d=1, pad_h=1, pad_w=1, dilation_d=2, dilation_h=1, dilation_w=1)


def _row(kernel, problem_idx, latency_ms, non_zero="True", **shape):
    return {"kernel": kernel, "problem_idx": problem_idx, **SHAPE_2D, **shape,
            "latency_ms": latency_ms, "tflops": 1.0, "non_zero": non_zero}


def _write(path, rows, columns=CK_COLUMNS):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


ROWS = [
    _row(FWD_2D, 0, 0.50),
    _row(FWD_2D, 7, 0.70),                        # same dims, another index: one problem
    _row(FWD_2D, 0, 0.40, dilation_h=2, pad_h=2),  # same index, other dims: another problem
    _row(FWD_2D_MEM, 0, 0.90),
    _row(FWD_3D, 3, 1.25, non_zero="0", **SHAPE_3D),
    _row(BWD_W, 0, 2.00),
]


def test_rows_are_keyed_on_the_dims_tuple(tmp_path):
    src = _write(tmp_path / "fwd_bench.csv", ROWS)
    summary = convert_ck_csv(src, tmp_path / "out.parquet", problem_set="holdout")
    frame = dataset.load(tmp_path / "out.parquet")
    assert (summary.rows, summary.kernels, summary.problems) == (5, 4, 4)
    assert "problem_idx" not in frame.columns
    forward = get_family("grouped_conv_forward")
    base = forward.problem({**SHAPE_2D, "dtype": "bf16", "ndim": 2})
    dilated = forward.problem({**SHAPE_2D, "dilation_h": 2, "pad_h": 2, "dtype": "bf16", "ndim": 2})
    seed = frame[frame["kernel"] == FWD_2D].set_index("dims_key")
    assert set(seed.index) == {forward.dims_key(base), forward.dims_key(dilated)}
    merged = seed.loc[forward.dims_key(base)]
    assert sorted(merged["samples_s"]) == pytest.approx([0.5e-3, 0.7e-3])
    assert merged["median_s"] == pytest.approx(0.6e-3)
    assert merged["tflops"] == pytest.approx(forward.flops(base) / 0.6e-3 / 1e12)
    assert (merged["status"], merged["family"], merged["role"], merged["phase"]) == \
        ("ok", "grouped_conv_forward", "candidate", "screen")
    assert (merged["run_id"], merged["hardware"], merged["problem_set"]) == \
        ("ck-csv:fwd_bench.csv", "ck-tile-engine", "holdout")
    assert (merged["pipeline"], merged["wave_mode"], merged["has_dsb"], merged["has_si"],
            merged["ndim_spatial"], merged["block"], merged["dtype"]) == \
        ("compv3", "intrawave", True, True, 2, 64, "bf16")
    wrong = frame[frame["kernel"] == FWD_3D].iloc[0]
    assert wrong["status"] == "wrong_result" and "non_zero" in wrong["reason"]
    assert (wrong["ndim"], wrong["Di"], wrong["dilation_d"], wrong["G"]) == (3, 8, 2, 4)
    assert dataset.valid(frame)["kernel"].tolist().count(FWD_3D) == 0
    backward = frame[frame["kernel"] == BWD_W].iloc[0]
    assert backward["family"] == "grouped_conv_bwd_weight" and backward["direction"] == "bwd_weight"
    assert pd.isna(backward["wave_mode"])          # optional in tile-engine names


def test_missing_columns_are_named_and_nothing_written(tmp_path):
    columns = [c for c in CK_COLUMNS if c not in ("dilation_w", "non_zero")]
    src = _write(tmp_path / "old.csv", ROWS, columns)
    with pytest.raises(DatasetError, match=r"old.csv: missing column\(s\) \['dilation_w', 'non_zero'\]"):
        convert_ck_csv(src, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


def test_unknown_kernels_are_named_and_the_file_rejected(tmp_path):
    bad = ["grouped_conv_forward_bf16_2d_64x64x64_compv9x_intrawave", "gemm_kernel_7"]
    src = _write(tmp_path / "bad.csv", ROWS + [_row(name, 9, 1.0) for name in bad])
    with pytest.raises(DatasetError, match="2 unknown kernel name") as err:
        convert_ck_csv(src, tmp_path / "out.parquet")
    assert all(name in str(err.value) for name in bad)
    assert "unknown pipeline 'compv9x'" in str(err.value)
    assert not (tmp_path / "out.parquet").exists()


def test_cli_convert_from_ck_csv(tmp_path, capsys):
    src = _write(tmp_path / "bench.csv", ROWS)
    out = tmp_path / "cli.parquet"
    assert main(["convert", "--from", "ck-csv", str(src), "--out", str(out)]) == 0
    assert "5 rows, 4 problems, 4 kernels" in capsys.readouterr().out
    assert set(dataset.load(out)["problem_set"]) == {"train"}
    _write(tmp_path / "broken.csv", ROWS, CK_COLUMNS[:-1])
    assert main(["convert", "--from", "ck-csv", str(tmp_path / "broken.csv"), "--out", str(out)]) == 2
    assert "non_zero" in capsys.readouterr().err


@pytest.mark.parametrize("content, needle", [
    (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "binary data (a NUL byte at offset 8)"),
    (b"kernel,latency_ms\n\xff\xfe\xfa,1.0\n", "not UTF-8 text (byte 0xff"),
    (b'kernel,N\n"unterminated,1\n', "not a well-formed CSV"),
    (b"", "empty file"),
    (b"latency_ms: fast\n", "missing column(s)"),
])
def test_a_file_of_garbage_is_a_clear_error(tmp_path, content, needle):
    src = tmp_path / "garbage.csv"
    src.write_bytes(content)
    with pytest.raises(DatasetError) as err:
        convert_ck_csv(src, tmp_path / "out.parquet")
    assert needle in str(err.value) and "garbage.csv" in str(err.value)
    assert not (tmp_path / "out.parquet").exists()
    note_case("clear")


def test_rows_without_a_usable_latency_are_left_out_and_reported(tmp_path, caplog):
    """`fast`, NaN and a negative latency: each row is left out and named by its CSV line;
    a kernel left with none is `crashed` saying which rows; the rest converts as before."""
    bad = [_row(FWD_2D, 0, "fast"),                                  # line 8
           _row(FWD_2D_MEM, 0, "nan", dilation_h=2, pad_h=2),        # line 9
           _row(FWD_2D, 0, -0.25)]                                    # line 10
    src = _write(tmp_path / "mixed.csv", ROWS + bad)
    with caplog.at_level("WARNING", logger="tilecast.stages.convert_ck"):
        summary = convert_ck_csv(src, tmp_path / "out.parquet")
    assert summary.bad_rows == 3 and summary.rows == 6
    assert "3 row(s) without a usable latency_ms" in caplog.text
    assert "CSV line(s) 8 (fast), 9 (nan), 10 (-0.25)" in caplog.text
    frame = dataset.load(tmp_path / "out.parquet").set_index(["kernel", "dilation_h"])
    kept = frame.loc[(FWD_2D, 1)]
    assert kept["status"] == "ok" and sorted(kept["samples_s"]) == pytest.approx([0.5e-3, 0.7e-3])
    lost = frame.loc[(FWD_2D_MEM, 2)]
    assert lost["status"] == "crashed" and "rows [9]" in lost["reason"] and pd.isna(lost["tflops"])
    for _ in bad:
        note_case("clear")


def test_no_usable_latency_at_all_is_an_error(tmp_path):
    src = _write(tmp_path / "fast.csv", [_row(FWD_2D, 0, "fast"), _row(BWD_W, 1, "-1")])
    with pytest.raises(DatasetError, match=r"fast.csv: no row has a usable latency_ms .*rows "
                                           r"2 \(fast\), 3 \(-1\)"):
        convert_ck_csv(src, tmp_path / "out.parquet")
    note_case("clear")


def test_malformed_shape_and_tflops_fields(tmp_path):
    """A shape field that is not a number is an error naming the row; a `tflops` that is not
    one only loses the CSV's own figure (tilecast recomputes TFLOP/s)."""
    src = _write(tmp_path / "shape.csv", ROWS[:1] + [_row(FWD_2D, 1, 0.5, N="two")])
    with pytest.raises(DatasetError, match=r"shape.csv row 3: bad shape field"):
        convert_ck_csv(src, tmp_path / "out.parquet")
    note_case("clear")
    rows = [{**_row(FWD_2D, 0, 0.5), "tflops": "fast"}]
    summary = convert_ck_csv(_write(tmp_path / "tflops.csv", rows), tmp_path / "out.parquet")
    record = dataset.load(summary.out_path).iloc[0]
    assert record["status"] == "ok" and pd.isna(record["source_tflops"]) and record["tflops"] > 0


def test_the_same_csv_twice_is_read_once_and_never_overwritten(tmp_path):
    src = _write(tmp_path / "bench.csv", ROWS)
    once = convert_ck_csv(src, tmp_path / "once.parquet")
    twice = convert_ck_csv([src, src], tmp_path / "twice.parquet")
    assert twice.duplicates_dropped == once.rows and twice.rows == once.rows
    note_records(lost=once.rows - twice.rows, duplicated=twice.rows - once.rows)
    before = src.read_bytes()
    with pytest.raises(DatasetError, match="is the input"):
        convert_ck_csv(src, src)
    note_case("clear")
    assert src.read_bytes() == before


def test_both_ck_readers_collapse_repeats_alike(tmp_path):
    """One CSV measuring slots several times (the tile engine appends each run), through the
    family pipeline (convert_ck) and into a table dataset (import --from ck-csv): one
    collapser and one schema (core.columns), so each slot has the same status, samples,
    median and MAD in both."""
    rows = [_row(FWD_2D, 0, 0.50), _row(FWD_2D, 1, 0.70), _row(FWD_2D, 2, 0.90),
            _row(FWD_2D, 3, 0.40),                                    # four runs: median 0.6
            _row(FWD_2D_MEM, 0, 0.30), _row(FWD_2D_MEM, 1, 0.20),
            _row(FWD_2D_MEM, 2, 0.25, non_zero="False"),              # failed once: not ok
            _row(FWD_2D, 0, 1.10, Hi=14, Wi=14)]                      # another problem
    src = _write(tmp_path / "runs.csv", rows)
    convert_ck_csv(src, tmp_path / "out.parquet")
    records = dataset.load(tmp_path / "out.parquet").set_index(["kernel", "Hi"])
    import_files("ck-csv", [src], tmp_path / "ds", device="MI300X")
    table = read_dataset(tmp_path / "ds").frame.set_index(["kernel_name", "Hi"])
    assert set(records.index) == set(table.index) == {(FWD_2D, 28), (FWD_2D_MEM, 28),
                                                       (FWD_2D, 14)}
    for slot in records.index:
        record, row = records.loc[slot], table.loc[slot]
        assert record["status"] == row["status"]
        assert list(record["samples_s"]) == list(row["samples_s"])
        if record["status"] == "ok":
            assert (record["median_s"], record["mad_s"]) == (row["median_s"], row["mad_s"])
        else:
            assert pd.isna(record["median_s"]) and pd.isna(row["median_s"])
            assert pd.isna(record["mad_s"]) and pd.isna(row["mad_s"])
    assert records.loc[(FWD_2D, 28), "median_s"] == pytest.approx(0.6e-3)
    assert records.loc[(FWD_2D, 28), "mad_s"] == pytest.approx(0.15e-3)
    assert table.loc[(FWD_2D, 28), "mad_s"] == pytest.approx(0.15e-3)
    failed = records.loc[(FWD_2D_MEM, 28)]
    assert failed["status"] == "wrong_result" and "CSV rows [8]" in failed["reason"]
    assert sorted(failed["samples_s"]) == pytest.approx([0.2e-3, 0.25e-3, 0.3e-3])


BAD_ROW = {   # one bad field on CSV line 3, and what both readers say of it
    "non_zero": ({"non_zero": "maybe"}, r"column non_zero: not a boolean \(true/false/1/0\) at "
                                        r"row\(s\) 3 \(maybe\)"),
    "shape": ({"N": "two"}, r"row 3: bad shape field \(N='two' is not a whole number\)"),
    "kernel": ({"kernel": "grouped_conv_forward_bf16_2d_64x64x64_compv9x_intrawave"},
               r"1 unknown kernel name\(s\), e.g. \['grouped_conv_forward_bf16_2d_64x64x64_"
               r"compv9x_intrawave'\] \(first: .*unknown pipeline 'compv9x'"),
    "blank kernel": ({"kernel": ""}, r"column kernel: blank kernel name at row\(s\) 3 \(\)"),
}


@pytest.mark.parametrize("case", list(BAD_ROW))
def test_both_ck_readers_name_a_bad_row_alike(tmp_path, case):
    """One parser: a bad field is the same error, naming the file, line and column, whether
    the CSV is converted into records or imported into a table dataset."""
    change, needle = BAD_ROW[case]
    src = _write(tmp_path / "bad.csv", [ROWS[0], {**ROWS[3], **change}])
    with pytest.raises(DatasetError, match=needle):
        convert_ck_csv(src, tmp_path / "out.parquet")
    with pytest.raises(TableDataError, match=needle):
        import_files("ck-csv", [src], tmp_path / "ds", device="MI300X")
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "ds").exists()
    note_case("clear")
    note_case("clear")


def test_a_latency_that_is_not_a_time_converts_without_the_row_and_refuses_the_import(tmp_path):
    src = _write(tmp_path / "fast.csv", [ROWS[0], _row(FWD_2D_MEM, 1, "fast")])
    summary = convert_ck_csv(src, tmp_path / "out.parquet")
    assert summary.bad_rows == 1 and summary.statuses == {"ok": 1, "crashed": 1}
    with pytest.raises(TableDataError, match=r"fast.csv: column latency_ms: not a positive "
                                             r"number at row\(s\) 3 \('fast'\)"):
        import_files("ck-csv", [src], tmp_path / "ds", device="MI300X")
    note_case("clear")


def test_depth_fields_are_filled_for_a_2d_kernel_only(tmp_path):
    """A 2D kernel's blank depth fields are the 2D values in both readers; a 3D kernel's are
    missing, which both refuse (the importer once filled them with the 2D values)."""
    blank_depth = {"Di": "", "Z": "", "stride_d": "", "pad_d": "", "dilation_d": ""}
    src = _write(tmp_path / "2d.csv", [{**ROWS[0], **blank_depth}])
    record = dataset.load(convert_ck_csv(src, tmp_path / "out.parquet").out_path).iloc[0]
    import_files("ck-csv", [src], tmp_path / "ds", device="MI300X")
    row = read_dataset(tmp_path / "ds").frame.iloc[0]
    for field, value in (("Di", 1), ("Z", 1), ("stride_d", 1), ("pad_d", 0), ("dilation_d", 1)):
        assert record[field] == row[field] == value
    src = _write(tmp_path / "3d.csv", [{**_row(FWD_3D, 0, 1.0, **SHAPE_3D), **blank_depth}])
    with pytest.raises(DatasetError, match=r"3d.csv row 2: bad shape field .*missing field\(s\) "
                                           r"\['Di', 'Z'\]"):
        convert_ck_csv(src, tmp_path / "out3.parquet")
    with pytest.raises(TableDataError, match=r"3d.csv: column Di: blank at row\(s\) \[2\]"):
        import_files("ck-csv", [src], tmp_path / "ds3", device="MI300X")
    note_case("clear")
    note_case("clear")


def test_problem_idx_and_tflops_are_not_needed(tmp_path):
    """The parser reads the columns it uses: a CSV without problem_idx and tflops converts,
    without the tile engine's own figure."""
    columns = [c for c in CK_COLUMNS if c not in ("problem_idx", "tflops")]
    src = _write(tmp_path / "lean.csv", ROWS, columns)
    frame = dataset.load(convert_ck_csv(src, tmp_path / "out.parquet").out_path)
    assert len(frame) == 5 and frame["source_tflops"].isna().all() and (frame["tflops"] > 0).any()
