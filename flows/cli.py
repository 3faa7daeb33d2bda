"""The `tilecast` console script: the library's subcommands plus `run` (the Prefect flow), and
`fleet` and `worker` (tilecast.flows.cli_fleet)."""
from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from tilecast import cli
from tilecast.cli.extras import require_pipeline
from tilecast.core.atomic import atomic_write_bytes
from tilecast.core.settings import EMBEDDED_SERVER_ENV, settings
from tilecast.flows.embedded_server import EmbeddedServer
from tilecast.stages import layout


def _template_database() -> Path | None:
    """A migrated, empty Prefect database for this Prefect version, made once per machine in
    tilecast's cache: a new workdir starts from a copy instead of migrating a new database
    (about 7 s of every cold run on 2 cores). None when it cannot be made (then Prefect
    migrates as usual)."""
    directory = settings().cache_root / "prefect-db" / version("prefect")
    template = directory / "prefect.db"
    if template.exists():
        return template
    scratch = directory / f"home-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PREFECT_HOME": str(scratch), "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
    try:
        proc = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade",
                               "-y"], env=env, capture_output=True, text=True)
        made = scratch / "prefect.db"
        if proc.returncode != 0 or not made.exists():
            return None
        with sqlite3.connect(made) as db:  # everything in the main file, no -wal beside it
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            db.execute("PRAGMA journal_mode=DELETE")
        atomic_write_bytes(template, made.read_bytes())
        return template
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


#: server services an embedded server (one run, one process, gone after it) never needs:
#: schedules, late and paused runs, worker health, cancellations, automations, the debug event
#: logger, and the expired-lease and worker-cleanup loops (Prefect's ephemeral mode leaves
#: those two out; `prefect server start` would run them). Left running they wake every few
#: seconds on the cores the benchmarks measure on. The event persister and the task-run
#: recorder stay: task runs and states need them.
EPHEMERAL_IDLE_SERVICES = ("SCHEDULER", "LATE_RUNS", "FOREMAN", "CANCELLATION_CLEANUP",
                           "PAUSE_EXPIRATIONS", "TRIGGERS", "EVENT_LOGGER", "REPOSSESSOR",
                           "CLEANUP_RECONCILER")


def prefect_env(workdir: Path, *, database: bool = True) -> None:
    """Offline Prefect: state inside the workdir, no telemetry; set before prefect is imported.
    An embedded server runs without the services it never needs (EPHEMERAL_IDLE_SERVICES).
    `database`: also give a new workdir its database (prefect_database) now."""
    home = layout.Workdir(workdir).prefect_home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "tilecast")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
    if "PREFECT_API_URL" not in os.environ:
        for service in EPHEMERAL_IDLE_SERVICES:
            os.environ.setdefault(f"PREFECT_SERVER_SERVICES_{service}_ENABLED", "false")
    if database:
        prefect_database(workdir)


def prefect_database(workdir: Path) -> None:
    """A new workdir's database starts as a copy of the migrated template (_template_database:
    made the first time on a machine, about 7 s), where this process's Prefect home is the
    workdir's (prefect_env) and it has none yet; a server at PREFECT_API_URL, or a
    PREFECT_HOME of the user's own, is left alone."""
    home = layout.Workdir(workdir).prefect_home.resolve()
    if ("PREFECT_API_URL" in os.environ or os.environ.get("PREFECT_HOME") != str(home)
            or (home / "prefect.db").exists()):
        return
    template = _template_database()
    if template is not None:
        atomic_write_bytes(home / "prefect.db", template.read_bytes())


class _UserErrorTracebacks(logging.Filter):
    """Drops the traceback Prefect's engines attach to the log line of a task or flow that
    failed with a user error (cli.USER_ERRORS): the command line prints that error as its
    one last line. A bug keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and isinstance(error, cli.user_errors()):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_user_error_tracebacks() -> None:
    """Put _UserErrorTracebacks on every handler of the root and Prefect loggers (a record
    reaches the console through the root's; Prefect configures them when imported)."""
    quiet = _UserErrorTracebacks()
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in
                                       list(logging.Logger.manager.loggerDict)
                                       if name.split(".")[0] == "prefect"]
    for logger in loggers:
        for handler in logger.handlers:
            handler.addFilter(quiet)


def _cmd_run(args) -> int:
    """`tilecast run`: the whole DAG, as a Prefect flow or (--plain) as library calls."""
    from tilecast.workflows import pipeline

    _require_pipeline(args)
    if args.dask_address:
        raise cli.CliError("--dask-address is retired: a remote Dask cluster's workers would "
                           "measure their own hardware under this machine's paths. One night "
                           "over many machines is `tilecast fleet` (docs/guide/fleet.md)")
    cli.config_arg(args.config)
    if args.workdir is None:
        args.workdir = cli.default_workdir(args.config)
    workdir = cli.user_dir(pipeline.expand_workdir(args.workdir), "workdir", writable=True)
    cli.registry_root(args.registry, must_exist=False)
    if args.store:
        from tilecast.store.store import Store
        Store(args.store).create()   # unreachable or unwritable: one line, before any build
    summary = _run_plain(args, workdir) if args.plain else _run_flow(args, workdir)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _require_pipeline(args) -> None:
    """The pipeline extra's modules this run imports: the report's plots always, Prefect and
    the progress bar under the flow, prefect-dask for its Dask runner."""
    modules = ["matplotlib"]
    if not args.plain:
        modules += ["prefect", "rich"]
        if args.task_runner == "dask":
            modules.append("prefect_dask")
    require_pipeline(*modules)


def _run_plain(args, workdir: Path) -> dict:
    """The stages as plain library calls: one run per thread count of the config, in turn."""
    from tilecast.workflows import pipeline

    counts = pipeline.thread_counts(args.config)
    runs = {}
    for threads in counts:
        ctx = pipeline.RunContext.create(args.config, workdir, args.registry,
                                         run_id=args.run_id, store=args.store,
                                         budget_minutes=args.budget_minutes, threads=threads)
        args.run_id = ctx.run_id
        runs[threads] = pipeline.run_all(ctx, device=args.device)
    return runs[counts[0]] if len(counts) == 1 else {"run_id": ctx.run_id, "threads": runs}


def _run_flow(args, workdir: Path) -> dict:
    """The nightly flow under Prefect, on an embedded server unless PREFECT_API_URL names one."""
    from tilecast.config import load_config

    prefect_env(workdir, database=False)   # the settings, before any thread starts compiling
    load_config(args.config)  # a bad config fails here, with its message, before Prefect starts
    if args.task_runner != "dask":   # the stages run in this process: compile while it starts
        _start_early_build(args)
    prefect_database(workdir)   # the first run on a machine migrates one: beside the compiles
    server = None
    if "PREFECT_API_URL" not in os.environ:
        # boots while this process imports Prefect and the flows (see embedded_server.py);
        # stopped at exit, after the exit handlers Prefect registers later (they run
        # first) have sent the run's last logs and events to it
        server = EmbeddedServer(layout.Workdir(workdir).prefect_home / "server.log")
        atexit.register(server.stop)
        os.environ["PREFECT_API_URL"] = server.api_url
        os.environ[EMBEDDED_SERVER_ENV] = "1"
    # Prefect reads its settings when first imported: only after prefect_env set them
    from tilecast.flows.nightly import nightly
    from tilecast.tasks import orchestration

    quiet_user_error_tracebacks()
    runner = orchestration.task_runner(args.task_runner, workers=args.dask_workers)
    if server is not None:
        server.wait_ready()
    try:
        return nightly.with_options(task_runner=runner)(
            config=args.config, workdir=args.workdir, registry=args.registry,
            run_id=args.run_id, device=args.device, store=args.store,
            budget_minutes=args.budget_minutes)
    except cli.user_errors():
        drain_prefect_workers()
        raise


def _start_early_build(args) -> None:
    """Compile the run's candidates while the server boots and Prefect imports
    (tilecast.workflows.pipeline.EarlyBuild): the first thread count's, as its build stage
    would, into the same cache."""
    from tilecast.workflows import pipeline

    ctx = pipeline.RunContext.create(args.config, args.workdir, args.registry,
                                     run_id=args.run_id, store=args.store)
    pipeline.start_early_build(ctx)


def drain_prefect_workers(timeout_s: float = 10.0) -> None:
    """Send the failed run's last events and logs now, so that the error line `main` prints
    is the last line on the console (drained at exit instead, they print progress after it)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)


def positive_minutes(text: str) -> float:
    """An argparse type: a number of minutes > 0 (not inf, not NaN)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected minutes > 0, got {text!r}")
    return value


def _add_run(subparsers) -> None:
    run = cli.add_command(subparsers, "run",
                          help="run the whole DAG (build .. publish) as a Prefect flow")
    run.add_argument("--config", default="quick",
                     help="a YAML file, or the name of a shipped config (quick, tiny, ...)")
    run.add_argument("--workdir", default=None,
                     help="default: work/<the config's name> (work/nightly for --config "
                          "nightly, work/mine for --config path/mine.yaml); {date} becomes "
                          "today's UTC date")
    run.add_argument("--registry", default="registry")
    run.add_argument("--store", default=None,
                     help="a measurement store (directory or s3:// prefix): the night's records "
                          "are added to it and the models train on the labels pooled over "
                          "its nights of this machine's hardware class (default: none)")
    run.add_argument("--run-id", default=None,
                     help="resume this run id (Prefect task cache); default: a new id")
    run.add_argument("--budget-minutes", type=positive_minutes, default=None,
                     help="with --store: tonight's measuring time; the night measures what its "
                          "plan chooses (labels to settle, drift sentinels, new shapes where the "
                          "model is least sure) rather than the config's lists (default: the "
                          "config's night.budget_minutes)")
    run.add_argument("--plain", action="store_true",
                     help="call the stages as plain library functions, without Prefect")
    run.add_argument("--task-runner", choices=("threads", "dask"), default="threads",
                     help="where the flow's tasks run: a thread pool (default) or Dask")
    run.add_argument("--dask-workers", type=int, default=None,
                     help="worker processes of the local Dask cluster (default 2)")
    run.add_argument("--dask-address", default=None, help=argparse.SUPPRESS)   # retired
    run.add_argument("--device", default=None,
                     help="the benchmark device's name; its tag `device:NAME` allows one "
                          "benchmark at a time (default: cpu@<this host>)")
    run.set_defaults(func=_cmd_run)


def build_parser() -> argparse.ArgumentParser:
    """The console script's parser: the library's commands, `run`, `fleet` and `worker`."""
    from tilecast.flows import cli_fleet

    parser = cli.build_parser()
    commands = cli.subparsers(parser)
    _add_run(commands)
    cli_fleet.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `tilecast` console script: one command, behind tilecast.cli's error boundary."""
    return cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
