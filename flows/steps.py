"""The pull step of tilecast's deployments (prefect.yaml `pull:`), run on the worker's machine
before a flow run loads its flow.

The flows are module entrypoints: a worker runs the tilecast installed in its own environment
(a wheel, or an editable checkout), so no code travels and no path of the machine that ran
`prefect deploy` has to exist on a worker. What the step gives every machine is a place to
work: its tilecast home, where a deployment's relative workdir, store and registry land.
"""
from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "TILECAST_HOME"
DEFAULT_HOME = "~/tilecast"


def enter_home(env: str = HOME_ENV, default: str = DEFAULT_HOME) -> dict[str, str]:
    """This machine's tilecast home ($TILECAST_HOME, else ~/tilecast), made if missing;
    Prefect runs the flow there (it changes to the `directory` a pull step returns)."""
    home = Path(os.environ.get(env) or default).expanduser().resolve()
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RuntimeError(f"tilecast home {home} (${env}) cannot be made on this worker: "
                           f"{err.strerror or err}") from None
    if not os.access(home, os.W_OK | os.X_OK):
        raise RuntimeError(f"tilecast home {home} (${env}) is not writable on this worker: "
                           f"set {env} to a directory the worker's user may write")
    return {"directory": str(home)}
