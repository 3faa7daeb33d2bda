"""The registry at an fsspec URL: tested against moto's S3 server on loopback (s3://) and
fsspec's in-memory store (memory://). Nothing here reaches past 127.0.0.1: the AWS
environment is dummy credentials and the endpoint of the server started below."""

import hashlib
import itertools
import json
import logging
import multiprocessing
import threading
import time

import pytest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from tilecast import cli  # noqa: E402
from tilecast.runtime import serving  # noqa: E402
from tilecast.registry import api as registry, remote as registry_remote
from tilecast.registry.api import RegistryError  # noqa: E402

BUCKET = "tilecast-test"
MODEL = "gemm-cpu"
GOOD = {"mean_efficiency": 0.90, "median_efficiency": 0.93, "p10_efficiency": 0.80,
        "min_efficiency": 0.55}
# every variable through which botocore could find other credentials, or another endpoint
AWS_ENV_CLEARED = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN",
                   "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_ROLE_ARN",
                   "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                   "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_MAX_ATTEMPTS")


def metrics(**overrides):
    return {**GOOD, **overrides}


def _atomic_conditional_puts(patch) -> None:
    """moto checks If-None-Match and stores the object in two steps, so two concurrent
    conditional PUTs of one key can both pass its check, where S3 decides the condition
    atomically with the write. The server runs in this process: serialize its PUT handler
    so the mock has S3's semantics (the registry's correctness rests on them)."""
    from moto.s3.responses import S3Response

    lock = threading.Lock()
    original = S3Response.put_object

    def put_object(self, *args, **kwargs):
        with lock:
            return original(self, *args, **kwargs)

    patch.setattr(S3Response, "put_object", put_object)


def _clear_fs_instances() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # cached clients hold the endpoint they saw


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 (a free port), with the AWS environment pointing at it."""
    home = tmp_path_factory.mktemp("aws-home")
    werkzeug_log = logging.getLogger("werkzeug")
    level = werkzeug_log.level
    werkzeug_log.setLevel(logging.ERROR)  # one line per request otherwise
    with pytest.MonkeyPatch.context() as patch:
        for name in AWS_ENV_CLEARED:
            patch.delenv(name, raising=False)
        patch.setenv("AWS_ACCESS_KEY_ID", "testing")
        patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        patch.setenv("AWS_CONFIG_FILE", str(home / "config"))
        patch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "credentials"))
        patch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        _atomic_conditional_puts(patch)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        patch.setenv("AWS_ENDPOINT_URL", endpoint)
        _clear_fs_instances()
        try:
            yield endpoint
        finally:
            server.stop()
            _clear_fs_instances()
            werkzeug_log.setLevel(level)


@pytest.fixture
def s3(s3_endpoint, request):
    """A fresh bucket per test; returns (registry URL, the s3fs filesystem, bucket/prefix)."""
    import fsspec

    fs = fsspec.filesystem("s3", use_listings_cache=False)
    bucket = f"{BUCKET}-{hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]}"
    fs.mkdir(bucket)
    return f"s3://{bucket}/reg", fs, f"{bucket}/reg"


def publish(root, text="model v", **kwargs):
    kwargs.setdefault("metrics", GOOD)
    return registry.publish(root, MODEL, {"model.txt": text, "blob.bin": b"\x00\x01\x02"},
                            **kwargs)


# --- publish, list, show, the gate ------------------------------------------------------


def test_publish_lists_and_reads_versions_with_the_local_layout(s3, tmp_path):
    url, fs, prefix = s3
    source = tmp_path / "spec.json"
    source.write_text('{"family": "gemm"}')
    folder = tmp_path / "plots"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.txt").write_text("plot a")
    results = [registry.publish(url, MODEL, {"model.txt": f"model {i}",
                                             "feature_spec.json": source, "plots": folder,
                                             "raw.bin": bytes([i, 255])},
                                metrics=metrics(mean_efficiency=0.9 + i / 100))
               for i in range(3)]
    assert [r.version for r in results] == [1, 2, 3]
    assert all(r.promoted for r in results)
    assert results[0].path == f"{url}/{MODEL}/versions/1"
    assert registry.list_models(url) == [MODEL]
    assert registry.list_versions(url, MODEL) == [1, 2, 3]
    assert registry.list_aliases(url, MODEL) == {"production": 3}
    assert registry.resolve(url, MODEL) == f"{url}/{MODEL}/versions/3"
    assert registry.resolve_version(url, MODEL, "2") == 2
    for i in range(3):
        files = {name: registry.read_version_file(url, MODEL, i + 1, name)
                 for name in ("model.txt", "feature_spec.json", "plots/sub/a.txt", "raw.bin")}
        assert files == {"model.txt": f"model {i}".encode(),
                         "feature_spec.json": b'{"family": "gemm"}',
                         "plots/sub/a.txt": b"plot a", "raw.bin": bytes([i, 255])}
        assert registry.read_metrics(url, MODEL, i + 1)["mean_efficiency"] == \
            pytest.approx(0.9 + i / 100)
    # the layout: DESIGN.md's, plus the claim and the completion marker of each version
    version_dir = f"{prefix}/{MODEL}/versions/1"
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(version_dir)) == [
        ".claim", ".complete", "checksums.json", "feature_spec.json", "metrics.json",
        "model.txt", "plots", "promotion.json", "raw.bin"]
    assert fs.cat_file(f"{prefix}/{MODEL}/aliases/production") == b"3\n"
    marker = json.loads(fs.cat_file(f"{version_dir}/.complete"))
    claim = json.loads(fs.cat_file(f"{version_dir}/.claim"))
    assert marker["token"] == claim["token"]
    assert marker["files"]["model.txt"] == len("model 0")
    assert marker["files"]["plots/sub/a.txt"] == len("plot a")
    # promotion.json is written after the aliases moved, so the marker does not list it
    assert "promotion.json" not in marker["files"]
    checksums = json.loads(fs.cat_file(f"{version_dir}/checksums.json"))["files"]
    assert sorted(checksums) == ["feature_spec.json", "metrics.json", "model.txt",
                                 "plots/sub/a.txt", "raw.bin"]
    assert checksums["model.txt"] == {"sha256": hashlib.sha256(b"model 0").hexdigest(),
                                      "bytes": len("model 0")}


def test_gate_refusal_publishes_a_candidate_with_the_reason(s3):
    url, _, _ = s3
    publish(url)                                                # production: 0.90 / 0.80
    refused = publish(url, metrics=metrics(mean_efficiency=0.85))
    assert not refused.promoted and refused.aliases == ("candidate",)
    assert "0.8500" in refused.reason and "0.9000" in refused.reason
    assert registry.list_aliases(url, MODEL) == {"candidate": 2, "production": 1}
    promotion = json.loads(registry.read_version_file(url, MODEL, 2, "promotion.json"))
    assert promotion["promoted"] is False and promotion["reason"] == refused.reason
    assert promotion["baseline_version"] == 1

    seen = []
    custom = publish(url, gate=lambda prod, new: seen.append(prod) or (False, "custom no"))
    assert seen[0]["mean_efficiency"] == 0.90 and custom.reason == "custom no"
    assert registry.read_alias(url, MODEL, "production") == 1


def test_promote_rollback_and_alias_history(s3):
    url, fs, prefix = s3
    for i in range(3):
        registry.publish(url, "m", {"model.txt": f"v{i}"}, metrics=GOOD,
                         gate=lambda prod, new: (True, "ok"))
    assert registry.read_alias(url, "m", "production") == 3
    assert registry.rollback(url, "m") == 2
    assert registry.rollback(url, "m") == 1  # further back, not back to 3
    with pytest.raises(RegistryError, match="no earlier version"):
        registry.rollback(url, "m")
    assert registry.promote(url, "m", 3) == 1
    assert registry.rollback(url, "m") == 1
    moves = registry.alias_history(url, "m", "production")
    assert [m["version"] for m in moves] == [1, 2, 3, 2, 1, 3, 1]
    assert moves[3]["why"] == "rollback from 3" and moves[3]["previous"] == 3
    # one object per move, numbered in order
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{prefix}/m/history"))
    assert names[0] == "0000000001-production.json" and len(names) == 7
    with pytest.raises(RegistryError, match="no version 7"):
        registry.promote(url, "m", 7)
    with pytest.raises(RegistryError, match=r"no alias 'staging'.*\['production'\]"):
        registry.read_alias(url, "m", "staging")


def test_alias_pointing_at_a_missing_version_is_named(s3):
    url, fs, prefix = s3
    publish(url)
    fs.pipe_file(f"{prefix}/{MODEL}/aliases/production", b"7\n")
    with pytest.raises(RegistryError, match=r"alias 'production'.*version 7"):
        registry.read_alias(url, MODEL, "production")
    fs.pipe_file(f"{prefix}/{MODEL}/aliases/production", b"latest")
    with pytest.raises(RegistryError, match=rf"{url}/{MODEL}/aliases/production.*'latest'"):
        registry.read_alias(url, MODEL, "production")
    # a publish replaces the broken production
    assert publish(url).promoted


def test_registry_command_line_over_s3(s3, capsys):
    url, _, _ = s3
    for i in range(2):
        registry.publish(url, "m", {"model.txt": f"v{i}"}, metrics=GOOD,
                         gate=lambda prod, new: (True, "ok"))
    assert cli.main(["registry", "list", "--registry", url]) == 0
    assert "m [no hardware class]: versions [1, 2]; aliases production -> 2" in \
        capsys.readouterr().out
    assert cli.main(["registry", "show", "m", "1", "--registry", url]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == 1 and shown["mean_efficiency"] == 0.9 and shown["aliases"] == []
    assert shown["path"] == f"{url}/m/versions/1"
    assert "unreadable" in shown["train_manifest.json"]
    assert cli.main(["registry", "promote", "m", "1", "--registry", url]) == 0
    assert "alias production -> version 1 (was 2)" in capsys.readouterr().out
    assert cli.main(["registry", "rollback", "m", "--registry", url]) == 0
    assert "rolled back to version 2" in capsys.readouterr().out
    assert cli.main(["registry", "promote", "m", "7", "--registry", url]) == 2
    assert "has no version 7" in capsys.readouterr().err


# --- what readers never see -----------------------------------------------------------------


def test_a_half_written_version_is_invisible(s3):
    url, fs, prefix = s3
    publish(url)
    # a publisher that died after claiming 2 and writing some files, before the marker
    half = f"{prefix}/{MODEL}/versions/2"
    fs.pipe_file(f"{half}/.claim", json.dumps({"token": "dead"}).encode())
    fs.pipe_file(f"{half}/model.txt", b"half")
    fs.pipe_file(f"{half}/metrics.json", json.dumps(GOOD).encode())
    assert registry.list_versions(url, MODEL) == [1]
    with pytest.raises(RegistryError, match=r"no version 2 \(no complete marker .*versions/2/"
                                            r"\.complete\); existing versions: \[1\]"):
        registry.resolve(url, MODEL, 2)
    with pytest.raises(RegistryError, match="no version 2"):
        registry.set_alias(url, MODEL, "production", 2)
    with pytest.raises(RegistryError, match="no version 2"):
        registry.read_version_file(url, MODEL, 2, "model.txt")
    # the number stays taken: the next publish gets 3, and 2 stays invisible
    assert publish(url, text="three").version == 3
    assert registry.list_versions(url, MODEL) == [1, 3]
    assert fs.cat_file(f"{half}/model.txt") == b"half"


def test_a_publish_failing_before_its_marker_leaves_nothing_visible(s3, monkeypatch):
    url, fs, prefix = s3
    publish(url)
    real_create = registry_remote.ObjectStore._create_exclusive

    def marker_write_fails(self, key, data):
        if key.endswith("/" + registry.COMPLETE_FILE):
            raise OSError(5, "connection reset while writing the marker")
        return real_create(self, key, data)

    monkeypatch.setattr(registry_remote.ObjectStore, "_create_exclusive", marker_write_fails)
    with pytest.raises(RegistryError, match=r"version 2 of model 'gemm-cpu' was claimed at "
                                            r".*could not be completed.*stays invisible"):
        publish(url, text="lost")
    monkeypatch.undo()
    assert registry.list_versions(url, MODEL) == [1]
    assert registry.list_aliases(url, MODEL) == {"production": 1}
    # its files were removed, its claim stays so the number is never reused
    assert [p.rsplit("/", 1)[-1] for p in fs.find(f"{prefix}/{MODEL}/versions/2")] == [".claim"]
    assert publish(url).version == 3


# --- concurrent publishers --------------------------------------------------------------------


def _payload(worker: int, index: int) -> bytes:
    seed = f"{worker}-{index}".encode()
    return b"".join(hashlib.sha256(seed + bytes([i % 256])).digest() for i in range(2048))


def _publish_many(url: str, worker: int, count: int, barrier) -> None:
    # A slow listing widens the window between choosing a number and claiming it, so the
    # publishers really collide and must move on to the next number.
    list_versions = registry.list_versions

    def slow_list_versions(*args):
        found = list_versions(*args)
        time.sleep(0.05)
        return found

    registry.list_versions = slow_list_versions
    barrier.wait()
    for index in range(count):
        registry.publish(url, MODEL, {"payload.bin": _payload(worker, index),
                                      "owner.json": json.dumps([worker, index])},
                         metrics=metrics(mean_efficiency=0.5 + worker / 10 + index / 100))


def test_concurrent_publishers_get_distinct_versions_none_corrupt(s3):
    url, fs, prefix = s3
    workers, each = 3, 3
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(workers)
    processes = [context.Process(target=_publish_many, args=(url, w, each, barrier))
                 for w in range(workers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert [p.exitcode for p in processes] == [0] * workers
    versions = registry.list_versions(url, MODEL)
    assert versions == list(range(1, workers * each + 1))
    owners = set()
    for version in versions:
        worker, index = json.loads(registry.read_version_file(url, MODEL, version, "owner.json"))
        owners.add((worker, index))
        assert registry.read_version_file(url, MODEL, version, "payload.bin") == \
            _payload(worker, index)
        stored = registry.read_metrics(url, MODEL, version)
        assert stored["mean_efficiency"] == pytest.approx(0.5 + worker / 10 + index / 100)
        base = f"{prefix}/{MODEL}/versions/{version}"
        assert json.loads(fs.cat_file(f"{base}/.claim"))["token"] == \
            json.loads(fs.cat_file(f"{base}/.complete"))["token"]
    assert owners == {(w, i) for w in range(workers) for i in range(each)}
    assert registry.read_alias(url, MODEL, "production") in versions
    moves = registry.alias_history(url, MODEL)
    assert len(moves) == workers * each  # every publish's alias move was kept


def test_concurrent_promotes_over_s3_keep_alias_and_history_in_agreement(s3):
    from faults import note_promotes
    from test_registry_faults import concurrent_promote_trials

    url, fs, prefix = s3
    for i in range(3):
        registry.publish(url, "m", {"model.txt": f"v{i}"}, metrics=GOOD,
                         gate=lambda prod, new: (True, "ok"))
    trials = 10
    disagreements = concurrent_promote_trials(url, "m", [1, 2, 3], trials, workers=2)
    note_promotes(trials, disagreements)
    assert disagreements == 0
    # every move held the lock: one released ticket per move, none left held
    tickets = [p.rsplit("/", 1)[-1] for p in fs.ls(f"{prefix}/m/lock")]
    moves = len(registry.alias_history(url, "m"))
    assert len(tickets) == 2 * moves
    assert sum(t.endswith(".released") for t in tickets) == moves


def test_concurrent_promote_threads_on_memory_agree_with_the_history():
    url = f"memory://tilecast-promotes-{time.time_ns()}/reg"
    for i in range(4):
        registry.publish(url, "m", {"model.txt": f"v{i}"}, metrics=GOOD,
                         gate=lambda prod, new: (True, "ok"))
    replaced = []
    threads = [threading.Thread(target=lambda v=v: [
        replaced.append(registry.promote(url, "m", v)) for _ in range(5)]) for v in (1, 2, 3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    moves = registry.alias_history(url, "m", "production")[4:]
    assert len(moves) == 20
    assert all(b["previous"] == a["version"] for a, b in zip(moves, moves[1:]))
    assert sorted(replaced) == sorted(m["previous"] for m in moves)
    assert registry.read_alias(url, "m", "production") == moves[-1]["version"]


def test_an_abandoned_lock_ticket_is_taken_over(monkeypatch, caplog):
    url = f"memory://tilecast-stale-lock-{time.time_ns()}/reg"
    publish(url)
    publish(url, metrics=metrics(mean_efficiency=0.1))
    store = registry._store(url)
    held = [p.rsplit("/", 1)[-1] for p in store.fs.ls(store._key(MODEL, "lock"), detail=False)]
    top = max(int(name) for name in held if name.isdigit())
    # a mover killed while holding the lock: its ticket is never released
    store.fs.pipe_file(store._key(MODEL, "lock", f"{top + 1:010d}"), b"{}")
    monkeypatch.setattr(registry_remote, "LOCK_STALE_S", 0.3)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tilecast.registry.remote"):
        assert registry.promote(url, MODEL, 2) == 1
    assert time.monotonic() - start >= 0.3
    assert f"alias lock ticket {top + 1} of model '{MODEL}' held for over" in caplog.text
    assert registry.read_alias(url, MODEL, "production") == 2


def test_rollback_over_s3_follows_the_promotion_order(s3):
    url, _, _ = s3
    for i in range(3):
        registry.publish(url, "m", {"model.txt": f"v{i}"}, metrics=GOOD,
                         gate=lambda prod, new: (True, "ok"))
    for version in (3, 2, 3):
        registry.promote(url, "m", version)
    assert registry.rollback(url, "m") == 2
    assert registry.rollback(url, "m") == 1  # not back to 3


def test_concurrent_threads_on_memory_get_distinct_versions(monkeypatch):
    url = f"memory://tilecast-threads-{time.time_ns()}/reg"
    threads = [threading.Thread(target=lambda w=w: [
        registry.publish(url, MODEL, {"owner.json": json.dumps([w, i])}, metrics=GOOD,
                         gate=lambda prod, new: (True, "ok")) for i in range(4)])
        for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    versions = registry.list_versions(url, MODEL)
    assert versions == list(range(1, 17))
    owners = {tuple(json.loads(registry.read_version_file(url, MODEL, v, "owner.json")))
              for v in versions}
    assert owners == set(itertools.product(range(4), range(4)))


def test_a_conflicting_conditional_put_is_retried_on_the_same_number(monkeypatch):
    url = f"memory://tilecast-conflict-{time.time_ns()}/reg"
    store = registry._store(url)
    real_pipe = store.fs.pipe_file
    conflicts = []

    class Conflict(Exception):
        response = {"Error": {"Code": "ConditionalRequestConflict"}}

    def pipe_file(path, value, mode="overwrite", **kwargs):
        if mode == "create" and path.endswith("/.claim") and not conflicts:
            conflicts.append(path)
            raise OSError(5, "conflict") from Conflict()
        return real_pipe(path, value, mode=mode, **kwargs)

    monkeypatch.setattr(store.fs, "pipe_file", pipe_file)
    assert registry._store(url).fs is store.fs  # the instance publish will use
    assert publish(url).version == 1
    assert conflicts and conflicts[0].endswith("/versions/1/.claim")


# --- loading and serving ------------------------------------------------------------------------


GEMM_HARDWARE = {"threads": 8, "simd_bits": 512, "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
                 "l3_bytes": 32 << 20, "clock_mhz": 3000.0,
                 "flags": ["avx2", "fma", "avx512f", "avx512_bf16"]}
GEMM_OPTIONS = {"dtype": ["fp32"], "isa": ["avx512", "avx2"], "parallel": ["m", "n", "k"],
                "tiles": ["14x32", "6x48", "4x64", "16x16", "6x16", "8x8"]}
QUERIES = [{"m": 300, "n": 70, "k": 129}, {"m": 33, "n": 4096, "k": 512},
           {"m": 2048, "n": 2048, "k": 2048}, {"m": 7, "n": 9, "k": 1000},
           {"m": 4096, "n": 24, "k": 64, "layout_a": "col"}, {"m": 1, "n": 1, "k": 1}]


@pytest.fixture(scope="module")
def gemm_files():
    """The artifact files of a small real LightGBM model on real GEMM features, whose choice
    depends on the shape (tile padding waste, parallel balance, ISA)."""
    import lightgbm
    import numpy as np

    from tilecast.families import get_family

    gemm = get_family("gemm")
    engine = gemm.feature_engine(GEMM_HARDWARE)
    configs = gemm.candidate_space(GEMM_OPTIONS, GEMM_HARDWARE)
    names = [gemm.kernel_name(c) for c in configs]
    kernel_matrix = engine.kernel_features(configs)
    blocks = []
    for m, n, k in itertools.product((17, 100, 256, 1000, 2048), repeat=3):
        problem = gemm.problem({"m": m, "n": n, "k": k})
        blocks.append(engine.combine(problem, engine.problem_features(problem), kernel_matrix,
                                     configs))
    features = np.vstack(blocks)
    col = {name: features[:, i] for i, name in enumerate(engine.feature_names())}
    tflops = (3.0 * np.where(col["is_avx512"] > 0, 1.0, 0.55) * col["tile_eff"] ** 2
              * col["par_balance"] * np.clip((col["log2_flops"] - 10) / 25, 0.05, 1.0)
              + 0.002 * col["mr"])
    booster = lightgbm.train({"objective": "regression", "num_leaves": 15,
                              "min_data_in_leaf": 5, "learning_rate": 0.2, "verbose": -1,
                              "num_threads": 1, "deterministic": True, "seed": 0},
                             lightgbm.Dataset(features, np.log1p(tflops)), num_boost_round=30)
    spec = {"family": "gemm", "feature_names": engine.feature_names(), "engine": "gemm",
            "engine_version": 1, "target_transform": "log1p_tflops", "hardware": GEMM_HARDWARE}
    return {"model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
            "candidates.json": json.dumps({"family": "gemm", "kernels": names,
                                           "static_best": names[0]}),
            "train_manifest.json": json.dumps({"rows": len(features)})}


def test_dispatcher_over_s3_selects_what_a_local_copy_selects(s3, gemm_files, tmp_path,
                                                              monkeypatch):
    from tilecast.runtime.dispatch import Dispatcher

    url, fs, prefix = s3
    registry.publish(url, "gemm", gemm_files, metrics=GOOD)
    local = tmp_path / "local-copy"
    fs.get(prefix, str(local), recursive=True)  # the same registry, byte for byte
    cache = tmp_path / "cache"
    remote = Dispatcher.from_registry(url, "gemm", cache_dir=cache)
    copied = Dispatcher.from_registry(local, "gemm")
    assert remote.version == copied.version == 1 and remote.model == "gemm"
    chosen = [remote.select(q) for q in QUERIES]
    assert chosen == [copied.select(q) for q in QUERIES]
    assert len(set(chosen)) >= 3, chosen  # the choice really depends on the shape
    assert remote.rank(QUERIES[0], k=5) == copied.rank(QUERIES[0], k=5)

    # the version was downloaded once: a second load never touches the files again
    (copy_dir,) = [p for p in cache.glob("*/1")]
    assert sorted(p.name for p in copy_dir.iterdir()) == sorted(
        [*gemm_files, "metrics.json", "checksums.json"])
    assert registry._store(url).fs is fs  # the instance from_registry will use
    monkeypatch.setattr(fs, "get_file", lambda *a, **k: pytest.fail("downloaded again"))
    assert Dispatcher.from_registry(url, "gemm", 1, cache_dir=cache).select(QUERIES[1]) == \
        chosen[1]
    monkeypatch.undo()
    # a damaged copy is fetched again: a different size, or the same size with a flipped bit
    (copy_dir / "model.txt").write_text("tree\n")
    assert Dispatcher.from_registry(url, "gemm", cache_dir=cache).select(QUERIES[2]) == chosen[2]
    assert (copy_dir / "model.txt").read_text() == gemm_files["model.txt"]
    flipped = bytearray(gemm_files["model.txt"].encode())
    flipped[len(flipped) // 2] ^= 0x08
    (copy_dir / "model.txt").write_bytes(bytes(flipped))
    assert Dispatcher.from_registry(url, "gemm", cache_dir=cache).select(QUERIES[3]) == chosen[3]
    assert (copy_dir / "model.txt").read_text() == gemm_files["model.txt"]

    # a version damaged in the bucket itself is a clear error naming it, and is not cached
    fs.pipe_file(f"{prefix}/gemm/versions/1/model.txt", bytes(flipped))
    other_cache = tmp_path / "other-cache"
    with pytest.raises(RegistryError, match=rf"model\.txt \(version 1 of model 'gemm' at "
                                            rf"{url}/gemm/versions/1\): its sha256 checksum "
                                            rf"does not match"):
        Dispatcher.from_registry(url, "gemm", cache_dir=other_cache)
    assert not list(other_cache.glob("*/1"))


def test_select_command_reads_an_s3_registry_from_the_environment(s3, gemm_files, tmp_path,
                                                                  monkeypatch, capsys):
    from tilecast.runtime.dispatch import Dispatcher

    url, _, _ = s3
    registry.publish(url, "gemm", gemm_files, metrics=GOOD)
    monkeypatch.setenv("TILECAST_REGISTRY_CACHE", str(tmp_path / "cache"))
    assert cli.main(["select", "--registry", url, "--model", "gemm", "--problem",
                     "m=300,n=70,k=129", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    expected = Dispatcher.from_registry(url, "gemm").select_json(QUERIES[0])
    assert answer == {**expected, "model": "gemm", "version": 1}
    assert any((tmp_path / "cache").glob("*/1/model.txt"))


def test_serve_and_refresh_over_s3(s3, gemm_files, tmp_path):
    url, fs, prefix = s3
    cache = tmp_path / "cache"
    registry.publish(url, "gemm", gemm_files, metrics=GOOD)
    service = serving.serve(url, "gemm", cache_dir=cache)
    assert service.version == 1 and service.last_reload_error is None
    chosen = service.select(QUERIES[0])
    # production moves to a version whose model does not load: version 1 keeps serving
    registry.publish(url, "gemm", {**gemm_files, "model.txt": "garbage"}, metrics=GOOD,
                     gate=lambda prod, new: (True, "forced"))
    kept = serving.refresh(service, url, "gemm", cache_dir=cache)
    assert kept is service and kept.select(QUERIES[0]) == chosen
    assert "still serving version 1" in kept.last_reload_error
    assert f"{url}/gemm/versions/2" in kept.last_reload_error
    registry.publish(url, "gemm", gemm_files, metrics=GOOD, gate=lambda prod, new: (True, "ok"))
    moved = serving.refresh(service, url, "gemm", cache_dir=cache)
    assert moved.version == 3 and moved.select(QUERIES[0]) == chosen


# --- unreachable stores and unknown schemes ----------------------------------------------------


def test_a_missing_bucket_is_a_clear_error_naming_the_url(s3_endpoint, gemm_files, tmp_path,
                                                          capsys):
    from tilecast.runtime.dispatch import Dispatcher

    url = "s3://tilecast-no-such-bucket/reg"
    message = (r"registry s3://tilecast-no-such-bucket/reg is unreachable: bucket "
               r"'tilecast-no-such-bucket' does not exist")
    with pytest.raises(RegistryError, match=message):
        registry.list_models(url)
    with pytest.raises(RegistryError, match=message):
        registry.read_alias(url, MODEL, "production")
    with pytest.raises(RegistryError, match=message):
        Dispatcher.from_registry(url, "gemm", cache_dir=tmp_path)
    with pytest.raises(RegistryError, match=message):
        publish(url)
    assert cli.main(["registry", "list", "--registry", url]) == 2
    assert "tilecast registry: error: registry s3://tilecast-no-such-bucket/reg is unreachable" \
        in capsys.readouterr().err
    static = serving.serve(url, "gemm", fallback_kernel="gemm_fp32_avx2_6x16_par_m")
    assert static.version is None and "unreachable" in static.last_fallback_reason


def test_an_endpoint_that_refuses_connections_is_a_clear_error(s3_endpoint, monkeypatch):
    import socket

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    _clear_fs_instances()
    try:
        with pytest.raises(RegistryError, match=r"registry s3://any-bucket/reg: cannot list "
                                                r"s3://any-bucket/reg: EndpointConnectionError"):
            registry.list_models("s3://any-bucket/reg")
    finally:
        _clear_fs_instances()


def test_unknown_scheme_and_missing_implementation_are_named(monkeypatch):
    from fsspec.registry import known_implementations

    from tilecast.runtime.dispatch import Dispatcher

    with pytest.raises(RegistryError, match=r"registry nosuchscheme://x/reg: fsspec cannot "
                                            r"open this URL \(Protocol not known: nosuchscheme"):
        registry.list_models("nosuchscheme://x/reg")
    monkeypatch.setitem(known_implementations, "tcfake",
                        {"class": "tilecast_no_such_module.FakeFileSystem",
                         "err": "Install tcfakefs to access tcfake"})
    with pytest.raises(RegistryError, match=r"registry tcfake://bucket/reg: no fsspec "
                                            r"implementation of tcfake:// is installed "
                                            r"\(Install tcfakefs"):
        Dispatcher.from_registry("tcfake://bucket/reg", "gemm")


def test_writes_are_refused_where_claims_cannot_be_atomic(monkeypatch):
    url = f"memory://tilecast-readonly-{time.time_ns()}/reg"
    assert publish(url).version == 1
    monkeypatch.delitem(registry_remote.ATOMIC_CREATE, "memory")
    with pytest.raises(RegistryError, match=r"cannot write to memory:// registries: claiming "
                                            r"version numbers needs an atomic create-if-absent"):
        publish(url)
    with pytest.raises(RegistryError, match="cannot write to memory://"):
        registry.promote(url, MODEL, 1)
    assert registry.list_versions(url, MODEL) == [1]  # reading still works
    assert registry.read_alias(url, MODEL, "production") == 1


def test_file_urls_and_paths_are_the_local_registry(tmp_path):
    url = (tmp_path / "reg").as_uri()
    result = publish(url)
    assert result.path == tmp_path / "reg" / MODEL / "versions" / "1"
    assert registry.list_versions(tmp_path / "reg", MODEL) == [1]
    assert registry.normalize_root(url) == tmp_path / "reg"
    assert registry.normalize_root("s3://bucket/prefix/") == "s3://bucket/prefix"
    assert not registry.is_remote(url) and registry.is_remote("memory://x")
