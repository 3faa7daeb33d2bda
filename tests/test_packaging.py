"""tilecast as an installed package: the resource locator on both layouts, the rebenchmark and
the training lineage without a checkout, and a wheel built from this tree (its file list, and
the package unpacked and run from a directory that is not the checkout)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import tilecast
from tilecast.core import resources
from tilecast.core.family import KERNELS_DIR
from tilecast.stages import train
from tilecast.workflows import rebench

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: repository directory -> its directory in the installed package, e.g. flows -> tilecast/flows
MAPPED = {directory: package.replace(".", "/")
          for package, directory in PYPROJECT["tool"]["setuptools"]["package-dir"].items()}
PACKAGE_ROOTS = ("tilecast", *MAPPED)


def _layout(root: Path, *dirs: str, files: tuple[str, ...] = ()) -> Path:
    for name in dirs:
        (root / name).mkdir(parents=True)
    for name in files:
        (root / name).write_text("")
    return root / "tilecast"


# -- the locator -------------------------------------------------------------------------------

def test_a_checkout_finds_the_top_level_directories(tmp_path):
    package = _layout(tmp_path, "tilecast", "kernels", "configs", files=("pyproject.toml",))
    found = resources.locate(package)
    assert found == resources.Resources(tmp_path / "kernels", tmp_path / "configs", tmp_path)
    assert not found.installed and "checkout" in found.describe()


def test_an_installed_package_uses_its_own_copies_even_inside_a_checkout(tmp_path):
    # a venv inside a checkout: site-packages/tilecast has _kernels; the checkout above it
    # is someone else's tree
    package = _layout(tmp_path, "tilecast/_kernels", "tilecast/_configs", "kernels",
                      files=("pyproject.toml",))
    found = resources.locate(package)
    assert found == resources.Resources(package / "_kernels", package / "_configs", None)
    assert found.installed and "installed package" in found.describe()


def test_a_package_without_its_files_names_where_they_should_be(tmp_path):
    # site-packages/tilecast without _kernels, beside no checkout: paths that a missing-file
    # error will name, never some unrelated kernels/ directory
    package = _layout(tmp_path, "tilecast", "kernels")
    assert resources.locate(package).kernels == package / "_kernels"


def test_this_tree_is_a_checkout():
    assert resources.checkout() == REPO and KERNELS_DIR == REPO / "kernels"
    assert (KERNELS_DIR / "cpu" / "gemm" / "gemm.cpp").is_file()


# -- without a checkout ------------------------------------------------------------------------

def test_rebench_measures_an_installed_package_s_own_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "checkout", lambda: None)
    source = rebench.resolve_source(tmp_path)
    assert (source.kind, source.kernels_dir, source.sha) == ("installed", KERNELS_DIR, "unknown")
    assert source.label() == f"installed package at {KERNELS_DIR}"


def test_a_git_ref_without_a_repository_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "checkout", lambda: None)
    with pytest.raises(rebench.RebenchError, match=r"git ref 'HEAD~1' needs a git repository "
                                                   r".* installed package .* --repo"):
        rebench.resolve_source(tmp_path, "HEAD~1")


def test_a_git_ref_of_a_named_repository_works_without_a_checkout(tmp_path, monkeypatch):
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs this tree as a git repository and git")
    monkeypatch.setattr(resources, "checkout", lambda: None)
    source = rebench.resolve_source(tmp_path, "HEAD", repo=REPO)
    assert source.kind == "git" and (source.kernels_dir / "cpu" / "gemm" / "gemm.cpp").is_file()


def test_training_lineage_has_no_git_sha_without_a_checkout(monkeypatch):
    # whatever repository site-packages lies in is not tilecast's
    monkeypatch.setattr(resources, "checkout", lambda: None)
    assert train.git_sha() == "unknown"


# -- a wheel of this tree ----------------------------------------------------------------------

def _tree_files(*roots: str) -> list[str]:
    """Repository-relative files under `roots`: tracked or new, not ignored (git), else all
    but caches."""
    if (REPO / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others",
                                 "--exclude-standard", "--", *roots],
                                check=True, capture_output=True, text=True).stdout.split()
        return sorted(name for name in listed if (REPO / name).is_file())
    return sorted(p.relative_to(REPO).as_posix() for root in roots
                  for p in (REPO / root).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def _installed_name(name: str) -> str:
    """Where a repository file lies in the wheel: flows/cli.py -> tilecast/flows/cli.py."""
    top, _, rest = name.partition("/")
    return f"{MAPPED[top]}/{rest}" if top in MAPPED else name


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built offline by this environment's setuptools from a copy of
    what the build reads (an in-tree build would leave build/ in the checkout)."""
    try:
        setuptools_version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no setuptools in this environment: the offline build "
                    "(--no-build-isolation) needs the build backend installed")
    if tuple(int(part) for part in setuptools_version.split(".")[:2]) < (70, 1):
        pytest.skip(f"setuptools {setuptools_version} is older than pyproject.toml's "
                    "build requirement (>= 70.1)")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", PYPROJECT["project"]["readme"]):
        shutil.copy2(REPO / name, source / name)
    for root in PACKAGE_ROOTS:
        shutil.copytree(REPO / root, source / root,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--no-index", "-q", "-w", str(work / "dist"),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"pip wheel failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    wheels = list((work / "dist").glob("tilecast-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


@pytest.mark.slow
def test_the_wheel_holds_every_kernel_source_and_shipped_config(wheel_names):
    expected = _tree_files("kernels", "configs")
    assert any(name.endswith(".hpp") for name in expected)
    assert "configs/tiny.yaml" in expected and "kernels/cpu/gemm/gemm.cpp" in expected
    missing = [name for name in expected if _installed_name(name) not in wheel_names]
    assert not missing, f"missing from the wheel: {missing}"


@pytest.mark.slow
def test_the_wheel_holds_every_file_of_the_package_tree(wheel_names):
    # a new subpackage must be added to pyproject.toml's package list: this names it if not
    expected = _tree_files("tilecast", "flows", "tasks")
    assert "flows/cli.py" in expected and "tasks/stages.py" in expected
    missing = [name for name in expected if _installed_name(name) not in wheel_names]
    assert not missing, f"missing from the wheel (pyproject.toml's packages?): {missing}"


@pytest.mark.slow
def test_the_wheel_installs_only_the_tilecast_package(wheel_names):
    tops = {name.split("/")[0] for name in wheel_names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"tilecast"}
    assert {"tilecast/flows/cli.py", "tilecast/tasks/stages.py",
            "tilecast/_kernels/cpu/common/harness.hpp",
            "tilecast/_configs/quick.yaml"} <= wheel_names
    info = next(top for top in tops if top.endswith(".dist-info"))
    assert info == f"tilecast-{tilecast.__version__}.dist-info"


@pytest.mark.slow
def test_the_wheel_s_console_script_is_the_flows_cli(wheel):
    with zipfile.ZipFile(wheel) as archive:
        info = next(n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt"))
        entry_points = archive.read(info).decode()
    assert "tilecast = tilecast.flows.cli:main" in entry_points


def _installed(site: Path, away: Path, *args: str) -> subprocess.CompletedProcess:
    """`python ARGS` with only the unpacked wheel added to the path, run from `away`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILECAST_")}
    env.update(PYTHONPATH=str(site), DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               TILECAST_CACHE=str(away / "cache"))
    return subprocess.run([sys.executable, *args], cwd=away, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_the_unpacked_wheel_runs_from_outside_the_checkout(wheel, tmp_path):
    site, away = tmp_path / "site", tmp_path / "away"
    away.mkdir()
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    where = _installed(site, away, "-c", "import json, tilecast.flows.cli; "
                       "from tilecast.core import resources; from tilecast import config; "
                       "r = resources.locate(); print(json.dumps([str(r.kernels), "
                       "str(r.checkout), str(config.resolve_path('tiny'))]))")
    assert where.returncode == 0, where.stderr[-3000:]
    kernels, checkout, tiny = json.loads(where.stdout.splitlines()[-1])
    assert (kernels, checkout) == (str(site / "tilecast" / "_kernels"), "None")
    assert tiny == str(site / "tilecast" / "_configs" / "tiny.yaml")

    check = _installed(site, away, "-m", "tilecast.flows.cli", "config", "check", "tiny")
    assert check.returncode == 0 and check.stdout.startswith("ok: "), check.stderr[-3000:]

    refused = _installed(site, away, "-m", "tilecast.flows.cli", "rebench", "--config", "tiny",
                         "--workdir", str(away / "w"), "--history", str(away / "h"),
                         "--git-ref", "HEAD")
    assert refused.returncode == 2, refused.stderr[-3000:]
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith("tilecast rebench: error: git ref 'HEAD' needs a git repository")
    assert "installed package" in message and "--repo" in message
