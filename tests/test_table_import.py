"""`tilecast import`: each format's files (tests/fixtures/table, written in each tool's own
layout) become the rows their content says, devices resolved in the hardware table; bad input
is one line naming the file, row and column, and leaves --out as it was; a second import into
the same directory adds a device, a conflicting one is refused."""
from __future__ import annotations

import gzip
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tilecast.cli import main
from tilecast.table.dataset import (ROWS_FILE, Column, TableDataError, TableSchema, finish_frame,
                                    read_dataset)
from tilecast.table.devices import SHIPPED
from tilecast.table.formats import READERS, reader
from tilecast.table.formats.ck_csv import GEMM_CONFIG, gemm_fields
from tilecast.table.formats.common import collapse_rows
from tilecast.table.importing import import_files
from tilecast.table.train import data_hash, same_data

FIXTURES = Path(__file__).parent / "fixtures" / "table"
KT_A100, KT_H100 = FIXTURES / "kt_a100.json", FIXTURES / "kt_h100.json.gz"
KT_OPEN = FIXTURES / "kt_t4_open.json"
T4_DIR = FIXTURES / "t4_v100"
AH_H100 = FIXTURES / "autoheuristic" / "NVIDIA_H100_80GB_HBM3" / "mixed_mm.txt"
AH_FLAT = FIXTURES / "ah_pad_mm.txt"
CK_GEMM, CK_CONV = FIXTURES / "ck_gemm.csv", FIXTURES / "ck_conv.csv"
TABLE, TABLE_MAP = FIXTURES / "table.csv", FIXTURES / "table_mapping.yaml"
KT_KEYS = "block_size_x={},block_size_y={},tile_size_x={},tile_size_y={}"


def _rows(out: Path) -> pd.DataFrame:
    return read_dataset(out).frame


def _row(frame: pd.DataFrame, **where) -> pd.Series:
    mask = np.logical_and.reduce([frame[k] == v for k, v in where.items()])
    assert mask.sum() == 1, where
    return frame[mask].iloc[0]


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (and its siblings' names), to show nothing changed."""
    files = {str(p.relative_to(directory.parent)): p.read_bytes()
             for p in directory.rglob("*") if p.is_file()} if directory.exists() else {}
    return {**files, "siblings": repr(sorted(p.name for p in directory.parent.iterdir()))}


@pytest.fixture
def mi300x_devices(tmp_path) -> Path:
    """A devices file: the shipped MI300X entry with the name CK prints for it (gfx942)."""
    entry = yaml.safe_load(SHIPPED.read_text())["MI300X"]
    path = tmp_path / "devices.yaml"
    path.write_text(yaml.safe_dump({"MI300X": {**entry, "aliases": ["gfx942"]}}))
    return path


# -- Kernel Tuner ----------------------------------------------------------------------------

def test_kernel_tuner_caches_of_two_devices(tmp_path):
    out = tmp_path / "ds"
    summary = import_files("kernel-tuner", [KT_A100, KT_H100], out)
    frame = _rows(out)
    assert sorted(frame["device"].unique()) == ["A100-SXM4-80GB", "H100-SXM5-80GB"]
    assert set(frame["device_label"]) == {"NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"}
    assert len(frame) == 48 and summary.rows == 48 and summary.problems == 1
    assert summary.configurations == 24
    assert set(frame["dims_key"]) == {"problem_size_0=4096,problem_size_1=4096,problem_size_2=4096"}
    entry = json.loads(KT_A100.read_text())["cache"]["32,8,2,4"]
    ok = _row(frame, device="A100-SXM4-80GB", kernel=KT_KEYS.format(32, 8, 2, 4))
    assert ok["status"] == "ok" and ok["median_s"] == pytest.approx(entry["time"] / 1e3)
    # Kernel Tuner's runs are the samples; its time (their mean) stays the row's time
    assert list(ok["samples_s"]) == pytest.approx([t / 1e3 for t in entry["times"]])
    assert len(entry["times"]) == 7 and ok["mad_s"] == pytest.approx(
        float(np.median(np.abs(np.array(entry["times"]) - np.median(entry["times"])))) / 1e3)
    assert ok["row"] == "32,8,2,4" and ok["source"] == str(KT_A100)
    failures = {(r.device, r.row): (r.status, r.reason) for r in frame.itertuples()
                if r.status != "ok"}
    assert failures == {
        ("A100-SXM4-80GB", "16,4,1,2"): ("build_failed", "CompilationFailedConfig"),
        ("A100-SXM4-80GB", "64,4,2,2"): ("crashed", "RuntimeFailedConfig"),
        ("A100-SXM4-80GB", "64,8,2,4"): ("unsupported", "InvalidConfig"),
        ("H100-SXM5-80GB", "64,8,2,4"): ("failed", "time 1e+20: an old Kernel Tuner's failure "
                                                   "marker")}
    assert frame.loc[frame["status"] != "ok", "median_s"].isna().all()
    assert frame.loc[frame["status"] != "ok", "mad_s"].isna().all()
    manifest = read_dataset(out).manifest
    assert [s["format"] for s in manifest["sources"]] == ["kernel-tuner-cache"] * 2
    gz = manifest["sources"][1]
    assert gz["rows"] == 24 and gz["ok"] == 23
    import hashlib
    assert gz["sha256"] == hashlib.sha256(KT_H100.read_bytes()).hexdigest()   # the file as given
    assert summary.per_device == {"A100-SXM4-80GB": {"ok": 21, "failed": 3},
                                  "H100-SXM5-80GB": {"ok": 23, "failed": 1}}


def test_kernel_name_is_a_problem_column_only_when_files_differ(tmp_path):
    other = json.loads(KT_A100.read_text())
    other.update(kernel_name="matmul_kernel_v2", device_name="Tesla T4")
    path = tmp_path / "t4_v2.json"
    path.write_text(json.dumps(other))
    imported = reader("kernel-tuner").read([KT_A100, path], mapping=None, device=None)
    assert imported.schema.problem_names[0] == "kernel_name"
    assert {r["kernel_name"] for r in imported.rows} == {"matmul_kernel", "matmul_kernel_v2"}
    alone = reader("kernel-tuner").read([KT_A100, KT_H100], mapping=None, device=None)
    assert "kernel_name" not in alone.schema.problem_names


def test_open_cache_is_closed_as_kernel_tuner_does(tmp_path):
    """The fixture is what a running tune leaves: the header, then one entry a line, each
    ending in a comma. A run killed while writing leaves a last entry cut short: left out."""
    imported = reader("kernel-tuner").read([KT_OPEN], mapping=None, device=None)
    assert len(imported.rows) == 9 and {r["device"] for r in imported.rows} == {"Tesla T4"}
    cut = tmp_path / "cut.json"
    cut.write_text(KT_OPEN.read_text()[:-60])
    assert len(reader("kernel-tuner").read([cut], mapping=None, device=None).rows) == 8
    header_only = tmp_path / "header.json"
    header_only.write_text(KT_OPEN.read_text().split('"tune_params"')[0])
    with pytest.raises(TableDataError, match=r"header.json: not valid JSON \(.* at line \d+"):
        reader("kernel-tuner").read([header_only], mapping=None, device=None)


def test_empty_device_name_takes_device_option(tmp_path):
    document = json.loads(KT_A100.read_text())
    document["device_name"] = ""
    path = tmp_path / "nameless.json"
    path.write_text(json.dumps(document))
    with pytest.raises(TableDataError, match="nameless.json: device_name is empty; give --device"):
        import_files("kernel-tuner", [path], tmp_path / "ds")
    import_files("kernel-tuner", [path], tmp_path / "ds", device="L4")
    assert set(_rows(tmp_path / "ds")["device"]) == {"L4"}


def test_t4_results_take_the_device_of_their_metadata(tmp_path):
    out = tmp_path / "ds"
    import_files("kernel-tuner", [T4_DIR / "results.json", T4_DIR / "metadata.json"], out)
    frame = _rows(out)
    assert set(frame["device"]) == {"V100-SXM2"} and set(frame["dims_key"]) == {"-"}
    results = json.loads((T4_DIR / "results.json").read_text())["results"]
    first = _row(frame, row="results[0]")
    assert first["median_s"] == pytest.approx(results[0]["measurements"][0]["value"] / 1e3)
    assert list(first["samples_s"]) == pytest.approx(
        [t / 1e3 for t in results[0]["times"]["runtimes"]])
    assert _row(frame, row="results[3]")["status"] == "build_failed"
    assert _row(frame, row="results[6]")["status"] == "unsupported"
    # units are honoured: the same time in microseconds and seconds
    for unit, scale in (("us", 1e3), ("s", 1e-3)):
        document = json.loads((T4_DIR / "results.json").read_text())
        for result in document["results"]:
            for measurement in result["measurements"]:
                if measurement["name"] == "time" and result["invalidity"] == "correct":
                    measurement.update(value=measurement["value"] * scale, unit=unit)
        path = tmp_path / f"results_{unit}.json"
        path.write_text(json.dumps(document))
        rows = reader("kernel-tuner").read([path], mapping=None, device="V100-SXM2").rows
        assert rows[0]["median_s"] == pytest.approx(first["median_s"])


def test_t4_results_without_a_device(tmp_path):
    path = tmp_path / "results.json"
    shutil.copy(T4_DIR / "results.json", path)
    with pytest.raises(TableDataError, match="results.json: T4 results name no device; give "
                                             "--device NAME, or the T4 metadata file"):
        import_files("kernel-tuner", [path], tmp_path / "ds")


# -- AutoHeuristic ---------------------------------------------------------------------------

def test_autoheuristic_default_log_path_names_the_device(tmp_path):
    out = tmp_path / "ds"
    import_files("autoheuristic", [AH_H100], out)
    frame = _rows(out)
    assert set(frame["device"]) == {"H100-SXM5-80GB"}
    assert set(frame["device_label"]) == {"NVIDIA H100 80GB HBM3"}
    schema = read_dataset(out).schema
    assert schema.problem_names == ("m", "k", "n", "mat1_dtype", "mat2_dtype", "using_tf32")
    assert [c.kind for c in schema.problem] == ["numeric"] * 3 + ["categorical"] * 3
    assert schema.config_names == ("choice",)
    assert len(frame) == 9      # 11 lines, two of them repeats
    triton = "type=triton_BLOCK-M=16_BLOCK-K=128_BLOCK-N=64_numstages=4_numwarps=4"
    seen_twice = _row(frame, m=16, choice=triton)
    assert list(seen_twice["samples_s"]) == pytest.approx([0.041814e-3, 0.0418e-3])
    assert seen_twice["row"] == "4,12"
    assert seen_twice["median_s"] == pytest.approx((0.041814 + 0.0418) / 2 * 1e-3)
    assert seen_twice["mad_s"] == pytest.approx((0.041814 - 0.0418) / 2 * 1e-3)
    failed = _row(frame, m=64, choice="extern_fallback_mixed_mm")
    assert failed["status"] == "crashed" and failed["row"].count(",") == 1
    assert math.isnan(failed["median_s"]) and "inf" in failed["reason"]


def test_autoheuristic_without_a_device_directory_needs_device(tmp_path):
    with pytest.raises(TableDataError, match=r"ah_pad_mm.txt: AutoHeuristic data names no device "
                                             r"\(compute capability 8.0, 166912 bytes of shared "
                                             r"memory\); give --device NAME"):
        import_files("autoheuristic", [AH_FLAT], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
    import_files("autoheuristic", [AH_FLAT], tmp_path / "ds", device="A100-PCIE-40GB")
    dataset = read_dataset(tmp_path / "ds")
    kinds = {c.name: c.kind for c in dataset.schema.problem}
    assert kinds["mat1_iscontig"] == "categorical" and kinds["mat1_stride_0"] == "numeric"
    assert _row(dataset.frame, m=1023, choice="pad")["median_s"] == pytest.approx(0.1873e-3)


def _ah_with_extra_column(tmp_path: Path) -> Path:
    """The H100 fixture as another device's run whose heuristic logs one more feature
    (AutoHeuristic's flex_attention files differ so: kv_seq_length on one device only)."""
    lines = AH_H100.read_text().splitlines()
    header = lines[1].split(",")
    at = header.index("choice")
    out = []
    for number, line in enumerate(lines[2:]):
        cells = line.split(",")
        out.append(",".join(cells[:at] + [str(512 * (1 + number % 2))] + cells[at:]))
    path = tmp_path / "autoheuristic" / "NVIDIA_A100-SXM4-80GB" / "mixed_mm.txt"
    path.parent.mkdir(parents=True)
    path.write_text("\n".join([lines[0], ",".join(header[:at] + ["kv_seq_length"] + header[at:]),
                               *out]) + "\n")
    return path


def test_files_whose_columns_differ_combine_with_the_column_missing_where_lacked(tmp_path):
    extra = _ah_with_extra_column(tmp_path)
    out = tmp_path / "ds"
    summary = import_files("autoheuristic", [AH_H100, extra], out)
    assert "mixed_mm.txt has no column kv_seq_length: missing in its rows" in summary.line()
    dataset = read_dataset(out)
    column = {c.name: c for c in dataset.schema.problem}["kv_seq_length"]
    assert column.kind == "numeric" and column.partial
    assert not any(c.partial for c in dataset.schema.problem if c.name != "kv_seq_length")
    frame = dataset.frame
    h100 = frame[frame["device"] == "H100-SXM5-80GB"]
    a100 = frame[frame["device"] == "A100-SXM4-80GB"]
    assert h100["kv_seq_length"].isna().all() and a100["kv_seq_length"].isin([512, 1024]).all()
    # one import after the other: the same union, said at the second
    again = tmp_path / "ds2"
    import_files("autoheuristic", [AH_H100], again)
    second = import_files("autoheuristic", [extra], again)
    assert "problem column kv_seq_length is missing in the dataset's rows" in second.line()
    merged = read_dataset(again)
    assert {c.name: c.partial for c in merged.schema.problem}["kv_seq_length"]
    assert sorted(merged.frame["dims_key"]) == sorted(frame["dims_key"])
    # a query may leave the partial column out
    from tilecast.table.model import check_problem

    values = check_problem(merged.schema, {"m": 16, "k": 64, "n": 64, "mat1_dtype": "a",
                                           "mat2_dtype": "b", "using_tf32": "c"})
    assert math.isnan(values["kv_seq_length"])
    with pytest.raises(TableDataError, match=r"missing \['m'\]"):
        check_problem(merged.schema, {"k": 64, "n": 64, "mat1_dtype": "a", "mat2_dtype": "b",
                                      "using_tf32": "c"})


def test_kernel_tuner_caches_of_different_problem_ranks_combine(tmp_path):
    """A 2-D problem's cache beside a 3-D one: problem_size_2 is missing in the 2-D rows."""
    flat = json.loads(KT_A100.read_text())
    flat.update(problem_size=[4096, 4096], device_name="Tesla T4")
    path = tmp_path / "t4_2d.json"
    path.write_text(json.dumps(flat))
    summary = import_files("kernel-tuner", [KT_A100, path], tmp_path / "ds")
    assert "t4_2d.json has no column problem_size_2: missing in its rows" in summary.line()
    dataset = read_dataset(tmp_path / "ds")
    partial = {c.name: c.partial for c in dataset.schema.problem}
    assert partial == {"problem_size_0": False, "problem_size_1": False, "problem_size_2": True}
    t4 = dataset.frame[dataset.frame["device"] == "T4"]
    assert t4["problem_size_2"].isna().all() and len(t4) == 24


def test_a_column_of_two_kinds_is_refused_in_one_line(tmp_path):
    first = tmp_path / "a" / "autoheuristic" / "NVIDIA_H100_80GB_HBM3" / "mixed_mm.txt"
    first.parent.mkdir(parents=True)
    first.write_text(AH_H100.read_text())
    out = tmp_path / "ds"
    import_files("autoheuristic", [first], out)
    second = tmp_path / "b" / "autoheuristic" / "NVIDIA_A100-SXM4-80GB" / "mixed_mm.txt"
    second.parent.mkdir(parents=True)
    lines = AH_H100.read_text().splitlines()
    second.write_text("\n".join(lines[:2] + [",".join(["many"] + line.split(",")[1:])
                                             for line in lines[2:]]) + "\n")
    with pytest.raises(TableDataError, match=r"problem column 'm' is numeric in one source "
                                             r"and categorical in the other"):
        import_files("autoheuristic", [second], out)


# -- CK tile engine --------------------------------------------------------------------------

def test_ck_gemm_profiler_csv(tmp_path, mi300x_devices):
    out = tmp_path / "ds"
    import_files("ck-csv", [CK_GEMM], out, devices_files=[mi300x_devices])
    dataset = read_dataset(out)
    frame = dataset.frame
    assert set(frame["device"]) == {"MI300X"} and set(frame["device_label"]) == {"gfx942"}
    assert dataset.schema.problem_names == ("split_k", "m", "n", "k", "stride_a", "stride_b",
                                            "stride_c", "dtype_a", "dtype_b", "dtype_acc",
                                            "dtype_c", "layout_a", "layout_b", "layout_c")
    assert dataset.schema.config_names == ("kernel_name",) + tuple(n for n, _ in GEMM_CONFIG)
    name = ("gemm_universal_fp16_rcr_compv3_cshuffle_intrawave_False_False_False_False_"
            "256x256x32_2x2x1_32x32x16")
    twice = _row(frame, m=1024, kernel_name=name)
    assert list(twice["samples_s"]) == pytest.approx([0.0043e-3, 0.0052e-3])
    assert twice["median_s"] == pytest.approx((0.0043 + 0.0052) / 2e3)
    assert (twice["pipeline"], twice["tile_m"], twice["tile_k"], twice["warp_tile_k"]) == \
        ("compv3", 256, 32, 16)
    asynchronous = frame[frame["pipeline"] == "comp_async"].iloc[0]
    assert (asynchronous["epilogue"], asynchronous["scheduler"], asynchronous["persistent"]) == \
        ("cshuffle", "default", 1)
    assert len(frame) == 8


@given(pipeline=st.sampled_from(["compv3", "compv4", "mem", "comp_async", "preshufflev2",
                                 "comp_tdm_v2"]),
       epilogue=st.sampled_from(["cshuffle", "default"]),
       scheduler=st.sampled_from(["intrawave", "interwave", "default"]),
       flags=st.lists(st.booleans(), min_size=4, max_size=4),
       tiles=st.lists(st.integers(1, 512), min_size=9, max_size=9))
@settings(max_examples=60, deadline=None)
def test_gemm_kernel_name_round_trip(pipeline, epilogue, scheduler, flags, tiles):
    """A name spelled as the tile engine's instance builder spells it parses back to the
    fields it was made of."""
    t = tiles
    name = (f"gemm_universal_fp16_rcr_{pipeline}_{epilogue}_{scheduler}_"
            + "_".join(str(f) for f in flags)
            + f"_{t[0]}x{t[1]}x{t[2]}_{t[3]}x{t[4]}x{t[5]}_{t[6]}x{t[7]}x{t[8]}")
    fields = gemm_fields(name)
    assert fields["pipeline"] == pipeline and fields["epilogue"] == epilogue
    assert fields["scheduler"] == scheduler
    assert [fields[f] for f in ("pad_m", "pad_n", "pad_k", "persistent")] == [int(f) for f in flags]
    assert [fields[f] for f in ("tile_m", "tile_n", "tile_k", "warp_m", "warp_n", "warp_k",
                                "warp_tile_m", "warp_tile_n", "warp_tile_k")] == tiles


def test_ck_gemm_names_outside_the_grammar_leave_the_name_alone(tmp_path, mi300x_devices):
    text = CK_GEMM.read_text().replace("gemm_universal_fp16_rcr_mem_default_interwave_True_True_"
                                       "True_False_128x128x64_2x2x1_32x32x16", "my_gemm_kernel")
    path = tmp_path / "gemm.csv"
    path.write_text(text)
    imported = reader("ck-csv").read([path], mapping=None, device=None)
    assert imported.schema.config_names == ("kernel_name",)


def test_ck_sweep_csv(tmp_path):
    """The tile engine's Python sweep writes the problem as a dict; 0 ms is no result."""
    name = "gemm_universal_bf16_rcr_compv3_cshuffle_intrawave_False_False_False_False_" \
           "256x256x32_2x2x1_32x32x16"
    problem = {"split_k": 1, "m": 2048, "n": 2048, "k": 2048, "dtype_a": "bf16"}
    lines = ["bandwidth_gb_s,name,perf_result,problem,tflops,time_ms",
             f'900.1,{name},"{{}}","{problem}",560.2,0.0307',
             f'0,{name.replace("256x256x32", "128x128x32")},"{{}}","{problem}",0,0']
    path = tmp_path / "gemm_universal_benchmark_results.csv"
    path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "ds"
    with pytest.raises(TableDataError, match="a CK tile-engine sweep CSV names no device"):
        import_files("ck-csv", [path], out)
    import_files("ck-csv", [path], out, device="MI300X")
    frame = _rows(out).sort_values("tile_m")
    assert list(frame["status"]) == ["failed", "ok"]
    assert frame["median_s"].iloc[1] == pytest.approx(0.0307e-3)
    assert read_dataset(out).schema.problem_names == tuple(problem)


def test_ck_grouped_conv_csv(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(TableDataError, match="ck_conv.csv: a CK tile-engine grouped-conv CSV "
                                             "names no device; give --device NAME"):
        import_files("ck-csv", [CK_CONV], out)
    import_files("ck-csv", [CK_CONV], out, device="MI300X")
    dataset = read_dataset(out)
    frame = dataset.frame
    assert dataset.schema.problem_names[:3] == ("direction", "dtype", "ndim")
    assert set(frame["Di"]) == {1} and set(frame["pad_d"]) == {0}    # blank 2D depth fields
    wrong = _row(frame, Hi=28, kernel_name="grouped_conv_forward_bf16_2d_128x64x32_basic_async_v1")
    assert wrong["status"] == "wrong_result" and "non_zero" in wrong["reason"]
    assert wrong["wave_mode"] == "none" and wrong["block"] == 128
    fast = _row(frame, Hi=28, kernel_name="grouped_conv_forward_bf16_2d_256x128x128_mem_interwave")
    assert fast["median_s"] == pytest.approx(0.074e-3) and fast["has_dsb"] == 0


# -- any table -------------------------------------------------------------------------------

def test_table_with_mapping_csv_and_parquet(tmp_path):
    out = tmp_path / "ds"
    import_files("table", [TABLE], out, mapping_path=TABLE_MAP)
    frame = _rows(out)
    assert sorted(frame["device"].unique()) == ["A100-PCIE-40GB", "L4"]
    timeout = _row(frame, device="L4", m=2048, tile_m=128, tile_n=128)
    assert (timeout["status"], timeout["reason"]) == ("timeout", "state=timeout")
    first = _row(frame, device="A100-PCIE-40GB", m=512, tile_m=64)
    assert first["median_s"] == pytest.approx(0.006e-3) and first["row"] == "2"
    assert first["kernel"] == "tile_m=64,tile_n=64,algo=splitk"
    parquet = tmp_path / "table.parquet"
    pd.read_csv(TABLE).to_parquet(parquet)
    again = reader("table").read([parquet], mapping=yaml.safe_load(TABLE_MAP.read_text()),
                                 device=None)
    by_row = {r["row"]: r for r in again.rows}
    assert by_row["0"]["median_s"] == pytest.approx(0.006e-3) and by_row["0"]["tile_m"] == 64


def test_table_status_values_tilecast_names_old_names_and_others(tmp_path):
    """A status value that is one of tilecast's is kept, one of the older vocabulary is
    renamed, anything else is `failed` with the value as the reason."""
    states = ["ok", "wrong_result", "compile_failed", "invalid", "runtime_failed", "segfault"]
    path = tmp_path / "states.csv"
    path.write_text("cfg,latency,state\n" + "".join(f"{i},0.5,{state}\n"
                                                    for i, state in enumerate(states)))
    mapping = {"config": ["cfg"], "time": {"column": "latency", "unit": "ms"},
               "device": {"value": "L4"}, "status": {"column": "state", "ok": ["ok"]}}
    rows = reader("table").read([path], mapping=mapping, device=None).rows
    frame = finish_frame(rows, TableSchema(problem=(), config=(Column("cfg", "numeric"),)))
    assert list(zip(frame["status"], frame["reason"])) == [
        ("ok", ""), ("wrong_result", "state=wrong_result"),
        ("build_failed", "state=compile_failed"), ("unsupported", "state=invalid"),
        ("crashed", "state=runtime_failed"), ("failed", "state=segfault")]


def test_a_dataset_written_in_the_old_status_vocabulary_still_reads(tmp_path):
    """measurements.parquet of a dataset imported before the one vocabulary holds
    compile_failed, runtime_failed and invalid: it reads as build_failed, crashed and
    unsupported, every other column as written."""
    out = tmp_path / "ds"
    import_files("kernel-tuner", [KT_A100, KT_H100], out)
    current = read_dataset(out).frame
    old_names = {"build_failed": "compile_failed", "crashed": "runtime_failed",
                 "unsupported": "invalid"}
    written = pd.read_parquet(out / ROWS_FILE)
    written["status"] = written["status"].replace(old_names)
    assert set(old_names.values()) <= set(written["status"])
    written.to_parquet(out / ROWS_FILE, index=False)
    read = read_dataset(out).frame
    pd.testing.assert_frame_equal(read, current)
    assert {"build_failed", "crashed", "unsupported", "failed"} <= set(read["status"])
    # a model trained on it before the rename recorded the old spelling's hash: still the same
    # data for the publish gate; other data is not
    assert data_hash(written) != data_hash(read) and same_data(read, data_hash(written))
    changed = written.assign(median_s=written["median_s"] * 1.01)
    assert not same_data(read, data_hash(changed))


@pytest.mark.parametrize("mapping, needle", [
    ({"config": ["a"], "time": {"column": "t", "unit": "ms"}, "devise": {"value": "L4"}},
     "key devise: Extra inputs are not permitted"),
    ({"config": ["a"], "time": {"column": "t", "unit": "fortnights"}},
     "key time.unit: Input should be 's', 'ms', 'us' or 'ns'"),
    ({"config": ["a"], "time": {"column": "t", "unit": "ms"},
      "device": {"column": "gpu", "value": "L4"}}, "key device: give exactly one of column"),
    ({"problem": ["m"], "time": {"column": "t", "unit": "ms"}}, "key config: Field required"),
    ({"problem": ["m"], "config": ["m"], "time": {"column": "t", "unit": "ms"}},
     "column 'm' is both problem and config"),
])
def test_bad_mapping_names_file_and_key(tmp_path, mapping, needle):
    path = tmp_path / "map.yaml"
    path.write_text(yaml.safe_dump(mapping))
    with pytest.raises(TableDataError) as err:
        import_files("table", [TABLE], tmp_path / "ds", mapping_path=path)
    assert f"mapping {path}:" in str(err.value) and needle in str(err.value)


# -- bad input: one clear message, nothing written --------------------------------------------

def _kt_variant(tmp_path, edit) -> Path:
    document = json.loads(KT_A100.read_text())
    edit(document)
    path = tmp_path / "kt.json"
    path.write_text(json.dumps(document))
    return path


def _write(tmp_path, name, text) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BAD = {
    "malformed JSON": (lambda d: ("kernel-tuner", [_write(d, "kt.json", '{"cache": {"1": {')],
                                  {}), r"kt.json: not valid JSON \(Expecting"),
    "malformed CSV": (lambda d: ("table", [_write(d, "t.csv", 'gpu,m\n"L4,1\n')],
                                 {"mapping_path": TABLE_MAP}), "t.csv: not a well-formed CSV"),
    "unknown unit": (lambda d: ("kernel-tuner", [_write(d, "r.json", (T4_DIR / "results.json")
                                                        .read_text().replace('"ms"', '"min"'))],
                                {"device": "V100-SXM2"}),
                     r"r.json row results\[0\]: column time: unknown time unit 'min'"),
    "missing column": (lambda d: ("ck-csv", [_write(d, "c.csv", CK_CONV.read_text().replace(
        ",non_zero", ",nonzero"))], {"device": "MI300X"}),
        r"c.csv: missing column\(s\) \['non_zero'\]"),
    "missing mapped column": (lambda d: ("table", [_write(d, "t.csv", TABLE.read_text().replace(
        "latency", "lat"))], {"mapping_path": TABLE_MAP}),
        r"t.csv: missing column\(s\) \['latency'\]"),
    "no time": (lambda d: ("kernel-tuner", [_kt_variant(d, lambda doc: doc["cache"]["16,4,1,4"]
                                                        .pop("time"))], {}),
                "kt.json row 16,4,1,4: column time: missing"),
    "NaN time": (lambda d: ("kernel-tuner", [_kt_variant(d, lambda doc: doc["cache"]["16,4,1,4"]
                                                         .update(time=float("nan")))], {}),
                 "kt.json row 16,4,1,4: column time: nan is not a positive number"),
    "negative time": (lambda d: ("table", [_write(d, "t.csv", TABLE.read_text().replace(
        ",0.0071,", ",-0.0071,"))], {"mapping_path": TABLE_MAP}),
        r"t.csv: column latency: not a positive number at row\(s\) 3 \('-0.0071'\)"),
    "unknown marker": (lambda d: ("kernel-tuner", [_kt_variant(d, lambda doc: doc["cache"][
        "16,4,1,4"].update(time="Broken"))], {}), "unknown marker 'Broken'"),
    "duplicate key": (lambda d: ("kernel-tuner", [KT_A100, shutil.copy(KT_A100, d / "again.json")],
                                 {}), "the same configuration of the same problem on the same "
                                      "device appears more than once"),
    "unknown device": (lambda d: ("kernel-tuner", [_kt_variant(d, lambda doc: doc.update(
        device_name="Voodoo5 6000"))], {}),
        r"kt.json: unknown device 'Voodoo5 6000'.*--devices FILE"),
    "empty file": (lambda d: ("autoheuristic", [_write(d, "e.txt", "")], {}), "e.txt: empty file"),
    "wrong format": (lambda d: ("kernel-tuner", [CK_GEMM], {}), "ck_gemm.csv: not valid JSON"),
    "JSON for a CSV format": (lambda d: ("ck-csv", [KT_A100], {}),
                              "kt_a100.json: (not a well-formed CSV|header .* is none of the "
                              "tile engine's CSV layouts)"),
    "CSV for AutoHeuristic": (lambda d: ("autoheuristic", [TABLE], {"device": "L4"}),
                              "table.csv: line 1 is not a JSON object"),
    "binary": (lambda d: ("table", [_write(d, "b.csv", "gpu\0m\n")], {"mapping_path": TABLE_MAP}),
               "b.csv: binary data"),
    "bad gzip": (lambda d: ("kernel-tuner", [d / "k.json.gz"], {}), "k.json.gz: a damaged gzip"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_message_and_writes_nothing(tmp_path, case):
    (tmp_path / "k.json.gz").write_bytes(gzip.compress(b'{"cache": {}}')[:12])
    make, needle = BAD[case]
    source, paths, options = make(tmp_path)
    out = tmp_path / "ds"
    before = _snapshot(out)
    with pytest.raises(TableDataError, match=needle) as err:
        import_files(source, paths, out, **options)
    assert "\n" not in str(err.value)
    assert _snapshot(out) == before and not out.exists()


# -- merging into an existing dataset ---------------------------------------------------------

def test_second_import_adds_a_device_and_conflicts_are_refused(tmp_path):
    out = tmp_path / "ds"
    import_files("kernel-tuner", [KT_A100], out)
    summary = import_files("kernel-tuner", [KT_H100], out)
    assert summary.merged and summary.rows == 24 and summary.total_rows == 48
    dataset = read_dataset(out)
    assert dataset.devices == ["A100-SXM4-80GB", "H100-SXM5-80GB"]
    assert [s["path"] for s in dataset.manifest["sources"]] == [str(KT_A100), str(KT_H100)]
    before = _snapshot(out)
    with pytest.raises(TableDataError, match="kt_a100.json was already imported into"):
        import_files("kernel-tuner", [KT_A100], out)
    with pytest.raises(TableDataError, match=r"configuration columns \['block_size_x.* differ"):
        import_files("table", [TABLE], out, mapping_path=TABLE_MAP)
    assert _snapshot(out) == before
    assert len(pd.read_parquet(out / ROWS_FILE)) == 48


# -- the command line ------------------------------------------------------------------------

def test_cli_import_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "ds"
    assert main(["import", "--from", "kernel-tuner", str(KT_A100), str(KT_H100),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1
    line = printed[0]
    assert line.startswith(f"imported 48 rows from 2 file(s) into {out} in ")
    assert "A100-SXM4-80GB 21 ok / 3 failed, H100-SXM5-80GB 23 ok / 1 failed" in line
    assert line.endswith("1 problems, 24 configurations")


def test_cli_import_with_devices_file_and_mapping(tmp_path, capsys, mi300x_devices):
    out = tmp_path / "ds"
    assert main(["import", "--from", "ck-csv", str(CK_GEMM), "--devices", str(mi300x_devices),
                 "--out", str(out)]) == 0
    assert "MI300X 8 ok / 0 failed" in capsys.readouterr().out
    assert main(["import", "--from", "table", str(TABLE), "--mapping", str(TABLE_MAP),
                 "--out", str(tmp_path / "other")]) == 0


@pytest.mark.parametrize("argv, needle", [
    (["--from", "kernel-tuner", str(CK_GEMM)], "ck_gemm.csv: not valid JSON"),
    (["--from", "kernel-tuner", "--mapping", str(TABLE_MAP), str(KT_A100)],
     "--mapping is for --from table"),
    (["--from", "table", str(TABLE)], "--from table needs --mapping MAP.yaml"),
    (["--from", "autoheuristic", str(AH_FLAT)], "AutoHeuristic data names no device"),
    (["--from", "kernel-tuner", "missing.json"], "input missing.json does not exist"),
])
def test_cli_bad_input_is_one_line_and_status_2(tmp_path, capsys, argv, needle):
    out = tmp_path / "ds"
    assert main(["import", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tilecast import: error: ") and needle in err[0]
    assert not out.exists()


def test_every_format_has_a_reader():
    for name in READERS:
        assert callable(reader(name).read)
    with pytest.raises(TableDataError, match="unknown format 'csv'; valid: kernel-tuner"):
        reader("csv")


# -- collapsing repeated measurements ---------------------------------------------------------

@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(1e-6, 1.0)), min_size=1,
                max_size=30))
@settings(max_examples=60, deadline=None)
def test_collapse_rows_keeps_the_samples_and_their_median(measurements):
    frame = pd.DataFrame({"key": [k for k, _ in measurements],
                          "time_s": [t for _, t in measurements], "status": "ok", "reason": "",
                          "row": [str(i) for i in range(len(measurements))]})
    collapsed = collapse_rows(frame, ["key"]).set_index("key")
    for key, times in frame.groupby("key")["time_s"]:
        assert collapsed.at[key, "median_s"] == pytest.approx(float(np.median(times)))
        assert collapsed.at[key, "samples_s"] == list(times)
        assert collapsed.at[key, "row"] == ",".join(frame.loc[times.index, "row"])
