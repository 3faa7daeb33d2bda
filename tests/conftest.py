"""Shared fixtures: the hardware profile, small real GEMM binaries built once per session."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tilecast.core import hardware
from tilecast.core.build import DEFAULT_FLAGS
from tilecast.core.family import KERNELS_DIR

FIXTURES = Path(__file__).parent / "fixtures"
CONFIGS = Path(__file__).parent / "configs"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def hw() -> dict:
    return hardware.profile(threads=2)


@pytest.fixture(scope="session")
def build_cache(tmp_path_factory) -> Path:
    """One build cache for the whole session, so each variant compiles once."""
    return tmp_path_factory.mktemp("build-cache")


@pytest.fixture(scope="session")
def faulty_binary(tmp_path_factory) -> Path:
    """The fault-injecting GEMM binary of tests/fixtures (segfault, hang, wrong result...)."""
    out = tmp_path_factory.mktemp("faulty") / "faulty_gemm"
    subprocess.run(["g++", *DEFAULT_FLAGS, f"-I{KERNELS_DIR / 'cpu' / 'common'}",
                    str(FIXTURES / "faulty_gemm.cpp"), "-o", str(out)], check=True)
    return out


@pytest.fixture
def slower_gemm_commit(tmp_path) -> tuple[Path, str]:
    """A clone of this repository whose GEMM binary does the whole multiply eight times per
    timed call: a real kernel, eight times the work."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
    source = clone / "kernels" / "cpu" / "gemm" / "gemm.cpp"
    text = source.read_text()
    timed = "measure(protocol, [&] { gemm(problem, workspace); })"
    assert timed in text, f"{source}: the timed call changed; update this test's edit"
    source.write_text(text.replace(timed, "measure(protocol, [&] {\n"
                                          "    for (int repeat = 0; repeat < 8; ++repeat) "
                                          "gemm(problem, workspace);\n  })"))
    git = ["git", "-C", str(clone), "-c", "user.name=rebench test", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "commit", "-q", "-am", "gemm: eight multiplies per call"], check=True)
    sha = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                         text=True).stdout.strip()
    return clone, sha


@pytest.fixture
def refused_samples(monkeypatch):
    """Every harness command line asks for `--samples 2.5`, which the real harness refuses
    (a usage error): what a config typo did before configs were checked. Gives the true
    `Protocol.argv`, for a test that fixes the typo midway."""
    from tilecast.measurement.protocol import Protocol

    argv = Protocol.argv

    def fractional(self, samples=None):
        flags = argv(self, samples)
        flags[flags.index("--samples") + 1] = "2.5"
        return flags

    monkeypatch.setattr(Protocol, "argv", fractional)
    return argv


def pytest_terminal_summary(terminalreporter) -> None:
    """The fault-injection suite's figures (tests/faults.py), when any of its cases ran."""
    from faults import summary

    line = summary()
    if line:
        terminalreporter.write_sep("=", "fault injection")
        terminalreporter.write_line(line)
