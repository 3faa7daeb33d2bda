"""What a model artifact is, for every kind of model (tilecast.core.kinds): its file names,
the target transforms its feature_spec.json may name, the error a damaged artifact raises,
and the provenance a training run records (versions, commit).

W/models/<model>/ and a registry version's directory hold these files (tilecast.stages.layout
says where the rest of a workdir lives).
"""
from __future__ import annotations

import importlib.metadata
import platform
import subprocess

import numpy as np

import tilecast
from tilecast.core import resources

MODEL_FILE = "model.txt"                    # the LightGBM booster
FEATURE_SPEC_FILE = "feature_spec.json"     # family, feature names, target transform, hardware
MANIFEST_FILE = "train_manifest.json"       # data hash, CV figures, lineage, versions
CANDIDATES_FILE = "candidates.json"         # the kernels to choose from, and the static best
SHORTLIST_FILE = "shortlist.json"           # optional: the few kernels worth scoring, by region
#: the files `train` writes and `publish` uploads (with the evaluation's per-problem table)
MODEL_FILES = (MODEL_FILE, FEATURE_SPEC_FILE, MANIFEST_FILE, CANDIDATES_FILE)
# a table model's files beside these (tilecast.table.model, tilecast.table.train)
CALIBRATION_FILE = "calibration.json"       # how sure an answer is, per case
FAILURES_FILE = "failures.json"             # configurations that failed on a device

# feature_spec.json "target_transform" -> (forward applied to TFLOP/s when training, inverse
# applied to the model's predictions to get TFLOP/s back)
TARGET_TRANSFORMS = {"log1p_tflops": (np.log1p, np.expm1), "log_tflops": (np.log, np.exp)}


class ModelArtifactError(ValueError):
    """A model directory lacks a file, or a file is corrupt or inconsistent."""


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions() -> dict:
    """Versions of tilecast, python and the libraries a model depends on (torch if present)."""
    import lightgbm  # slow to import, with sklearn: only a training run records versions
    import pandas as pd
    import sklearn   # sklearn: only training needs it

    # the running code's own version (pyproject.toml's version is read from it): an editable
    # install's metadata keeps the version it was installed at
    versions = {"tilecast": tilecast.__version__, "python": platform.python_version(),
                "lightgbm": lightgbm.__version__, "numpy": np.__version__,
                "pandas": pd.__version__, "sklearn": sklearn.__version__}
    torch_version = _version("torch")  # metadata only: importing torch costs seconds
    if torch_version is not None:
        versions["torch"] = torch_version
    return versions


def git_sha() -> str:
    """HEAD of the checkout holding this code, or "unknown" when git cannot tell or tilecast
    is an installed package (whatever repository its directory happens to lie in)."""
    checkout = resources.checkout()
    if checkout is None:
        return "unknown"
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True,
                                text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() or "unknown"
