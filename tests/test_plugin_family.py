"""Families from other packages (tilecast.families' `tilecast.families` entry points).

tests/plugin_family is such a package, tilecast-rowsum: a row-sum family with its own C++
kernel. CI installs it into the venv (.ci/run); on a machine that ran only the README's
set-up, the fixture pip-installs it into a temporary directory and the pipeline runs in a
subprocess with that directory on PYTHONPATH, so the test runs (never skips) on both. Then
the refusals: plugins that fail to import, are not families, bear another name, or clash
with a built-in or with each other, each one line naming the entry point and package(s).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import tilecast
from tilecast.core.family import FamilyError
from tilecast.families import BUILT_IN, ENTRY_POINT_GROUP, FAMILIES, discover, get_family
from tilecast.stages.records import FILLED_FIELDS, RECORD_FIELDS

REPO = Path(__file__).resolve().parents[1]
PLUGIN_SOURCE = Path(__file__).parent / "plugin_family"
PLUGIN_DIST = "tilecast-rowsum"
CONFIG = PLUGIN_SOURCE / "rowsum_tiny.yaml"
TILECAST = [sys.executable, "-m", "tilecast.flows.cli"]
ROWSUM_FIELDS = {"m", "n", "ld", "dtype", "accumulators", "rows", "parallel"}


def _installed() -> bool:
    try:
        metadata.distribution(PLUGIN_DIST)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict:
    """The environment of a tilecast subprocess that finds the plugin: this one where it is
    installed, else PYTHONPATH with a `pip install --target` of it (a copy of its source, so
    that the build leaves nothing in the tree)."""
    paths = [str(REPO)]
    if not _installed():
        leave_out = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
        source = shutil.copytree(PLUGIN_SOURCE, tmp_path_factory.mktemp("plugin-src") / "plugin",
                                 ignore=leave_out)
        target = tmp_path_factory.mktemp("plugin-site")
        installed = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
             "--no-build-isolation", "--check-build-dependencies", "--target", str(target),
             str(source)],
            capture_output=True, text=True, timeout=300)
        assert installed.returncode == 0, installed.stderr[-3000:]
        paths.insert(0, str(target))
    paths += [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def _tilecast(env: dict, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*TILECAST, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"tilecast {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@pytest.mark.slow
def test_a_plugin_family_runs_through_the_whole_pipeline(plugin_env, tmp_path):
    work, registry = tmp_path / "work", tmp_path / "registry"
    summary = json.loads(_tilecast(plugin_env, "run", "--plain", "--config", str(CONFIG),
                                   "--workdir", str(work), "--registry", str(registry)).stdout)
    stages = summary["stages"]["rowsum"]
    assert stages["build"]["ok"] == 4 and stages["build"]["failed"] == 0
    assert summary["published"]["rowsum"]["version"] == 1

    # every candidate ran and its output matched the float64 torch reference
    raw = [json.loads(line) for line in (work / "bench" / "rowsum.jsonl").read_text().splitlines()]
    candidates = [r for r in raw if r["role"] == "candidate"]
    assert {r["status"] for r in candidates} == {"ok"} and len({r["dims_key"] for r in raw}) == 11
    assert all(0 <= r["max_error"] <= 1e-4 and r["median_s"] > 0 for r in candidates)
    # ... then timed side by side through the variants' in-process libraries
    assert {r["timing"] for r in candidates} == {"interleaved"}
    assert {r["kernel"] for r in raw if r["role"] == "peer"} == {"torch.sum"}
    # the documented record schema is what the benchmark writes (docs/guide/records.md)
    documented = ({field.name for field in RECORD_FIELDS} | ROWSUM_FIELDS
                  | {name for name, _ in FILLED_FIELDS if not name.startswith("<")})
    assert all(set(record) == documented for record in candidates)

    evaluation = json.loads((work / "report" / "evaluation.json").read_text())["models"]["rowsum"]
    assert evaluation["n_problems"] == 3 and 0 < evaluation["mean_efficiency"] <= 1
    model = summary["published"]["rowsum"]["model"]
    version = registry / model / "versions" / "1"
    kernels = json.loads((version / "candidates.json").read_text())["kernels"]
    chosen = json.loads(_tilecast(plugin_env, "select", "--registry", str(registry), "--model",
                                  "rowsum", "--problem", "m=300,n=900", "--json").stdout)
    assert chosen["kernel"] in kernels and chosen["version"] == 1

    # a team's own rowsum records convert like any family's (docs/guide/records.md)
    team = tmp_path / "team.jsonl"
    team.write_text(
        '{"family": "rowsum", "kernel": "rowsum_fp32_acc4_r2_threads", "m": 64, "n": 1000, '
        '"ld": 1024, "status": "ok", "median_s": 2.5e-05, "threads": 2}\n'
        '{"family": "rowsum", "kernel": "rowsum_fp32_acc32_r2_threads", "m": 64, "n": 1000, '
        '"status": "ok", "median_s": 2.5e-05}\n')
    refused = subprocess.run([*TILECAST, "convert", "--from", "records", str(team), "--out",
                              str(tmp_path / "team.parquet")], capture_output=True, text=True,
                             env=plugin_env, cwd=REPO, timeout=300)
    assert refused.returncode == 2
    assert ("line 2: field 'kernel': invalid kernel name 'rowsum_fp32_acc32_r2_threads'"
            in refused.stderr)
    team.write_text(team.read_text().splitlines()[0] + "\n")
    converted = _tilecast(plugin_env, "convert", "--from", "records", str(team), "--out",
                          str(tmp_path / "team.parquet"))
    assert "1 rows, 1 problems, 1 kernels" in converted.stdout


def test_the_plugin_keeps_the_family_contract(plugin_env):
    """tests/test_family_contract.py on the plugin: in this process where it is installed
    (its parametrized cases include it), else in a subprocess that finds it."""
    if _installed():
        assert "rowsum" in FAMILIES and get_family("rowsum").name == "rowsum"
        return
    contract = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "rowsum",
         str(Path(__file__).parent / "test_family_contract.py")],
        capture_output=True, text=True, env=plugin_env, cwd=REPO, timeout=300)
    assert contract.returncode == 0, contract.stdout[-3000:]
    assert contract.stdout.splitlines()[-1].startswith("8 passed")


# -- refusals ---------------------------------------------------------------------------------

GOOD_MODULE = """\
from tilecast.families.gemm import GemmFamily


class AnotherGemm(GemmFamily):
    name = "gemm_again"


FAMILY = AnotherGemm()
"""
PLUGINS = {   # distribution -> (version, {entry point name: value})
    "good-plugin": ("1.0", {"gemm_again": "plugin_good:FAMILY"}),
    "broken-plugin": ("0.2", {"broken": "plugin_broken:FAMILY"}),
    "hollow-plugin": ("0.3", {"hollow": "plugin_hollow:FAMILY"}),
    "misnamed-plugin": ("0.4", {"other_name": "plugin_good:FAMILY"}),
    "clashing-plugin": ("0.5", {"gemm": "plugin_good:FAMILY"}),
    "twin-a": ("1.1", {"twin": "plugin_good:FAMILY"}),
    "twin-b": ("2.2", {"twin": "plugin_good:FAMILY"}),
}


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """A directory on sys.path holding real distributions' metadata (dist-info with entry
    points) and the modules they name; FAMILIES reads it afresh, and forgets it after."""
    from tilecast.config import schema

    (tmp_path / "plugin_good.py").write_text(GOOD_MODULE)
    (tmp_path / "plugin_broken.py").write_text("raise ImportError('needs libfoo.so.3')\n")
    (tmp_path / "plugin_hollow.py").write_text("class Hollow:\n    name = 'hollow'\n\n\n"
                                               "FAMILY = Hollow()\n")
    for dist, (version, entry_points) in PLUGINS.items():
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(
            f"[{ENTRY_POINT_GROUP}]\n" + "".join(f"{name} = {value}\n"
                                                 for name, value in entry_points.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
    FAMILIES.reload()
    schema.config_model.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    FAMILIES.reload()
    schema.config_model.cache_clear()


def test_discovery_refuses_what_it_cannot_use_in_one_line_each(plugin_site, caplog):
    entry_points = [ep for dist in metadata.distributions(path=[str(plugin_site)])
                    for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
    plugins, refused = discover(entry_points)
    assert list(plugins) == ["gemm_again"] and plugins["gemm_again"].name == "gemm_again"
    assert set(refused) == {"broken", "hollow", "other_name", "gemm", "twin"}
    assert all("\n" not in line for line in refused.values())
    assert ("entry point 'broken' = 'plugin_broken:FAMILY' of broken-plugin 0.2 failed to "
            "import: ImportError: needs libfoo.so.3") in refused["broken"]
    assert "'hollow'" in refused["hollow"] and "hollow-plugin 0.3" in refused["hollow"]
    assert "is not a kernel family: Hollow lacks CANDIDATE_OPTIONS, applicability_key" \
        in refused["hollow"]
    assert "is a family named 'gemm_again'; an entry point must bear its family's name" \
        in refused["other_name"] and "misnamed-plugin 0.4" in refused["other_name"]
    assert "clashing-plugin 0.5" in refused["gemm"]
    assert f"built-in family 'gemm' of tilecast {tilecast.__version__}" in refused["gemm"]
    assert "declared by two packages, twin-a 1.1" in refused["twin"]
    assert "twin-b 2.2" in refused["twin"]
    assert sorted(r.getMessage() for r in caplog.records if r.name == "tilecast.families") \
        == sorted(refused.values())


def test_a_refused_plugin_breaks_only_its_own_name(plugin_site):
    from tilecast.config import ConfigError, load_config

    assert get_family("gemm") is BUILT_IN["gemm"]        # the built-in, never the clash
    assert "gemm_again" in FAMILIES and "broken" not in FAMILIES
    with pytest.raises(FamilyError, match=r"kernel family 'broken' is unusable: .*broken-plugin "
                                          r"0.2 failed to import: ImportError: needs libfoo"):
        get_family("broken")
    with pytest.raises(FamilyError, match=r"unknown kernel family 'nope'; valid: gemm, .*gemm_ag"):
        get_family("nope")
    # configs of the built-ins load as before; one naming a refused plugin says why
    assert list(load_config(REPO / "tests" / "configs" / "tiny.yaml").families) == ["gemm"]
    config = plugin_site / "broken.yaml"
    config.write_text("name: b\nfamilies:\n  broken: {candidates: {}, problems: {train: "
                      "[{list: [{m: 1}]}], holdout: [{list: [{m: 2}]}]}}\n")
    with pytest.raises(ConfigError, match=r"families: family 'broken' is unusable: .*broken-plug"):
        load_config(config)
