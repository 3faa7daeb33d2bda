"""Serving DISCO without a compiler: a DISCO model's version carries tilecast.disco.native's two
kernel libraries and the native scorer's forest (tilecast.registry.prebuilt's process
libraries, made by `tilecast prebuild` and the publish stage); a DISCO call in a process with
no g++ runs them and equals the reference, a damaged one is refused naming the file, a host
the build does not fit, or a tilecast whose sources differ, is told so in one line."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import lightgbm
import numpy as np
import pytest

from test_dispatch import METRICS, PARAMS
from tilecast.cli import main
from tilecast.disco import native
from tilecast.families import get_family
from tilecast.registry import api as registry
from tilecast.runtime import prebuild
from tilecast.registry import prebuilt
from tilecast.runtime.dispatch import Dispatcher
from tilecast.runtime.native import library as native_library

DISCO = get_family("disco_forward")
MODEL = "disco_forward"
NOWHERE = "/nonexistent/tilecast-test/g++"
SMALL = {"batch": 2, "channels": 3, "nlat_in": 12, "nlon_in": 48, "nlat_out": 6, "nlon_out": 24,
         "grid_out": "legendre-gauss"}
LIBRARIES = ["disco_csr", "disco_kpacked", "forest"]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to prebuild")


def _candidates(hw) -> list[str]:
    """Two csr and two kpacked forward kernels of this CPU's ISA."""
    configs = DISCO.candidate_space({"variant": ["csr", "kpacked"], "lat_block": [4]}, hw)
    by_variant = {variant: [c for c in configs if c.variant == variant][:2]
                  for variant in ("csr", "kpacked")}
    return [DISCO.kernel_name(c) for chosen in by_variant.values() for c in chosen]


def _publish(root, hw, names) -> None:
    """Version 1 of a small real DISCO forward model: a forest on the family's features."""
    engine = DISCO.feature_engine(hw)
    configs = [DISCO.parse_name(name) for name in names]
    problems = [DISCO.problem({**SMALL, "batch": batch, "channels": channels})
                for batch in (1, 2, 4) for channels in (1, 3, 8)]
    features = np.vstack([engine.matrix(p, configs) for p in problems])
    tflops = np.random.default_rng(0).uniform(0.1, 2.0, len(features))
    booster = lightgbm.train({**PARAMS, "min_data_in_leaf": 2},
                             lightgbm.Dataset(features, np.log1p(tflops)), num_boost_round=5)
    spec = {"family": MODEL, "feature_names": list(engine.feature_names()),
            "engine": engine.name, "engine_version": engine.version,
            "target_transform": "log1p_tflops", "hardware": hw}
    files = {"model.txt": booster.model_to_string(), "feature_spec.json": json.dumps(spec),
             "candidates.json": json.dumps({"family": MODEL, "kernels": names,
                                            "static_best": names[0]}),
             "train_manifest.json": "{}"}
    registry.publish(root, MODEL, files, metrics=METRICS)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, hw):
    """A registry whose DISCO model has version 1 without libraries and version 2 made from
    it by `tilecast prebuild` (DISCO's libraries from their cache where a call built them)."""
    root = tmp_path_factory.mktemp("registry")
    names = _candidates(hw)
    _publish(root, hw, names)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["prebuild", "--model", MODEL, "--registry", str(root)]) == 0
    version = registry.local_copy(root, MODEL, 2)
    [(tag, entry)] = prebuilt.read_manifest(version)["builds"].items()
    return {"root": root, "names": names, "printed": printed.getvalue(), "version": version,
            "tag": tag, "entry": entry}


@pytest.fixture
def fresh_loaders(monkeypatch):
    """The process libraries' loaders as in a new process: nothing loaded, nothing offered."""
    monkeypatch.setattr(prebuilt, "_offers", {})
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_kpacked_library", None)
    monkeypatch.setattr(native_library, "_loaded", {})


def test_prebuild_carries_the_disco_libraries_and_no_kernels(setup):
    entry, tag, version = setup["entry"], setup["tag"], setup["version"]
    assert f"version 2 = version 1 with prebuilt kernels for {tag} (3 libraries" in \
        setup["printed"]
    assert entry["kernels"] == {} and sorted(entry["libraries"]) == LIBRARIES
    checksums = json.loads((version / "checksums.json").read_text())["files"]
    for name, library in entry["libraries"].items():
        assert library["file"] in checksums
        source = native.LIBRARIES[name] if name in native.LIBRARIES else \
            native_library.LIBRARIES[name]
        # the very library a first call in this tilecast compiles, and the files it read
        assert (version / library["file"]).read_bytes() == \
            (native.build_library(name) if name in native.LIBRARIES
             else native_library.build_library(name)).read_bytes()
        assert source.source.relative_to(source.root).as_posix() in library["sources"]
    assert "disco/disco_csr_variants.hpp" in entry["libraries"]["disco_csr"]["sources"]


@pytest.mark.parametrize("family", sorted(prebuild.FAMILY_LIBRARIES))
def test_the_family_table_names_the_libraries_its_module_declares(family):
    module, names = prebuild.FAMILY_LIBRARIES[family]
    assert module == native.__name__ and sorted(names) == sorted(native.LIBRARIES)


CHILD = textwrap.dedent("""
    import json, os, shutil, sys
    import torch
    from tilecast.disco import compute_psi, csr_from_psi, native, reference
    from tilecast.disco.kpacked import kpack_psi
    from tilecast.families import get_family
    from tilecast.runtime.disco import selector
    from tilecast.runtime.native import library

    root, small = sys.argv[1], json.loads(sys.argv[2])
    x = torch.randn(2, 3, 12, 48, generator=torch.Generator().manual_seed(3))
    fields = selector.problem_fields(x.shape, (12, 48), (6, 24), grid_out="legendre-gauss",
                                     dtype=x.dtype)
    chosen = selector.choose_variant(root, fields)
    problem = get_family("disco_forward").problem(fields)
    psi = compute_psi((12, 48), (6, 24), (3, 3), basis_type="harmonic",
                      grid_out="legendre-gauss", theta_cutoff=problem.theta_cutoff)
    csr = csr_from_psi(psi)
    kpacked = chosen["entry"] == "kpacked_contraction"
    ys = [native.contraction(x, csr.roff, csr.col, csr.vals, psi.kernel_size, 6, 24,
                             tile=None if kpacked else chosen["tile"]),
          native.kpacked_contraction(x, *kpack_psi(psi).tensors(), psi.kernel_size, 6, 24,
                                     tile=chosen["tile"] if kpacked else None)]
    expected = reference.disco_contraction(x.double(), psi, 24)
    scorer = selector._dispatcher(root, "disco_forward", "production")._scorer
    print(json.dumps({
        "kernel": chosen["kernel"], "version": chosen["version"],
        "errors": [float((y.double() - expected).norm() / expected.norm()) for y in ys],
        "libraries": [str(native.library()._name), str(native.kpacked_library()._name),
                      *(str(value._name) for value in library._loaded.values())],
        "native_forest": scorer.forest is not None, "gxx": shutil.which("g++"),
        "cache": sorted(os.listdir(os.environ["TILECAST_CACHE"]))
                 if os.path.isdir(os.environ["TILECAST_CACHE"]) else []}))
""")


def test_a_disco_call_without_a_compiler_runs_the_versions_libraries(setup, tmp_path):
    """The selector's choice and both DISCO libraries in a process whose PATH has no g++ and
    whose TILECAST_CXX points nowhere: the contractions equal the reference, every library
    (the scorer's forest too: not its numpy fallback) is the version's, nothing compiled."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PATH=str(empty), TILECAST_CXX=NOWHERE, TILECAST_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", CHILD, str(setup["root"]), json.dumps(SMALL)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["gxx"] is None and result["cache"] == []
    assert result["kernel"] in setup["names"] and result["version"] == 2
    assert max(result["errors"]) < 1e-5
    folder = setup["version"] / "kernels" / setup["tag"] / "libraries"
    assert result["libraries"] == [str(folder / f"{name}.so") for name in LIBRARIES]
    assert result["native_forest"]


def _offered_copy(setup, tmp_path):
    """A copy of version 2, loaded (its libraries offered) as version 2 of the model."""
    copy = shutil.copytree(setup["version"], tmp_path / "2")
    Dispatcher.from_directory(copy, model=MODEL, version=2)
    return copy


def test_a_damaged_disco_library_is_refused_naming_the_file(setup, tmp_path, fresh_loaders):
    copy = _offered_copy(setup, tmp_path)
    for name, load, error in (("disco_csr", native.library, native.DiscoBuildError),
                              ("forest", lambda: native_library.load("forest.cpp"),
                               native_library.NativeBuildError)):
        library = copy / setup["entry"]["libraries"][name]["file"]
        original = library.read_bytes()
        # a new file: the copy may share its inode with a library this process has mapped
        # (rewriting a mapped library in place changes the code it runs)
        library.unlink()
        library.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(error) as raised:
            load()
        message = str(raised.value)
        assert "\n" not in message
        assert message.startswith(f"prebuilt library {library} of library {name!r} ({name}.cpp) "
                                  "(version 2 of model 'disco_forward') does not match "
                                  "kernels/manifest.json")
        assert "the file is damaged; publish the model again or roll back" in message


def test_a_host_lacking_the_builds_isa_gets_one_line(setup, tmp_path, monkeypatch,
                                                     fresh_loaders):
    _offered_copy(setup, tmp_path)
    spare = sorted(set(setup["entry"]["cpu_flags"]) - {"avx", "avx2", "fma", "avx512f"})
    if not spare:
        pytest.skip("the build's CPU has no flag beyond what the kernels need")
    monkeypatch.setattr(prebuilt, "cpu_flags",
                        lambda: frozenset(prebuilt.hardware.profile(1)["flags"]) - {spare[0]})
    monkeypatch.setenv("TILECAST_CXX", NOWHERE)
    with pytest.raises(native.DiscoBuildError) as raised:
        native.kpacked_library()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"library 'disco_kpacked' (disco_kpacked.cpp): version 2 of model "
                              f"'disco_forward' carries prebuilt libraries for {setup['tag']} "
                              "(built on ")
    assert f"this host lacks {spare[0]})" in message and "not for this host (" in message
    assert f"there is no compiler here ('{NOWHERE}' does not run" in message
    assert message.endswith("run `tilecast prebuild --model disco_forward --version 2` on a "
                            "host with this host's CPU flags and a compiler, and serve the "
                            "version it publishes")


def test_a_version_without_libraries_and_no_compiler_says_to_prebuild(setup, monkeypatch,
                                                                       fresh_loaders):
    root = setup["root"]
    Dispatcher.from_registry(root, MODEL, 1)
    monkeypatch.setenv("TILECAST_CXX", NOWHERE)
    with pytest.raises(native.DiscoBuildError) as raised:
        native.library()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("library 'disco_csr' (disco_csr.cpp): version 1 of model "
                              "'disco_forward' carries no prebuilt libraries, and there is no "
                              f"compiler here ('{NOWHERE}' does not run")
    assert f"run `tilecast prebuild --model disco_forward --version 1 --registry {root}`" \
        in message


def test_a_library_built_from_other_sources_is_not_used(setup, tmp_path):
    """A process library is tilecast's code: one whose recorded sources differ from this
    tilecast's is not runnable here, and the line says which files differ."""
    [library] = prebuilt.libraries(setup["version"], {"builds": {setup["tag"]: setup["entry"]}},
                                   prebuilt.LIBRARIES)["disco_csr"]
    spec = native.LIBRARIES["disco_csr"]
    offer = prebuilt.Offer("version 2 of model 'disco_forward'", "tilecast prebuild ...",
                           (library,))
    have = prebuilt.cpu_flags()
    assert prebuilt.runnable(offer, have, spec.root) == library
    edited = tuple((name, "0" * 64 if name == "disco/disco_csr.cpp" else sha256)
                   for name, sha256 in library.sources)
    other = prebuilt.Offer(offer.where, offer.prebuild,
                           (prebuilt.Library(**{**vars(library), "sources": edited}),))
    assert prebuilt.runnable(other, have, spec.root) is None
    assert "built from other sources of tilecast than this one's (disco/disco_csr.cpp differ)" \
        in prebuilt.not_here(str(spec), other, have, "libraries", spec.root)


def test_the_publish_stage_carries_the_disco_libraries_where_the_run_built(setup, tmp_path,
                                                                          caplog):
    """publish_kernels for a DISCO model: its libraries where its candidates' executables
    were built here; none (and nothing compiled) where they were built elsewhere."""
    model_dir = registry.local_copy(setup["root"], MODEL, 1)
    cache = tmp_path / "build-cache"
    cache.mkdir()
    assert prebuild.publish_kernels(model_dir, cache) == {}
    assert "4 of 4 candidates were not built in" in caplog.text
    for name in setup["names"]:   # the benchmark executables a run's build stage leaves
        (cache / f"{name}-0123456789abcdef01234567").write_bytes(b"")
    files = prebuild.publish_kernels(model_dir, cache)
    manifest = json.loads(files[prebuilt.MANIFEST_FILE])
    [(tag, entry)] = manifest["builds"].items()
    assert tag == setup["tag"] and entry["origin"] == "publish" and entry["kernels"] == {}
    assert entry["libraries"] == setup["entry"]["libraries"]
    assert sorted(files) == sorted([prebuilt.MANIFEST_FILE, *(
        library["file"] for library in entry["libraries"].values())])


def test_a_runs_build_compiles_the_process_libraries_its_versions_carry(tmp_path, monkeypatch):
    """The build stage compiles, beside the candidates, the process libraries the run's
    published versions will carry (the scorer's for every family, DISCO's two for a DISCO
    family), so that evaluating and publishing, one family after another, compile nothing;
    the block waits for them."""
    from tilecast.core import hardware
    from tilecast.core.settings import settings
    from tilecast.workflows import pipeline

    profile = hardware.profile(1)
    disco = prebuild.serving_libraries(get_family("disco_forward"), profile)
    assert {"forest", "disco_csr", "disco_kpacked"} <= set(disco)
    assert not {"disco_csr", "disco_kpacked"} & set(
        prebuild.serving_libraries(get_family("gemm"), profile))
    started, finished = [], []

    def build(families, hardware_profile, compiler):
        started.append(([f.name for f in families], compiler))
        time.sleep(0.2)
        finished.append(True)

    monkeypatch.setattr(prebuild, "build_serving_libraries", build)

    class Ctx:
        hardware = profile

    with pipeline.serving_libraries_built(Ctx, [get_family("gemm"), get_family("disco_forward")]):
        pass
    assert started == [(["gemm", "disco_forward"], settings().compiler)] and finished == [True]
