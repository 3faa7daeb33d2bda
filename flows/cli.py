"""The `tilecast` console script: the library's subcommands plus `run` (the Prefect flow)."""
from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from tilecast import cli
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


def prefect_env(workdir: Path) -> None:
    """Offline Prefect: state inside the workdir, no telemetry; set before prefect is imported.
    A new workdir's database starts as a copy of the migrated template (_template_database);
    an embedded server runs without the services it never needs (EPHEMERAL_IDLE_SERVICES)."""
    home = layout.Workdir(workdir).prefect_home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    if "PREFECT_API_URL" not in os.environ and "PREFECT_HOME" not in os.environ \
            and not (home / "prefect.db").exists():
        template = _template_database()
        if template is not None:
            atomic_write_bytes(home / "prefect.db", template.read_bytes())
    os.environ.setdefault("PREFECT_HOME", str(home))
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "tilecast")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_RESULTS_PERSIST_BY_DEFAULT", "true")
    if "PREFECT_API_URL" not in os.environ:
        for service in EPHEMERAL_IDLE_SERVICES:
            os.environ.setdefault(f"PREFECT_SERVER_SERVICES_{service}_ENABLED", "false")


class _UserErrorTracebacks(logging.Filter):
    """Drops the traceback Prefect's engines attach to the log line of a task or flow that
    failed with a user error (cli.USER_ERRORS): the command line prints that error as its
    one last line. A bug keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and isinstance(error, cli.user_errors()):
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_user_error_tracebacks() -> None:
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
    from tilecast.core.config import load_config
    from tilecast.workflows import pipeline

    if args.dask_address:
        raise cli.CliError("--dask-address is retired: a remote Dask cluster's workers would "
                           "measure their own hardware under this machine's paths. One night "
                           "over many machines is `tilecast fleet` (docs/guide/fleet.md)")
    cli.config_arg(args.config)
    workdir = cli.user_dir(pipeline.expand_workdir(args.workdir), "workdir", writable=True)
    cli.registry_root(args.registry, must_exist=False)
    if args.store:
        from tilecast.store.store import Store
        Store(args.store).create()   # unreachable or unwritable: one line, before any build
    if args.plain:
        counts = pipeline.thread_counts(args.config)
        runs = {}
        for threads in counts:   # a config of several thread counts: one run each, in turn
            ctx = pipeline.RunContext.create(args.config, workdir, args.registry,
                                             run_id=args.run_id, store=args.store,
                                             budget_minutes=args.budget_minutes, threads=threads)
            args.run_id = ctx.run_id
            runs[threads] = pipeline.run_all(ctx, device=args.device)
        summary = (runs[counts[0]] if len(counts) == 1 else
                   {"run_id": ctx.run_id, "threads": runs})
    else:
        prefect_env(workdir)
        load_config(args.config)  # a bad config fails here, with its message, before Prefect starts
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

        _quiet_user_error_tracebacks()
        runner = orchestration.task_runner(args.task_runner, workers=args.dask_workers)
        if server is not None:
            server.wait_ready()
        try:
            summary = nightly.with_options(task_runner=runner)(
                config=args.config, workdir=args.workdir, registry=args.registry,
                run_id=args.run_id, device=args.device, store=args.store,
                budget_minutes=args.budget_minutes)
        except cli.user_errors():
            _drain_prefect_workers()
            raise
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _cmd_fleet(args) -> int:
    """`tilecast fleet`: the fleet_night flow run here, against the Prefect server that the
    pool's workers reach (PREFECT_API_URL)."""
    from tilecast import fleet
    from tilecast.workflows import pipeline

    if not os.environ.get("PREFECT_API_URL"):
        raise cli.CliError("a fleet night needs the Prefect server its workers reach: set "
                           "PREFECT_API_URL (docs/guide/fleet.md)")
    cli.config_arg(args.config)
    workdir = cli.user_dir(pipeline.expand_workdir(args.workdir), "workdir", writable=True)
    cli.registry_root(args.registry, must_exist=False)
    from dataclasses import asdict

    from tilecast.workflows.fleet import Pool

    if args.pool and (args.hardware_class or args.shards != 2
                      or args.deployment != fleet.SHARD_DEPLOYMENT):
        raise cli.CliError("--pool names each class's deployment and machines: give it "
                           "instead of --shards, --hardware-class and --deployment")
    pools = [asdict(Pool.parse(text)) for text in args.pool] or None
    prefect_env(workdir)
    from tilecast.flows.fleet import fleet_night

    _quiet_user_error_tracebacks()
    try:
        summary = fleet_night(config=args.config, workdir=args.workdir, registry=args.registry,
                              store=args.store, shards=args.shards,
                              budget_minutes=args.budget_minutes,
                              hardware_class=args.hardware_class, run_id=args.run_id,
                              deployment=args.deployment, pools=pools,
                              shard_workdir=args.shard_workdir,
                              lease_s=args.lease_s, retries=args.retries, grace_s=args.grace_s,
                              poll_s=args.poll_s)
    except cli.user_errors():
        _drain_prefect_workers()
        raise
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _cmd_worker(args) -> int:
    """`tilecast worker`: this process becomes a Prefect worker of `--pool` taking one run at a
    time; with --cpus, on the first free slot of this host's CPUs (tilecast.fleet.slots)."""
    if not os.environ.get("PREFECT_API_URL"):
        raise cli.CliError("a worker needs the Prefect server of its pool: set PREFECT_API_URL")
    env = dict(os.environ)
    host = args.host or os.environ.get("TILECAST_HOST") or socket.gethostname()
    name = args.name or host
    if args.cpus is not None:
        from tilecast.core.device import lock_dir
        from tilecast.fleet import slots

        folder = Path(args.slots) if args.slots else lock_dir() / "slots"
        try:
            slot = slots.claim(folder, args.cpus)
        except slots.SlotError as err:
            raise cli.CliError(str(err)) from None
        env.update(slots.enter(slot, host))
        name = args.name or f"{host}-slot{slot.index}"
        print(f"tilecast worker {name}: slot {slot.index} of {folder}, CPUs "
              f"{','.join(map(str, slot.cpus))}, device {env['TILECAST_DEVICE']}", flush=True)
    command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", args.pool,
               "--limit", "1", "--name", name,
               *[a for a in args.prefect_args if a != "--"]]
    os.execvpe(command[0], command, env)
    return 0   # not reached: exec replaced this process


def _drain_prefect_workers(timeout_s: float = 10.0) -> None:
    """Send the failed run's last events and logs now, so that the error line `main` prints
    is the last line on the console (drained at exit instead, they print progress after it)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout_s)


def _positive_minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected minutes > 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    run = sub.add_parser("run", help="run the whole DAG (build .. publish) as a Prefect flow")
    run.add_argument("--config", default="quick",
                     help="a YAML file, or the name of a shipped config (quick, tiny, ...)")
    run.add_argument("--workdir", default="work/quick")
    run.add_argument("--registry", default="registry")
    run.add_argument("--store", default=None,
                     help="a measurement store (directory or s3:// prefix): the night's records "
                          "are added to it and the models train on the labels pooled over "
                          "its nights of this machine's hardware class (default: none)")
    run.add_argument("--run-id", default=None,
                     help="resume this run id (Prefect task cache); default: a new id")
    run.add_argument("--budget-minutes", type=_positive_minutes, default=None,
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

    from tilecast import fleet
    fleets = sub.add_parser(
        "fleet", help="one night over the machines of a Prefect work pool (docs/guide/fleet.md)",
        description="Cut tonight's problems into shards, run each as a flow run of the shard "
                    "deployment on its pool's workers, wait (a failed or silent shard goes to "
                    "another worker), then train, evaluate, report and publish once. Needs "
                    "PREFECT_API_URL: the server the workers reach.")
    fleets.add_argument("--config", default="nightly")
    fleets.add_argument("--workdir", default="work/fleet-{date}")
    fleets.add_argument("--registry", default="registry")
    fleets.add_argument("--store", required=True,
                        help="the store every machine appends to (a shared path or s3://)")
    fleets.add_argument("--shards", type=int, default=2, help="shards per family (default 2)")
    fleets.add_argument("--budget-minutes", type=_positive_minutes, default=None,
                        help="the night's wall time; it plans shards x this of measuring")
    fleets.add_argument("--hardware-class", default=None,
                        help="the pool's class, when this machine is not of it")
    fleets.add_argument("--run-id", default=None, help="resume this night")
    fleets.add_argument("--deployment", default=fleet.SHARD_DEPLOYMENT)
    fleets.add_argument("--pool", action="append", default=[], metavar="CLASS=DEPLOYMENT[:N]",
                        help="a mixed fleet: one per hardware class, its shard deployment and "
                             "N machines (default 2); replaces --shards, --hardware-class "
                             "and --deployment")
    fleets.add_argument("--shard-workdir", default="work/shards",
                        help="each machine's workdirs: <this>/<night>/<shard>")
    fleets.add_argument("--lease-s", type=float, default=fleet.LEASE_S,
                        help="a running shard silent this long is given to another worker")
    fleets.add_argument("--retries", type=int, default=fleet.RETRIES)
    fleets.add_argument("--grace-s", type=float, default=fleet.GRACE_S,
                        help="how long shards may run past the night's deadline")
    fleets.add_argument("--poll-s", type=float, default=fleet.POLL_S)
    fleets.set_defaults(func=_cmd_fleet)

    workers = sub.add_parser(
        "worker", help="a Prefect worker of a pool, one run at a time; --cpus: on a slot of "
                       "this host's cores (docs/guide/fleet.md)",
        description="Become `prefect worker start --pool POOL --limit 1`. With --cpus N, first "
                    "claim the first free slot of N of this host's cores (held while the "
                    "worker lives), pin to them and measure as device cpu@HOST:CPUS, so that "
                    "several workers of one host measure at once without sharing a core.")
    workers.add_argument("--pool", required=True)
    workers.add_argument("--cpus", type=int, default=None,
                         help="cores per worker (default: the whole machine, no slot)")
    workers.add_argument("--slots", default=None,
                         help="this host's slots directory, shared by its workers (default: "
                              "slots/ beside the device locks, $TILECAST_LOCKS)")
    workers.add_argument("--host", default=None,
                         help="the machine's name in device names (default $TILECAST_HOST, "
                              "else the hostname)")
    workers.add_argument("--name", default=None, help="the worker's name (default from host)")
    workers.add_argument("prefect_args", nargs=argparse.REMAINDER,
                         help="after --: more arguments of `prefect worker start`")
    workers.set_defaults(func=_cmd_worker)
    return cli.main(argv, parser)


if __name__ == "__main__":
    sys.exit(main())
