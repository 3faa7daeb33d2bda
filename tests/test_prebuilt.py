"""Serving without a compiler: a version's prebuilt kernel libraries (tilecast.registry.prebuilt,
tilecast.runtime.prebuild, `tilecast prebuild`) on a real tiny GEMM registry; the kernels and
the dispatcher's native scorer run in a process that has no g++, a damaged library is refused
by name, and a host the version has no build for, or a version without prebuilt kernels, gets
one line saying what to do. DISCO's libraries: tests/test_prebuilt_disco.py."""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import lightgbm
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from test_dispatch import HARDWARE, PARAMS, publish_model, training_set
from test_ops import ALL_GEMM_VARIANTS, CONV_VARIANTS, rel_error
from tilecast.cli import main
from tilecast.core import build
from tilecast.families import get_family
from tilecast.registry import api as registry
from tilecast.registry.api import RegistryError
from tilecast.runtime import kernel_library, ops, prebuild
from tilecast.registry import prebuilt
from tilecast.runtime.dispatch import Dispatcher
from tilecast.runtime.native import library as native_library

GEMM = get_family("gemm")
CONFIGS = [c for c in ALL_GEMM_VARIANTS if c.isa == "avx2" and c.dtype == "fp32"]
NAMES = [GEMM.kernel_name(c) for c in CONFIGS]
NOWHERE = "/nonexistent/tilecast-test/g++"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to prebuild")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, build_cache, hw):
    """A registry whose GEMM model has version 1 without kernels and version 2 made from it by
    `tilecast prebuild`, after the libraries were built into the build cache the way a run's
    build stage builds them."""
    if not {"avx2", "fma"} <= set(hw["flags"]):
        pytest.skip("the GEMM variants here need AVX2 and FMA")
    root = tmp_path_factory.mktemp("registry")
    engine = GEMM.feature_engine(HARDWARE)
    features, tflops = training_set(engine, CONFIGS)
    booster = lightgbm.train(PARAMS, lightgbm.Dataset(features, np.log1p(tflops)),
                             num_boost_round=10)
    publish_model(root, "gemm", booster, engine.feature_names(), NAMES, "log1p_tflops")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.BUILD_CACHE_ENV, str(build_cache))
        built = build.build_candidates(GEMM, CONFIGS, build_cache, jobs=2, shared=True)
        assert all(b.binary is not None for b in built)
        outputs = []
        for _ in range(2):
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                assert main(["prebuild", "--model", "gemm", "--registry", str(root)]) == 0
            outputs.append(printed.getvalue())
    return {"root": root, "outputs": outputs, "built": {b.kernel: b.binary for b in built}}


@pytest.fixture
def fresh_loader(monkeypatch):
    """kernel_library and prebuilt as in a new process: nothing loaded, nothing offered."""
    monkeypatch.setattr(kernel_library, "_loaded", {})
    monkeypatch.setattr(kernel_library, "_by_variables", {})
    monkeypatch.setattr(prebuilt, "_offers", {})


def test_prebuild_publishes_the_version_again_with_its_kernels_checksummed(setup):
    root = setup["root"]
    first, second = setup["outputs"]
    assert "version 2 = version 1 with prebuilt kernels for" in first
    # the 2 candidates' libraries and the native scorer's 2 (forest, gemm_features)
    assert "(4 libraries" in first and re.search(r"; [24] from the caches, [02] compiled\)", first)
    assert "aliases moved: production -> 2" in first
    assert "version 2 already carries kernels this host runs" in second
    assert registry.list_versions(root, "gemm") == [1, 2]
    assert registry.read_alias(root, "gemm", "production") == 2
    one, two = (registry.local_copy(root, "gemm", v) for v in (1, 2))
    for name in ("model.txt", "candidates.json", "metrics.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes()
    manifest = prebuilt.read_manifest(two)
    [(tag, entry)] = manifest["builds"].items()
    assert set(entry["cpu_flags"]) <= kernel_library.cpu_flags()
    assert entry["origin"] == "prebuild of version 1" and sorted(entry["kernels"]) == sorted(NAMES)
    checksums = json.loads((two / "checksums.json").read_text())["files"]
    for name, kernel in entry["kernels"].items():
        assert kernel["file"] == f"kernels/{tag}/{name}.so" and kernel["file"] in checksums
        # the very library the build cache holds, copied
        assert (two / kernel["file"]).read_bytes() == setup["built"][name].read_bytes()
    assert sorted(entry["libraries"]) == ["forest", "gemm_features"]
    for name, library in entry["libraries"].items():
        assert library["file"] == f"kernels/{tag}/libraries/{name}.so"
        assert library["file"] in checksums and library["source"] == f"{name}.cpp"
        # the very library the native scorer's cache holds, built from these sources
        assert (two / library["file"]).read_bytes() == \
            native_library.build_library(name).read_bytes()
        assert library["sources"][f"{name}.cpp"] == hashlib.sha256(
            native_library.LIBRARIES[name].source.read_bytes()).hexdigest()
    assert "kernels/manifest.json" in checksums and prebuilt.read_manifest(one) is None
    promotion = json.loads((two / "promotion.json").read_text())
    assert promotion["reason"].startswith("prebuild: version 1's files unchanged")


CHILD = textwrap.dedent("""
    import json, os, shutil, sys
    import torch
    from tilecast.runtime import kernel_library, ops
    from tilecast.runtime.dispatch import Dispatcher
    from tilecast.runtime.native import library

    dispatcher = Dispatcher.from_registry(sys.argv[1], "gemm")
    gen = torch.Generator().manual_seed(8)
    a, b = torch.randn(70, 90, generator=gen), torch.randn(90, 33, generator=gen)
    kernel = dispatcher.select({"m": 70, "n": 33, "k": 90})
    through_op = torch.ops.tilecast.gemm(a, b, kernel, "", "")
    chosen = ops.gemm(a, b, dispatcher=dispatcher)
    reference = torch.matmul(a.double(), b.double())
    error = float((through_op.double() - reference).norm() / reference.norm())
    cache = os.environ["TILECAST_CACHE"]
    scorer = dispatcher._scorer
    print(json.dumps({"kernel": kernel, "error": error, "same": torch.equal(through_op, chosen),
                      "path": str(kernel_library.load(dispatcher.family, kernel).path),
                      "gxx": shutil.which("g++"),
                      "native": [scorer.forest is not None, scorer.filler is not None],
                      "scorer": sorted(str(value._name) for value in library._loaded.values()),
                      "built": sorted(os.listdir(cache)) if os.path.isdir(cache) else []}))
""")


def test_a_host_without_a_compiler_serves_the_prebuilt_kernel(setup, tmp_path):
    """The product on a GEMM model of the registry in a process whose PATH has no g++ and
    whose TILECAST_CXX points nowhere, through the torch op, equals torch.matmul; the
    dispatcher scored on its native forest and features, loaded from the version."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {key: value for key, value in os.environ.items()
           if key not in (build.BUILD_CACHE_ENV, "PYTHONPATH")}
    env.update(PATH=str(empty), TILECAST_CXX=NOWHERE, TILECAST_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", CHILD, str(setup["root"])], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["gxx"] is None and result["built"] == []
    assert result["kernel"] in NAMES and result["error"] < 1e-5 and result["same"]
    version = setup["root"] / "gemm" / "versions" / "2"
    assert result["path"].startswith(str(version / "kernels"))
    assert result["native"] == [True, True]     # not the numpy fallback
    [(tag, _)] = prebuilt.read_manifest(version)["builds"].items()
    assert result["scorer"] == [str(version / "kernels" / tag / "libraries" / f"{name}.so")
                                for name in ("forest", "gemm_features")]


def test_a_damaged_prebuilt_library_is_refused_naming_the_file(setup, tmp_path, fresh_loader):
    version = shutil.copytree(registry.local_copy(setup["root"], "gemm", 2), tmp_path / "2")
    library = next(version.glob("kernels/*/*.so"))
    # a flipped byte before loading: the version's checksums refuse it
    original = library.read_bytes()
    library.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(RegistryError, match=rf"{library}: its sha256 checksum does not match"):
        Dispatcher.from_directory(version, model="gemm", version=2)
    # damaged after the version loaded, before the kernel's first call: refused by name
    library.write_bytes(original)
    Dispatcher.from_directory(version, model="gemm", version=2)
    library.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(kernel_library.KernelBuildError,
                       match=rf"prebuilt library {library} of kernel '{library.stem}' \(version "
                             r"2 of model 'gemm'\) does not match kernels/manifest.json"):
        kernel_library.load(GEMM, library.stem)


def test_a_host_lacking_the_builds_isa_gets_one_line(setup, monkeypatch, fresh_loader):
    root = setup["root"]
    dispatcher = Dispatcher.from_registry(root, "gemm")
    [(tag, entry)] = prebuilt.read_manifest(registry.local_copy(root, "gemm", 2))["builds"].items()
    # a flag of the build's CPU that the variants themselves do not need
    spare = sorted(set(entry["cpu_flags"]) - {"avx", "avx2", "fma"})
    if not spare:
        pytest.skip("the build's CPU has no flag beyond what the variants need")
    monkeypatch.setattr(kernel_library, "cpu_flags",
                        lambda: frozenset(prebuilt.hardware.profile(1)["flags"]) - {spare[0]})
    monkeypatch.setenv("TILECAST_CXX", NOWHERE)
    with pytest.raises(kernel_library.KernelBuildError) as raised:
        ops.gemm(torch.randn(5, 6), torch.randn(6, 7), dispatcher=dispatcher)
    message = str(raised.value)
    assert "\n" not in message
    assert f"version 2 of model 'gemm' carries prebuilt kernels for {tag} (built on " in message
    assert f"this host lacks {spare[0]})" in message and "not for this host (" in message
    assert f"run `tilecast prebuild --model gemm --version 2 --registry {root}`" in message


def test_a_version_without_kernels_and_no_compiler_says_to_prebuild(setup, tmp_path, monkeypatch,
                                                                     fresh_loader):
    root = setup["root"]
    dispatcher = Dispatcher.from_registry(root, "gemm", 1)
    monkeypatch.setenv("TILECAST_CXX", NOWHERE)
    monkeypatch.setenv(build.BUILD_CACHE_ENV, str(tmp_path / "empty"))
    with pytest.raises(kernel_library.KernelBuildError) as raised:
        ops.gemm(torch.randn(5, 6), torch.randn(6, 7), dispatcher=dispatcher)
    message = str(raised.value)
    assert "\n" not in message
    assert "version 1 of model 'gemm' carries no prebuilt kernels" in message
    assert f"there is no compiler here ('{NOWHERE}' does not run" in message
    assert f"run `tilecast prebuild --model gemm --version 1 --registry {root}`" in message


def test_a_grouped_conv_kernel_runs_from_a_prebuilt_library_without_a_compiler(
        build_cache, tmp_path, monkeypatch, fresh_loader):
    """The grouped-conv families' kernels travel the same way: this host's build of one
    forward variant, offered as a version's, runs with no compiler and equals F.conv2d."""
    family = get_family("grouped_conv_forward")
    config = CONV_VARIANTS["forward_2d"]
    name = family.kernel_name(config)
    files, entry = prebuild.kernel_files(family, [name], build_cache)
    version = tmp_path / "version"
    for relative, source in files.items():
        (version / relative).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, str):
            (version / relative).write_text(source)
        else:
            shutil.copyfile(source, version / relative)
    prebuilt.offer(version, family.name, [name], model="conv", version=1)
    monkeypatch.setenv("TILECAST_CXX", NOWHERE)
    monkeypatch.setenv(build.BUILD_CACHE_ENV, str(tmp_path / "empty"))
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 8, 9, 9, generator=gen), torch.randn(8, 4, 3, 3, generator=gen)
    y = ops.grouped_conv(x, w, padding=1, groups=2, kernel=name)
    assert rel_error(y, F.conv2d(x.double(), w.double(), padding=1, groups=2)) < 1e-4
    assert kernel_library.load(family, name).path == version / entry["kernels"][name]["file"]
    assert not (tmp_path / "empty").exists()


def test_the_publish_stage_copies_the_runs_libraries_and_compiles_nothing(setup, build_cache,
                                                                            tmp_path, caplog):
    """publish_kernels (the publish stage's) takes every candidate's library from the run's
    build cache; where they were built elsewhere (a fleet's parent) the version carries none."""
    model_dir = registry.local_copy(setup["root"], "gemm", 1)
    files = prebuild.publish_kernels(model_dir, build_cache)
    manifest = json.loads(files[prebuilt.MANIFEST_FILE])
    [(tag, entry)] = manifest["builds"].items()
    assert entry["origin"] == "publish" and sorted(entry["kernels"]) == sorted(NAMES)
    assert {files[k["file"]] for k in entry["kernels"].values()} == set(setup["built"].values())
    elsewhere = tmp_path / "parent-cache"
    elsewhere.mkdir()
    assert prebuild.publish_kernels(model_dir, elsewhere) == {}
    assert "publish without prebuilt kernels: 2 of 2 candidates were not built in" in caplog.text
    assert not any(elsewhere.iterdir())
