"""What every part of the registry shares: names, file names, the gate's thresholds, the error.

Kept apart from `api` so the storage backends (`local`, `remote`, `cache`) and the gate can
import it while `api` imports them: no import circle.
"""
from __future__ import annotations

import re
from pathlib import PurePosixPath

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
# a model's name: a name, or a name and the hardware class it was measured on (`gemm@<class>`,
# tilecast.registry.classes)
MODEL_RE = re.compile(r"^[A-Za-z0-9_.-]+(@[a-z0-9][a-z0-9.-]*)?$")
PRODUCTION = "production"
CANDIDATE = "candidate"
METRICS_FILE = "metrics.json"
HISTORY_FILE = "history.jsonl"
PROMOTION_FILE = "promotion.json"
CHECKSUMS_FILE = "checksums.json"  # sha256 and size of every file of a version (integrity)
CLAIM_FILE = ".claim"          # remote registries: who claimed a version number
COMPLETE_FILE = ".complete"    # remote registries: files written; a version without it is invisible
# written by publish itself (the markers only on remote registries, reserved everywhere so a
# version can be copied between the two)
RESERVED_FILES = (METRICS_FILE, PROMOTION_FILE, CHECKSUMS_FILE, CLAIM_FILE, COMPLETE_FILE)
TEMP_PREFIX = ".tmp-"
# A temporary (a version being assembled, an alias being replaced) whose writer is gone is
# swept by the next publish: at once when its name says it was this host's and that process
# is dead, else once it is this old (a live publish never takes this long to copy its files).
STALE_TEMP_S = 30 * 60

# The promotion gate's thresholds (registry.api.default_gate on stored metrics, runtime.gate
# on this run's holdout): the new model may lose at most this much against production.
MEAN_TOLERANCE = 0.005
MEDIAN_TOLERANCE = 0.005
P10_TOLERANCE = 0.02
MAX_PROBLEM_LOSS = 0.10   # per held-out problem (runtime.gate)
FLOAT_SLACK = 1e-12  # so a figure exactly on the threshold passes despite rounding
MAX_CLAIM_ATTEMPTS = 10_000


class RegistryError(Exception):
    """A registry operation failed; the message names the model, version, alias or file."""


def relative_name(name: str) -> PurePosixPath:
    """An artifact file name as a relative POSIX path; RegistryError for an absolute path,
    '..', empty parts or backslashes."""
    rel = PurePosixPath(name)
    if (not name or rel.is_absolute() or any(part in ("", ".", "..") for part in rel.parts)
            or "\\" in name):
        raise RegistryError(f"invalid artifact file name {name!r}: use a relative path "
                            "without '..'")
    return rel
