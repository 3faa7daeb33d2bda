"""What a command needs beyond the slim install. `pip install tilecast` serves (dispatcher,
`select`, `export`, the torch ops) without Prefect, Dask or matplotlib; the DAG's commands
(`run`, `fleet`, `worker`) need the `pipeline` extra, and say so in one line before any work
starts rather than failing with a traceback halfway through a run."""
from __future__ import annotations

import importlib.util

from tilecast.cli.errors import CliError

#: The `pipeline` extra of pyproject.toml: module -> the distribution that installs it
#: (tests/test_packaging.py checks that the two name the same distributions).
PIPELINE_MODULES = {
    "prefect": "prefect",            # the flows, tasks and their server
    "prefect_dask": "prefect-dask",  # `run --task-runner dask`
    "rich": "rich",                  # the tasks' progress bar
    "matplotlib": "matplotlib",      # the report's plots
}

PIPELINE_INSTALL = "pip install 'tilecast[pipeline]'"


def missing(*modules: str) -> list[str]:
    """The distributions of `modules` (keys of PIPELINE_MODULES) that are not installed."""
    unknown = [m for m in modules if m not in PIPELINE_MODULES]
    if unknown:
        raise ValueError(f"unknown pipeline modules {unknown}; valid: {sorted(PIPELINE_MODULES)}")
    return [PIPELINE_MODULES[m] for m in modules if importlib.util.find_spec(m) is None]


def require_pipeline(*modules: str) -> None:
    """Raise CliError when any of `modules` is not installed (the command line prefixes the
    command's name): the command needs the extra."""
    absent = missing(*modules)
    if absent:
        raise CliError(f"needs the pipeline extra, not installed here (missing: "
                       f"{', '.join(absent)}): {PIPELINE_INSTALL}")
