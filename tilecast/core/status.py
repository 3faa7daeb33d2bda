"""tilecast's one vocabulary of status codes (STATUS_TABLE): a benchmark record's, an imported
table dataset's (tilecast.table.dataset) and, beside them, a build's outcome (BUILD_STATUSES, a
different thing: what happened to a candidate's compilation)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Status:
    """One status code: what it means, and whether a benchmark record (`record`) and an
    imported table dataset's row (`table`) may hold it."""
    name: str
    meaning: str
    record: bool = True
    table: bool = True


# What happened to one kernel (configuration) on one problem: the single table of status
# codes. `ok` is the only one whose time counts; the others are kept so that nothing that
# failed or could not run there is ever chosen there.
STATUS_TABLE = (
    Status("ok", "it ran, its output checked, and its time counts"),
    Status("build_failed", "it did not compile"),
    Status("unsupported", "it cannot run this problem (its constraints, or the harness "
                          "refused the problem)"),
    Status("wrong_result", "it ran, but its output was wrong"),
    Status("timeout", "it ran past its time limit"),
    Status("crashed", "it ran and died, or gave no usable time"),
    Status("failed", "the source says it failed without saying how (its reason keeps what "
                     "the source said); tilecast's own records always know how", record=False),
)
# A benchmark record's statuses (convert checks them) and an imported table row's.
STATUSES = tuple(s.name for s in STATUS_TABLE if s.record)
TABLE_STATUSES = tuple(s.name for s in STATUS_TABLE if s.table)
# Names table datasets written before the one vocabulary hold; `current_statuses` reads them.
LEGACY_STATUSES = {"invalid": "unsupported", "compile_failed": "build_failed",
                   "runtime_failed": "crashed"}

# What the build made of one candidate (tune.BuildEvent): `ok` (a binary), `failed` (the
# compiler refused it or died; its records say `build_failed`), `rejected` (examined and
# turned down before compiling, e.g. by its constraints). A build's outcome, not a measurement's.
BUILD_STATUSES = ("ok", "failed", "rejected")

# The reason of a job the harness refused to run because its command line was bad (it exits
# 2 and prints its usage): the record says `crashed`, but no kernel ran; see is_usage_error.
USAGE_ERROR = "harness usage error"


def is_usage_error(reason) -> bool:
    """Whether an outcome's (or a record's) reason says the harness refused its command line:
    nothing was measured, so such a record never stands for a measurement."""
    return isinstance(reason, str) and reason.startswith(USAGE_ERROR)


def current_statuses(statuses: pd.Series) -> pd.Series:
    """`statuses` with the names of the vocabulary before STATUS_TABLE (LEGACY_STATUSES:
    `compile_failed`, `invalid`, `runtime_failed`) spelled as today's; the one place an old
    dataset's statuses are read."""
    return statuses.replace(LEGACY_STATUSES)
