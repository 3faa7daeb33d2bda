"""`tilecast fleet` and `tilecast worker`: one night over the machines of a Prefect work pool,
and a worker of such a pool (docs/guide/fleet.md). Added to the parser by tilecast.flows.cli."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from tilecast import cli
from tilecast.cli.extras import require_pipeline
from tilecast.flows.cli import (drain_prefect_workers, positive_minutes, prefect_env,
                                quiet_user_error_tracebacks)


def add_parser(subparsers) -> None:
    """Add `fleet` and `worker`."""
    _add_fleet(subparsers)
    _add_worker(subparsers)


def _add_fleet(subparsers) -> None:
    from tilecast import fleet

    fleets = cli.add_command(
        subparsers, "fleet",
        help="one night over the machines of a Prefect work pool (docs/guide/fleet.md)",
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
    fleets.add_argument("--budget-minutes", type=positive_minutes, default=None,
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


def _add_worker(subparsers) -> None:
    workers = cli.add_command(
        subparsers, "worker",
        help="a Prefect worker of a pool, one run at a time; --cpus: on a slot of this host's "
             "cores (docs/guide/fleet.md)",
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


def _cmd_fleet(args) -> int:
    """`tilecast fleet`: the fleet_night flow run here, against the Prefect server that the
    pool's workers reach (PREFECT_API_URL)."""
    from tilecast import fleet
    from tilecast.workflows import pipeline

    require_pipeline("prefect", "rich", "matplotlib")   # the flows, then the report
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

    quiet_user_error_tracebacks()
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
        drain_prefect_workers()
        raise
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _cmd_worker(args) -> int:
    """`tilecast worker`: this process becomes a Prefect worker of `--pool` taking one run at a
    time; with --cpus, on the first free slot of this host's CPUs (tilecast.fleet.slots)."""
    require_pipeline("prefect", "rich")   # the shard flows it runs
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
