"""tilecast as an installed package: the resource locator on both layouts, the rebenchmark and
the training lineage without a checkout, and a wheel built from this tree (its file list, and
the package unpacked and run from a directory that is not the checkout), and its dependencies:
ranges in pyproject.toml, the tested versions in constraints.txt, the slim install without the
pipeline extra."""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10: the test extra's tomli
    import tomli as tomllib

import tilecast
from tilecast.cli import extras
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


# -- dependencies: ranges, the tested set, the slim install -------------------------------------


#: distributions only the DAG needs: never a requirement of the slim install
PIPELINE_ONLY = {"prefect", "prefect-dask", "dask", "distributed", "matplotlib", "rich"}
#: modules the slim install must serve without importing
PIPELINE_IMPORTS = ("prefect", "prefect_dask", "dask", "distributed", "matplotlib", "rich")


def _requirements(lines) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, lines)}


def _constraints() -> dict[str, str]:
    """constraints.txt: distribution -> its exact version."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = version
    return pins


def _set_up_line(text: str) -> str:
    return next(line.split("#")[0].strip() for line in text.splitlines()
                if line.startswith("python3 -m venv .venv"))


def test_the_core_dependencies_are_ranges_without_the_pipeline():
    core = _requirements(PYPROJECT["project"]["dependencies"])
    assert not PIPELINE_ONLY & set(core), sorted(PIPELINE_ONLY & set(core))
    exact = [str(r) for r in core.values() if any(s.operator in ("==", "===") for s in r.specifier)]
    assert not exact, f"pins in pyproject.toml's dependencies (they belong in constraints.txt): {exact}"
    # 2.6 cannot infer the ops' schemas (Optional[list[int]] as a string annotation); 2.7 can
    assert core["torch"].specifier.contains("2.7.0") and not core["torch"].specifier.contains("2.6.0")


def test_the_pipeline_extra_is_what_the_commands_check_for():
    pipeline = _requirements(PYPROJECT["project"]["optional-dependencies"]["pipeline"])
    assert set(pipeline) == {canonicalize_name(d) for d in extras.PIPELINE_MODULES.values()}
    test = _requirements(PYPROJECT["project"]["optional-dependencies"]["test"])
    assert "pipeline" in test["tilecast"].extras   # the tests run the DAG


def test_constraints_pin_every_requirement_inside_its_range():
    pins = _constraints()
    assert pins["torch"] == "2.13.0"
    project = PYPROJECT["project"]
    requirements = [*project["dependencies"],
                    *(line for name in ("pipeline", "s3", "test")
                      for line in project["optional-dependencies"][name])]
    for requirement in _requirements(requirements).values():
        if requirement.name == "tilecast" or requirement.marker is not None:
            continue   # the extras themselves; a backport for another Python than CI's
        name = canonicalize_name(requirement.name)
        assert name in pins, f"constraints.txt has no tested version of {requirement}"
        assert requirement.specifier.contains(pins[name]), \
            f"constraints.txt's {name}=={pins[name]} is outside pyproject.toml's {requirement}"


def test_the_readme_s_set_up_is_what_ci_runs():
    readme = _set_up_line((REPO / PYPROJECT["project"]["readme"]).read_text())
    assert readme == _set_up_line((REPO / ".ci" / "run").read_text())
    assert "-c constraints.txt" in readme and "'.[pipeline,test]'" in readme


def test_serving_imports_nothing_of_the_pipeline():
    """The dispatcher, select/export's command module, the ops, export and the console
    script's module load without Prefect, Dask, matplotlib or rich."""
    loaded = subprocess.run(
        [sys.executable, "-c",
         "import sys, json\n"
         "import tilecast.runtime.dispatch, tilecast.runtime.ops, tilecast.runtime.export\n"
         "import tilecast.cli.dispatch, tilecast.flows.cli\n"
         "tilecast.flows.cli.build_parser()\n"
         f"print(json.dumps(sorted(m for m in {PIPELINE_IMPORTS!r} if m in sys.modules)))"],
        capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert json.loads(loaded.stdout.splitlines()[-1]) == []


def _without_pipeline(*args: str) -> subprocess.CompletedProcess:
    """The console script's main with the pipeline's modules absent (as in the slim install)."""
    code = ("import sys\n"
            f"for name in {PIPELINE_IMPORTS!r}: sys.modules[name] = None\n"
            "from tilecast.flows.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("command", [["run", "--config", "tiny"],
                                     ["run", "--plain", "--config", "tiny"],
                                     ["fleet", "--store", "store"],
                                     ["worker", "--pool", "pool"]])
def test_the_dag_s_commands_name_the_extra_when_it_is_missing(command, tmp_path):
    refused = _without_pipeline(*command, *(["--workdir", str(tmp_path / "w")]
                                            if command[0] == "run" else []))
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"tilecast {command[0]}: error: needs the pipeline extra")
    assert lines[0].endswith("pip install 'tilecast[pipeline]'")
    assert "prefect" in lines[0] or command[1] == "--plain"
    assert not (tmp_path / "w").exists()   # refused before any work


def test_the_version_answers_without_the_pipeline():
    answered = _without_pipeline("--version")
    assert answered.returncode == 0, answered.stderr[-3000:]
    assert answered.stdout.startswith(f"tilecast {tilecast.__version__}")


def test_an_unknown_pipeline_module_is_a_value_error():
    with pytest.raises(ValueError, match="unknown pipeline modules \\['pandas'\\]"):
        extras.missing("pandas")
