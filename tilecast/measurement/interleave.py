"""The interleaved protocol: a batch's validated candidates timed side by side in one process.

Why (measured on the 2-core AVX2 EPYC VM, README "Measurement"): the machine switches
between states lasting 0.2-6 s (the cores' barrier latency 76 vs 120 us, and states no
canary sees), and each kernel feels a state differently. Timing each candidate in its own
process, one after another, gave each kernel its own mixture of states: one run's winners
scored 0.89 mean / 0.64 P10 on another's. Timing all candidates of a batch in one process,
one sample each per cycle in a shuffled order (problems and kernels), spreads every pair's
samples over the same stretch of time, so every candidate sees the same mixture: 0.987 /
0.961 on the same kernels, shapes and hour. Within a cycle a problem's candidates run within
a fraction of a second of each other, so each sample is also divided by its cycle's window
factor (`_window_factors`): a window that slowed every candidate of the problem does not
decide which looks fastest. One process also means one memory allocator,
one OpenMP team and the same input buffers for every candidate of a problem.

The candidates were first run alone in their own processes (`bench`): a kernel that
crashes, hangs or computes wrong numbers is a record before it gets here. This module still
runs in a worker process of its own (`measure`), so a fault costs the batch's interleaved
timing, which `bench` then takes the isolated way, never the pipeline.

A family takes part by offering `timer(library, prepared, threads, output) -> time(reps) ->
seconds per call` over its in-process library, writing into `output` (`families.gemm`), and
`output_tensor(prepared)`: one output buffer per problem, shared by its candidates (its
first elements the reference's, in the reference's order), each candidate's result checked
against the reference right after its warm-up.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from tilecast.families import get_family
from tilecast.core.family import norm_relative_error
from tilecast.measurement.protocol import Protocol, cpu_stall_us


class InterleaveError(RuntimeError):
    """The worker died, hung or wrote no result: the batch is timed the isolated way."""


@dataclass(frozen=True)
class Plan:
    """What one worker times: `pairs` (kernel, dims_key) of `problems` ((dims_key, problem
    fields, data seed)), each kernel's in-process library, `cycles` samples per pair."""
    family: str
    libraries: Mapping[str, str]
    problems: Sequence[tuple[str, Mapping, int]]
    pairs: Sequence[tuple[str, str]]
    cycles: int
    protocol: Mapping
    seed: int = 0
    # None: operands where the family put them; else each problem's operands and output are
    # copied to random 64-byte offsets within a page (`_placed`), drawn from this seed
    placement_seed: int | None = None


@dataclass
class PairTiming:
    """One pair's interleaved samples (seconds per call), as measure.JobOutcome holds them.
    `samples_s` are in-window times: each raw time divided by its cycle's factor in
    `window_factors` (see `_window_factors`); `sample_cycles` says which cycle took each."""
    status: str = "ok"
    reason: str = ""
    reps: int = 0
    samples_s: list = field(default_factory=list)
    disturbed_samples_s: list = field(default_factory=list)
    retaken: int = 0
    max_error: float | None = None
    window_factors: list = field(default_factory=list)
    sample_cycles: list = field(default_factory=list)
    # the barrier probe taken just before the sample's problem block in its cycle: the
    # machine's state in that window (the VM's vCPUs placed on one core's SMT siblings, in
    # one CCX or across two read clearly apart), recorded for state-aware labels
    window_probes_us: list = field(default_factory=list)


# a cycle's factor needs this many of the problem's pairs sampled in it; else it stays 1
MIN_PAIRS_FOR_FACTOR = 3
# the most candidates of one problem raced after the screening (`contenders`)
RACE_MAX = 16


def supports(family) -> bool:
    """Whether `family` offers an in-process timer (and so the interleaved protocol)."""
    return callable(getattr(family, "timer", None))


def _size_reps(time_calls: Callable[[int], float], protocol: Protocol) -> int:
    """Warm up for warmup_ms; reps so one sample lasts >= min_sample_ms, sized from the
    fastest warm-up call (the first pays for page faults), as the harness does."""
    fastest, start = math.inf, time.perf_counter()
    while True:
        fastest = min(fastest, time_calls(1))
        if (time.perf_counter() - start) * 1e3 >= protocol.warmup_ms:
            break
    wanted = math.ceil(protocol.min_sample_ms / 1e3 / max(fastest, 1e-9))
    return int(min(max(1, wanted), protocol.max_reps))


def run(plan: Plan, scratch: Path, progress: Callable[[str], None] = lambda _: None) -> dict:
    """Time the plan's pairs in this process; {"kernel|dims_key": PairTiming as a dict}."""
    import torch   # the worker's: bench imports this module without torch

    family = get_family(plan.family)
    protocol = Protocol.from_mapping(plan.protocol)
    torch.set_num_threads(protocol.threads)
    prepared = {key: family.prepare(family.problem(fields), scratch / f"p{i}", seed=seed)
                for i, (key, fields, seed) in enumerate(plan.problems)}
    outputs = {key: family.output_tensor(p) for key, p in prepared.items()}
    if plan.placement_seed is not None:
        placer = random.Random(plan.placement_seed)
        prepared = {key: replace(p, tensors={name: _placed(t, placer) for name, t in p.tensors.items()})
                    for key, p in prepared.items()}
        outputs = {key: _placed(t, placer) for key, t in outputs.items()}
    timings = {pair: PairTiming() for pair in map(tuple, plan.pairs)}
    timers = {}
    for kernel, key in timings:
        timing = timings[kernel, key]
        try:
            time_calls = family.timer(Path(plan.libraries[kernel]), prepared[key],
                                      protocol.threads, outputs[key])
            timing.reps = _size_reps(time_calls, protocol)
        except (OSError, RuntimeError) as err:
            timing.status, timing.reason = "crashed", f"in-process library: {err}"
            continue
        # checked now: the problem's other candidates write the same buffer later
        reference = prepared[key].reference
        result = outputs[key].numpy().reshape(-1)[:reference.size].reshape(reference.shape)
        timing.max_error = float(norm_relative_error(result, reference))
        tol = family.tolerance(prepared[key].problem)
        if not timing.max_error <= tol:
            timing.status, timing.reason = "wrong_result", (
                f"in-process norm-relative error {timing.max_error:.3g} > tolerance {tol:g}")
            continue
        timers[kernel, key] = time_calls
    probe = _sync_probe(plan.libraries[next(iter(timers))[0]]) if timers else None
    rng = random.Random(plan.seed)
    by_problem: dict[str, list] = {}
    for pair in timers:
        by_problem.setdefault(pair[1], []).append(pair)
    extra_cycles = 0
    cycle = 0
    while True:
        short = {pair for pair in timers if len(timings[pair].samples_s) < plan.cycles}
        if cycle >= plan.cycles:
            # a pair left short by the contention guard gets more cycles, `retakes` at most
            if not short or extra_cycles >= protocol.retakes:
                break
            extra_cycles += 1
        keys = list(by_problem)
        rng.shuffle(keys)
        for key in keys:
            pairs = [p for p in by_problem[key] if cycle < plan.cycles or p in short]
            rng.shuffle(pairs)
            probe_us = probe() if probe is not None and pairs else -1.0
            for pair in pairs:
                _sample(timers[pair], timings[pair], protocol, cycle, probe_us)
        cycle += 1
        progress(f"cycle {cycle}: {len(timers)} pairs")
    for pairs in by_problem.values():
        _window_factors([timings[pair] for pair in pairs])
    return {f"{kernel}|{key}": asdict(t) for (kernel, key), t in timings.items()}


# a placed tensor starts this many bytes, a multiple of PLACEMENT_STEP, into its own buffer
PLACEMENT_SPAN, PLACEMENT_STEP = 4096, 64


def _placed(tensor, rng: random.Random):
    """A copy of `tensor` (same sizes and strides) starting at a random multiple of 64 bytes
    within a page of a fresh allocation: where a problem's operands and output sit relative
    to each other, to page boundaries and to cache sets is drawn anew for each plan, so a
    kernel that one placement happens to favour (4K aliasing, conflicting sets) is not
    favoured in every sample of a run."""
    import torch

    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    shift = rng.randrange(PLACEMENT_SPAN // PLACEMENT_STEP) * PLACEMENT_STEP // tensor.element_size()
    storage = torch.empty(span + shift, dtype=tensor.dtype)
    placed = storage.as_strided(tensor.shape, tensor.stride(), shift)
    placed.copy_(tensor)
    return placed


def _window_factors(pairs: Sequence[PairTiming], sweeps: int = 10) -> None:
    """Compare like with like: every candidate of a problem took one sample per cycle, within
    a fraction of a second of each other. Each log time is split into the pair's level plus
    its cycle's window effect (Tukey's median polish: alternate medians over cycles and over
    pairs; a cycle with fewer than MIN_PAIRS_FOR_FACTOR of the problem's pairs keeps effect
    0), window effects measured from the median cycle. Each sample is then divided by its
    cycle's factor exp(effect), so a window in which the machine slowed every candidate (on
    the 2-core VM: 2-3x for microsecond kernels, in some of a problem's cycles only) no
    longer decides which of them looks fastest. The factors are kept: raw = sample * factor."""
    logs = [np.log(np.asarray(t.samples_s, dtype=float)) for t in pairs]
    cycles = [np.asarray(t.sample_cycles, dtype=int) for t in pairs]
    counts: dict[int, int] = {}
    for owned in cycles:
        for cycle in owned:
            counts[int(cycle)] = counts.get(int(cycle), 0) + 1
    effect = {cycle: 0.0 for cycle in counts}
    levels = [float(np.median(values)) if len(values) else 0.0 for values in logs]
    for _ in range(sweeps):
        residuals: dict[int, list[float]] = {}
        for values, owned, level in zip(logs, cycles, levels):
            for value, cycle in zip(values, owned):
                residuals.setdefault(int(cycle), []).append(value - level)
        effect = {cycle: float(np.median(values)) if counts[cycle] >= MIN_PAIRS_FOR_FACTOR
                  else 0.0 for cycle, values in residuals.items()}
        levels = [float(np.median(values - np.array([effect[int(c)] for c in owned])))
                  if len(values) else 0.0 for values, owned in zip(logs, cycles)]
    counted = [value for cycle, value in effect.items() if counts[cycle] >= MIN_PAIRS_FOR_FACTOR]
    center = float(np.median(counted)) if counted else 0.0
    for timing, owned in zip(pairs, cycles):
        timing.window_factors = [float(np.exp(effect[int(c)] - center))
                                 if counts[int(c)] >= MIN_PAIRS_FOR_FACTOR else 1.0 for c in owned]
        timing.samples_s = [seconds / factor
                            for seconds, factor in zip(timing.samples_s, timing.window_factors)]


def contenders(levels: Mapping[str, float], margin: float) -> list[str]:
    """The kernels of one problem worth racing, fastest first: in-window time (`levels`,
    seconds) within `margin` of the best's, and the best MIN_PAIRS_FOR_FACTOR at least (so
    a race cycle still has a window factor), RACE_MAX at most."""
    ranked = sorted(levels, key=lambda kernel: (levels[kernel], kernel))
    if not ranked:
        return []
    limit = levels[ranked[0]] * (1 + margin)
    return [kernel for rank, kernel in enumerate(ranked)
            if rank < MIN_PAIRS_FOR_FACTOR or levels[kernel] <= limit][:RACE_MAX]


def survivors(timings: Mapping[str, PairTiming], keep: float) -> list[str]:
    """The contenders of one problem that stay in the race after a round, fastest first:
    the round's median in-window time within `keep` of the best's, and the best
    MIN_PAIRS_FOR_FACTOR at least (the next round's cycles still get a window factor). A
    contender that failed, or has no sample in the round, leaves."""
    levels = {kernel: float(np.median(timing.samples_s)) for kernel, timing in timings.items()
              if timing.status == "ok" and timing.samples_s}
    return contenders(levels, keep)


def _sync_probe(library: str) -> Callable[[], float] | None:
    """The barrier probe of the kernels' OpenMP team (every library links the same runtime),
    or None for a library built before the probe existed."""
    entry = getattr(ctypes.CDLL(library), "tilecast_sync_probe_us", None)
    if entry is None:
        return None
    entry.restype, entry.argtypes = ctypes.c_double, []
    return entry


def _sample(time_calls, timing: PairTiming, protocol: Protocol, cycle: int,
            probe_us: float) -> None:
    """One sample: an untimed call (this pair's data back in cache after the others ran)
    unless one call fills a sample alone, then `reps` calls timed; one during which tasks
    waited for a CPU is kept apart."""
    if timing.reps > 1:
        time_calls(1)
    stall_before = cpu_stall_us()
    seconds = time_calls(timing.reps)
    stall_after = cpu_stall_us()
    contended = (stall_before is not None and stall_after is not None
                 and (stall_after - stall_before) * 1e-6 > protocol.stall_limit * seconds * timing.reps)
    if contended:
        timing.disturbed_samples_s.append(seconds)
        timing.retaken += 1
    else:
        timing.samples_s.append(seconds)
        timing.sample_cycles.append(cycle)
        timing.window_probes_us.append(probe_us)


class Worker:
    """A worker process (`python -m tilecast.measurement.interleave`) serving plans one after another,
    so a benchmark pays Python's and torch's start-up (about 3 s here) once, not per batch.
    Started at the first plan; one that died or hung is ended and started afresh at the next.
    Use it as a context manager, or call `close`."""

    def __init__(self, protocol: Protocol, scratch: Path):
        self.protocol = protocol
        self.scratch = Path(scratch)
        self._proc: subprocess.Popen | None = None
        self._stderr_path: Path | None = None
        self._buffer = b""

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> subprocess.Popen:
        self.scratch.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix="interleave-worker-", suffix=".stderr",
                                        dir=self.scratch)
        self._stderr_path = Path(name)
        with os.fdopen(handle, "wb") as stderr:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tilecast.measurement.interleave"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr, env=self.protocol.env(),
                start_new_session=True)
        self._buffer = b""
        return self._proc

    def close(self) -> None:
        """End the worker (closing its input ends its loop; a stuck one is killed)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)  # our own session: the worker only
            proc.wait()
        proc.stdout.close()
        self._forget_stderr()

    def _forget_stderr(self) -> None:
        if self._stderr_path is not None:
            self._stderr_path.unlink(missing_ok=True)
            self._stderr_path = None

    def _failed(self, why: str) -> InterleaveError:
        tail = ""
        if self._stderr_path is not None and self._stderr_path.exists():
            tail = self._stderr_path.read_text(errors="replace")[-600:].strip()
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
        self._forget_stderr()
        return InterleaveError(f"{why}: {tail}" if tail else why)

    def measure(self, plan: Plan, timeout_s: float | None = None) -> dict[tuple[str, str], PairTiming]:
        """Time `plan`; InterleaveError if the worker dies, hangs past `timeout_s` (default:
        every pair's warm-up and samples at ten times their nominal length, plus start-up)
        or fails the plan."""
        protocol = self.protocol
        if timeout_s is None:
            per_pair = protocol.warmup_ms + (plan.cycles + protocol.retakes) * 2 * protocol.min_sample_ms
            timeout_s = 120 + 10 * len(plan.pairs) * per_pair / 1e3
        if self._proc is not None and self._proc.poll() is not None:
            self._failed("died between plans")   # tidied up; a new one starts below
        proc = self._proc if self._proc is not None else self._start()
        with tempfile.TemporaryDirectory(prefix="interleave-", dir=self.scratch) as tmp:
            plan_path, result_path = Path(tmp) / "plan.json", Path(tmp) / "result.json"
            plan_path.write_text(json.dumps(asdict(plan)))
            try:
                proc.stdin.write(f"{plan_path}\t{result_path}\t{Path(tmp) / 'data'}\n".encode())
                proc.stdin.flush()
            except OSError as err:
                raise self._failed(f"interleaved worker gone ({err})") from None
            reply = self._reply(timeout_s)
            if reply != "DONE" or not result_path.exists():
                raise self._failed(f"interleaved worker: {reply}")
            raw = json.loads(result_path.read_text())
        result = {}
        for name, values in raw.items():
            kernel, key = name.split("|", 1)
            result[kernel, key] = PairTiming(**values)
        return result

    def _reply(self, timeout_s: float) -> str:
        """The worker's next line, or why there is none."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self._proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return f"hung past {timeout_s:.0f} s"
                if not selector.select(timeout=min(remaining, 1.0)):
                    continue
                chunk = os.read(self._proc.stdout.fileno(), 65536)
                if not chunk:
                    return f"exited with status {self._proc.wait()}"
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode(errors="replace").strip()


def measure(plan: Plan, scratch: Path, protocol: Protocol, *,
            timeout_s: float | None = None) -> dict[tuple[str, str], PairTiming]:
    """Time one plan in a worker of its own; see Worker.measure."""
    with Worker(protocol, scratch) as worker:
        return worker.measure(plan, timeout_s)


def _serve() -> int:
    """The worker's loop: one `plan result data` line in, the result file and one line out
    (DONE, or ERROR and why), until its input closes."""
    for line in sys.stdin:
        if not line.strip():
            continue
        plan_path, result_path, data_dir = map(Path, line.rstrip("\n").split("\t"))
        try:
            values = json.loads(plan_path.read_text())
            values["problems"] = [tuple(p) for p in values["problems"]]
            values["pairs"] = [tuple(p) for p in values["pairs"]]
            result = run(Plan(**values), data_dir,
                         progress=lambda text: print(text, file=sys.stderr, flush=True))
            tmp = result_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, result_path)
            reply = "DONE"
        except Exception as err:  # noqa: BLE001 - reported to the parent, which falls back
            reply = f"ERROR {type(err).__name__}: {err}".replace("\n", " ")
        print(reply, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
