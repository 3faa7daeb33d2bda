"""Models per hardware class in the registry (tilecast.registry.classes): each class its own
versions and production, the host's class served, the nearest one with a warning, none an
error that says what to do."""
from __future__ import annotations

import logging

import pytest

from tilecast import cli
from tilecast.registry import api as registry, classes
from tilecast.registry.base import RegistryError

GOOD = {"mean_efficiency": 0.9, "median_efficiency": 0.9, "p10_efficiency": 0.8,
        "min_efficiency": 0.5}
EPYC_2T = "amd-epyc-avx512-2c-2t-aaaaaaaa"
EPYC_8T = "amd-epyc-avx512-8c-8t-bbbbbbbb"
EPYC_AVX2 = "amd-epyc-7763-avx2-64c-64t-cccccccc"
XEON_2T = "intel-xeon-platinum-8480-avx512-2c-2t-dddddddd"


def publish(root, name, text="model"):
    return registry.publish(root, name, {"model.txt": text}, metrics=GOOD)


def test_each_class_has_its_own_versions_and_production(tmp_path):
    for _ in range(2):
        publish(tmp_path, classes.class_model("gemm", EPYC_2T))
    publish(tmp_path, classes.class_model("gemm", EPYC_8T))
    assert registry.list_versions(tmp_path, f"gemm@{EPYC_2T}") == [1, 2]
    assert registry.list_versions(tmp_path, f"gemm@{EPYC_8T}") == [1]
    assert registry.read_alias(tmp_path, f"gemm@{EPYC_8T}", "production") == 1
    assert classes.classes(registry.list_models(tmp_path), "gemm") == [EPYC_2T, EPYC_8T]


def test_the_host_class_is_served_and_the_nearest_one_with_a_warning(tmp_path, caplog):
    for hardware_class in (EPYC_8T, XEON_2T, EPYC_AVX2):
        publish(tmp_path, classes.class_model("gemm", hardware_class))
    assert registry.serving_name(tmp_path, "gemm", EPYC_8T) == f"gemm@{EPYC_8T}"
    assert caplog.text == ""
    # a 2-thread EPYC: the same ISA and CPU at 8 threads beats another CPU at 2 threads
    with caplog.at_level(logging.WARNING):
        assert registry.serving_name(tmp_path, "gemm", EPYC_2T) == f"gemm@{EPYC_8T}"
    assert EPYC_2T in caplog.text and EPYC_8T in caplog.text
    # an AVX2 host is never served an AVX-512 class while an AVX2 one exists
    host = "amd-epyc-avx2-2c-2t-eeeeeeee"
    assert registry.serving_name(tmp_path, "gemm", host) == f"gemm@{EPYC_AVX2}"
    # a name with its class is served as it is
    assert registry.serving_name(tmp_path, f"gemm@{XEON_2T}", EPYC_2T) == f"gemm@{XEON_2T}"


def test_a_classless_model_is_served_with_a_warning_and_none_is_an_error(tmp_path, caplog):
    publish(tmp_path, "conv")
    with caplog.at_level(logging.WARNING):
        assert registry.serving_name(tmp_path, "conv", "host-avx2-2c-2t-ffffffff") == "conv"
    assert "without a hardware class" in caplog.text
    with pytest.raises(RegistryError, match=r"no 'gemm' model for any hardware class.*"
                                            r"tilecast run --config nightly"):
        registry.serving_name(tmp_path, "gemm", EPYC_2T)


def test_the_registry_command_lists_classes_and_moves_this_hosts_production(tmp_path, capsys):
    host = classes.host_class()
    for _ in range(2):
        publish(tmp_path, classes.class_model("gemm", host))
    publish(tmp_path, classes.class_model("gemm", XEON_2T))
    assert cli.main(["registry", "list", "gemm", "--registry", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"gemm [{host}]: versions [1, 2]; aliases production -> 2" in out
    assert f"gemm [{XEON_2T}]: versions [1]" in out
    assert cli.main(["registry", "promote", "gemm", "1", "--registry", str(tmp_path)]) == 0
    assert registry.read_alias(tmp_path, f"gemm@{host}", "production") == 1
    assert registry.read_alias(tmp_path, f"gemm@{XEON_2T}", "production") == 1
    assert cli.main(["registry", "rollback", f"gemm@{XEON_2T}", "--registry",
                     str(tmp_path)]) == 2   # nothing to roll back to: one version
    publish(tmp_path, classes.class_model("conv", XEON_2T))
    assert cli.main(["registry", "promote", "conv", "1", "--registry", str(tmp_path)]) == 2
    assert "none of them this host's" in capsys.readouterr().err


def test_distance_orders_isa_cpu_threads_then_cores():
    host = "amd-epyc-avx512-4c-4t-00000000"
    ranked = sorted([EPYC_AVX2, XEON_2T, EPYC_8T, EPYC_2T, "weird-name"],
                    key=lambda c: classes.distance(c, host))
    assert ranked == [EPYC_2T, EPYC_8T, XEON_2T, EPYC_AVX2, "weird-name"]


def test_the_host_class_is_at_the_thread_count_kernels_will_run_with(monkeypatch):
    import sys

    import torch

    monkeypatch.setitem(sys.modules, "torch", torch)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert classes.host_threads() == 1 and "-1t-" in classes.host_class()
    finally:
        torch.set_num_threads(before)
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert classes.host_threads() == 3 and "-3t-" in classes.host_class()
