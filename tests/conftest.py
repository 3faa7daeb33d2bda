"""Shared fixtures: the hardware profile, small real GEMM binaries built once per session."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tilecast import hardware
from tilecast.build import DEFAULT_FLAGS
from tilecast.families.base import KERNELS_DIR

FIXTURES = Path(__file__).parent / "fixtures"
CONFIGS = Path(__file__).parent / "configs"


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
    subprocess.run(["g++", *DEFAULT_FLAGS, f"-I{KERNELS_DIR / 'cpu'}",
                    str(FIXTURES / "faulty_gemm.cpp"), "-o", str(out)], check=True)
    return out
