"""Time-to-ready of `tilecast run`'s embedded Prefect server (tilecast.flows.embedded_server):
from the launch to the first answer of /api/health, each run with a fresh PREFECT_HOME copied
from the migrated template database and the idle services off, as `tilecast run` starts it.

    .venv/bin/python benchmarks/embedded_server_ready.py --runs 5
    git show REV:flows/embedded_server.py > /tmp/old_server.py
    .venv/bin/python benchmarks/embedded_server_ready.py --runs 5 --baseline /tmp/old_server.py

`--baseline` times another version of the module too, alternating with the current one (the
order flips every run, so a drift of the machine favours neither); prints every run and the
medians.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tilecast.flows import cli as flows_cli  # noqa: E402
from tilecast.flows import embedded_server  # noqa: E402


def load_module(path: Path):
    """An embedded_server.py from elsewhere (e.g. an earlier commit's) as a module."""
    spec = importlib.util.spec_from_file_location(f"embedded_server_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_to_ready(module, template: Path | None) -> float:
    """Seconds from EmbeddedServer() to its wait_ready() returning, in a fresh PREFECT_HOME."""
    home = Path(tempfile.mkdtemp(prefix="tilecast-server-ready-"))
    try:
        if template is not None:
            shutil.copy(template, home / "prefect.db")
        os.environ["PREFECT_HOME"] = str(home)
        started = time.perf_counter()
        server = module.EmbeddedServer(home / "server.log")
        try:
            server.wait_ready()
            return time.perf_counter() - started
        finally:
            server.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another embedded_server.py to time, alternating with this one")
    args = parser.parse_args()
    os.environ.pop("PREFECT_API_URL", None)
    os.environ.update({"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    for service in flows_cli.EPHEMERAL_IDLE_SERVICES:
        os.environ[f"PREFECT_SERVER_SERVICES_{service}_ENABLED"] = "false"
    template = flows_cli._template_database()
    variants = {"current": embedded_server}
    if args.baseline is not None:
        variants["baseline"] = load_module(args.baseline)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(args.runs):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        for name in order:
            seconds[name].append(time_to_ready(variants[name], template))
            print(f"run {index + 1} {name}: ready in {seconds[name][-1]:.2f} s", flush=True)
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.2f} s over {len(values)} runs "
              f"(min {min(values):.2f}, max {max(values):.2f})")


if __name__ == "__main__":
    main()
