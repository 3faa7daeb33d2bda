"""Where tilecast's shipped files are: the kernel sources and the run configs, in a source
checkout and in an installed wheel. Every other module asks here instead of counting parents
of its own file.

A checkout keeps them at the repository's top level, beside the `tilecast/` package
(`kernels/`, `configs/`); an editable install imports from the checkout, so it is the same
case. A wheel cannot install top-level directories that code finds again, so pyproject.toml's
`package-dir` maps them into the package at build time: `tilecast/_kernels/`,
`tilecast/_configs/` (underscored: data, not modules to import). A package directory that
holds `_kernels/` is therefore an installed one, wherever it lies (a venv inside a checkout
included), and only a checkout has a repository for git to read.

Nothing here reads a file or runs anything: paths and existence checks only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: the repository's directory names (a checkout, and what `git archive` unpacks)
KERNELS_SUBDIR = "kernels"
CONFIGS_SUBDIR = "configs"
#: their names inside an installed package (pyproject.toml's [tool.setuptools.package-dir])
PACKAGED_KERNELS = "_kernels"
PACKAGED_CONFIGS = "_configs"


@dataclass(frozen=True)
class Resources:
    """The kernel sources and shipped configs of this tilecast, and the checkout holding them
    (None for an installed package)."""
    kernels: Path
    configs: Path
    checkout: Path | None

    @property
    def installed(self) -> bool:
        return self.checkout is None

    def describe(self) -> str:
        """Where these files come from, for messages: 'the checkout /x' or 'the installed
        package /y'."""
        if self.checkout is not None:
            return f"the checkout {self.checkout}"
        return f"the installed package {self.kernels.parent}"


@functools.lru_cache(maxsize=None)
def locate(package_dir: Path = PACKAGE_DIR) -> Resources:
    """The resources of the `tilecast` package at `package_dir`: its packaged copies when it
    has them (a wheel), else the checkout's top-level directories beside it. A package with
    neither (a broken install) gets the packaged paths, so that the error a missing source
    later causes names where the file should have been."""
    package_dir = Path(package_dir)
    packaged = package_dir / PACKAGED_KERNELS
    root = package_dir.parent
    if not packaged.is_dir() and (root / KERNELS_SUBDIR).is_dir() \
            and (root / "pyproject.toml").is_file():
        return Resources(root / KERNELS_SUBDIR, root / CONFIGS_SUBDIR, root)
    return Resources(packaged, package_dir / PACKAGED_CONFIGS, None)


def kernels_dir() -> Path:
    """The kernel sources: kernels/cpu/<family>/*.cpp|*.hpp (common/: what the families
    share), kernels/cuda/*.cu|*.cuh."""
    return locate().kernels


def configs_dir() -> Path:
    """The shipped run configs (`--config NAME` looks here)."""
    return locate().configs


def checkout() -> Path | None:
    """The repository root when tilecast runs from a checkout; None when installed."""
    return locate().checkout
