"""The one sources of shared facts: workdir layout, environment settings, target transforms,
the benchmark settings of a config, the device tag."""
import socket
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tilecast.config import load_config
from tilecast.core.device import default_device, device_tag, lock_dir
from tilecast.core.settings import Settings
from tilecast.registry.cache import default_cache_dir as registry_cache_dir
from tilecast.runtime.dispatch import INVERSE_TRANSFORMS
from tilecast.core import build
from tilecast.stages import layout
from tilecast.stages.bench import BenchSettings
from tilecast.stages.train import TARGETS


def test_workdir_paths_are_the_documented_layout(tmp_path, monkeypatch):
    monkeypatch.delenv("TILECAST_BUILD_CACHE", raising=False)
    w = layout.Workdir(tmp_path)
    assert w.build_events("gemm") == tmp_path / "build" / "gemm" / "events.json"
    assert w.build_cache == tmp_path / "cache" / "build"
    assert w.raw_log("gemm") == tmp_path / "bench" / "gemm.jsonl"
    assert w.scratch() == tmp_path / "scratch" and w.scratch("gemm") == tmp_path / "scratch" / "gemm"
    assert w.dataset("gemm") == tmp_path / "data" / "gemm.parquet"
    assert w.model_dir("gemm") == tmp_path / "models" / "gemm"
    assert w.eval_dir("gemm") == tmp_path / "eval" / "gemm"
    assert w.publish_outcome("gemm") == tmp_path / "report" / "publish_gemm.json"
    assert w.plot("gemm") == tmp_path / "report" / "efficiency_gemm.png"
    assert w.rebench_raw_log("gemm") == tmp_path / "rebench" / "gemm.jsonl"
    assert w.rebench_finished("gemm", "r1") == tmp_path / "rebench" / "runs" / "gemm-r1.jsonl"
    assert w.rebench_scratch("gemm") == tmp_path / "rebench" / "scratch" / "gemm"
    assert w.rebench_report("gemm") == tmp_path / "report" / "rebench_gemm.json"
    assert layout.MODEL_FILES == ("model.txt", "feature_spec.json", "train_manifest.json",
                                  "candidates.json")
    assert layout.METRICS_FILE == "metrics.json"
    monkeypatch.setenv("TILECAST_BUILD_CACHE", str(tmp_path / "shared"))
    assert w.build_cache == tmp_path / "shared"


def test_settings_defaults_and_overrides(tmp_path):
    home_cache = Path.home() / ".cache" / "tilecast"
    default = Settings.from_env({"TILECAST_CACHE": "", "TILECAST_DEVICE": ""})
    assert default == Settings(cache_root=home_cache, build_cache=None,
                               registry_cache=home_cache / "registry",
                               lock_dir=home_cache / "devices", device=None,
                               embedded_server=False)
    rooted = Settings.from_env({"TILECAST_CACHE": str(tmp_path), "TILECAST_EMBEDDED_SERVER": "1"})
    assert (rooted.registry_cache, rooted.lock_dir) == (tmp_path / "registry", tmp_path / "devices")
    assert rooted.embedded_server
    explicit = Settings.from_env({"TILECAST_CACHE": str(tmp_path),
                                  "TILECAST_BUILD_CACHE": "/b", "TILECAST_REGISTRY_CACHE": "/r",
                                  "TILECAST_LOCKS": "/l", "TILECAST_DEVICE": "gpu0"})
    assert (explicit.build_cache, explicit.registry_cache, explicit.lock_dir, explicit.device) \
        == (Path("/b"), Path("/r"), Path("/l"), "gpu0")


def test_cache_directories_follow_the_environment_when_asked(tmp_path, monkeypatch):
    for name in ("TILECAST_BUILD_CACHE", "TILECAST_REGISTRY_CACHE", "TILECAST_LOCKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TILECAST_CACHE", str(tmp_path))
    assert build.cache_root() == tmp_path
    assert build.default_cache_dir() == tmp_path / "build"
    assert registry_cache_dir() == tmp_path / "registry"
    assert lock_dir() == tmp_path / "devices"


def test_device_tag_names_the_default_device(monkeypatch):
    monkeypatch.delenv("TILECAST_DEVICE", raising=False)
    assert default_device() == f"cpu@{socket.gethostname()}"
    assert device_tag() == f"device:cpu@{socket.gethostname()}"
    monkeypatch.setenv("TILECAST_DEVICE", "cpu-shared")
    assert device_tag() == "device:cpu-shared" == device_tag(default_device())
    assert device_tag("gpu0") == "device:gpu0"


@pytest.mark.parametrize("name", sorted(layout.TARGET_TRANSFORMS))
def test_dispatch_inverts_the_training_transform(name):
    tflops = np.array([0.001, 0.5, 3.0, 250.0])
    forward, _ = TARGETS[name]
    np.testing.assert_allclose(INVERSE_TRANSFORMS[name](forward(tflops)), tflops, rtol=1e-12)
    assert set(INVERSE_TRANSFORMS) == set(TARGETS)


def test_bench_settings_from_config_copies_the_run_settings():
    cfg = replace(load_config("quick"), finalists=7, rounds=5, race_cycles=9, race_rounds=4,
                  interleave=False)
    settings = BenchSettings.from_config(cfg, seed=3, libraries={"k": Path("/k.so")})
    assert (settings.protocol, settings.tie_threshold_pct, settings.finalists,
            settings.confirm_samples, settings.problems_per_batch, settings.rounds,
            settings.retry_disturbed, settings.interleave, settings.race_cycles,
            settings.race_rounds, settings.race_margin_pct) == (
        cfg.protocol, cfg.tie_threshold_pct, 7, cfg.confirm_samples, cfg.problems_per_batch, 5,
        cfg.retry_disturbed, False, 9, 4, cfg.race_margin_pct)
    assert (settings.seed, dict(settings.libraries), settings.measure_peer) == (
        3, {"k": Path("/k.so")}, True)
    overridden = BenchSettings.from_config(cfg, finalists=0, measure_peer=False)
    assert (overridden.finalists, overridden.measure_peer, overridden.seed) == (0, False, 0)
    with pytest.raises(TypeError, match="bogus"):
        BenchSettings.from_config(cfg, bogus=1)
