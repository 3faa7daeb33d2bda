"""The measurement store: round trips, idempotent and concurrent appends, killed writers,
damaged and foreign files, versions, and the command line. Records are small generated
dataset rows (the store never times anything); tests/test_end_to_end.py runs real nights."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from tilecast.cli import main
from tilecast.core import dataset, hardware
from tilecast.families import get_family
from tilecast.store import nights, records as store_records
from tilecast.store.store import Store, StoreError
from tests.test_registry_s3 import s3, s3_endpoint  # noqa: F401 - moto's S3 on 127.0.0.1

GEMM = get_family("gemm")
CLASS = "test-cpu-avx2-2c-2t-00000000"


def record(run_id, m, kernel, seconds, *, time_="2026-12-01T00:00:00", status="ok",
           problem_set="train", build_key="b1", protocol_hash="p1"):
    """One converted dataset row of a GEMM problem m x 64 x 64."""
    base = {c: None for c in dataset.RECORD_COLUMNS}
    problem = GEMM.problem({"m": m, "n": 64, "k": 64})
    ok = status == "ok"
    base.update(schema_version=dataset.SCHEMA_VERSION, timing="interleaved", run_id=run_id,
                time=time_, git_sha="abc", hardware="fp", family="gemm",
                problem_set=problem_set, dims_key=GEMM.dims_key(problem), kernel=kernel,
                role="candidate", phase="screen", status=status, reason="" if ok else "boom",
                samples_s=[seconds, seconds * 1.01] if ok else [], reps_per_sample=3,
                median_s=seconds if ok else None, mad_s=0.0,
                tflops=2 * m * 64 * 64 / seconds / 1e12 if ok else None, gbps=1.0,
                max_error=0.0, threads=2, protocol_hash=protocol_hash, build_key=build_key,
                binary_bytes=1000, **{f: getattr(problem, f) for f in GEMM.problem_fields})
    return base


def night(run_id, times, **kwargs):
    """A dataset frame: {m: {kernel: seconds}}."""
    rows = [record(run_id, m, kernel, s, **kwargs) for m, kernels in times.items()
            for kernel, s in kernels.items()]
    return pd.DataFrame(rows)


NIGHT = {8: {"k1": 1e-5, "k2": 2e-5}, 16: {"k1": 3e-5, "k2": 2e-5}}


def new_store(tmp_path, name="store") -> Store:
    return Store(tmp_path / name).create()


def test_a_night_comes_back_as_it_went_in(tmp_path):
    store = new_store(tmp_path)
    frame = night("n1", NIGHT)
    appended = nights.append_frame(store, frame, GEMM, CLASS)
    assert (appended.records, appended.files) == (4, 1)
    back = nights.read_frame(store, CLASS, "gemm").sort_values(["dims_key", "kernel"])
    frame = frame.sort_values(["dims_key", "kernel"])
    for column in ("dims_key", "kernel", "median_s", "tflops", "status", "m", "n", "k",
                   "layout_a", "binary_bytes", "build_key", "threads"):
        assert back[column].tolist() == frame[column].tolist(), column
    assert back["samples_s"].tolist() == frame["samples_s"].tolist()
    assert set(back["hardware_class"]) == {CLASS}
    assert nights.read_frame(store, "other-class", "gemm").empty


def test_a_peer_record_without_a_binary_goes_in_and_keeps_its_id(tmp_path):
    store = new_store(tmp_path)
    frame = night("n1", NIGHT)
    peer = dict(frame.iloc[0], kernel="torch", role="peer", build_key=None, protocol_hash=None)
    frame = pd.concat([frame, pd.DataFrame([peer])], ignore_index=True)
    table = store_records.to_table(frame, GEMM.problem_fields, CLASS)
    assert table.column("record_id").to_pylist()[-1] == store_records.record_id(peer)
    nights.append_frame(store, frame, GEMM, CLASS)
    back = nights.read_frame(store, CLASS, "gemm")
    assert back.loc[back["role"] == "peer", "build_key"].isna().all() and len(back) == 5
    assert nights.summary(store)[0]["kernels"] == 2   # the peer is no kernel


def test_appending_again_adds_nothing_and_overlapping_files_are_read_once(tmp_path):
    store = new_store(tmp_path)
    first = night("n1", {8: NIGHT[8]})
    nights.append_frame(store, first, GEMM, CLASS)
    again = nights.append_frame(store, first, GEMM, CLASS)
    assert again.files == 0
    # the night resumed and measured more: a second file holding the first one's records too
    nights.append_frame(store, night("n1", NIGHT), GEMM, CLASS)
    assert len(store.parts()) == 2
    back = nights.read_frame(store, CLASS, "gemm")
    assert len(back) == 4 and back["record_id"].is_unique


def _append_many(location: str, writer: int, count: int) -> None:
    store = Store(location)
    for index in range(count):
        frame = night(f"w{writer}", {1 + index: {"k1": 1e-5}})
        nights.append_frame(store, frame, GEMM, CLASS)


def test_concurrent_appends_lose_and_duplicate_nothing(tmp_path):
    store = new_store(tmp_path)
    writers, count = 6, 15
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_append_many, args=(store.location, w, count))
             for w in range(writers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    back = nights.read_frame(store, CLASS, "gemm")
    assert len(back) == writers * count
    assert back["record_id"].is_unique
    assert sorted(set(zip(back["run_id"], back["m"]))) == sorted(
        (f"w{w}", 1 + i) for w in range(writers) for i in range(count))
    assert store.check() == []


KILLED_WRITER = """
import sys
from tests.test_store import _append_many
_append_many(sys.argv[1], 0, 10_000)
"""


def test_a_writer_killed_at_any_point_leaves_every_reader_consistent(tmp_path):
    store = new_store(tmp_path)
    repo = Path(__file__).resolve().parents[1]
    for pause in (0.0, 0.013, 0.029, 0.051):   # after the writer's first file: mid-append
        before = len(store.parts())
        proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, store.location], cwd=repo)
        deadline = time.monotonic() + 60
        while len(store.parts()) == before and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(pause)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert len(store.parts()) > before
        back = nights.read_frame(store, CLASS, "gemm")   # every visible file whole
        assert back["record_id"].is_unique and len(back) == len(store.parts())
        for part in store.parts():
            assert pq.read_table(part.path).num_rows == 1
    left = [d for d in store.check() if "temporary" not in d.why]
    assert left == []


def test_damaged_and_foreign_files_are_skipped_with_a_warning_and_listed(tmp_path, caplog):
    store = new_store(tmp_path)
    nights.append_frame(store, night("n1", NIGHT), GEMM, CLASS)
    nights.append_frame(store, night("n2", NIGHT), GEMM, CLASS)
    damaged = store.parts()[0].path
    data = Path(damaged).read_bytes()
    Path(damaged).write_bytes(data[: len(data) // 2])
    foreign = Path(store.location) / "records" / "notes.txt"
    foreign.write_text("hello")
    back = nights.read_frame(store, CLASS, "gemm")
    assert len(back) == 4   # the other night
    assert damaged in caplog.text
    found = {d.path: d.why for d in store.check()}
    assert set(found) == {damaged, str(foreign)}
    assert "unreadable" in found[damaged] and "foreign" in found[str(foreign)]
    assert main(["store", "check", store.location]) == 1


def test_a_file_in_another_class_s_partition_is_found(tmp_path):
    store = new_store(tmp_path)
    nights.append_frame(store, night("n1", NIGHT), GEMM, CLASS)
    [part] = store.parts()
    moved = Path(part.path.replace(f"class={CLASS}", "class=other-class"))
    moved.parent.mkdir(parents=True)
    os.replace(part.path, moved)
    [damage] = store.check()
    assert damage.path == str(moved) and "hardware_class" in damage.why


def test_a_newer_store_and_a_foreign_directory_are_errors_naming_them(tmp_path):
    store = new_store(tmp_path)
    (Path(store.location) / "STORE.json").write_text(json.dumps(
        {"format": "tilecast-store", "version": 99}))
    with pytest.raises(StoreError, match=r"version 99.*reads version 1"):
        store.require()
    other = tmp_path / "other"
    (other / "records").mkdir(parents=True)
    with pytest.raises(StoreError, match="not a tilecast store"):
        Store(other).require()
    with pytest.raises(StoreError, match="does not exist"):
        Store(tmp_path / "nothing").require()


def test_an_unwritable_store_fails_before_anything_runs(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot be written"):
        Store(blocker / "store").create()
    code = main(["store", "add", str(blocker / "store"), str(tmp_path)])
    assert code == 2


def test_summary_counts_nights_problems_kernels_per_class(tmp_path, capsys):
    store = new_store(tmp_path)
    nights.append_frame(store, night("n1", NIGHT, time_="2026-12-01T01:00:00"), GEMM, CLASS)
    nights.append_frame(store, night("n2", {**NIGHT, 32: {"k3": 1e-4}},
                                     time_="2026-12-02T01:00:00"), GEMM, CLASS)
    nights.append_frame(store, night("x1", NIGHT), GEMM, "other-avx512-4c-4t-11111111")
    rows = {r["hardware_class"]: r for r in nights.summary(store)}
    assert rows[CLASS] == {"hardware_class": CLASS, "nights": 2, "families": ["gemm"],
                           "problems": 3, "kernels": 3, "records": 9,
                           "last_night": "2026-12-02T01:00:00"}
    assert rows["other-avx512-4c-4t-11111111"]["records"] == 4
    assert main(["store", "summary", store.location]) == 0
    out = capsys.readouterr().out
    assert CLASS in out and "other-avx512" in out


def test_store_add_takes_a_workdir_with_its_class_and_refuses_a_foreign_one(tmp_path, capsys):
    workdir = tmp_path / "w"
    frame = night("n1", NIGHT)
    raw = workdir / "bench" / "gemm.jsonl"
    raw.parent.mkdir(parents=True)
    raw.write_text("".join(json.dumps(r) + "\n" for r in frame.to_dict("records")))
    store = tmp_path / "store"
    # records of fingerprint "fp": not this host's, and no hardware.json
    assert main(["store", "add", str(store), str(workdir)]) == 2
    assert "--hardware-class" in capsys.readouterr().err
    assert main(["store", "add", str(store), str(workdir), "--hardware-class", CLASS]) == 0
    assert "4 records of night n1" in capsys.readouterr().out
    nights.write_hardware(workdir, {"hardware_class": "from-file-avx2-2c-2t-22222222"})
    assert main(["store", "add", str(store), str(workdir)]) == 0
    classes = {r["hardware_class"] for r in nights.summary(Store(store))}
    assert classes == {CLASS, "from-file-avx2-2c-2t-22222222"}
    (workdir / nights.HARDWARE_FILE).write_text("{not json")
    assert main(["store", "add", str(store), str(workdir)]) == 2
    assert "does not name a hardware class" in capsys.readouterr().err


def test_appending_rows_of_another_schema_is_refused(tmp_path):
    store = new_store(tmp_path)
    with pytest.raises(store_records.RecordError, match="lack column"):
        store_records.to_table(pd.DataFrame({"kernel": ["k"]}), GEMM.problem_fields, CLASS)
    table = store_records.to_table(night("n/1", NIGHT), GEMM.problem_fields, CLASS)
    with pytest.raises(StoreError, match="cannot name a store partition"):
        store.append(table)


@settings(max_examples=60, deadline=None)
@given(model=st.text(min_size=0, max_size=80), cores=st.integers(1, 512),
       threads=st.integers(1, 512), avx512=st.booleans())
def test_every_profile_has_a_path_safe_class_that_its_fingerprint_decides(model, cores, threads,
                                                                         avx512):
    prof = {"cpu_model": model, "cores": cores, "threads": threads, "l1d_bytes": 1, "l2_bytes": 2,
            "l3_bytes": 3, "flags": ["avx2", "fma"] + (["avx512f"] if avx512 else [])}
    name = hardware.hardware_class(prof)
    assert hardware.CLASS_RE.match(name), name
    assert name.endswith(hardware.fingerprint(prof)[:8])
    assert f"-{cores}c-{threads}t-" in name
    other = hardware.hardware_class({**prof, "threads": threads + 1})
    assert other != name


# -- on S3 (moto's server on 127.0.0.1, tests/test_registry_s3.py's fixtures) -------------------

def test_a_store_on_s3_appends_reads_checks_and_takes_concurrent_writers(s3):
    import threading

    url, fs, prefix = s3
    location = url.replace("/reg", "/store")
    store = Store(location).create()
    nights.append_frame(store, night("n1", NIGHT), GEMM, CLASS)
    assert nights.append_frame(store, night("n1", NIGHT), GEMM, CLASS).files == 0
    errors = []

    def writer(number):
        try:
            _append_many(location, number, 8)
        except Exception as err:   # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    back = nights.read_frame(store, CLASS, "gemm")
    assert len(back) == 4 + 4 * 8 and back["record_id"].is_unique
    [row] = nights.summary(store)
    assert row["nights"] == 5 and row["records"] == 36
    damaged = (f"{prefix.replace('/reg', '/store')}/records/class={CLASS}/family=gemm/night=n1/"
               f"{'0' * 32}.parquet")
    fs.pipe_file(damaged, b"PAR1 not really")
    assert len(nights.read_frame(store, CLASS, "gemm")) == 36
    assert [d.path for d in store.check()] == [damaged]


def test_an_unreachable_s3_store_is_one_line(s3, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")   # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        assert main(["store", "summary", "s3://tilecast-nowhere/store"]) == 2
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "store s3://tilecast-nowhere/store" in err[0]


def test_repeatability_of_two_stores_prints_each_k_and_refuses_mixed_or_bad_input(tmp_path,
                                                                                   capsys):
    # series A and B agree on m=8 and disagree on m=16 one night in each
    for name, slow in (("a", "n2"), ("b", "n1")):
        store = new_store(tmp_path, name)
        for run_id in ("n1", "n2"):
            k2 = 4e-5 if run_id == slow else 2e-5
            nights.append_frame(store, night(f"{name}{run_id}", {8: NIGHT[8],
                                                               16: {"k1": 3e-5, "k2": k2}},
                                             time_=f"2026-12-0{run_id[1]}T01:00:00"),
                                GEMM, CLASS)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["repeatability", a, b]) == 0
    out = capsys.readouterr().out
    assert "K = 1" in out and "K = 2" in out and "K = 3" not in out
    assert f"on {CLASS}" in out
    one, two = out.split("K = 2")
    # one night each: A picks k2 on m=16, which B measured 4/3 slower; pooled, both pick k2
    assert "A's winners scored on B: 2 problems  mean 0.8750" in one
    assert "A's winners scored on B: 2 problems  mean 1.0000" in two
    assert main(["repeatability", a, b, "--nights", "1"]) == 0
    assert "K = 2" not in capsys.readouterr().out
    workdir = tmp_path / "w"
    workdir.mkdir()
    for args, needle in (([a, str(workdir)], "not one of each"),
                         ([a, b, "--nights", "0"], "--nights 0 must be at least 1"),
                         ([a, b, "--hardware-class", "nope"], "holds no gemm records of class")):
        assert main(["repeatability", *args]) == 2
        assert needle in capsys.readouterr().err
