"""The stages of one run as plain functions over a workdir: what the Prefect tasks wrap, and
what `tilecast run --plain` calls directly. Each stage reads its inputs from files the
previous stage wrote, so any stage can be re-run (or resumed) alone; where each file lives
is tilecast.stages.layout's (build events, raw records, dataset, model, evaluation, report).
"""
from __future__ import annotations

import json
import logging
import threading
import uuid
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pandas as pd

from tilecast.core import dataset, hardware, tune
from tilecast.core.atomic import atomic_write_json
from tilecast.config import PROBLEM_SETS, ConfigError, RunConfig, load_config
from tilecast.core.device import default_device, exclusive
from tilecast.core.settings import settings
from tilecast.families import get_family
from tilecast.registry import api as registry
from tilecast.registry import classes as registry_classes
from tilecast.runtime import gate as promotion
from tilecast.runtime import prebuild
from tilecast.registry.api import normalize_root
from tilecast.core import build
from tilecast.stages import layout, roofline
from tilecast.stages.bench import BenchSettings, benchmark, in_process_libraries
from tilecast.measurement.interleave import supports as interleave_supported
from tilecast.stages.convert import convert_raw
from tilecast.stages.evaluate import (Evaluation, evaluate, peer_ratios, shortlist_metrics,
                                      slice_metrics, static_best)
from tilecast.stages.report import write_report
from tilecast.core.artifact import git_sha
from tilecast.stages.train import ModelSpec, check_warm_start, load_predictor, train_model
from tilecast.store import labels as pooled_labels
from tilecast.store import nights as store_nights
from tilecast.store import plan as night_plan
from tilecast.store.drift import change_points
from tilecast.store.nights import write_hardware
from tilecast.store.store import Store
from tilecast.workflows.repeatability import run_noise

log = logging.getLogger("tilecast.workflows.pipeline")


def expand_workdir(workdir: str | Path, now: datetime | None = None) -> str:
    """`{date}` in a workdir becomes today's UTC date: one fresh workdir per night from a
    deployment's fixed parameter, shared by a re-run on the same day, which then resumes."""
    now = now or datetime.now(timezone.utc)
    return str(workdir).replace("{date}", now.strftime("%Y-%m-%d"))


def thread_workdir(workdir: str | Path, counts: Sequence[int], threads: int) -> str:
    """A run's workdir for one of its thread counts: itself for a single count, else
    W/threads-<count>."""
    return str(workdir) if len(counts) <= 1 else str(Path(workdir) / f"threads-{threads}")


def thread_counts(config: str | Path) -> tuple[int, ...]:
    """The thread counts a config measures with, in its order."""
    cfg = load_config(config)
    return cfg.thread_counts or (cfg.protocol.threads,)


@dataclass(frozen=True)
class RunContext:
    """Everything a stage needs: the config, where to read and write, who is running."""
    config: RunConfig
    workdir: Path
    registry: Path | str     # a local path, or an fsspec URL (tilecast.registry.api)
    run_id: str
    hardware: dict
    git_sha: str
    store: str | None = None   # the measurement store (tilecast.store): a path or fsspec URL

    @classmethod
    def create(cls, config: str | Path, workdir: str | Path, registry: str | Path,
               run_id: str | None = None, store: str | Path | None = None,
               budget_minutes: float | None = None, threads: int | None = None
               ) -> "RunContext":
        """`budget_minutes` overrides the config's night.budget_minutes (a budgeted night
        with a store: tilecast.store.plan). `threads`: one of the config's thread counts
        (default its first); a config with several measures each in its own workdir,
        W/threads-<count> (`thread_workdir`), as its own hardware class."""
        cfg = load_config(config)
        counts = cfg.thread_counts or (cfg.protocol.threads,)
        threads = counts[0] if threads is None else int(threads)
        if threads not in counts:
            raise ConfigError(f"{cfg.path}: measures with {', '.join(map(str, counts))} "
                              f"thread(s), not {threads}")
        cfg = replace(cfg, protocol=replace(cfg.protocol, threads=threads))
        if budget_minutes is not None:
            if not (budget_minutes > 0):
                raise ConfigError(f"budget_minutes must be > 0, got {budget_minutes!r}")
            cfg = replace(cfg, night=replace(cfg.night, budget_minutes=float(budget_minutes)))
        now = datetime.now(timezone.utc)
        run_id = run_id or now.strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
        workdir = thread_workdir(expand_workdir(workdir, now), counts, threads)
        return cls(config=cfg, workdir=Path(workdir).resolve(), registry=normalize_root(registry),
                   run_id=run_id, hardware=hardware.profile(cfg.protocol.threads),
                   git_sha=git_sha(), store=None if store in (None, "") else str(store))

    def path(self, *parts: str) -> Path:
        return self.workdir.joinpath(*parts)

    @property
    def layout(self) -> layout.Workdir:
        """Where this run's files live (tilecast.stages.layout)."""
        return layout.Workdir(self.workdir)

    @property
    def build_cache(self) -> Path:
        return self.layout.build_cache


def _family(ctx: RunContext, name: str):
    if name not in ctx.config.families:
        raise ConfigError(f"family {name!r} is not in config {ctx.config.path}; "
                          f"it has: {', '.join(ctx.config.families)}")
    return get_family(name), ctx.config.families[name]


def select_candidates(ctx: RunContext, name: str) -> list:
    """The first `budget` valid variants of the space (budgeted)."""
    family, fc = _family(ctx, name)
    configs = family.candidate_space(fc.candidates, ctx.hardware)
    if not configs:
        raise ConfigError(f"{ctx.config.path}: family {name}: the candidate options allow no "
                          "variant this CPU can run")
    return budgeted(family, configs, fc.seed, fc.budget)


def budgeted(family, configs: Sequence, seed: int, budget: int) -> list:
    """The first `budget` of `configs` in the seeded (FNV-1a) order of their names, dealt
    round-robin across the family's strata where it has them (`family.stratum(config)`, e.g.
    a grouped-conv pipeline: every pipeline gets its share of the budget)."""
    space = {family.kernel_name(c): c for c in configs}
    stratum = getattr(family, "stratum", None)
    names = (tune.stratified_order(list(space), seed, lambda n: stratum(space[n]))
             if stratum else tune.seeded_order(list(space), seed))
    return [space[n] for n in names[:budget]]


def build_stage(ctx: RunContext, name: str,
                progress: Callable[[int, int, str], None] = build.log_progress) -> dict:
    """Compile the selected candidates; writes W/build/<family>/events.json. When none
    built, a build.BuildError names the failures (after the events are written).
    `progress(done, total, message)` follows the candidates (build.build_candidates)."""
    family, _ = _family(ctx, name)
    configs = select_candidates(ctx, name)
    log.info("build %s: %d candidates, %d parallel compiles", name, len(configs), ctx.config.build_jobs)
    builts = build.build_candidates(family, configs, ctx.build_cache, jobs=ctx.config.build_jobs,
                                    progress=progress)
    return _record_builds(ctx, name, builts)


def build_all(ctx: RunContext, names: Sequence[str] | None = None,
              progress: Callable[[int, int, str], None] = build.log_progress) -> dict:
    """build_stage of every family of the config (or `names`) before anything is measured,
    their candidates in one pool of build_jobs compilers; with the interleaved protocol their
    in-process libraries too, linked from the same objects, so that the benchmarks find them
    built; and beside them the process libraries their versions carry
    (serving_libraries_built). Returns each family's build_stage summary; the first family none of whose
    candidates built raises its build.BuildError once every family's events are written."""
    names = list(ctx.config.families if names is None else names)
    requests = [(_family(ctx, name)[0], select_candidates(ctx, name)) for name in names]
    log.info("build %s: %d candidates, %d parallel compiles", ", ".join(names),
             sum(len(configs) for _, configs in requests), ctx.config.build_jobs)
    with serving_libraries_built(ctx, [family for family, _ in requests]):
        results = build.build_families(requests, ctx.build_cache, jobs=ctx.config.build_jobs,
                                       progress=progress)
    summaries, failure = {}, None
    for name, builts in zip(names, results):
        try:
            summaries[name] = _record_builds(ctx, name, builts)
        except build.BuildError as err:
            failure = failure or err
    if failure is not None:
        raise failure
    if ctx.config.interleave:
        libraries = [(family, [b.config for b in builts if b.binary is not None])
                     for (family, _), builts in zip(requests, results)
                     if interleave_supported(family)]
        build.build_families(libraries, ctx.build_cache, jobs=ctx.config.build_jobs, shared=True)
    return summaries


@contextmanager
def serving_libraries_built(ctx: RunContext, families: Sequence) -> Iterator[None]:
    """Compile, on a thread beside the candidates' compiles of the block, the process
    libraries the families' published versions carry and their evaluation loads (the
    native scorer's, DISCO's: prebuild.build_serving_libraries), so that evaluate and
    publish, which run one family after another, find them built; the block's end waits
    for them."""
    thread = threading.Thread(target=prebuild.build_serving_libraries, daemon=True,
                              name="tilecast-serving-libraries",
                              args=(families, ctx.hardware, settings().compiler))
    thread.start()
    try:
        yield
    finally:
        thread.join()


class EarlyBuild:
    """build_all's compiles started on a thread before the run's own build stage, so that they
    overlap what comes first (`tilecast run` starting its Prefect server and importing the
    flow). The stage then finds each artifact built, or waits on the compile of it in flight
    (tilecast.core.compile holds one lock per recipe), so nothing compiles twice; what the
    early build fails at is the stage's to report, not this thread's. No benchmark measures
    while it runs: bench_stage waits for it first (`wait_early_build`)."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.thread = threading.Thread(target=self._compile, name="tilecast-early-build",
                                       daemon=True)

    def _compile(self) -> None:
        ctx = self.ctx
        try:
            requests = [(_family(ctx, name)[0], select_candidates(ctx, name))
                        for name in ctx.config.families]
            with serving_libraries_built(ctx, [family for family, _ in requests]):
                results = build.build_families(requests, ctx.build_cache,
                                               jobs=ctx.config.build_jobs)
            if ctx.config.interleave:
                libraries = [(family, [b.config for b in builts if b.binary is not None])
                             for (family, _), builts in zip(requests, results)
                             if interleave_supported(family)]
                build.build_families(libraries, ctx.build_cache,
                                     jobs=ctx.config.build_jobs, shared=True)
        except Exception as err:   # the build stage meets the same trouble and names it
            log.debug("early build stopped: %r", err)


_EARLY_BUILDS: list[EarlyBuild] = []
_EARLY_LOCK = threading.Lock()


def start_early_build(ctx: RunContext) -> EarlyBuild:
    """Start compiling `ctx`'s candidates (and in-process libraries) now, on a thread of this
    process; the run's build stage and benchmarks then proceed as usual (see EarlyBuild)."""
    early = EarlyBuild(ctx)
    with _EARLY_LOCK:
        _EARLY_BUILDS.append(early)
    early.thread.start()
    return early


def wait_early_build() -> None:
    """Return once no early build of this process is compiling (at once when none is)."""
    with _EARLY_LOCK:
        pending = list(_EARLY_BUILDS)
    for early in pending:
        early.thread.join()
    with _EARLY_LOCK:
        for early in pending:
            if early in _EARLY_BUILDS:
                _EARLY_BUILDS.remove(early)


def _record_builds(ctx: RunContext, name: str, builts: Sequence[build.Built]) -> dict:
    """A family's build events written to W/build/<family>/events.json, and its summary;
    build.BuildError when none of its candidates built."""
    events = ctx.layout.build_events(name)
    build.write_events(events, builts)
    build.require_some_built(name, builts, events)
    counts = {status: sum(b.event.status == status for b in builts) for status in ("ok", "failed")}
    return {"family": name, "candidates": len(builts), **counts,
            "cached": sum(b.cached for b in builts)}


def load_builds(ctx: RunContext, name: str) -> list[build.Built]:
    """The build stage's results, read back from its events file (build.read_events); a
    build.BuildError when none of them built."""
    family, _ = _family(ctx, name)
    path = ctx.layout.build_events(name)
    builts = build.read_events(path, family)
    build.require_some_built(name, builts, path)
    return builts


def night_kernels(ctx: RunContext, name: str) -> list[str]:
    """The candidates tonight's model chooses among: those this workdir built, or, where the
    night was measured on other machines (tilecast.workflows.fleet), those its records hold."""
    if ctx.layout.build_events(name).is_file():
        return [b.kernel for b in load_builds(ctx, name) if b.binary is not None]
    records = dataset.load(ctx.layout.dataset(name))
    return sorted(set(records.loc[records["role"] == "candidate", "kernel"]))


def problems(ctx: RunContext, name: str) -> list[tuple[str, object]]:
    """(problem_set, problem) pairs; a shape in both sets is a config error."""
    family, fc = _family(ctx, name)
    pairs = [(ps, family.problem(values)) for ps in PROBLEM_SETS for values in fc.problems[ps]]
    keys = {ps: {family.dims_key(p) for s, p in pairs if s == ps} for ps in PROBLEM_SETS}
    overlap = sorted(keys["train"] & keys["holdout"])
    if overlap:
        raise ConfigError(f"{ctx.config.path}: holdout problem {overlap[0]} is also a training "
                          f"problem ({len(overlap)} in all); holdouts must never be trained on")
    seen, unique = set(), []
    for ps, problem in pairs:
        key = family.dims_key(problem)
        if key not in seen:
            seen.add(key)
            unique.append((ps, problem))
    return unique


def budgeted_night(ctx: RunContext) -> bool:
    """Whether tonight spends a time budget (a store and night.budget_minutes) rather than
    measuring the config's problem lists."""
    return bool(ctx.store and ctx.config.night.budget_minutes)


def night_problems(ctx: RunContext, name: str, builts: Sequence | None = None
                   ) -> list[tuple[str, object]]:
    """What tonight measures: the config's lists, or on a budgeted night the plan
    (tilecast.store.plan), made once and kept in W/plan/<family>.json so that a resumed
    night measures what it planned. A store with no night of this class and family yet
    starts from the config's lists."""
    if not budgeted_night(ctx):
        return problems(ctx, name)
    family, _ = _family(ctx, name)
    path = ctx.layout.plan(name)
    if path.is_file():
        plan = night_plan.read(path)
        log.info("bench %s: the plan made earlier tonight (%s)", name, path)
    else:
        builts = load_builds(ctx, name) if builts is None else builts
        plan = make_plan(ctx, name, [b.kernel for b in builts if b.binary is not None])
        if plan is None:
            log.info("bench %s: the store has no night of class %s yet; tonight measures the "
                     "config's problem lists", name, ctx.hardware["hardware_class"])
            return problems(ctx, name)
        night_plan.write(plan, path)
    for line in plan.lines():
        log.info("plan %s", line)
    return plan.problems(family)


def make_plan(ctx: RunContext, name: str, kernels: Sequence[str]) -> night_plan.NightPlan | None:
    """Tonight's plan for the family's `kernels` from the store's nights of this class (None
    while it has none)."""
    family, fc = _family(ctx, name)
    stored = _stored(ctx, name)
    if stored.empty:
        return None
    spec = ModelSpec.from_mapping({"seed": fc.seed, **fc.model})
    from tilecast.fleet.lease import machines, night_key   # a fleet night: its machines' time

    store = Store(ctx.store)
    return night_plan.plan_night(family, family.feature_engine(ctx.hardware), fc,
                                 ctx.config.night, ctx.config.protocol, stored, kernels, spec,
                                 seed=zlib.crc32(ctx.run_id.encode()),
                                 threads=int(ctx.hardware.get("threads") or 2),
                                 machines=lambda night: machines(
                                     store, night_key(ctx.hardware["hardware_class"], night)))


def bench_stage(ctx: RunContext, name: str, device: str | None = None,
                progress: Callable[[int, int, str], None] | None = None,
                pairs: Sequence[tuple[str, object]] | None = None,
                deadline_s: float | None = None) -> dict:
    """Measure every built candidate on every problem; appends to W/bench/<family>.jsonl.
    Holds `device` (default: this host's CPU) exclusively while it measures.
    `progress(done, total, message)` follows its batches and race rounds (bench.benchmark).
    `pairs`: what to measure (default: tonight's, `night_problems`); `deadline_s`: no batch
    starts this many seconds after the stage starts (default: a budgeted night's budget)."""
    family, fc = _family(ctx, name)
    builts = load_builds(ctx, name)
    cfg = ctx.config
    wait_early_build()   # nothing compiles beside a measurement
    libraries = (in_process_libraries(family, builts, ctx.build_cache, cfg.build_jobs)
                 if cfg.interleave else {})
    settings = BenchSettings.from_config(cfg, seed=fc.seed, libraries=libraries)
    run_info = {"run_id": ctx.run_id, "git_sha": ctx.git_sha,
                "hardware": ctx.hardware["fingerprint"]}
    if pairs is None:
        pairs = night_problems(ctx, name, builts)
        if ctx.layout.plan(name).is_file():   # a budgeted night stops screening at its budget
            deadline_s = ctx.config.night.budget_minutes * 60 if deadline_s is None else deadline_s
    if deadline_s is not None:
        settings = replace(settings, deadline_s=max(0.0, float(deadline_s)))
    write_hardware(ctx.workdir, ctx.hardware)
    log.info("bench %s: %d candidates x %d problems", name, len(builts), len(pairs))
    with exclusive(device or default_device()):
        summary = benchmark(family, builts, pairs, ctx.layout.raw_log(name),
                            ctx.layout.scratch(name), run_info, settings, progress)
    return {"family": name, "new_records": summary.measured,
            "already_measured": summary.skipped_existing, "statuses": dict(summary.statuses),
            "seconds": round(summary.seconds, 1), "past_deadline": summary.past_deadline}


def convert_stage(ctx: RunContext, name: str) -> dict:
    """Raw records -> W/data/<family>.parquet; with a store, the night's records are also
    appended to it (a re-run appends nothing twice)."""
    summary = convert_raw([ctx.layout.raw_log(name)], ctx.layout.dataset(name))
    outcome = {"family": name, "rows": summary.rows, "problems": summary.problems,
               "kernels": summary.kernels, "statuses": summary.statuses}
    if ctx.store:
        family, _ = _family(ctx, name)
        frame = dataset.load(ctx.layout.dataset(name))
        store = Store(ctx.store).require()
        appended = store_nights.append_frame(store, frame, family, ctx.hardware["hardware_class"])
        store.put_profile(ctx.hardware)
        log.info("convert %s: %s", name, appended.line())
        outcome["stored"] = {"store": ctx.store, "records": appended.records,
                             "new_files": appended.files,
                             "hardware_class": appended.hardware_class}
    return outcome


def holdout_keys(ctx: RunContext, name: str) -> set[str]:
    """The dims_keys of the config's held-out problems (a budgeted night's too: it
    measures some of them, but judges its model on all that the store holds)."""
    family, _ = _family(ctx, name)
    return {family.dims_key(p) for ps, p in problems(ctx, name) if ps == "holdout"}


def _stored(ctx: RunContext, name: str) -> pd.DataFrame:
    """The store's records of the family measured on this run's hardware class."""
    return store_nights.read_frame(Store(ctx.store).require(), ctx.hardware["hardware_class"],
                                   name)


def _final_by_set(ctx: RunContext, name: str, stored: pd.DataFrame | None = None
                  ) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """(this night's records, the final table by problem set). With a store, the final
    table is the labels pooled over the class's nights (tilecast.store.labels) for this
    night's candidates: training takes every problem of the class's nights but the held-out
    ones (the config's, and any a night held out), evaluation the config's held-out
    problems. `stored`: the class's store records when the caller has read them already."""
    records = dataset.load(ctx.layout.dataset(name))
    if not ctx.store:
        final = dataset.final_table(records)
        return records, {ps: final[final["problem_set"] == ps] for ps in PROBLEM_SETS}
    stored = _stored(ctx, name) if stored is None else stored
    kernels = set(records.loc[records["role"] == "candidate", "kernel"])
    final = pooled_labels.pooled_final(stored[stored["kernel"].isin(kernels)])
    config_holdout = holdout_keys(ctx, name)
    held = config_holdout | set(stored.loc[stored["problem_set"] == "holdout", "dims_key"])
    is_holdout = final["dims_key"].isin(config_holdout)
    final = final.assign(problem_set=np.where(is_holdout, "holdout", "train"))
    return records, {"holdout": final[is_holdout],
                     "train": final[~final["dims_key"].isin(held)]}


def _warm_start(ctx: RunContext, name: str, fc, family, engine, spec) -> tuple[Path | None, dict]:
    """(base model.txt or None, lineage entry) for the family's warm_start setting. A registry
    without that version yet (a first run) trains from scratch and says so."""
    if fc.warm_start is None:
        return None, {}
    try:
        base_dir = registry.local_copy(ctx.registry, registered_model(ctx, name), fc.warm_start)
    except registry.RegistryError as err:
        log.warning("train %s: warm start from %r impossible (%s); training from scratch",
                    name, fc.warm_start, err)
        return None, {"warm_start": fc.warm_start, "base": None, "why": str(err)}
    init = check_warm_start(base_dir, family, engine, spec)
    manifest = json.loads((base_dir / layout.MANIFEST_FILE).read_text() or "{}")
    return init, {"warm_start": fc.warm_start, "base": {
        "model": registered_model(ctx, name), "version": int(base_dir.name),
        "data_hash": manifest.get("data_hash"), "registry": str(ctx.registry)}}


def train_stage(ctx: RunContext, name: str) -> dict:
    """Train the family's model; writes W/models/<family>/ (with candidates.json)."""
    family, fc = _family(ctx, name)
    _, by_set = _final_by_set(ctx, name)
    spec = ModelSpec.from_mapping({"seed": fc.seed, **fc.model})
    engine = family.feature_engine(ctx.hardware)
    init, warm = _warm_start(ctx, name, fc, family, engine, spec)
    lineage = [{"run_id": ctx.run_id, "config": str(ctx.config.path), "git_sha": ctx.git_sha,
                "dataset": str(ctx.layout.dataset(name)), **warm}]
    out = ctx.layout.model_dir(name)
    result = train_model(family, engine, dataset.valid(by_set["train"]), spec, out, ctx.hardware,
                         lineage=lineage, init_model=init)
    kernels = night_kernels(ctx, name)
    static_kernel, static_mean = static_best(by_set["train"], kernels)
    atomic_write_json(out / layout.CANDIDATES_FILE, {"family": name, "kernels": kernels,
                                                      "static_best": static_kernel})
    _learn_shortlist(family, spec, by_set["train"], out)
    log.info("train %s: cv mean efficiency %.3f, %d rounds%s; static best %s (%.3f on training)",
             name, result.cv["mean_efficiency"], result.num_boost_round,
             f" on top of version {warm['base']['version']}" if warm.get("base") else "",
             static_kernel, static_mean)
    return {"family": name, "model_dir": str(out), "cv_mean_efficiency": result.cv["mean_efficiency"],
            "num_boost_round": result.num_boost_round,
            "warm_start_version": (warm.get("base") or {}).get("version")}


def _learn_shortlist(family, spec: ModelSpec, train: pd.DataFrame, model_dir: Path) -> None:
    """Write the model's shortlist.json (spec.shortlist kernels a leaf; none when 0)."""
    from tilecast.runtime import shortlist as shortlists
    from tilecast.runtime.dispatch import Dispatcher

    file = model_dir / shortlists.FILE
    file.unlink(missing_ok=True)   # a model trained again in this workdir
    if not spec.shortlist:
        return
    problems = [family.problem({f: row[f] for f in family.problem_fields})
                for _, row in train.drop_duplicates("dims_key").iterrows()]
    dispatcher = Dispatcher.from_directory(model_dir, model=family.name)
    shortlist = shortlists.learn(dispatcher, problems, spec.shortlist, seed=spec.seed)
    atomic_write_json(file, shortlist.to_json())
    unseen = shortlist.summary.get("unseen", {})
    log.info("train %s: shortlist of %d kernels a leaf, %d leaves; on drawn problems it was "
             "not fitted on it keeps %s of the predicted efficiency", family.name,
             shortlist.size, len(shortlist.leaves),
             ", ".join(f"{v['mean_efficiency']:.3f} with {k}" for k, v in unseen.items()) or "?")


def _shortlist_dispatchers(model_dir: Path, name: str) -> dict:
    """size -> Dispatcher choosing through the model's shortlist cut to that size (1 and
    the whole), {} for a model without one."""
    from tilecast.runtime import shortlist as shortlists
    from tilecast.runtime.dispatch import Dispatcher

    file = model_dir / shortlists.FILE
    if not file.is_file():
        return {}
    shortlist = shortlists.Shortlist.from_json(json.loads(file.read_text()), str(file))
    base = Dispatcher.from_directory(model_dir, model=name)   # the forest, loaded once
    candidates = {"family": name, "kernels": list(base.kernels),
                  "static_best": base.static_best}
    return {k: Dispatcher(base.booster, base.feature_spec, candidates, model=name,
                          source=model_dir, shortlist=shortlist.truncated(k))
            for k in sorted({1, shortlist.size})}


def evaluate_stage(ctx: RunContext, name: str) -> dict:
    """The model on the held-out problems; writes W/eval/<family>/."""
    family, _ = _family(ctx, name)
    stored = _stored(ctx, name) if ctx.store else None
    records, by_set = _final_by_set(ctx, name, stored)
    model_dir = ctx.layout.model_dir(name)
    candidates = json.loads((model_dir / layout.CANDIDATES_FILE).read_text())["kernels"]
    evaluation = evaluate(family, family.feature_engine(ctx.hardware), load_predictor(model_dir),
                          by_set["holdout"], by_set["train"], candidates, ctx.config.tie_threshold_pct)
    peer = peer_ratios(records, family)
    evaluation.metrics["slices"] = slice_metrics(family, evaluation.per_problem)
    dispatchers = _shortlist_dispatchers(model_dir, name)
    if dispatchers:
        evaluation.metrics["shortlist"] = shortlist_metrics(
            family, dispatchers, evaluation.per_problem, by_set["holdout"])
        log.info("evaluate %s: through the shortlist, mean eff %s", name, ", ".join(
            f"{v['mean_efficiency']:.3f} with {k}"
            for k, v in evaluation.metrics["shortlist"]["sizes"].items()))
    if ctx.store:
        evaluation.metrics["pooled_labels"] = {
            "store": ctx.store, "hardware_class": ctx.hardware["hardware_class"],
            **{ps: pooled_labels.label_spread_summary(by_set[ps]) for ps in PROBLEM_SETS}}
        evaluation.metrics["change_points"] = [c.as_dict() for c in change_points(stored)]
        evaluation.metrics["run_id"] = ctx.run_id
        evaluation.metrics["train_problems"] = int(by_set["train"]["dims_key"].nunique())
        if ctx.layout.plan(name).is_file():
            evaluation.metrics["night_plan"] = night_summary(
                night_plan.read(ctx.layout.plan(name)), records)
        evaluation.metrics["nights"] = model_history(ctx, name)
        fleet_states = ctx.workdir / "fleet" / f"{name}.states.json"
        if fleet_states.is_file():
            evaluation.metrics["fleet"] = json.loads(fleet_states.read_text())
    out = ctx.layout.eval_dir(name)
    out.mkdir(parents=True, exist_ok=True)
    evaluation.per_problem.to_parquet(out / layout.PER_PROBLEM_FILE, index=False)
    atomic_write_json(out / layout.METRICS_FILE, evaluation.metrics)
    atomic_write_json(out / layout.PEER_FILE, {"problem_sets": peer.get("problem_sets", {})})
    if "per_problem" in peer:
        peer["per_problem"].to_parquet(out / layout.PEER_PER_PROBLEM_FILE, index=False)
    m = evaluation.metrics
    log.info("evaluate %s: %d held-out problems, mean eff %.3f, P10 %.3f, top1 %.2f, top5 %.2f, "
             "static best %.3f", name, m["n_problems"], m["mean_efficiency"], m["p10_efficiency"],
             m["top1"], m["top5"], m["static_best"]["mean_efficiency"])
    return {"family": name, **{k: v for k, v in m.items()
                               if k not in ("slices", "shortlist", "pooled_labels",
                                            "change_points", "night_plan", "nights")}}


def night_summary(plan: night_plan.NightPlan, records: pd.DataFrame) -> dict:
    """A budgeted night's plan as evaluation.json keeps it: its counts, its estimate and the
    measuring time it took (its records' first to last)."""
    times = pd.to_datetime(records["time"], utc=True, format="ISO8601")
    summary = {k: v for k, v in plan.to_json().items() if k != "chosen"}
    return {**summary, "measured_s": round((times.max() - times.min()).total_seconds(), 1)}


HISTORY_KEYS = ("run_id", "train_problems", "n_problems", "mean_efficiency", "p10_efficiency",
                "top1", "top5")


def model_history(ctx: RunContext, name: str) -> list[dict]:
    """The held-out figures of the class model's versions so far, one a night, oldest first
    (what report.md draws night by night); [] when the registry cannot tell."""
    model = registered_model(ctx, name)
    try:
        versions = registry.list_versions(ctx.registry, model)
        rows = []
        for version in versions:
            metrics = registry.read_metrics(ctx.registry, model, version)
            rows.append({"version": version, **{k: metrics.get(k) for k in HISTORY_KEYS},
                         "static_best": (metrics.get("static_best") or {}).get("mean_efficiency")})
        return rows
    except registry.RegistryError as err:
        log.warning("evaluate %s: no history of %s (%s)", name, model, err)
        return []


def report_stage(ctx: RunContext, ceilings: dict | None = None) -> dict:
    """evaluation.json, report.md and plots for every family of the config, with each
    family's roofline under the CPU's ceilings, measured once, now, holding the CPU (as a
    benchmark does) so that no measurement runs beside the probe; `ceilings`: those measured
    on the machines of a fleet night instead."""
    if ceilings is None:
        with exclusive(default_device()):
            ceilings = roofline.measure_ceilings(ctx.config.protocol.threads,
                                                 int(ctx.hardware.get("l3_bytes") or 0))
    log.info("report: ceilings %.1f GFLOP/s FMA peak, %.1f GB/s read (%d threads, %d MiB)",
             ceilings["fma_peak_gflops"], ceilings["read_bandwidth_gbps"], ceilings["threads"],
             ceilings["buffer_mib"])
    results, rooflines = {}, {}
    for name in ctx.config.families:
        out = ctx.layout.eval_dir(name)
        metrics = json.loads((out / layout.METRICS_FILE).read_text())
        manifest = json.loads((ctx.layout.model_dir(name) / layout.MANIFEST_FILE).read_text())
        peer = json.loads((out / layout.PEER_FILE).read_text())
        if (out / layout.PEER_PER_PROBLEM_FILE).exists():
            peer["per_problem"] = pd.read_parquet(out / layout.PEER_PER_PROBLEM_FILE)
        evaluation = Evaluation(metrics=metrics,
                                per_problem=pd.read_parquet(out / layout.PER_PROBLEM_FILE))
        noise = run_noise(dataset.load(ctx.layout.dataset(name)), ctx.config.tie_threshold_pct)
        results[name] = (evaluation, {"cv": manifest["cv"], "peer": peer, "noise": noise})
        rooflines[name] = (roofline.table(_family(ctx, name)[0], evaluation.per_problem,
                                          peer.get("per_problem"), ceilings), ceilings)
    directory = write_report(ctx.workdir, results, peer={}, rooflines=rooflines)
    return {"report_dir": str(directory), "evaluation": str(directory / layout.EVALUATION_FILE)}


def registered_model(ctx: RunContext, name: str) -> str:
    """The registry's name of a family's model measured on this run's hardware class: each
    class has its own versions, aliases and gate (tilecast.registry.classes)."""
    return registry_classes.class_model(name, ctx.hardware["hardware_class"])


def publish_stage(ctx: RunContext, name: str) -> dict:
    """A new registry version of the family's model; production moves only if the new model
    passes the gate against production's choices on this run's holdout (tilecast.runtime.gate)."""
    family, _ = _family(ctx, name)
    model_dir, eval_dir = ctx.layout.model_dir(name), ctx.layout.eval_dir(name)
    files = {f: model_dir / f for f in layout.MODEL_FILES}
    if (model_dir / layout.SHORTLIST_FILE).is_file():
        files[layout.SHORTLIST_FILE] = model_dir / layout.SHORTLIST_FILE
    per_problem = eval_dir / layout.PER_PROBLEM_FILE
    files[layout.PER_PROBLEM_FILE] = per_problem
    # the candidates' in-process libraries, so that a host serves them without a compiler
    files.update(prebuild.publish_kernels(model_dir, ctx.build_cache, jobs=ctx.config.build_jobs))
    metrics = json.loads((eval_dir / layout.METRICS_FILE).read_text())
    _, by_set = _final_by_set(ctx, name)
    model = registered_model(ctx, name)
    baseline = promotion.production_baseline(ctx.registry, model, family, by_set["holdout"],
                                             ctx.config.tie_threshold_pct)
    gate = promotion.make_gate(baseline, promotion.read_candidate_table(per_problem))
    result = registry.publish(ctx.registry, model, files, metrics=metrics, gate=gate)
    log.info("publish %s: version %d, %s (%s)", model, result.version,
             "promoted" if result.promoted else "not promoted", result.reason)
    outcome = {"family": name, "model": model, "hardware_class": ctx.hardware["hardware_class"],
               "version": result.version, "promoted": result.promoted,
               "reason": result.reason, "path": str(result.path),
               "aliases": list(result.aliases), "baseline_version": baseline.version}
    atomic_write_json(ctx.layout.publish_outcome(name), outcome)
    return outcome


def run_all(ctx: RunContext, device: str | None = None) -> dict:
    """Every stage in order without Prefect (the plain-library baseline of the flow); the
    benchmarks hold `device` (default: this host's CPU), as the flow's do."""
    device = device or default_device()
    stages, published = {}, {}
    built = build_all(ctx)   # every family's compiles first, none beside a measurement
    for name in ctx.config.families:
        stages[name] = {"build": built[name], "bench": bench_stage(ctx, name, device),
                        "convert": convert_stage(ctx, name), "train": train_stage(ctx, name),
                        "evaluate": evaluate_stage(ctx, name)}
    report = report_stage(ctx)
    for name in ctx.config.families:
        published[name] = publish_stage(ctx, name)
    return {"run_id": ctx.run_id, "device": device, "stages": stages, "report": report,
            "published": published}
