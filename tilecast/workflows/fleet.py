"""One night over many machines of one hardware class: shards on a work pool.

The parent (`night`) makes tonight's problems as a one-machine night would (the store's plan
on a budgeted night, the config's lists otherwise), cuts them into shards
(tilecast.fleet.shards) and hands each to a `Submitter` (on Prefect: a run of the shard
deployment on the class's work pool). Each machine (`run_shard`) refuses a shard of another
class before measuring, builds (from its cache where it can), measures every candidate on its
problems in one window, and appends to the shared store; its lease (tilecast.fleet.lease)
says it is alive. The parent gives a shard whose machine failed or went silent to another
attempt, and at the night's deadline closes what is left. Then, once for the class, it trains,
evaluates, reports (naming any shard and problem that went unmeasured) and publishes, from
the night's records in the store and the labels pooled over the class's nights.

The parent's state is the store's fleet/<night>/ documents and W/fleet/<family>.json: a
parent killed and started again with the same run id resumes the same night (the same shards,
the same attempts; Prefect's idempotency keys return the flow runs it had created).
"""
from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Mapping, Protocol, Sequence

from tilecast.core.atomic import atomic_write_json, atomic_write_text
from tilecast.config import ConfigError
from tilecast.core.device import default_device, exclusive
from tilecast.families import get_family
from tilecast.fleet import GRACE_S, LEASE_S, POLL_S, RETRIES, SHARD_DEPLOYMENT  # noqa: F401
from tilecast.fleet import lease as leases
from tilecast.fleet.shards import Shard, cut, list_items, plan_items
from tilecast.stages import roofline
from tilecast.stages.convert import write_parquet
from tilecast.store import nights as store_nights
from tilecast.store.store import Store
from tilecast.workflows import pipeline

log = logging.getLogger("tilecast.workflows.fleet")



class FleetError(RuntimeError):
    """A shard or a fleet night that cannot go on, in one line."""


# -- the machine's side ---------------------------------------------------------------------

def code_identity() -> dict:
    """What code this machine runs: tilecast's version and, in a checkout, its commit."""
    from tilecast import __version__
    from tilecast.core.artifact import git_sha

    return {"version": __version__, "git_sha": git_sha()}


def _code_differs(parent: Mapping | None) -> str | None:
    """Why this machine's code is not the parent's (None when it is, or cannot be told)."""
    if not parent:
        return None
    mine = code_identity()
    if parent.get("version") != mine["version"]:
        return f"tilecast {mine['version']} here, {parent.get('version')} in the parent"
    if "unknown" not in (parent.get("git_sha"), mine["git_sha"]) \
            and parent.get("git_sha") != mine["git_sha"]:
        return f"commit {mine['git_sha'][:12]} here, {str(parent.get('git_sha'))[:12]} in the parent"
    return None


def run_shard(config: str, store: str, registry: str, workdir: str, night: str,
              shard: Mapping, hardware_class: str, attempt: int = 1,
              deadline: str | None = None, device: str | None = None,
              code: Mapping | None = None) -> dict:
    """Measure one shard on this machine and append its records to `store` (see the module
    docstring). `deadline`: an ISO time after which no batch starts; `code`: the parent's
    code_identity(), which this machine's must match."""
    piece = Shard.from_json(shard)
    shared = Store(store).require()
    ctx = pipeline.RunContext.create(config, workdir, registry, run_id=night, store=store)
    lease = leases.Lease(shared, leases.night_key(hardware_class, night), piece.name,
                         int(attempt))
    mine = ctx.hardware["hardware_class"]
    differs = _code_differs(code)
    if mine != hardware_class or differs:
        why = (f"is for class {hardware_class}; this machine ({socket.gethostname()}) is {mine}"
               if mine != hardware_class else
               f"was cut by other code: {differs} ({socket.gethostname()})")
        message = f"shard {piece.name} {why}: refused before measuring"
        lease.write("refused", message=message, hardware_class=mine)
        raise FleetError(message)
    why = lease.superseded()
    if why:
        raise FleetError(f"shard {piece.name} attempt {attempt}: {why}")
    family = get_family(piece.family)
    try:
        with lease.beating(hardware_class=mine):
            started = time.monotonic()
            pipeline.build_stage(ctx, piece.family)
            build_s = time.monotonic() - started
            have = set(store_nights.read_frame(shared, mine, piece.family, night)["dims_key"])
            pairs = [(ps, p) for ps, p in piece.pairs(family) if family.dims_key(p) not in have]
            left = (None if deadline is None else
                    (datetime.fromisoformat(deadline) - leases.now()).total_seconds())
            log.info("shard %s attempt %d on %s: %d problems, %d already in the store",
                     piece.name, attempt, socket.gethostname(), len(pairs),
                     len(piece.items) - len(pairs))
            started = time.monotonic()
            bench = (pipeline.bench_stage(ctx, piece.family, device, pairs=pairs, deadline_s=left)
                     if pairs else {"new_records": 0, "past_deadline": 0})
            bench_s = time.monotonic() - started
            why = lease.superseded()
            if why:
                raise FleetError(f"shard {piece.name} attempt {attempt} appends nothing: {why}")
            measured_any = ctx.layout.raw_log(piece.family).is_file() and \
                ctx.layout.raw_log(piece.family).stat().st_size > 0
            # past the deadline before its first batch: nothing to append, and not a failure
            converted = (pipeline.convert_stage(ctx, piece.family) if pairs and measured_any
                         else {"rows": 0, "problems": 0})
            with exclusive(device or default_device()):
                ceilings = roofline.measure_ceilings(ctx.config.protocol.threads,
                                                     int(ctx.hardware.get("l3_bytes") or 0))
    except Exception as err:
        lease.write("failed", message=f"{type(err).__name__}: {err}"[:2000])
        raise
    outcome = {"records": int(converted["rows"]), "problems": int(converted["problems"]),
               "measured": len(pairs) - int(bench.get("past_deadline", 0)),
               "already_stored": len(piece.items) - len(pairs),
               "past_deadline": int(bench.get("past_deadline", 0)),
               "build_s": round(build_s, 1), "bench_s": round(bench_s, 1),
               "profile": ctx.hardware, "ceilings": ceilings}
    lease.write("done", **outcome)
    return {"shard": piece.name, "attempt": int(attempt), "host": socket.gethostname(),
            **{k: v for k, v in outcome.items() if k != "profile"}}


# -- the parent's side ----------------------------------------------------------------------

class Submitter(Protocol):
    """Where shards run: Prefect's work pool (PrefectSubmitter), or anything that can start
    one and say how it is."""

    def submit(self, name: str, key: str, parameters: dict) -> str:
        """Start a run of a shard (`key`: the same key, the same run); its handle."""

    def state(self, handle: str) -> tuple[str, str]:
        """(pending | running | completed | failed, a message)."""

    def cancel(self, handle: str) -> None:
        """Stop the run if it can be stopped."""


@dataclass
class ShardState:
    """The parent's view of one shard."""
    shard: str
    problems: list[str]
    attempt: int = 0
    handle: str | None = None
    state: str = "waiting"      # waiting, running, done, missing
    message: str = ""
    host: str | None = None
    records: int = 0
    past_deadline: int = 0      # problems a done shard left unmeasured at the deadline
    attempts: list[dict] = field(default_factory=list)
    since: str | None = None    # when the current attempt was submitted (ISO)


@dataclass(frozen=True)
class Timing:
    deadline: datetime
    lease_s: float = LEASE_S
    grace_s: float = GRACE_S
    poll_s: float = POLL_S
    retries: int = RETRIES


@dataclass(frozen=True)
class Group:
    """The shards of one hardware class: where their leases live (leases.night_key), who runs
    them (the class's shard deployment) and each attempt's parameters."""
    night: str
    shards: Sequence[Shard]
    submitter: Submitter
    parameters: Callable[[Shard, int], dict]


def supervise(store: Store, night: str, shards: Sequence[Shard], submitter: Submitter,
              parameters: Callable[[Shard, int], dict], timing: Timing,
              clock: Callable[[], datetime] = leases.now,
              sleep: Callable[[float], None] = time.sleep,
              progress: Callable[[str], None] | None = None) -> list[ShardState]:
    """Run every shard of one class to done or missing (see the module docstring)."""
    return supervise_groups(store, [Group(night, shards, submitter, parameters)], timing,
                            clock, sleep, progress)[0]


def supervise_groups(store: Store, groups: Sequence[Group], timing: Timing,
                     clock: Callable[[], datetime] = leases.now,
                     sleep: Callable[[float], None] = time.sleep,
                     progress: Callable[[str], None] | None = None) -> list[list[ShardState]]:
    """Run every shard of every group to done or missing, all at once under one deadline; the
    shards' states, group by group."""
    watched = [(g, _resume(store, g.night, s, clock()), s) for g in groups for s in g.shards]

    def start(group: Group, state: ShardState, shard: Shard, why: str) -> None:
        if state.handle is not None:
            group.submitter.cancel(state.handle)
        if state.attempt > timing.retries:
            state.state, state.message = "missing", f"{why}; no attempts left"
            leases.set_current(store, group.night, state.shard, state.attempt, state.handle,
                               closed=True)
            return
        state.attempt += 1
        state.since = clock().isoformat()
        key = f"{group.night}/{state.shard}/{state.attempt}"
        state.handle = group.submitter.submit(state.shard, key,
                                              group.parameters(shard, state.attempt))
        leases.set_current(store, group.night, state.shard, state.attempt, state.handle)
        state.state, state.message = "running", why
        state.attempts.append({"attempt": state.attempt, "handle": state.handle, "why": why})
        _say(progress, f"fleet {group.night}: {state.shard} attempt {state.attempt} submitted "
                       f"({why})")

    for group, state, shard in watched:
        if state.state == "waiting":
            start(group, state, shard, "first attempt")
    end = timing.deadline + timedelta(seconds=timing.grace_s)
    while True:
        open_ = [w for w in watched if w[1].state == "running"]
        if not open_:
            break
        at = clock()
        for group, state, shard in open_:
            _check(store, group, state, timing, at,
                   lambda why, g=group, st=state, sh=shard: start(g, st, sh, why), progress)
        still = [w for w in watched if w[1].state == "running"]
        if at >= end and still:
            for group, state, _ in still:
                group.submitter.cancel(state.handle)
                leases.set_current(store, group.night, state.shard, state.attempt,
                                   state.handle, closed=True)
                state.state = "missing"
                state.message = (f"still running {timing.grace_s:g} s after the night's "
                                 f"deadline ({timing.deadline.isoformat()}); closed")
                _say(progress, f"fleet {group.night}: {state.shard} missing: {state.message}")
            break
        if still:
            sleep(timing.poll_s)
    return [[state for g, state, _ in watched if g is group] for group in groups]


def _check(store: Store, group: Group, state: ShardState, timing: Timing, at: datetime,
           start: Callable[[str], None], progress) -> None:
    """One look at a running shard: done, still going, or to be given to another attempt.
    The run's state is read before the machine's document: a machine writes "done" before
    its run completes, so a completed run's document is never read stale."""
    run_state, run_message = group.submitter.state(state.handle)
    document = leases.attempt_doc(store, group.night, state.shard, state.attempt)
    if document and document.get("state") == "done":
        state.state, state.host = "done", document.get("host")
        state.records = int(document.get("records", 0))
        state.past_deadline = int(document.get("past_deadline", 0))
        state.message = f"{state.records} records from {state.host}" + (
            f", {state.past_deadline} problems left at the deadline" if state.past_deadline
            else "")
        _say(progress, f"fleet {group.night}: {state.shard} done ({state.message})")
        return
    if document and document.get("state") in ("refused", "failed"):
        start(f"attempt {state.attempt} {document['state']} on {document.get('host')}: "
              f"{document.get('message', '')}")
    elif run_state in ("failed", "completed"):
        start(f"attempt {state.attempt}'s run {run_state} without finishing the shard"
              + (f": {run_message}" if run_message else ""))
    elif run_state == "running" and _silent_s(state, document, at) > timing.lease_s:
        start(f"attempt {state.attempt} silent for more than {timing.lease_s:g} s "
              + (f"(host {document.get('host')})" if document else "(it never wrote its lease)"))
    elif run_state == "pending" and at >= timing.deadline:
        state.state = "missing"
        state.message = "no worker took it before the night's deadline"
        group.submitter.cancel(state.handle)
        leases.set_current(store, group.night, state.shard, state.attempt, state.handle,
                           closed=True)
        _say(progress, f"fleet {group.night}: {state.shard} missing: {state.message}")


def _silent_s(state: ShardState, document: dict | None, at: datetime) -> float:
    """How long a running attempt has said nothing: since its last heartbeat, or, before its
    machine wrote one (a process starting), since it was submitted."""
    if document is not None:
        return leases.age_s(document, at)
    return (at - datetime.fromisoformat(state.since)).total_seconds() if state.since else 0.0


def _resume(store: Store, night: str, shard: Shard, at: datetime) -> ShardState:
    """A shard's state from the store's documents (a restarted parent), or a fresh one."""
    state = ShardState(shard.name, [_key(shard.family, i.values) for i in shard.items],
                       since=at.isoformat())
    word = leases.current(store, night, shard.name)
    if word is None:
        return state
    state.attempt, state.handle = int(word["attempt"]), word.get("flow_run")
    document = leases.attempt_doc(store, night, shard.name, state.attempt)
    if document and document.get("state") == "done":
        state.state, state.host = "done", document.get("host")
        state.records = int(document.get("records", 0))
    elif word.get("closed"):
        state.state, state.message = "missing", "closed by an earlier parent"
    else:
        state.state = "running"
    return state


def _key(family_name: str, values: Mapping) -> str:
    family = get_family(family_name)
    return family.dims_key(family.problem(values))


def _say(progress, line: str) -> None:
    log.info("%s", line)
    if progress:
        progress(line)


# -- the night -------------------------------------------------------------------------------

def class_context(ctx: pipeline.RunContext, hardware_class: str | None,
                  required: bool = True) -> pipeline.RunContext:
    """`ctx` for the fleet's class: this host's profile when it is of that class, else the
    class's profile from the store (its nights write it). Without one, an error when
    `required` (planning and training compute the class's hardware features), else `ctx` with
    only the class named (a night of lists: its shards write the profile)."""
    wanted = hardware_class or ctx.hardware["hardware_class"]
    if wanted == ctx.hardware["hardware_class"]:
        return ctx
    profile = Store(ctx.store).require().profile(wanted)
    if profile is None:
        if not required:
            return replace(ctx, hardware={**ctx.hardware, "hardware_class": wanted})
        raise ConfigError(f"the store {ctx.store} has no profile of class {wanted} (this host "
                          f"is {ctx.hardware['hardware_class']}): run the parent on a machine "
                          "of the class, or one night of the class with this tilecast first")
    return replace(ctx, hardware=profile)


def cut_night(ctx: pipeline.RunContext, name: str, count: int) -> list[Shard]:
    """Tonight's problems of one family in `count` shards, kept in W/fleet/<family>.json so
    that a resumed parent cuts nothing again."""
    path = ctx.workdir / "fleet" / f"{name}.json"
    if path.is_file():
        return [Shard.from_json(s) for s in json.loads(path.read_text())["shards"]]
    family, fc = get_family(name), ctx.config.families[name]
    if pipeline.budgeted_night(ctx):
        kernels = [family.kernel_name(c) for c in pipeline.select_candidates(ctx, name)]
        plan = pipeline.make_plan(ctx, name, kernels)
    else:
        plan = None
    if plan is not None:
        pipeline.night_plan.write(plan, ctx.layout.plan(name))
        items = plan_items(plan)
    else:
        items = list_items(family, pipeline.problems(ctx, name), ctx.config.protocol,
                           min(fc.budget, len(pipeline.select_candidates(ctx, name))))
    shards = cut(name, items, count)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"family": name, "shards": [s.to_json() for s in shards]})
    return shards


def gather(ctx: pipeline.RunContext, name: str) -> int:
    """The night's records of the family, from every shard, as W/data/<family>.parquet."""
    frame = store_nights.read_frame(Store(ctx.store).require(), ctx.hardware["hardware_class"],
                                    name, ctx.run_id)
    if frame.empty:
        raise FleetError(f"no shard of {name} appended any record tonight; nothing to train "
                         "on")
    out = ctx.layout.dataset(name)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_parquet(frame.drop(columns=["hardware_class", "record_id"], errors="ignore"), out)
    return len(frame)


def missing_lines(states: Mapping[str, Sequence[ShardState]]) -> list[str]:
    """What went unmeasured, for report.md."""
    lines = []
    for name, shard_states in states.items():
        for s in shard_states:
            if s.state == "done" and s.past_deadline:
                lines.append(f"{s.shard}: {s.past_deadline} of its {len(s.problems)} problems "
                             "were not started before the night's deadline (the last of its "
                             "order)")
            elif s.state != "done":
                shown = ", ".join(s.problems[:8]) + (" ..." if len(s.problems) > 8 else "")
                lines.append(f"{s.shard}: {s.message}; {len(s.problems)} problems unmeasured "
                             f"tonight ({shown})")
    return lines



@dataclass(frozen=True)
class Pool:
    """One hardware class of a fleet: its shard deployment (on the class's work pool) and its
    machines, as many shards per family."""
    hardware_class: str | None = None     # None: this host's class
    deployment: str = SHARD_DEPLOYMENT
    shards: int = 2

    def __post_init__(self) -> None:
        if int(self.shards) < 1:
            raise ConfigError(f"shards must be at least 1, got {self.shards}")

    @classmethod
    def parse(cls, text: str) -> "Pool":
        """CLASS=DEPLOYMENT[:SHARDS], as `tilecast fleet --pool` reads it."""
        hardware_class, sep, rest = text.partition("=")
        deployment, _, shards = rest.rpartition(":") if ":" in rest else (rest, "", "")
        if not sep or not hardware_class or not deployment or (shards and not shards.isdigit()):
            raise ConfigError(f"pool {text!r}: expected CLASS=DEPLOYMENT[:SHARDS], e.g. "
                              f"amd-epyc-avx2-16c-32t-ab12cd34=tilecast-shard/shard-epyc:4")
        return cls(hardware_class, deployment, int(shards) if shards else 2)


@dataclass(frozen=True)
class FleetSettings:
    """How a parent runs a fleet night."""
    shard_workdir: str = "work/shards"    # on each machine: <this>/<night>/<shard>
    deadline_minutes: float = 720.0       # a night of the config's lists ends after this
    # what a shard takes before it measures (a flow run's process, imports, a cached build):
    # added to a budgeted night's deadline, so that the budget is measuring time
    startup_s: float = 60.0
    lease_s: float = LEASE_S
    grace_s: float = GRACE_S
    poll_s: float = POLL_S
    retries: int = RETRIES

    def __post_init__(self) -> None:
        if not self.deadline_minutes > 0 or not self.lease_s > 0 or int(self.retries) < 0:
            raise ConfigError("deadline_minutes and lease_s must be > 0 and retries >= 0")


def night(config: str, workdir: str, registry: str, store: str, pools: Sequence[Pool],
          submitter: Callable[[str], Submitter], settings: FleetSettings = FleetSettings(),
          budget_minutes: float | None = None, run_id: str | None = None,
          progress: Callable[[str], None] | None = None,
          clock: Callable[[], datetime] = leases.now,
          sleep: Callable[[float], None] = time.sleep) -> dict:
    """One night of every family of `config` over the fleet's pools, one per hardware class
    (see the module docstring); `submitter(deployment)` runs a pool's shards. The summary, by
    class. A budgeted night (a store with night.budget_minutes, or `budget_minutes`) plans
    each pool's machines' worth of its budget and ends at the budget's wall time. A class
    whose night cannot be trained (no shard measured anything) does not stop the others: the
    others publish, then the night fails naming it."""
    if not pools:
        raise ConfigError("a fleet night needs at least one pool")
    host = pipeline.RunContext.create(config, workdir, registry, run_id=run_id, store=store,
                                      budget_minutes=budget_minutes)
    shared = Store(store).create()   # unreachable or unwritable: one line, before any submit
    mine = host.hardware["hardware_class"]
    classes = [p.hardware_class or mine for p in pools]
    if len(set(classes)) < len(classes):
        raise ConfigError(f"a fleet night has one pool per class; classes given: "
                          f"{', '.join(classes)}")
    budgeted = pipeline.budgeted_night(host)
    # one class: the night's workdir; a mixed fleet: a folder of it per class
    homes = {c: host if len(pools) == 1 else pipeline.RunContext.create(
        config, str(host.workdir / c), registry, run_id=host.run_id, store=store,
        budget_minutes=budget_minutes) for c in classes}
    state_path = host.workdir / "fleet" / "night.json"
    if state_path.is_file():    # a restarted parent: the same night, the same deadline
        deadline = datetime.fromisoformat(json.loads(state_path.read_text())["deadline"])
    else:
        deadline = clock() + (
            timedelta(minutes=host.config.night.budget_minutes, seconds=settings.startup_s)
            if budgeted else timedelta(minutes=settings.deadline_minutes))
        state_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(state_path, {"run_id": host.run_id, "deadline": deadline.isoformat(),
                                       "pools": [{**asdict(p), "hardware_class": c}
                                                 for p, c in zip(pools, classes)]})
    code = code_identity()
    groups, cuts = [], {}
    for pool, hardware_class in zip(pools, classes):
        ctx = class_context(homes[hardware_class], hardware_class, required=budgeted)
        if budgeted:   # plan every machine's share of the budget
            ctx = replace(ctx, config=replace(ctx.config, night=replace(
                ctx.config.night, budget_minutes=ctx.config.night.budget_minutes * pool.shards)))
        cuts[hardware_class] = {name: cut_night(ctx, name, pool.shards)
                                for name in ctx.config.families}
        every = [s for name in cuts[hardware_class] for s in cuts[hardware_class][name]]
        _say(progress, f"fleet {host.run_id}: class {hardware_class}, {len(every)} shard(s) of "
                       f"{sum(len(s.items) for s in every)} problems on {pool.deployment}, "
                       f"deadline {deadline.isoformat()}")

        def parameters(shard: Shard, attempt: int, hardware_class=hardware_class) -> dict:
            return {"config": config, "store": store, "registry": str(registry),
                    "workdir": f"{settings.shard_workdir}/{host.run_id}/{shard.name}",
                    "night": host.run_id, "shard": shard.to_json(),
                    "hardware_class": hardware_class, "attempt": attempt,
                    "deadline": deadline.isoformat(), "code": code}

        groups.append(Group(leases.night_key(hardware_class, host.run_id), every,
                            submitter(pool.deployment), parameters))

    timing = Timing(deadline, settings.lease_s, settings.grace_s, settings.poll_s,
                    settings.retries)
    watched = supervise_groups(shared, groups, timing, clock=clock, sleep=sleep,
                               progress=progress)
    summaries, failed = {}, {}
    for hardware_class, states in zip(classes, watched):
        try:
            summaries[hardware_class] = _train_class(homes[hardware_class], hardware_class,
                                                     cuts[hardware_class], states, shared,
                                                     progress)
        except (FleetError, ConfigError) as err:
            failed[hardware_class] = str(err)
            _say(progress, f"fleet {host.run_id}: class {hardware_class} not trained: {err}")
    summary = {"run_id": host.run_id, "deadline": deadline.isoformat(), "classes": summaries,
               "failed": failed}
    atomic_write_text(host.workdir / "fleet" / "summary.json",
                      json.dumps(summary, indent=2, default=str) + "\n")
    if failed:
        raise FleetError(f"fleet night {host.run_id}: " + "; ".join(
            f"class {c}: {why}" for c, why in failed.items()))
    return summary


def _train_class(home: pipeline.RunContext, hardware_class: str,
                 cuts: Mapping[str, Sequence[Shard]], states: Sequence[ShardState],
                 shared: Store, progress) -> dict:
    """After the shards: one class's records gathered, trained, evaluated, reported (with
    what went unmeasured) and published, in the class's workdir."""
    by_family = {name: [s for s in states if s.shard.startswith(f"{name}-")] for name in cuts}
    for name, shard_states in by_family.items():
        atomic_write_json(home.workdir / "fleet" / f"{name}.states.json",
                          {"shards": [asdict(s) for s in shard_states],
                           "missing": missing_lines({name: shard_states})})
    ceilings = _ceilings(shared, leases.night_key(hardware_class, home.run_id), states)
    ctx = class_context(home, hardware_class)     # the profile the shards kept, for features
    families = {}
    for name in ctx.config.families:
        records = gather(ctx, name)
        families[name] = {"shards": [{k: getattr(s, k) for k in
                                      ("shard", "state", "attempt", "host", "records", "message")}
                                     for s in by_family[name]],
                          "records": records,
                          "train": pipeline.train_stage(ctx, name),
                          "evaluate": pipeline.evaluate_stage(ctx, name)}
    report = pipeline.report_stage(ctx, ceilings=ceilings)
    published = {name: pipeline.publish_stage(ctx, name) for name in ctx.config.families}
    missing = missing_lines(by_family)
    for line in missing:
        _say(progress, f"fleet {ctx.run_id}: {hardware_class} unmeasured: {line}")
    return {"workdir": str(ctx.workdir), "families": families, "report": report,
            "published": published, "missing": missing}


def _ceilings(store: Store, night: str, states: Sequence[ShardState]) -> dict | None:
    """The ceilings a finished shard measured on its machine (None: no shard finished)."""
    for state in states:
        if state.state == "done":
            document = leases.attempt_doc(store, night, state.shard, state.attempt)
            if document and document.get("ceilings"):
                return document["ceilings"]
    return None
