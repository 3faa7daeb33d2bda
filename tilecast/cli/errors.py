"""The errors the command line reports as one line: which classes, and how they print."""
from __future__ import annotations

import sys


class CliError(Exception):
    """A user error found by the command line itself: printed as one line, exit status 2."""


#: The errors a user can cause, as (module, class): the one list the boundary catches.
#: Resolved when an error reaches `main` (user_errors), from the modules loaded by then: an
#: error of a module that was never imported cannot have been raised.
USER_ERRORS = (
    ("tilecast.cli.errors", "CliError"),                # bad arguments and paths
    ("tilecast.config.run", "ConfigError"),            # configs and problem files
    ("tilecast.core.dataset", "DatasetError"),          # raw logs, CSVs, parquet datasets
    ("tilecast.core.family", "FamilyError"),          # kernel names, problems (ProblemError)
    ("tilecast.registry.base", "RegistryError"),        # registries, versions, aliases
    ("tilecast.runtime.dispatch", "NoKernelError"),     # a problem no kernel of a model runs
    ("tilecast.runtime.export", "ExportError"),         # a model version export cannot carry
    ("tilecast.core.artifact", "ModelArtifactError"),   # a model directory a run left
    ("tilecast.workflows.rebench", "RebenchError"),     # rebench inputs and history
    ("tilecast.workflows.user_eval", "EvaluationError"),  # problems with nothing to score
    ("tilecast.table.transfer", "TransferError"),       # cross-hardware evaluation options
    ("tilecast.table.dataset", "TableDataError"),       # imported datasets, device tables
    ("tilecast.store.store", "StoreError"),             # measurement stores
    ("tilecast.workflows.fleet", "FleetError"),         # fleet nights: pools, shards, classes
)


def user_errors() -> tuple[type[BaseException], ...]:
    """The classes of USER_ERRORS whose modules are loaded."""
    return tuple(getattr(sys.modules[module], name) for module, name in USER_ERRORS
                 if module in sys.modules)


def one_line(message: str) -> str:
    """A message on one line: its lines joined (a YAML error's caret line left out)."""
    lines = (line.strip() for line in str(message).splitlines())
    return " ".join(line for line in lines if line and line != "^")
