"""Benchmark stage: every built candidate on every problem, validated, every sample kept.

Problems run in batches: a batch's inputs and torch references are prepared once, each
candidate binary then runs all of the batch's jobs in one isolated process (see
`measure.run_binary`), and its outputs are checked against the reference before the time
counts. Each problem's finalists (the practical-tie set and the next best, per
`tune.tie_set`) are re-measured with fresh samples (`confirm` phase, sample count from
`tune.confirmation_count`), which removes the winner's curse from the oracle. Samples are
taken in several rounds over the batch (see `_execute`). Records are
appended as they are produced; a re-run skips what the raw file already holds, provided it
was measured the same way: every record carries its protocol's hash
(`measure.protocol_hash`) and its binary's build cache key, and a resumed run reuses only
records of its own protocol, binary and problem, never one the harness refused to run (a
usage error: `measure.is_usage_error`). The rest are measured again and say so.
"""
from __future__ import annotations

import logging
import math
import secrets
import shutil
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping, Sequence

from tilecast.core import build
from tilecast.core import stats, tune
from tilecast.measurement import interleave
from tilecast.core.dataset import SCHEMA_VERSION
from tilecast.core.family import PreparedProblem, norm_relative_error
from tilecast.measurement.protocol import (JobOutcome, Protocol, is_usage_error, measure_callable,
                                   protocol_hash, run_binary)
from tilecast.measurement.rawlog import RawWriter, read_records

log = logging.getLogger("tilecast.stages.bench")


@dataclass(frozen=True)
class BenchSettings:
    """Policy of one benchmark run (the protocol says how to time, this what to time).
    Only the protocol is part of a record's protocol hash: these settings decide which pairs
    are timed, how many samples they get and how they are grouped in time, never what a
    sample is (the timing style is recorded per record, `timing`, and a run resumed without
    interleaving keeps its interleaved labels)."""
    protocol: Protocol
    tie_threshold_pct: float = 1.0
    finalists: int = 3
    confirm_samples: int = 5
    problems_per_batch: int = 8
    seed: int = 0
    measure_peer: bool = True
    rounds: int = 3
    # extra passes, at the end of a batch, for pairs every sample of which the synchronization
    # guard kept apart (measure.Protocol.sync_limit): the spell that disturbed them has
    # usually passed by then
    retry_disturbed: int = 1
    # the interleaved protocol (tilecast.measurement.interleave) for families with an in-process timer:
    # kernel -> its in-process library; a kernel without one is timed the isolated way
    libraries: Mapping[str, Path] = field(default_factory=dict)
    interleave: bool = True
    # interleaved protocol, in place of the confirm phase: once every batch is screened, each
    # problem's contenders (within race_margin_pct of its best) get race_cycles more samples,
    # in `race_rounds` rounds spread over the rest of the run (`_race`)
    race_cycles: int = 16
    race_rounds: int = 3
    # a budgeted night's (tilecast.store.plan): no batch starts screening once this many
    # seconds have passed; the problems left are not measured tonight, the screened ones
    # are still raced. None: every batch
    deadline_s: float | None = None
    race_margin_pct: float = 25.0
    # after each race round but the last, a contender slower than the round's best by more
    # than this leaves the race (interleave.survivors): the wide margin finds the leaders, the
    # later rounds spend their cycles on the few that are still close
    race_keep_pct: float = 5.0
    # each race round in a worker process of its own with the operands at random offsets
    # (interleave.Plan.placement_seed): a bias one process gives a kernel (measured relative
    # to its rivals by benchmarks/process_bias.py) then differs from
    # round to round, and the rounds average it away; a fresh round scatters no more
    race_fresh_process: bool = True

    @classmethod
    def from_config(cls, config, *, seed: int = 0, libraries: Mapping[str, Path] | None = None,
                    **overrides) -> "BenchSettings":
        """The settings a run config (tilecast.config.RunConfig) asks for: every field
        of both (the protocol, the tune and bench keys) taken from the config, then `seed`,
        `libraries` and any `overrides` (a field name and its value, e.g. a rebenchmark's
        own protocol). An unknown override is a TypeError naming it."""
        shared = {f.name for f in fields(cls)} & {f.name for f in fields(config)}
        values = {name: getattr(config, name) for name in shared}
        values.update(seed=seed, libraries=dict(libraries or {}), **overrides)
        return cls(**values)


def in_process_libraries(family, builts: Sequence, cache_dir: Path, jobs: int = 2) -> dict[str, Path]:
    """kernel -> its in-process library, for the interleaved protocol: built (or found in
    the cache) for every candidate whose executable built, where the family has a timer;
    a library that fails to build leaves its kernel out (the batch is then timed apart)."""
    if not interleave.supports(family):
        return {}
    configs = [b.config for b in builts if b.binary is not None]
    libraries = build.build_candidates(family, configs, cache_dir, jobs=jobs, shared=True)
    return {lib.kernel: lib.binary for lib in libraries if lib.binary is not None}


@dataclass
class BenchSummary:
    """What a benchmark call did: new records per status, how many were already there, how
    many earlier records it could not reuse (per reason: `_reusable`) and how many of its own
    records are harness usage errors (nothing measured)."""
    raw_path: Path
    measured: int = 0
    skipped_existing: int = 0
    statuses: dict = field(default_factory=lambda: defaultdict(int))
    seconds: float = 0.0
    set_aside: dict = field(default_factory=dict)
    usage_errors: int = 0
    first_usage_error: str = ""
    past_deadline: int = 0     # problems left unmeasured at BenchSettings.deadline_s


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class _Recorder:
    """Builds records in the dataset's schema and appends them to the raw file."""

    def __init__(self, family, writer: RawWriter, run_info: dict, protocol: Protocol,
                 summary: BenchSummary):
        self.family, self.writer, self.run_info = family, writer, run_info
        self.protocol, self.summary = protocol, summary
        self.protocol_hash = protocol_hash(protocol)

    def write(self, problem_set: str, problem, kernel: str, config, role: str, phase: str,
              outcome: JobOutcome, binary_bytes: int = 0, max_error: float | None = None,
              round_medians: list[float] | None = None, timing: str = "isolated",
              build_key: str | None = None) -> dict:
        """Append one record; `build_key` is the candidate's build cache key (None: a peer)."""
        fam = self.family
        record = {
            "schema_version": SCHEMA_VERSION, "time": _now(), **self.run_info,
            "protocol_hash": self.protocol_hash, "build_key": build_key,
            "family": fam.name, "problem_set": problem_set, "dims_key": fam.dims_key(problem),
            **fam.problem_dict(problem), "kernel": kernel, "role": role, "phase": phase,
            "status": outcome.status, "reason": outcome.reason, "samples_s": outcome.samples_s,
            "reps_per_sample": outcome.reps, "median_s": None, "mad_s": None, "tflops": None,
            "gbps": None, "max_error": max_error, "threads": self.protocol.threads,
            "binary_bytes": binary_bytes, "retaken": outcome.retaken,
            "disturbed_samples_s": outcome.disturbed_samples_s,
            "round_medians_s": list(round_medians or []), "timing": timing,
            "window_factors": outcome.window_factors,
            "window_probes_us": outcome.window_probes_us,
        }
        if config is not None:
            for key, value in fam.config_dict(config).items():
                record.setdefault(key, value)  # problem fields (e.g. dtype) win: they are equal
        if outcome.status == "ok":
            # undisturbed samples decide; only a measurement with none falls back on the rest
            usable = stats.scored_samples(outcome.samples_s, outcome.disturbed_samples_s)
            if usable:
                median_s = stats.median(usable)
                record.update(median_s=median_s, mad_s=stats.mad(usable),
                              tflops=fam.flops(problem) / median_s / 1e12,
                              gbps=fam.bytes_moved(problem) / median_s / 1e9)
            else:
                record.update(status="crashed", reason="no usable sample (all zero or non-finite)")
        self.writer.append(record)
        self.summary.measured += 1
        self.summary.statuses[record["status"]] += 1
        if is_usage_error(record["reason"]):
            self.summary.usage_errors += 1
            self.summary.first_usage_error = self.summary.first_usage_error or record["reason"]
        return record


def _validate(family, prepared: PreparedProblem, outcome: JobOutcome) -> tuple[JobOutcome, float | None]:
    """The output must match the torch reference within the dtype's tolerance before its time counts."""
    if outcome.status != "ok":
        return outcome, None
    try:
        output = family.read_output(prepared)
    except (OSError, ValueError) as err:
        return JobOutcome("wrong_result", f"unreadable output: {err}", outcome.reps, outcome.samples_s), None
    error = norm_relative_error(output, prepared.reference)
    tol = family.tolerance(prepared.problem)
    if not error <= tol:
        return JobOutcome("wrong_result", f"norm-relative error {error:.3g} > tolerance {tol:g}",
                          outcome.reps, outcome.samples_s), error
    return outcome, error


def _finalists(screen: dict[str, dict], settings: BenchSettings) -> list[tuple[str, int]]:
    """(kernel, confirmation samples) for the practical-tie set plus the next best."""
    scores = [tune.score_samples(kernel, stats.scored_samples(rec["samples_s"],
                                                              rec.get("disturbed_samples_s") or []))
              for kernel, rec in screen.items() if rec["status"] == "ok"]
    usable = sorted((s for s in scores if s.usable), key=lambda s: (s.value, s.id))
    if not usable:
        return []
    ties = {s.id for s in tune.tie_set(usable, settings.tie_threshold_pct)}
    leaders = {s.id for s in usable[:settings.finalists]}
    chosen = [s for s in usable if s.id in ties | leaders]
    budget = settings.confirm_samples * 3
    return [(s.id, tune.confirmation_count(settings.confirm_samples,
                                           stats.relative_uncertainty(list(s.samples)), budget))
            for s in chosen]


# Why an earlier record is not reused (`_reusable`), as a resumed run's log line says it.
SET_ASIDE = {"protocol": "of another protocol", "binary": "of another binary",
             "usage": "of harness usage errors"}


def _slot(record: dict) -> tuple:
    """(dims_key, kernel, phase) of a record; peers are keyed by role, since the peer's name
    (e.g. torch.matmul) is the family's business."""
    return (record.get("dims_key"), "peer" if record.get("role") == "peer" else record.get("kernel"),
            record.get("phase"))


def _why_not_reused(record: dict, current_hash: str, build_keys: Mapping[str, str]) -> str | None:
    """None when `record` stands for a measurement of this run, else a SET_ASIDE key."""
    if is_usage_error(record.get("reason")):
        return "usage"
    if record.get("protocol_hash") != current_hash:
        return "protocol"
    kernel = _slot(record)[1]
    if kernel in build_keys and record.get("build_key") != build_keys[kernel]:
        return "binary"
    return None


def _reusable(family, builts, problems, existing: list[dict], settings: BenchSettings,
              summary: BenchSummary) -> dict:
    """The `done` map of a resumed run: slot -> the latest earlier record measured with this
    run's protocol (hash) and binary (build key), not refused by the harness. The slots of
    this run left without one are counted per reason in `summary.set_aside` and logged."""
    current_hash = protocol_hash(settings.protocol)
    build_keys = {b.kernel: b.cache_key for b in builts}
    in_run = {family.dims_key(problem) for _, problem in problems}
    done, set_aside = {}, {}
    for record in existing:
        slot = _slot(record)
        why = _why_not_reused(record, current_hash, build_keys)
        if why is None:
            done[slot] = record
        elif slot[0] in in_run and (slot[1] in build_keys
                                    or (slot[1] == "peer" and settings.measure_peer)):
            set_aside[slot] = why
    counts = Counter(why for slot, why in set_aside.items() if slot not in done)
    if counts:
        log.warning("bench %s: %s (a run reuses only records of its own protocol, binary and "
                    "problem; a record without a protocol hash is of another)", family.name,
                    "; ".join(f"{counts[why]} records {SET_ASIDE[why]} re-measured"
                              for why in SET_ASIDE if counts[why]))
    summary.set_aside = dict(counts)
    return done


def log_progress(done: int, total: int, message: str) -> None:
    """Default progress: the message (batch or race round done, records, elapsed, eta) as one
    log line."""
    log.info(message)


def benchmark(family, builts: Sequence, problems: Sequence[tuple[str, object]], raw_path: Path,
              scratch_dir: Path, run_info: dict, settings: BenchSettings,
              progress: Callable[[int, int, str], None] | None = None) -> BenchSummary:
    """Measure every built candidate on every (problem_set, problem); see the module docstring.
    `progress(done, total, message)` follows the steps: each batch, then each race round
    (default log_progress; a race that has nothing to race ends short of `total`)."""
    progress = progress or log_progress
    summary = BenchSummary(raw_path=Path(raw_path))
    started = time.perf_counter()
    done = _reusable(family, builts, problems, read_records(raw_path), settings, summary)
    batches = [problems[i:i + settings.problems_per_batch]
               for i in range(0, len(problems), settings.problems_per_batch)]
    steps = len(batches) + (len(_race_rounds(settings)) if settings.interleave else 0)

    def race_progress(round_index: int, _rounds: int, message: str) -> None:
        progress(len(batches) + round_index, steps, message)

    with RawWriter(raw_path) as writer, interleave.Worker(settings.protocol, scratch_dir) as worker:
        rec = _Recorder(family, writer, run_info, settings.protocol, summary)
        for index, batch in enumerate(batches, 1):
            if settings.deadline_s is not None and time.perf_counter() - started > settings.deadline_s:
                left = sum(map(len, batches[index - 1:]))
                summary.past_deadline = left
                log.warning("bench %s: the night's %.0f s are spent; %d problem(s) of %d batch(es) "
                            "left unmeasured tonight (the screened ones are still raced)",
                            family.name, settings.deadline_s, left, len(batches) - index + 1)
                break
            _run_batch(family, builts, batch, done, rec, scratch_dir / f"batch{index}", settings,
                       summary, worker)
            elapsed = time.perf_counter() - started
            eta = elapsed / index * (len(batches) - index)
            progress(index, steps, f"bench {family.name}: batch {index}/{len(batches)} done, "
                     f"{summary.measured} new records, {summary.skipped_existing} already measured, "
                     f"elapsed {elapsed:.0f}s, eta {eta:.0f}s")
        _race(family, builts, problems, done, rec, settings, worker, race_progress)
    summary.seconds = time.perf_counter() - started
    if summary.usage_errors:
        log.warning("bench %s: the harness refused %d job(s) without measuring (%s); fix the "
                    "protocol and run again: these records are never reused", family.name,
                    summary.usage_errors, summary.first_usage_error)
    return summary


def _run_batch(family, builts, batch, done, rec: _Recorder, scratch: Path,
               settings: BenchSettings, summary: BenchSummary, worker: interleave.Worker) -> None:
    keys = {family.dims_key(p): (ps, p) for ps, p in batch}
    prepared: dict[str, PreparedProblem] = {}

    def prepare(key: str) -> PreparedProblem:
        if key not in prepared:
            problem = keys[key][1]
            prepared[key] = family.prepare(problem, scratch / f"p{len(prepared)}",
                                           seed=_data_seed(settings, key))
        return prepared[key]

    try:
        tasks = []
        for built in builts:
            todo = []
            for key, (ps, problem) in keys.items():
                if not family.applicable(built.config, problem):
                    continue
                if (key, built.kernel, "screen") in done:
                    summary.skipped_existing += 1
                    continue
                reason = family.unsupported_reason(built.config, problem)
                if built.binary is None or reason:
                    status, why = ("build_failed", built.event.reason[:500]) if built.binary is None \
                        else ("unsupported", reason)
                    done[key, built.kernel, "screen"] = rec.write(
                        ps, problem, built.kernel, built.config, "candidate", "screen",
                        JobOutcome(status, why), built.event.binary_bytes,
                        build_key=built.cache_key)
                    continue
                todo.append(key)
            if todo:
                tasks.append(_Task(built, todo, settings.protocol.samples))
        # the peer runs where some candidate runs: a problem no kernel supports has no inputs;
        # a family whose peer library is missing here (has_peer() false) measures none
        runnable = {key for task in tasks for key in task.keys}
        has_peer = settings.measure_peer and family.has_peer()
        peers = [key for key in keys if has_peer and key in runnable
                 and (key, "peer", "screen") not in done]
        _execute(family, tasks, peers, keys, prepare, rec, "screen", done, settings, worker)
        _confirm(family, builts, keys, prepare, rec, done, settings, worker)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@dataclass
class _Task:
    """One candidate binary to run on some problems of a batch, `samples` per job in all."""
    built: object
    keys: list
    samples: int


def _split(total: int, rounds: int) -> list[int]:
    """`total` samples spread over `rounds` as evenly as possible (earlier rounds first)."""
    return [total // rounds + (1 if r < total % rounds else 0) for r in range(rounds)]


def _race_rounds(settings: BenchSettings) -> list[int]:
    """The race's cycles per round (`_race`): race_cycles over `race_rounds`, empty rounds
    dropped."""
    return [c for c in _split(settings.race_cycles, max(1, settings.race_rounds)) if c]


def _round_median(round_medians: dict, key, outcome: JobOutcome) -> None:
    """One round's median: each round is a process of its own, so the spread of these is the
    run-to-run noise a comparison of two runs must beat (tilecast.workflows.regression)."""
    usable = stats.scored_samples(outcome.samples_s, outcome.disturbed_samples_s)
    if outcome.status == "ok" and usable:
        round_medians[key].append(stats.median(usable))


def _all_disturbed(outcome: JobOutcome) -> bool:
    """A valid measurement whose samples the synchronization guard all kept apart."""
    return outcome.status == "ok" and not outcome.samples_s and bool(outcome.disturbed_samples_s)


def _merge(merged: dict, key, outcome: JobOutcome, error: float | None) -> None:
    """Fold one round's outcome in: samples add up; the first failure is final."""
    previous = merged.get(key)
    if previous is None:
        merged[key] = (JobOutcome(outcome.status, outcome.reason, outcome.reps,
                                  list(outcome.samples_s), outcome.retaken,
                                  list(outcome.disturbed_samples_s)), error)
        return
    acc, acc_error = previous
    if acc.status != "ok":
        return
    if outcome.status != "ok":
        merged[key] = (outcome, error)
        return
    acc.samples_s.extend(outcome.samples_s)
    acc.reps = min(acc.reps, outcome.reps)
    acc.retaken += outcome.retaken
    acc.disturbed_samples_s.extend(outcome.disturbed_samples_s)
    errors = [e for e in (acc_error, error) if e is not None]
    merged[key] = (acc, max(errors) if errors else None)


def _data_seed(settings: BenchSettings, dims_key: str) -> int:
    """The seed of a problem's inputs: the same in this process and in the interleaved
    worker, which prepares the problem again in its own memory."""
    return settings.seed + zlib.crc32(dims_key.encode())


def _interleavable(family, tasks: list[_Task], settings: BenchSettings) -> list[_Task]:
    """The tasks the interleaved protocol times: all of them when the family has an
    in-process timer and every kernel its library, else none (a batch is never split
    between protocols: its candidates must see the same stretch of time)."""
    if not (settings.interleave and tasks and interleave.supports(family)):
        return []
    if any(task.built.kernel not in settings.libraries for task in tasks):
        return []
    return list(tasks)


def _time_interleaved(family, tasks: list[_Task], keys, merged, round_medians,
                      settings: BenchSettings, worker: interleave.Worker) -> bool:
    """Replace each validated pair's outcome by its interleaved samples; False (and a
    warning) when the worker failed, so the caller times the batch the isolated way."""
    pairs = [(task.built.kernel, key) for task in tasks for key in task.keys
             if merged[task.built.kernel, key][0].status == "ok"]
    if not pairs:
        return True
    used = sorted({key for _, key in pairs})
    plan = interleave.Plan(
        family=family.name,
        libraries={kernel: str(settings.libraries[kernel]) for kernel, _ in pairs},
        problems=[(key, family.problem_dict(keys[key][1]), _data_seed(settings, key))
                  for key in used],
        pairs=pairs, cycles=max(task.samples for task in tasks),
        protocol=asdict(settings.protocol), seed=settings.seed + zlib.crc32(",".join(used).encode()))
    try:
        timings = worker.measure(plan)
    except interleave.InterleaveError as err:
        log.warning("bench %s: interleaved timing failed (%s); timing this batch the isolated "
                    "way", family.name, err)
        return False
    rounds = max(1, settings.rounds)
    for pair, timing in timings.items():
        outcome = JobOutcome(timing.status, timing.reason, timing.reps, timing.samples_s,
                             timing.retaken, timing.disturbed_samples_s, timing.window_factors,
                             timing.window_probes_us)
        merged[pair] = (outcome, timing.max_error)
        # consecutive stretches of cycles stand for the isolated protocol's rounds
        samples = timing.samples_s
        for r in range(rounds):
            part = samples[len(samples) * r // rounds:len(samples) * (r + 1) // rounds]
            if timing.status == "ok" and part:
                round_medians[pair].append(stats.median(part))
    return True


def _execute(family, tasks: list[_Task], peers: list[str], keys, prepare, rec, phase, done,
             settings: BenchSettings, worker: interleave.Worker) -> None:
    """Time the tasks' pairs. Where the family has an in-process timer and every kernel its
    library, each pair is first run alone in its candidate's process (one sample: crash,
    hang and wrong result are caught there), then the batch's valid pairs are timed side by
    side (tilecast.measurement.interleave). Otherwise, or if that worker fails, samples are taken in
    `settings.rounds` isolated passes over the batch, each pass in a rotated order, so that
    a slow spell of the machine lands in one pass of a few candidates; a pair left with no
    undisturbed sample gets `settings.retry_disturbed` more passes at the end."""
    if not tasks and not peers:
        return
    rounds = max(1, settings.rounds)
    merged: dict[tuple[str, str], tuple[JobOutcome, float | None]] = {}
    round_medians: dict[tuple[str, str], list[float]] = defaultdict(list)

    def run_task(task: _Task, todo: list, count: int) -> None:
        jobs = [(f"j{i}", tuple(prepare(key).job_args)) for i, key in enumerate(todo)]
        # each job writes its own output file, so outputs never overwrite each other
        outcomes = run_binary(task.built.binary, jobs, settings.protocol, samples=count)
        for (job_id, _), key in zip(jobs, todo):
            outcome, error = _validate(family, prepare(key), outcomes[job_id])
            _merge(merged, (task.built.kernel, key), outcome, error)
            _round_median(round_medians, (task.built.kernel, key), outcome)

    interleaved = _interleavable(family, tasks, settings)
    if interleaved:
        for task in interleaved:
            run_task(task, task.keys, 1)
        round_medians.clear()  # the validation sample is not part of the label
        if not _time_interleaved(family, interleaved, keys, merged, round_medians, settings,
                                 worker):
            interleaved = []
            merged.clear()
    isolated = [task for task in tasks if task not in interleaved]
    for r in range(rounds):
        shift = r * max(1, len(isolated) // rounds) if isolated else 0
        for task in isolated[shift:] + isolated[:shift]:
            count = _split(task.samples, rounds)[r]
            todo = [k for k in task.keys
                    if count and merged.get((task.built.kernel, k), (JobOutcome("ok"),))[0].status == "ok"]
            if todo:
                run_task(task, todo, count)
        for key in peers:
            count = _split(settings.protocol.samples, rounds)[r]
            if count:
                name, fn = family.peer(prepare(key), settings.protocol.threads)
                outcome = measure_callable(fn, settings.protocol, samples=count)
                _merge(merged, ("peer", key), outcome, None)
                _round_median(round_medians, ("peer", key), outcome)
    for _ in range(settings.retry_disturbed):
        for task in isolated:
            todo = [k for k in task.keys
                    if _all_disturbed(merged.get((task.built.kernel, k), (JobOutcome("ok"),))[0])]
            if todo:
                run_task(task, todo, _split(task.samples, rounds)[0])
    for task in tasks:
        b = task.built
        for key in task.keys:
            ps, problem = keys[key]
            outcome, error = merged[b.kernel, key]
            done[key, b.kernel, phase] = rec.write(ps, problem, b.kernel, b.config, "candidate",
                                                   phase, outcome, b.event.binary_bytes, error,
                                                   round_medians[b.kernel, key],
                                                   "interleaved" if task in interleaved else "isolated",
                                                   build_key=b.cache_key)
    for key in peers:
        ps, problem = keys[key]
        name, _ = family.peer(prepare(key), settings.protocol.threads)
        done[key, "peer", phase] = rec.write(ps, problem, name, None, "peer", phase,
                                             merged["peer", key][0],
                                             round_medians=round_medians["peer", key])


def _confirm(family, builts, keys, prepare, rec, done, settings, worker) -> None:
    by_kernel = {b.kernel: b for b in builts}
    plan: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for key in keys:
        screen = {k: r for (dk, k, ph), r in done.items() if dk == key and ph == "screen"
                  and k in by_kernel and by_kernel[k].binary is not None}
        if any(r.get("timing") == "interleaved" for r in screen.values()):
            continue  # raced instead, once every batch is screened (`_race`)
        for kernel, n_samples in _finalists(screen, settings):
            if (key, kernel, "confirm") not in done and n_samples > 0:
                plan[kernel].append((key, n_samples))
    tasks = []
    for kernel, items in sorted(plan.items()):
        for n_samples in sorted({n for _, n in items}):
            tasks.append(_Task(by_kernel[kernel], [k for k, n in items if n == n_samples], n_samples))
    _execute(family, tasks, [], keys, prepare, rec, "confirm", done, settings, worker)


def _race(family, builts, problems, done, rec: _Recorder, settings: BenchSettings,
          worker: interleave.Worker, progress: Callable[[int, int, str], None]) -> None:
    """The interleaved protocol's confirmation. Measured on the 2-core VM (README:
    Measurement), a problem's screening cycles, all within its batch's half minute, can sit
    in one state of the machine that ranks its leaders otherwise than the next run's state
    does. So once every batch is screened, each problem's contenders
    (`interleave.contenders` of its in-window screen times) get `race_cycles` more samples
    in `race_rounds` rounds over all problems, spread over the rest of the run, each round one
    worker plan; with `race_fresh_process` each in a new worker with its operands at
    random offsets, so the bias a process gives a kernel differs from round to round. The
    contenders are taken wide (`race_margin_pct` of the best's screen time: six screening
    samples put the next run's winner 10-25 % behind in one problem in six,
    docs/journal/2026-12-02-avx2-epyc.md) and narrowed after each round but the last to those within
    `race_keep_pct` of the round's best (`interleave.survivors`), so the later rounds'
    cycles go to the close ones. A round's in-window samples are put on the screen's scale through its contenders (the median ratio of their screen
    to their round times), so a contender's pooled label (`dataset.final_table`) still
    compares with the screen labels of the problem's other candidates. A problem raced
    before a resume is not raced again; a round whose worker fails ends the racing (the
    screen labels stand, with a warning)."""
    by_kernel = {b.kernel: b for b in builts if b.binary is not None}
    keys = {family.dims_key(problem): (ps, problem) for ps, problem in problems}
    screens: dict[str, dict[str, dict]] = defaultdict(dict)
    raced = set()
    for (key, kernel, phase), record in done.items():
        if key in keys and kernel in by_kernel:
            if phase == "confirm":
                raced.add(key)
            elif (record.get("timing") == "interleaved" and record["status"] == "ok"
                  and record.get("median_s")):
                screens[key][kernel] = record
    margin = settings.race_margin_pct / 100
    racing = {key: interleave.contenders({k: r["median_s"] for k, r in screen.items()}, margin)
             for key, screen in screens.items() if key not in raced and len(screen) > 1}
    racing = {key: kernels for key, kernels in racing.items() if kernels}
    counts = _race_rounds(settings)
    if not racing or not counts:
        return
    # a run resumed with `bench.interleave: false` (or a library gone) cannot race these
    raceable = {key: kernels for key, kernels in racing.items()
                if settings.interleave and all(k in settings.libraries for k in kernels)}
    if len(raceable) < len(racing):
        log.warning("bench %s: %d problem(s) screened the interleaved way cannot be raced "
                    "(interleave off or an in-process library missing); their screen labels "
                    "stand", family.name, len(racing) - len(raceable))
    racing = raceable
    if not racing:
        return
    outcomes = {(kernel, key): JobOutcome("ok")
                for key, kernels in racing.items() for kernel in kernels}
    errors: dict[tuple[str, str], float | None] = {}
    round_medians: dict[tuple[str, str], list[float]] = defaultdict(list)
    started, finished = time.perf_counter(), 0
    keep = settings.race_keep_pct / 100
    for index, count in enumerate(counts, 1):
        pairs = [(kernel, key) for key, kernels in racing.items() for kernel in kernels]
        plan = interleave.Plan(
            family=family.name,
            libraries={kernel: str(settings.libraries[kernel]) for kernel, _ in pairs},
            problems=[(key, family.problem_dict(keys[key][1]), _data_seed(settings, key))
                      for key in racing],
            pairs=pairs, cycles=count, protocol=asdict(settings.protocol),
            seed=settings.seed + index + zlib.crc32(",".join(racing).encode()),
            # drawn afresh by every run: two runs of one config must not share a placement
            placement_seed=secrets.randbits(31) if settings.race_fresh_process else None)
        if settings.race_fresh_process:
            worker.close()   # the next plan starts a new process: libraries, buffers and all
        try:
            timings = worker.measure(plan)
        except interleave.InterleaveError as err:
            log.warning("bench %s: race round %d failed (%s); %s", family.name, index, err,
                        "the screen labels stand" if not finished else
                        f"the contenders keep {finished} round(s)")
            break
        for key, kernels in racing.items():
            _fold_round(screens[key], {kernel: timings[kernel, key] for kernel in kernels},
                        key, outcomes, errors, round_medians)
        if index < len(counts):
            racing = {key: interleave.survivors({kernel: timings[kernel, key]
                                                 for kernel in kernels}, keep)
                      for key, kernels in racing.items()}
        finished += 1
        elapsed = time.perf_counter() - started
        progress(index, len(counts), f"bench {family.name}: race round {index}/{len(counts)} "
                 f"done, {len(pairs)} contenders of {len(racing)} problems, elapsed "
                 f"{elapsed:.0f}s, eta {elapsed / index * (len(counts) - index):.0f}s")
    if not finished:
        return
    for (kernel, key), outcome in outcomes.items():
        ps, problem = keys[key]
        built = by_kernel[kernel]
        done[key, kernel, "confirm"] = rec.write(ps, problem, kernel, built.config, "candidate",
                                                 "confirm", outcome, built.event.binary_bytes,
                                                 errors.get((kernel, key)),
                                                 round_medians[kernel, key], "interleaved",
                                                 build_key=built.cache_key)


def _fold_round(screen: Mapping[str, dict], timings: Mapping[str, interleave.PairTiming], key,
                outcomes: dict, errors: dict, round_medians: dict) -> None:
    """Add one race round's samples of one problem's contenders to their outcomes, on the
    screen's scale; the first failure of a contender is final."""
    ratios = [math.log(stats.median(screen[kernel]["samples_s"])
                       / stats.median(timing.samples_s))
              for kernel, timing in timings.items()
              if timing.status == "ok" and timing.samples_s and screen[kernel]["samples_s"]]
    scale = math.exp(stats.median(ratios)) if ratios else 1.0
    for kernel, timing in timings.items():
        acc = outcomes[kernel, key]
        if acc.status != "ok":
            continue
        if timing.status != "ok":
            outcomes[kernel, key] = JobOutcome(timing.status, timing.reason, timing.reps)
            errors[kernel, key] = timing.max_error
            continue
        samples = [seconds * scale for seconds in timing.samples_s]
        acc.samples_s.extend(samples)
        acc.reps = min(acc.reps, timing.reps) if acc.reps else timing.reps
        acc.retaken += timing.retaken
        acc.disturbed_samples_s.extend(seconds * scale for seconds in timing.disturbed_samples_s)
        acc.window_factors.extend(factor / scale for factor in timing.window_factors)
        acc.window_probes_us.extend(timing.window_probes_us)
        errors[kernel, key] = max(errors.get((kernel, key)) or 0.0, timing.max_error or 0.0)
        if samples:
            round_medians[kernel, key].append(stats.median(samples))
