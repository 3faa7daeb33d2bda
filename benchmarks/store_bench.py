"""The measurement store's figures: a night's append, concurrent appends (lost / duplicated),
and `store summary` over 10 M records, on a local directory and on moto's S3 server on
127.0.0.1 (started here; nothing leaves the machine).

    .venv/bin/python benchmarks/store_bench.py                       # everything, local and S3
    .venv/bin/python benchmarks/store_bench.py --records 1000000 --no-s3
    .venv/bin/python benchmarks/store_bench.py --layouts ours delta  # beside Delta Lake (needs
                                                                     # `pip install deltalake`)

A night is generated in the shape of the nightly's (64 kernels x 300 problems, one screen
record each and a confirm record for the finalists, 6-24 samples a record): the store does
not care where the numbers came from, so the figures are the store's own. The 10 M-record
store is that night written under 400 run ids (record ids made unique per night).
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.core import dataset  # noqa: E402
from tilecast.families import get_family  # noqa: E402
from tilecast.store import nights, records as store_records  # noqa: E402
from tilecast.store.store import Store  # noqa: E402

GEMM = get_family("gemm")
LAYOUTS = {"ours": "immutable parquet parts (tilecast.store)", "delta": "a Delta Lake table"}
CLASS = "bench-cpu-avx512-2c-2t-00000000"


def synthetic_night(run_id: str, kernels: int = 64, problems: int = 300,
                    seed: int = 0) -> pd.DataFrame:
    """A dataset frame shaped like one nightly's records (see the module docstring)."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(problems):
        m, n, k = (int(x) for x in rng.integers(1, 1536, 3))
        problem = GEMM.problem({"m": m, "n": n, "k": k})
        key = GEMM.dims_key(problem)
        for j in range(kernels):
            for phase in ("screen",) + (("confirm",) if j < 3 else ()):
                samples = list(rng.uniform(1e-4, 2e-4, 6 if phase == "screen" else 24))
                median = float(np.median(samples))
                rows.append({
                    "schema_version": dataset.SCHEMA_VERSION, "run_id": run_id,
                    "time": f"2026-12-07T01:{p // 60:02d}:{p % 60:02d}", "git_sha": "0" * 40,
                    "hardware": "0" * 12, "family": "gemm", "problem_set": "train",
                    "dims_key": key, "kernel": f"gemm_kernel_{j:03d}", "role": "candidate",
                    "phase": phase, "status": "ok", "reason": "", "samples_s": samples,
                    "reps_per_sample": 10.0, "median_s": median, "mad_s": median * 0.01,
                    "tflops": 2 * m * n * k / median / 1e12, "gbps": 10.0, "max_error": 1e-7,
                    "threads": 2, "timing": "interleaved", "protocol_hash": "p" * 16,
                    "build_key": f"b{j:03d}", "binary_bytes": 100000,
                    "round_medians_s": samples[:3], "window_factors": [1.0] * len(samples),
                    **{f: getattr(problem, f) for f in GEMM.problem_fields}})
    return pd.DataFrame(rows)


def _as_night(table: pa.Table, run_id: str) -> pa.Table:
    """`table` (one night's store rows) as night `run_id`: run ids and record ids replaced."""
    ids = [hashlib.sha256(f"{run_id}|{rid}".encode()).hexdigest()[:32]
           for rid in table.column("record_id").to_pylist()]
    table = table.set_column(table.schema.get_field_index("run_id"), "run_id",
                             pa.array([run_id] * table.num_rows, pa.string()))
    return table.set_column(table.schema.get_field_index("record_id"), "record_id",
                            pa.array(ids, pa.string()))


def time_night_append(location: str, rounds: int) -> list[float]:
    """Seconds per append of one nightly-sized night (converted frame -> store files)."""
    store = Store(location).create()
    frame = synthetic_night("n-0")
    seconds = []
    for index in range(rounds):
        frame["run_id"] = f"append-{index}"
        start = time.perf_counter()
        nights.append_frame(store, frame, GEMM, CLASS)
        seconds.append(time.perf_counter() - start)
    return seconds


def _appends(writer: int, appends: int):
    """The frames one concurrent writer appends: 4 records each, unique to the writer."""
    base = synthetic_night("w", kernels=2, problems=1, seed=writer)
    for index in range(appends):
        yield base.assign(run_id=f"w{writer}", m=index + 1,
                          dims_key=[f"writer{writer}-append{index}-{k}" for k in range(len(base))])


def _writer(layout: str, location: str, writer: int, appends: int, env: dict) -> None:
    os.environ.update(env)
    store = Store(location)
    for frame in _appends(writer, appends):
        if layout == "ours":
            nights.append_frame(store, frame, GEMM, CLASS)
        else:
            delta_append(location, store_records.to_table(frame, tuple(GEMM.problem_fields), CLASS))


def _record_ids(layout: str, location: str) -> list[str]:
    if layout == "ours":
        table = Store(location).read(CLASS, "gemm", columns=["record_id"])
    else:
        from deltalake import DeltaTable
        table = (DeltaTable(location, storage_options=_delta_options(location))
                 .to_pyarrow_dataset().to_table(columns=["record_id"]))
    return table.column("record_id").to_pylist()


def concurrent_appends(layout: str, location: str, writers: int, appends: int,
                       env: dict) -> dict:
    """`writers` processes x `appends` appends of 4 records each: lost and duplicated records."""
    if layout == "ours":
        Store(location).create()
    else:   # the table made before the race: creating it is not an append
        delta_append(location, store_records.SCHEMA.empty_table())
    context = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    procs = [context.Process(target=_writer, args=(layout, location, w, appends, env))
             for w in range(writers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    wall = time.perf_counter() - start
    ids = _record_ids(layout, location)
    expected = writers * appends * 4
    return {"writers": writers, "appends": appends,
            "failed_writers": sum(p.exitcode != 0 for p in procs), "expected": expected,
            "read": len(ids), "lost": expected - len(set(ids)),
            "duplicated": len(ids) - len(set(ids)), "wall_s": wall}


# -- the same work on a Delta Lake table (deltalake, delta-rs), for the layout's choice ----------

def _delta_options(location: str) -> dict | None:
    """delta-rs storage options: on S3 the endpoint and conditional PUTs (If-None-Match),
    which make its commits safe from concurrent writers without a lock table."""
    if not location.startswith("s3://"):
        return None
    return {"AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"], "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "conditional_put": "etag"}


def delta_append(location: str, table: pa.Table) -> None:
    from deltalake import write_deltalake
    write_deltalake(location, table.replace_schema_metadata(None), mode="append",
                    partition_by=["hardware_class", "family"],
                    storage_options=_delta_options(location))


def delta_night_append(location: str, rounds: int) -> list[float]:
    frame = synthetic_night("n-0")
    seconds = []
    for index in range(rounds):
        frame["run_id"] = f"append-{index}"
        start = time.perf_counter()
        delta_append(location, store_records.to_table(frame, tuple(GEMM.problem_fields), CLASS))
        seconds.append(time.perf_counter() - start)
    return seconds


def delta_big(location: str, records: int) -> None:
    night = store_records.to_table(synthetic_night("big-0"), tuple(GEMM.problem_fields), CLASS)
    for index in range(max(1, records // night.num_rows)):
        delta_append(location, _as_night(night, f"big-{index:04d}"))


def delta_summary(location: str, rounds: int) -> list[float]:
    """The same figures as nights.summary, from the Delta table's columns (it has no
    per-file summaries to read instead)."""
    from deltalake import DeltaTable

    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        table = DeltaTable(location).to_pyarrow_dataset().to_table(
            columns=["hardware_class", "run_id", "family", "dims_key", "kernel", "time"])
        for hardware_class in pc.unique(table.column("hardware_class")).to_pylist():
            rows = table.filter(pc.equal(table.column("hardware_class"), hardware_class))
            problems = pc.binary_join_element_wise(rows.column("family"), rows.column("dims_key"),
                                                   "|")
            [pc.count_distinct(rows.column(c)).as_py() for c in ("run_id", "kernel")]
            pc.count_distinct(problems).as_py()
        seconds.append(time.perf_counter() - start)
    return seconds


LABEL_COLUMNS = ("run_id", "dims_key", "kernel", "status", "median_s", "time")


def time_label_read(layout: str, location: str) -> float:
    """Seconds to read what pooling labels needs of every record of one class."""
    start = time.perf_counter()
    if layout == "ours":
        Store(location).read(CLASS, "gemm", columns=LABEL_COLUMNS)
    else:
        import pyarrow.dataset as ds
        from deltalake import DeltaTable
        DeltaTable(location).to_pyarrow_dataset().to_table(
            columns=list(LABEL_COLUMNS), filter=(ds.field("hardware_class") == CLASS))
    return time.perf_counter() - start


def big_store(location: str, records: int) -> Store:
    """A store of about `records` records: one generated night written under many run ids."""
    store = Store(location).create()
    night = store_records.to_table(synthetic_night("big-0"), tuple(GEMM.problem_fields), CLASS)
    count = max(1, records // night.num_rows)
    for index in range(count):
        store.append(_as_night(night, f"big-{index:04d}"))
        if index % 50 == 0:
            print(f"  writing the big store: night {index + 1}/{count}", flush=True)
    return store


def time_summary(store: Store, rounds: int) -> tuple[list[float], dict]:
    seconds, rows = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        rows = nights.summary(store)
        seconds.append(time.perf_counter() - start)
    return seconds, rows[0]


def s3_server():
    """moto's S3 server on 127.0.0.1 and the environment pointing at it."""
    import logging
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)   # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}",
           "AWS_EC2_METADATA_DISABLED": "true"}
    os.environ.update(env)
    import fsspec
    fsspec.filesystem("s3").mkdir("tilecast-bench")
    return server, env


def _median(values: list[float]) -> str:
    return (f"median {statistics.median(values):.3f} s (min {min(values):.3f}, "
            f"max {max(values):.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--appends", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--no-appends", action="store_true",
                        help="only the big store's summary and read times")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["ours"])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tilecast-store-bench-"))
    print(f"CPU: {_cpu()}; {os.cpu_count()} CPUs")
    locations = {"local": lambda name: str(root / name)}
    env = {}
    server = None
    if not args.no_s3:
        server, env = s3_server()
        locations["moto S3"] = lambda name: f"s3://tilecast-bench/{name}"
    try:
        for where, location in ({} if args.no_appends else locations).items():
            for layout in args.layouts:
                print(f"\n== {where}, {LAYOUTS[layout]}")
                appender = time_night_append if layout == "ours" else delta_night_append
                night_s = appender(location(f"{layout}-append"), args.rounds)
                rows = len(synthetic_night("x"))
                print(f"a night's append ({rows} records): {_median(night_s)}")
                result = concurrent_appends(layout, location(f"{layout}-concurrent"),
                                            args.writers, args.appends, env)
                print(f"{result['writers']} processes x {result['appends']} appends: "
                      f"{result['read']} of {result['expected']} records read, {result['lost']} "
                      f"lost, {result['duplicated']} duplicated, {result['failed_writers']} "
                      f"writers failed, {result['wall_s']:.1f} s")
        for layout in args.layouts:
            print(f"\n== local, {args.records:,} records, {LAYOUTS[layout]}")
            where = root / f"{layout}-big"
            if layout == "ours":
                store = big_store(str(where), args.records)
                seconds, summary = time_summary(store, args.rounds)
                print(f"{summary['records']:,} records, {summary['nights']} nights, "
                      f"{summary['problems']} problems")
            else:
                delta_big(str(where), args.records)
                seconds = delta_summary(str(where), args.rounds)
            size = sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
            print(f"store summary, {size / 2**20:.0f} MiB on disk: {_median(seconds)}")
            read_s = [time_label_read(layout, str(where)) for _ in range(args.rounds)]
            print(f"reading one class's label columns ({', '.join(LABEL_COLUMNS)}): "
                  f"{_median(read_s)}")
            shutil.rmtree(where, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _cpu() -> str:
    from tilecast.core import hardware
    return hardware.profile()["hardware_class"]


if __name__ == "__main__":
    main()
