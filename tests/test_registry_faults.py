"""Registry integrity under faults (issue 19): damaged model files, concurrent promotes and
publishes, a publish killed with SIGKILL, file modes under the umask. Every case ends in a
clear RegistryError (exit 2 on the command line), never a process killed by a signal; the
figures are counted in tests/faults.py's ledger."""
from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from faults import REPO_ROOT, expect_clear, note_case, note_promotes, run_cli
from tilecast.families import get_family
from tilecast.registry import api as registry, integrity
from tilecast.registry.api import RegistryError
from tilecast.runtime import serving
from tilecast.runtime.dispatch import Dispatcher

GEMM = get_family("gemm")
HARDWARE = {"threads": 2, "simd_bits": 512, "l1d_bytes": 48 << 10, "l2_bytes": 2 << 20,
            "l3_bytes": 32 << 20, "clock_mhz": 3000.0, "flags": ["avx2", "fma", "avx512f"]}
OPTIONS = {"dtype": ["fp32"], "isa": ["avx512", "avx2"], "parallel": ["m", "n"],
           "tiles": ["14x32", "6x16"]}
METRICS = {"mean_efficiency": 0.9, "median_efficiency": 0.9, "p10_efficiency": 0.8}
FRACTIONS = (0.05, 0.25, 0.5, 0.75, 0.95, 0.98)
PROBLEM = "m=64,n=64,k=64"


def always(prod, new):
    return True, "forced"


@pytest.fixture(scope="module")
def gemm_files() -> dict:
    """The artifact files of a small real LightGBM model over GEMM features."""
    import lightgbm  # here, not at the top: the promote workers import this module

    engine = GEMM.feature_engine(HARDWARE)
    configs = GEMM.candidate_space(OPTIONS, HARDWARE)
    names = [GEMM.kernel_name(c) for c in configs]
    rows, target = [], []
    for m in (32, 256, 1024):
        problem = GEMM.problem({"m": m, "n": m, "k": m})
        rows.append(engine.combine(problem, engine.problem_features(problem),
                                   engine.kernel_features(configs), configs))
        target += [np.log(2.0 if c.isa == "avx512" else 1.0) + i * 1e-3 + m * 1e-5
                   for i, c in enumerate(configs)]
    booster = lightgbm.train({"objective": "regression", "min_data_in_leaf": 1, "verbose": -1,
                              "num_threads": 1}, lightgbm.Dataset(np.vstack(rows), target),
                             num_boost_round=20)
    spec = {"family": "gemm", "feature_names": engine.feature_names(), "engine": engine.name,
            "engine_version": engine.version, "target_transform": "log_tflops",
            "hardware": HARDWARE}
    return {"model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
            "candidates.json": json.dumps({"family": "gemm", "kernels": names,
                                           "static_best": names[0]}),
            "train_manifest.json": "{}"}


@pytest.fixture
def root(tmp_path, gemm_files) -> Path:
    """A registry whose production gemm model (version 1) is the real model above."""
    registry.publish(tmp_path / "reg", "gemm", gemm_files, metrics=METRICS)
    return tmp_path / "reg"


def model_file(root: Path, version: int = 1, name: str = "model.txt") -> Path:
    return root / "gemm" / "versions" / str(version) / name


def truncate(path: Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


# --- damaged files: checksums ------------------------------------------------------------


def test_every_file_of_a_version_has_its_sha256(root, gemm_files):
    manifest = json.loads(model_file(root, name=registry.CHECKSUMS_FILE).read_text())
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == sorted([*gemm_files, registry.METRICS_FILE])
    for name, entry in manifest["files"].items():
        data = model_file(root, name=name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_truncated_model_is_a_clear_error_naming_the_file(root, fraction):
    truncate(model_file(root), fraction)
    with pytest.raises(RegistryError, match=r"versions/1/model\.txt .*checksum does not match"):
        Dispatcher.from_registry(root, "gemm")
    note_case("clear")


@pytest.mark.parametrize("name, where", [("model.txt", 0.1), ("model.txt", 0.5),
                                         ("model.txt", 0.999), ("feature_spec.json", 0.5),
                                         ("candidates.json", 0.3), ("metrics.json", 0.5)])
def test_a_flipped_bit_is_a_clear_error_naming_the_file(root, name, where):
    path = model_file(root, name=name)
    flip_bit(path, int(path.stat().st_size * where), bit=3)
    with pytest.raises(RegistryError, match=rf"{name} .*checksum does not match"):
        Dispatcher.from_registry(root, "gemm")
    with pytest.raises(RegistryError, match=rf"{name} .*checksum does not match"):
        registry.local_copy(root, "gemm")  # what every loader goes through (warm start too)
    note_case("clear")


def test_a_missing_file_or_a_corrupt_manifest_is_a_clear_error(root):
    model_file(root, name="candidates.json").unlink()
    with pytest.raises(RegistryError, match=r"candidates\.json .*is missing, but "
                                            r"checksums\.json lists it"):
        Dispatcher.from_registry(root, "gemm")
    truncate(model_file(root, name=registry.CHECKSUMS_FILE), 0.5)
    with pytest.raises(RegistryError, match=r"corrupt checksum manifest .*checksums\.json"):
        Dispatcher.from_registry(root, "gemm")
    note_case("clear")
    note_case("clear")


@pytest.mark.parametrize("damage", ["truncate 5%", "truncate 98%", "flip a bit"])
def test_select_exits_2_with_one_line_on_a_damaged_model(root, damage):
    if damage == "flip a bit":
        flip_bit(model_file(root), 100)
    else:
        truncate(model_file(root), int(damage.split()[1][:-1]) / 100)
    result = run_cli("select", "--registry", root, "--model", "gemm", "--problem", PROBLEM)
    message = expect_clear(result, "model.txt", "checksum does not match")
    assert message.startswith("tilecast select: error:")


def test_a_version_without_checksums_loads_with_a_warning(root, caplog):
    expected = Dispatcher.from_registry(root, "gemm").select(PROBLEM)
    model_file(root, name=registry.CHECKSUMS_FILE).unlink()  # published before checksums
    with caplog.at_level(logging.WARNING, logger="tilecast.registry.api"):
        dispatcher = Dispatcher.from_registry(root, "gemm")
    assert dispatcher.select(PROBLEM) == expected
    assert "has no checksums.json (published before checksums were kept)" in caplog.text


LEGACY_LOADS = """
import sys
from tilecast.registry.api import RegistryError
from tilecast.runtime.dispatch import Dispatcher
for directory in sys.argv[1:]:
    try:
        Dispatcher.from_directory(directory)
        print("loaded", directory, flush=True)
    except RegistryError as err:
        print("clear", directory, str(err).replace(chr(10), " "), flush=True)
"""


def test_a_truncated_model_without_checksums_is_an_error_not_a_crash(root, tmp_path):
    """No checksum to catch it: the model text's own layout must (LightGBM's loader aborts
    or segfaults on these). Loaded in a child process, so a crash fails the test instead of
    killing the test run."""
    source = model_file(root).parent
    length = model_file(root).stat().st_size
    cuts = sorted({*(int(length * f) for f in FRACTIONS), *range(0, length, max(1, length // 97)),
                   length - 1, length - 2})
    directories = []
    for cut in cuts:
        directory = tmp_path / f"cut-{cut}"
        shutil.copytree(source, directory)
        (directory / registry.CHECKSUMS_FILE).unlink()
        (directory / "model.txt").write_bytes((source / "model.txt").read_bytes()[:cut])
        directories.append(directory)
    result = subprocess.run([sys.executable, "-c", LEGACY_LOADS, *map(str, directories)],
                            capture_output=True, encoding="utf-8", errors="replace", timeout=300,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    outcomes = [line.split(" ", 2) for line in result.stdout.splitlines()]
    assert result.returncode == 0, (f"the loader died (exit {result.returncode}) after "
                                    f"{len(outcomes)} of {len(cuts)} cuts:\n"
                                    f"{result.stderr[-2000:]}")
    assert len(outcomes) == len(cuts)
    for (kind, directory, *message), cut in zip(outcomes, cuts):
        assert kind == "clear", f"a cut at byte {cut} of {length} loaded"
        assert "model.txt" in message[0]
        note_case("clear")


# --- what the dispatcher does with a damaged version ---------------------------------------


def test_serving_keeps_the_last_good_version_when_the_new_one_is_damaged(root, gemm_files):
    service = serving.serve(root, "gemm")
    chosen = service.select(PROBLEM)
    registry.publish(root, "gemm", gemm_files, metrics=METRICS, gate=always)
    flip_bit(model_file(root, 2), 200)
    kept = serving.refresh(service, root, "gemm")
    assert kept is service and kept.version == 1 and kept.select(PROBLEM) == chosen
    assert "still serving version 1" in kept.last_reload_error
    assert "checksum does not match" in kept.last_reload_error
    static = serving.serve(root, "gemm", fallback_kernel="gemm_fp32_avx2_6x16_par_m")
    assert static.version is None and "checksum does not match" in static.last_fallback_reason


def test_rollback_recovers_from_a_damaged_production(root, gemm_files):
    registry.publish(root, "gemm", gemm_files, metrics=METRICS, gate=always)
    truncate(model_file(root, 2), 0.5)
    with pytest.raises(RegistryError, match="checksum does not match"):
        Dispatcher.from_registry(root, "gemm")
    assert registry.rollback(root, "gemm") == 1
    assert Dispatcher.from_registry(root, "gemm").version == 1


# --- concurrent promotes -----------------------------------------------------------------


def _promote_worker(root: str, model: str, tasks, results, barrier) -> None:
    """Promote what the queue says, all workers at once (the barrier), until told None."""
    from tilecast.registry import api

    while (version := tasks.get()) is not None:
        barrier.wait(timeout=120)
        try:
            results.put((version, api.promote(root, model, version), None))
        except Exception as err:  # reported to the test, which fails on it
            results.put((version, None, f"{type(err).__name__}: {err}"))


def concurrent_promote_trials(root, model: str, versions: list[int], trials: int,
                              workers: int = 3) -> int:
    """`trials` rounds of `workers` processes promoting distinct versions at once; returns
    how many rounds left the alias and the history's last entry disagreeing. Also checks
    each round's moves chain (each one's previous is the one before it) and that every
    process reported the version it really replaced."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(workers)
    queues = [context.Queue() for _ in range(workers)]
    results = context.Queue()
    processes = [context.Process(target=_promote_worker,
                                 args=(str(root), model, queues[w], results, barrier),
                                 daemon=True)
                 for w in range(workers)]
    for process in processes:
        process.start()
    rng = random.Random(19)
    disagreements = 0
    try:
        for _ in range(trials):
            before = registry.read_alias(root, model, "production")
            picks = rng.sample(versions, workers)
            for queue, version in zip(queues, picks):
                queue.put(version)
            outcomes = [results.get(timeout=120) for _ in picks]
            assert [error for *_, error in outcomes if error] == []
            moves = registry.alias_history(root, model, "production")
            alias = registry.read_alias(root, model, "production")
            disagreements += alias != moves[-1]["version"]
            trial = moves[-workers:]
            assert sorted(m["version"] for m in trial) == sorted(picks)
            assert trial[0]["previous"] == before
            assert all(b["previous"] == a["version"] for a, b in zip(trial, trial[1:]))
            # the "was" each process got is the version its own move replaced
            assert {v: was for v, was, _ in outcomes} == {m["version"]: m["previous"]
                                                          for m in trial}
    finally:
        for queue in queues:
            queue.put(None)
        for process in processes:
            process.join(30)
    return disagreements


def test_concurrent_promotes_keep_alias_and_history_in_agreement(tmp_path):
    root = tmp_path / "reg"
    for i in range(4):
        registry.publish(root, "m", {"model.txt": f"v{i}"}, metrics=METRICS, gate=always)
    trials = 120
    disagreements = concurrent_promote_trials(root, "m", [1, 2, 3, 4], trials)
    note_promotes(trials, disagreements)
    assert disagreements == 0
    assert not list((root / "m" / "aliases").glob(".*"))  # no temporaries left


def test_concurrent_promote_commands_print_the_version_each_replaced(tmp_path):
    root = tmp_path / "reg"
    for i in range(3):
        registry.publish(root, "m", {"model.txt": f"v{i}"}, metrics=METRICS, gate=always)
    for trial in range(2):
        before = registry.read_alias(root, "m", "production")
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda v: run_cli("registry", "promote", "m", str(v),
                                                   "--registry", root), (1, 2)))
        assert [r.returncode for r in runs] == [0, 0], [r.stderr[-500:] for r in runs]
        printed = [r.stdout.decode().strip().rsplit("(was ", 1)[1].rstrip(")") for r in runs]
        moves = registry.alias_history(root, "m", "production")[-2:]
        assert sorted(printed) == sorted(str(m["previous"]) for m in moves)
        # the two moves chain: the first replaced what was there before the trial, the
        # second replaced the first's version (both print the same "was" when the first
        # promote re-promotes the version already in production)
        assert moves[0]["previous"] == before
        assert moves[1]["previous"] == moves[0]["version"]
        assert registry.read_alias(root, "m", "production") == moves[-1]["version"]
        note_promotes(1, 0)


def _publish_forced(root: str, worker: int, count: int, barrier) -> None:
    from tilecast.registry import api, local

    claim = local.LocalStage.commit
    rng = random.Random(worker)

    def slow_claim(self, first_number):
        # a pause between claiming the number and moving the aliases, where the publishers
        # overtake one another
        number = claim(self, first_number)
        time.sleep(rng.uniform(0, 0.08))
        return number

    local.LocalStage.commit = slow_claim
    barrier.wait()
    for index in range(count):
        api.publish(root, "m", {"owner.json": json.dumps([worker, index])}, metrics=METRICS,
                    gate=lambda prod, new: (True, "forced"))


def test_concurrent_publishers_leave_production_on_the_newest_promoted(tmp_path):
    root = tmp_path / "reg"
    registry.publish(root, "m", {"owner.json": "[]"}, metrics=METRICS)
    workers, each = 3, 3
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(workers)
    processes = [context.Process(target=_publish_forced, args=(str(root), w, each, barrier))
                 for w in range(workers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert [p.exitcode for p in processes] == [0] * workers
    versions = registry.list_versions(root, "m")
    assert versions == list(range(1, workers * each + 2))
    promotions = {v: json.loads(registry.read_version_file(root, "m", v, "promotion.json"))
                  for v in versions}
    promoted = [v for v, p in promotions.items() if p["promoted"]]
    production = registry.read_alias(root, "m", "production")
    assert production == max(promoted)
    moves = registry.alias_history(root, "m", "production")
    assert moves[-1]["version"] == production
    assert {m["version"] for m in moves} == set(promoted)  # production moved to each, only
    # and only ever forward: no publisher overtaken on its way moved production back
    assert [m["version"] for m in moves] == sorted(promoted)
    for version, promotion in promotions.items():
        if not promotion["promoted"]:
            assert "candidate" in promotion["aliases"]
            assert promotion["reason"].startswith("not promoted: production moved from")


# --- a publish killed with SIGKILL ---------------------------------------------------------


KILLED_PUBLISH = """
import os, signal, sys
from tilecast.registry import api, local

root, point = sys.argv[1], sys.argv[2]
owner, name = {
    "staging": (local.LocalStage, "add"),            # one file of the version staged
    "claimed": (local.LocalStage, "commit"),         # the version renamed into place
    "alias-written": (local.LocalStore, "write_alias"),  # before its history line
    "aliases-moved": (local.LocalStore, "append_move"),  # before promotion.json
    "promotion-written": (local.LocalStore, "write_version_file"),  # all done
}[point]
real = getattr(owner, name)

def then_die(*args, **kwargs):
    result = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
    return result

setattr(owner, name, then_die)
api.publish(root, "m", {"model.txt": "killed", "plots/a.txt": "a", "plots/b.txt": "b"},
            metrics={"mean_efficiency": 0.9, "median_efficiency": 0.9, "p10_efficiency": 0.8},
            gate=lambda prod, new: (True, "forced"))
print("not killed")
"""


def assert_consistent(root: Path, model: str = "m") -> None:
    """What a reader may rely on: every listed version is complete and intact, and a
    version's promotion.json says promoted only if production really moved to it."""
    moved_to = {m["version"] for m in registry.alias_history(root, model, "production")}
    for version in registry.list_versions(root, model):
        directory = root / model / "versions" / str(version)
        assert integrity.verify_directory(directory) is not None
        promotion = directory / registry.PROMOTION_FILE
        if promotion.exists() and json.loads(promotion.read_text())["promoted"]:
            assert version in moved_to, f"version {version} says promoted, production never moved"
    assert registry.read_alias(root, model, "production") in registry.list_versions(root, model)


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(registry.TEMP_PREFIX + "*"))


@pytest.mark.parametrize("point", ["staging", "claimed", "alias-written", "aliases-moved",
                                   "promotion-written"])
def test_a_publish_killed_at_any_point_leaves_the_registry_consistent(tmp_path, point):
    root = tmp_path / "reg"
    registry.publish(root, "m", {"model.txt": "one"}, metrics=METRICS)
    result = subprocess.run([sys.executable, "-c", KILLED_PUBLISH, str(root), point],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert_consistent(root)
    versions = registry.list_versions(root, "m")
    assert versions == ([1] if point == "staging" else [1, 2])
    production = registry.read_alias(root, "m", "production")
    assert production == (1 if point in ("staging", "claimed") else 2)
    if point in ("claimed", "alias-written", "aliases-moved"):
        assert not model_file(root, 2, registry.PROMOTION_FILE).exists()  # written last
    if point == "staging":
        assert [p.split("/")[-1].startswith(registry.TEMP_PREFIX) for p in leftovers(root)] \
            == [True]  # the half-staged version: never listed, swept below

    # the next publish sweeps what the killed one left and repairs the history
    after = registry.publish(root, "m", {"model.txt": "three"}, metrics=METRICS, gate=always)
    assert leftovers(root) == []
    assert_consistent(root)
    moves = registry.alias_history(root, "m", "production")
    assert registry.read_alias(root, "m", "production") == moves[-1]["version"] == after.version
    if point == "alias-written":
        assert moves[-2]["version"] == 2 and moves[-2]["why"].startswith("repair:")
    # and rollback walks back through what production really held
    assert registry.rollback(root, "m") == production


# --- modes follow the umask ----------------------------------------------------------------


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def modes(top: Path) -> dict[str, int]:
    found = {".": stat.S_IMODE(top.stat().st_mode)}
    for path in top.rglob("*"):
        found[str(path.relative_to(top))] = stat.S_IMODE(path.stat().st_mode)
    return found


def expected_mode(path: Path, umask: int) -> int:
    return (0o777 if path.is_dir() else 0o666) & ~umask


def test_registry_files_follow_the_umask(tmp_path, umask):
    plots = tmp_path / "plots"
    (plots / "sub").mkdir(parents=True)
    (plots / "sub" / "a.txt").write_text("a")
    os.chmod(plots / "sub" / "a.txt", 0o600)  # a private workdir: its modes are not copied
    os.chmod(plots / "sub", 0o700)
    source = tmp_path / "model.txt"
    source.write_text("model")
    os.chmod(source, 0o600)
    root = tmp_path / "reg"
    registry.publish(root, "m", {"model.txt": source, "plots": plots, "raw.bin": b"\x00"},
                     metrics=METRICS)
    registry.publish(root, "m", {"model.txt": "two"}, metrics=METRICS, gate=always)
    registry.promote(root, "m", 1)
    found = modes(root)
    for name in ("m/versions/1", "m/versions/1/plots/sub/a.txt", "m/versions/1/model.txt",
                 "m/versions/2/promotion.json", "m/versions/1/checksums.json",
                 "m/aliases/production", "m/history.jsonl", "m/.lock"):
        assert name in found
    wrong = {name: oct(mode) for name, mode in found.items()
             if mode != expected_mode(root / name, umask)}
    assert wrong == {}, f"modes under umask {umask:03o}"


def test_the_remote_cache_follows_the_umask(tmp_path, umask):
    pytest.importorskip("fsspec")
    url = f"memory://tilecast-umask-{umask:o}-{os.getpid()}/reg"
    registry.publish(url, "m", {"model.txt": "model", "plots/a.txt": "a"}, metrics=METRICS)
    cache = tmp_path / "cache"
    copy = registry.local_copy(url, "m", cache_dir=cache)
    assert (copy / "plots" / "a.txt").read_text() == "a"
    wrong = {name: oct(mode) for name, mode in modes(cache).items()
             if mode != expected_mode(cache / name, umask)}
    assert wrong == {}
