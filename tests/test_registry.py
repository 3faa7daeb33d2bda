"""Tests for tilecast.registry.api: numbered immutable versions, the promotion gate, aliases,
concurrent publishers and failed registrations."""

import hashlib
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from tilecast.registry import api as registry
from tilecast.registry.api import RegistryError

MODEL = "gemm-cpu"
GOOD = {"mean_efficiency": 0.90, "median_efficiency": 0.93, "p10_efficiency": 0.80,
        "min_efficiency": 0.55, "static_best": {"kernel": "k0", "mean_efficiency": 0.70}}


def metrics(**overrides):
    return {**GOOD, **overrides}


def publish(root, text="model v", **kwargs):
    kwargs.setdefault("metrics", GOOD)
    return registry.publish(root, MODEL, {"model.txt": text, "blob.bin": b"\x00\x01\x02"},
                            **kwargs)


def entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# --- versions ----------------------------------------------------------------------------


def test_publish_numbers_versions_from_one_and_writes_every_file(tmp_path):
    source = tmp_path / "spec.json"
    source.write_text('{"family": "gemm"}')
    root = tmp_path / "registry"
    results = [registry.publish(root, MODEL, {"model.txt": f"model {i}",
                                              "feature_spec.json": source,
                                              "raw.bin": bytes([i, 255])},
                                metrics=metrics(mean_efficiency=0.9 + i / 100))
               for i in range(3)]
    assert [r.version for r in results] == [1, 2, 3]
    assert registry.list_versions(root, MODEL) == [1, 2, 3]
    assert registry.list_models(root) == [MODEL]
    for i, result in enumerate(results):
        assert result.path == root / MODEL / "versions" / str(i + 1)
        assert (result.path / "model.txt").read_text() == f"model {i}"
        assert (result.path / "feature_spec.json").read_text() == '{"family": "gemm"}'
        assert (result.path / "raw.bin").read_bytes() == bytes([i, 255])
        written = json.loads((result.path / "metrics.json").read_text())
        assert written["mean_efficiency"] == pytest.approx(0.9 + i / 100)
    # nothing but the claimed versions is left in versions/
    assert entries(root / MODEL / "versions") == ["1", "2", "3"]


def test_publish_records_the_sha256_of_every_file_it_stages(tmp_path):
    folder = tmp_path / "plots"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.txt").write_text("plot a")
    result = registry.publish(tmp_path / "reg", MODEL, {"model.txt": "m", "plots": folder,
                                                        "raw.bin": b"\xff" * 3}, metrics=GOOD)
    manifest = json.loads((result.path / registry.CHECKSUMS_FILE).read_text())
    # every file but the manifest itself and promotion.json (written after the aliases moved)
    assert sorted(manifest["files"]) == ["metrics.json", "model.txt", "plots/sub/a.txt",
                                         "raw.bin"]
    for name, entry in manifest["files"].items():
        data = (result.path / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert registry.local_copy(tmp_path / "reg", MODEL) == result.path  # verified
    (result.path / "plots" / "sub" / "a.txt").write_text("plot b")  # same size, new bytes
    with pytest.raises(RegistryError, match=r"plots/sub/a\.txt \(version 1 of model "
                                            r"'gemm-cpu' at .*\): its sha256 checksum does "
                                            r"not match checksums\.json"):
        registry.local_copy(tmp_path / "reg", MODEL)


def test_versions_are_never_rewritten_even_when_the_next_number_is_stale(tmp_path, monkeypatch):
    first = publish(tmp_path, text="first")
    before = {p.name: p.read_bytes() for p in first.path.iterdir()}
    # a publisher whose view of the registry is stale tries version 1 again
    monkeypatch.setattr(registry, "list_versions", lambda root, model: [])
    second = publish(tmp_path, text="second", metrics=metrics(mean_efficiency=0.95))
    assert second.version == 2
    assert {p.name: p.read_bytes() for p in first.path.iterdir()} == before
    assert (second.path / "model.txt").read_text() == "second"


def test_resolve_accepts_alias_number_and_numeric_string(tmp_path):
    publish(tmp_path, text="one")
    publish(tmp_path, text="two", metrics=metrics(mean_efficiency=0.2))  # refused: candidate
    v1 = tmp_path / MODEL / "versions" / "1"
    v2 = tmp_path / MODEL / "versions" / "2"
    assert registry.resolve(tmp_path, MODEL) == v1
    assert registry.resolve(tmp_path, MODEL, "production") == v1
    assert registry.resolve(tmp_path, MODEL, "candidate") == v2
    assert registry.resolve(tmp_path, MODEL, 2) == v2
    assert registry.resolve(tmp_path, MODEL, "2") == v2
    with pytest.raises(RegistryError, match="no version 5"):
        registry.resolve(tmp_path, MODEL, 5)


# --- the gate ----------------------------------------------------------------------------


def test_first_publish_is_promoted_to_every_requested_alias(tmp_path):
    result = publish(tmp_path, aliases_if_promoted=("production", "stable"))
    assert result.promoted and result.aliases == ("production", "stable")
    assert "no usable production version" in result.reason
    assert registry.read_alias(tmp_path, MODEL, "production") == 1
    assert registry.read_alias(tmp_path, MODEL, "stable") == 1
    promotion = json.loads((result.path / "promotion.json").read_text())
    assert promotion["promoted"] is True and promotion["baseline_version"] is None


def test_gate_refuses_a_worse_mean_and_says_so_with_figures(tmp_path):
    publish(tmp_path)                                               # production: 0.90 / 0.80
    result = publish(tmp_path, metrics=metrics(mean_efficiency=0.85))
    assert not result.promoted
    assert "0.8500" in result.reason and "0.9000" in result.reason and "0.005" in result.reason
    assert "p10" not in result.reason  # only the failed check is named
    assert registry.read_alias(tmp_path, MODEL, "production") == 1
    assert registry.read_alias(tmp_path, MODEL, "candidate") == 2
    promotion = json.loads((result.path / "promotion.json").read_text())
    assert promotion == {**promotion, "promoted": False, "reason": result.reason,
                         "aliases": ["candidate"], "baseline_version": 1}


def test_gate_refuses_a_worse_p10(tmp_path):
    publish(tmp_path)
    result = publish(tmp_path, metrics=metrics(mean_efficiency=0.95, p10_efficiency=0.77))
    assert not result.promoted
    assert "p10_efficiency 0.7700 < production 0.8000" in result.reason
    assert registry.read_alias(tmp_path, MODEL, "production") == 1


def test_gate_promotes_within_tolerance_and_compares_with_current_production(tmp_path):
    publish(tmp_path)                                                        # v1 0.90 / 0.80
    within = publish(tmp_path, metrics=metrics(mean_efficiency=0.896, p10_efficiency=0.785))
    assert within.promoted, within.reason
    assert registry.read_alias(tmp_path, MODEL, "production") == 2
    # now production is v2 (0.896 / 0.785): 0.892 is within 0.005 of it, not of v1's 0.90 - ok
    again = publish(tmp_path, metrics=metrics(mean_efficiency=0.892, p10_efficiency=0.77))
    assert again.promoted, again.reason
    # 0.886 < 0.892 - 0.005
    refused = publish(tmp_path, metrics=metrics(mean_efficiency=0.886, p10_efficiency=0.9))
    assert not refused.promoted
    assert registry.read_alias(tmp_path, MODEL, "production") == 3


def test_custom_gate_receives_production_metrics(tmp_path):
    seen = []

    def gate(production, new):
        seen.append((production, new))
        return new["mean_efficiency"] > 0.5, "custom says so"

    publish(tmp_path, gate=gate)
    refused = publish(tmp_path, gate=gate, metrics=metrics(mean_efficiency=0.4))
    assert seen[0][0] is None
    assert seen[1][0]["mean_efficiency"] == 0.90 and seen[1][1]["mean_efficiency"] == 0.4
    assert refused.reason == "custom says so" and not refused.promoted


def test_gate_rejects_metrics_without_the_figures_it_needs(tmp_path):
    with pytest.raises(RegistryError, match="p10_efficiency"):
        publish(tmp_path, metrics={"mean_efficiency": 0.9})
    assert not (tmp_path / MODEL).exists()


# --- failures leave nothing behind -------------------------------------------------------


def test_missing_source_file_mid_publish_leaves_no_directory(tmp_path):
    publish(tmp_path)
    with pytest.raises(RegistryError, match="nowhere.txt"):
        registry.publish(tmp_path, MODEL, {"model.txt": "ok", "spec.json": tmp_path / "nowhere.txt"},
                         metrics=GOOD)
    assert entries(tmp_path / MODEL / "versions") == ["1"]
    assert registry.list_aliases(tmp_path, MODEL) == {"production": 1}


def test_failed_rename_removes_the_temp_directory(tmp_path, monkeypatch):
    def broken_rename(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    monkeypatch.setattr(registry.os, "rename", broken_rename)
    with pytest.raises(PermissionError):
        publish(tmp_path)
    assert entries(tmp_path / MODEL / "versions") == []
    assert not (tmp_path / MODEL / "aliases").exists()


def test_unserializable_metrics_leave_no_directory(tmp_path):
    with pytest.raises(TypeError):
        publish(tmp_path, metrics=metrics(extra=object()))
    assert entries(tmp_path / MODEL / "versions") == []


@pytest.mark.parametrize("name", ["../escape.txt", "/abs.txt", "metrics.json", "promotion.json",
                                  "checksums.json"])
def test_bad_or_reserved_artifact_names_are_refused(tmp_path, name):
    with pytest.raises(RegistryError, match="escape|abs|written by publish"):
        registry.publish(tmp_path, MODEL, {name: "x"}, metrics=GOOD)
    assert not (tmp_path / MODEL / "versions").exists()
    assert not (tmp_path / "escape.txt").exists()


def test_a_killed_publishers_temporaries_are_swept_by_the_next_publish(tmp_path):
    import socket
    import subprocess
    import sys

    publish(tmp_path)
    versions_dir = tmp_path / MODEL / "versions"
    aliases_dir = tmp_path / MODEL / "aliases"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    host = socket.gethostname()
    dead = versions_dir / f"{registry.TEMP_PREFIX}{host}+{gone}+abc"   # its writer is gone
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "model.txt").write_text("half")
    old = versions_dir / f"{registry.TEMP_PREFIX}elsewhere+1+def"       # another host's, old
    old.mkdir()
    os.utime(old, (time.time() - 2 * registry.STALE_TEMP_S,) * 2)
    live = versions_dir / f"{registry.TEMP_PREFIX}{host}+{os.getpid()}+ghi"  # still writing
    live.mkdir()
    recent = versions_dir / f"{registry.TEMP_PREFIX}elsewhere+1+jkl"    # may still be writing
    recent.mkdir()
    torn_alias = aliases_dir / f"{registry.TEMP_PREFIX}{host}+{gone}+production.{gone}.x.tmp"
    torn_alias.write_text("7")
    assert registry.list_versions(tmp_path, MODEL) == [1]       # never taken for versions
    assert sorted(registry.list_aliases(tmp_path, MODEL)) == ["production"]
    publish(tmp_path, metrics=metrics(mean_efficiency=0.95))
    assert entries(versions_dir) == sorted(["1", "2", live.name, recent.name])
    assert entries(aliases_dir) == ["production"]


def test_a_publish_whose_production_moved_meanwhile_becomes_a_candidate(tmp_path):
    publish(tmp_path)                                          # 1: production
    publish(tmp_path, metrics=metrics(mean_efficiency=0.1))    # 2: candidate

    def gate_while_someone_promotes(production, new):
        registry.promote(tmp_path, MODEL, 2)  # another user, between the gate and the move
        return True, "promoted: better than version 1"

    result = publish(tmp_path, gate=gate_while_someone_promotes)
    assert not result.promoted and result.aliases == ("candidate",)
    assert result.reason.startswith("not promoted: production moved from version 1 to 2 "
                                    "while version 3 was being published")
    assert "[gate: promoted: better than version 1]" in result.reason
    assert registry.read_alias(tmp_path, MODEL, "production") == 2
    assert registry.read_alias(tmp_path, MODEL, "candidate") == 3
    promotion = json.loads((result.path / "promotion.json").read_text())
    assert promotion["promoted"] is False and promotion["reason"] == result.reason


def test_promotion_json_is_written_after_the_aliases_moved(tmp_path, monkeypatch):
    from tilecast.registry.local import LocalStore

    publish(tmp_path)
    seen = []
    real = LocalStore.write_version_file

    def write_version_file(self, model, number, name, data):
        seen.append((name, registry.read_alias(tmp_path, MODEL, "production"),
                     registry.alias_history(tmp_path, MODEL)[-1]["version"]))
        return real(self, model, number, name, data)

    monkeypatch.setattr(LocalStore, "write_version_file", write_version_file)
    result = publish(tmp_path, metrics=metrics(mean_efficiency=0.95))
    assert seen == [("promotion.json", result.version, result.version)]


# --- aliases -----------------------------------------------------------------------------


def test_alias_pointing_at_missing_version_names_alias_and_version(tmp_path):
    publish(tmp_path)
    (tmp_path / MODEL / "aliases" / "production").write_text("7\n")
    with pytest.raises(RegistryError, match=r"alias 'production'.*version 7"):
        registry.read_alias(tmp_path, MODEL, "production")
    with pytest.raises(RegistryError, match="version 7"):
        registry.resolve(tmp_path, MODEL)


def test_missing_and_corrupt_aliases_name_the_alias_and_file(tmp_path):
    publish(tmp_path)
    with pytest.raises(RegistryError, match=r"no alias 'staging'.*existing aliases: \['production'\]"):
        registry.read_alias(tmp_path, MODEL, "staging")
    alias_file = tmp_path / MODEL / "aliases" / "production"
    alias_file.write_text("latest")
    with pytest.raises(RegistryError, match=f"{alias_file}.*'latest'"):
        registry.read_alias(tmp_path, MODEL, "production")


def test_set_alias_requires_an_existing_version_and_replaces_atomically(tmp_path):
    publish(tmp_path)
    publish(tmp_path, metrics=metrics(mean_efficiency=0.1))
    with pytest.raises(RegistryError, match="no version 3"):
        registry.set_alias(tmp_path, MODEL, "production", 3)
    assert registry.read_alias(tmp_path, MODEL, "production") == 1
    registry.set_alias(tmp_path, MODEL, "production", "2")  # a rollback/forward by hand
    assert registry.read_alias(tmp_path, MODEL, "production") == 2
    assert (tmp_path / MODEL / "aliases" / "production").read_text() == "2\n"
    assert entries(tmp_path / MODEL / "aliases") == ["candidate", "production"]


def test_an_alias_moved_without_its_history_line_is_repaired_by_the_next_move(tmp_path):
    publish(tmp_path)
    publish(tmp_path, metrics=metrics(mean_efficiency=0.95))
    # a mover killed between writing the alias and appending its history line
    (tmp_path / MODEL / "aliases" / "production").write_text("1\n")
    assert registry.promote(tmp_path, MODEL, 2) == 1
    moves = registry.alias_history(tmp_path, MODEL, "production")
    assert [(m["version"], m["previous"]) for m in moves] == [(1, None), (2, 1), (1, 2), (2, 1)]
    assert moves[2]["why"].startswith("repair: the alias held 1 but the history ended at 2")
    assert registry.rollback(tmp_path, MODEL) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any mode")
def test_moving_an_alias_in_a_read_only_registry_is_a_registry_error(tmp_path):
    publish(tmp_path)
    model_dir = tmp_path / MODEL
    for path in (model_dir, model_dir / "aliases", model_dir / ".lock"):
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        with pytest.raises(RegistryError, match="cannot move alias 'production'"):
            registry.promote(tmp_path, MODEL, 1)
    finally:
        for path in (model_dir, model_dir / "aliases"):
            path.chmod(0o755)


@pytest.mark.parametrize("alias", ["prod/uction", "..", "", "a b", "ünï"])
def test_invalid_alias_names_are_refused(tmp_path, alias):
    publish(tmp_path)
    with pytest.raises(RegistryError, match="invalid alias name"):
        registry.set_alias(tmp_path, MODEL, alias, 1)
    with pytest.raises(RegistryError, match="invalid alias name"):
        publish(tmp_path, aliases_if_promoted=(alias,))
    assert registry.list_versions(tmp_path, MODEL) == [1]


def test_invalid_model_name_is_refused(tmp_path):
    with pytest.raises(RegistryError, match="invalid model name"):
        registry.publish(tmp_path, "../outside", {"model.txt": "x"}, metrics=GOOD)
    assert not (tmp_path.parent / "outside").exists()


# --- concurrent publishers ---------------------------------------------------------------


def _payload(worker: int, index: int) -> bytes:
    seed = f"{worker}-{index}".encode()
    return b"".join(hashlib.sha256(seed + bytes([i % 256])).digest() for i in range(4096))


def _publish_many(root: str, worker: int, count: int, barrier) -> None:
    # A slow directory listing widens the window between choosing a number and claiming
    # it, so the publishers really collide and must retry.
    list_versions = registry.list_versions

    def slow_list_versions(*args):
        found = list_versions(*args)
        time.sleep(0.03)
        return found

    registry.list_versions = slow_list_versions
    barrier.wait()
    for index in range(count):
        registry.publish(root, MODEL, {"payload.bin": _payload(worker, index),
                                       "owner.json": json.dumps([worker, index])},
                         metrics=metrics(mean_efficiency=0.5 + worker / 10 + index / 100))


def test_concurrent_publishers_get_distinct_consecutive_versions(tmp_path):
    workers, each = 4, 3
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(workers)
    processes = [context.Process(target=_publish_many, args=(str(tmp_path), w, each, barrier))
                 for w in range(workers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [p.exitcode for p in processes] == [0] * workers
    versions = registry.list_versions(tmp_path, MODEL)
    assert versions == list(range(1, workers * each + 1))
    assert entries(tmp_path / MODEL / "versions") == sorted(str(v) for v in versions)
    owners = set()
    for version in versions:
        path = tmp_path / MODEL / "versions" / str(version)
        worker, index = json.loads((path / "owner.json").read_text())
        owners.add((worker, index))
        assert (path / "payload.bin").read_bytes() == _payload(worker, index)
        stored = json.loads((path / "metrics.json").read_text())
        assert stored["mean_efficiency"] == pytest.approx(0.5 + worker / 10 + index / 100)
    assert owners == {(w, i) for w in range(workers) for i in range(each)}
    assert registry.read_alias(tmp_path, MODEL, "production") in versions
    assert not [p for p in os.listdir(tmp_path / MODEL / "aliases") if p.startswith(".")]
