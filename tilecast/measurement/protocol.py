"""The measurement protocol, one implementation for every family.

The timing loop itself lives in `kernels/cpu/common/harness.hpp` (warm-up, repetitions per sample
sized from a minimum sample time, N samples, optional cache flush) so that it runs next to
the kernel; this module owns the protocol's parameters, runs each candidate binary as an
isolated subprocess with a per-job timeout, and turns its output into outcomes. A kernel that
crashes or hangs becomes a `crashed` / `timeout` outcome and the remaining jobs go on in a
fresh process. `measure_callable` applies the same protocol to an in-process peer (torch).
A harness that rejects its command line (a usage error: nothing was measured) marks every job
of the process with the USAGE_ERROR reason, which no later run takes as a measurement.
"""
from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import selectors
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from tilecast.core.dataset import USAGE_ERROR, is_usage_error  # noqa: F401  (as before)
from tilecast.core.hardware import cpu_count


class ProtocolError(ValueError):
    """An invalid measurement protocol setting."""


# how harness.hpp's usage text starts (detail::kUsage)
_HARNESS_USAGE = "usage: <binary>"

# Protocol fields that count something: whole numbers, never booleans or fractions (the
# harness rejects `--samples 2.5` as a usage error) -> their least allowed value.
_COUNTS = {"samples": 1, "max_reps": 1, "threads": 1, "retakes": 0}
# protocol.threads: measure with as many threads as this machine has cores (the default): a
# label is only true of the thread count it was measured with, and that is a hardware class's
AUTO_THREADS = "auto"
_NUMBERS = ("warmup_ms", "min_sample_ms", "timeout_s", "stall_limit", "sync_limit")


@dataclass(frozen=True)
class Protocol:
    """How every candidate is timed; see the module docstring."""
    warmup_ms: float = 20.0
    min_sample_ms: float = 10.0
    samples: int = 7
    max_reps: int = 10000
    flush_cache: bool = False
    threads: int | str = AUTO_THREADS   # "auto": this machine's cores (core.hardware.cpu_count)
    timeout_s: float = 60.0
    # Contention guard (see harness.hpp): a sample during which tasks waited for a CPU for
    # more than stall_limit of its time is re-taken, at most `retakes` times per job.
    retakes: int = 10
    stall_limit: float = 0.05
    # Synchronization guard (harness.hpp SyncGuard): a sample next to a barrier probe slower
    # than sync_limit x the fastest probe seen is kept apart as disturbed (0 turns it off).
    sync_limit: float = 1.5

    def __post_init__(self):
        if self.threads == AUTO_THREADS:
            object.__setattr__(self, "threads", cpu_count())
        for name in _NUMBERS:
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                    or not math.isfinite(value)):
                raise ProtocolError(f"protocol {name}={value!r} must be a finite number")
        for name, least in _COUNTS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ProtocolError(f"protocol {name}={value!r} must be a whole number >= {least}")
            object.__setattr__(self, name, int(value))   # a numpy integer becomes a plain int
        if not isinstance(self.flush_cache, bool):
            raise ProtocolError(f"protocol flush_cache={self.flush_cache!r} must be true or false")
        for name in ("warmup_ms", "min_sample_ms", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ProtocolError(f"protocol {name}={getattr(self, name)!r} must be > 0")
        if not 0 < self.stall_limit <= 1:
            raise ProtocolError(f"protocol stall_limit={self.stall_limit!r} must be in (0, 1]")
        if not (self.sync_limit == 0 or self.sync_limit > 1):
            raise ProtocolError(f"protocol sync_limit={self.sync_limit!r} must be 0 (off) or > 1")

    @classmethod
    def from_mapping(cls, values: Mapping) -> "Protocol":
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ProtocolError(f"unknown protocol key(s) {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**values)

    def argv(self, samples: int | None = None) -> list[str]:
        return ["--warmup-ms", f"{self.warmup_ms:g}", "--min-sample-ms", f"{self.min_sample_ms:g}",
                "--samples", str(samples or self.samples), "--max-reps", str(self.max_reps),
                "--flush", str(int(self.flush_cache)), "--retakes", str(self.retakes),
                "--stall-limit", f"{self.stall_limit:g}",
                *(["--sync-limit", f"{self.sync_limit:g}"] if self.sync_limit else [])]

    def env(self) -> dict[str, str]:
        """Threads counted and pinned: one OpenMP thread per core, bound close."""
        env = dict(os.environ)
        env.update(OMP_NUM_THREADS=str(self.threads), OMP_PROC_BIND="close", OMP_PLACES="cores",
                   OMP_DYNAMIC="false")
        return env


def protocol_hash(protocol: Protocol) -> str:
    """A stable hash of every field of `protocol` (16 hex digits), written into each
    benchmark record: a resumed run reuses only records of its own protocol. Every field
    changes what a record holds: how a sample is taken (warm-up, sample time, repetitions,
    flush, threads, the guards), how many there are, and when a job is given up (a `timeout`
    record under 3 s says nothing under 60 s). Numbers are compared by value (20 == 20.0)."""
    def canonical(value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return value
        return int(value) if float(value).is_integer() else float(value)

    values = {f.name: canonical(getattr(protocol, f.name)) for f in fields(protocol)}
    payload = json.dumps({"protocol_hash": 1, **values}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class JobOutcome:
    """What one job produced: status (a dataset.STATUSES code) and the samples if any."""
    status: str
    reason: str = ""
    reps: int = 0
    samples_s: list[float] = field(default_factory=list)  # undisturbed samples
    retaken: int = 0    # samples re-taken because another task competed for the CPU
    # samples kept although disturbed (the retake allowance ran out, or the cores were slow
    # to meet: harness.hpp SyncGuard); not in samples_s
    disturbed_samples_s: list[float] = field(default_factory=list)
    # interleaved protocol only: each sample's window factor (samples_s = raw / factor)
    window_factors: list[float] = field(default_factory=list)
    window_probes_us: list[float] = field(default_factory=list)   # and its barrier probe

    @property
    def disturbed(self) -> int:
        return len(self.disturbed_samples_s)


def _usage_outcome(stderr_tail: str) -> JobOutcome:
    """The outcome of every job of a process whose harness printed its usage and exited 2."""
    lines = [line.strip() for line in stderr_tail.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("error:")), lines[0] if lines else "")
    return JobOutcome("crashed", f"{USAGE_ERROR} (exit 2, nothing measured): "
                                 f"{said.removeprefix('error:').strip()}")


def _parse_line(line: str) -> tuple[str, JobOutcome] | None:
    parts = line.strip().split(maxsplit=2)
    if len(parts) < 2:
        return None
    tag, job_id = parts[0], parts[1]
    rest = parts[2] if len(parts) > 2 else ""
    if tag == "OK":
        values = rest.split()
        try:
            reps, retaken, disturbed = (int(v) for v in values[:3])
            samples = [float(v) for v in values[3:]]
        except ValueError:
            return job_id, JobOutcome("crashed", f"malformed result line {line.strip()!r}")
        if not 0 <= disturbed <= len(samples):
            return job_id, JobOutcome("crashed", f"malformed result line {line.strip()!r}")
        clean = len(samples) - disturbed  # the harness prints disturbed samples last
        return job_id, JobOutcome("ok", "", reps, samples[:clean], retaken, samples[clean:])
    if tag == "UNSUPPORTED":
        return job_id, JobOutcome("unsupported", rest)
    if tag == "ERROR":
        return job_id, JobOutcome("crashed", f"kernel error: {rest}")
    return None


def _describe_exit(returncode: int, stderr_tail: str) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with status {returncode}: {stderr_tail}".strip()


def _release_affinity() -> None:
    """In the child before exec: run on every CPU of the machine. A parent whose threads were
    pinned (torch under OMP_PROC_BIND pins the calling thread to one core) would otherwise
    pass its one-core mask on, and the kernel's threads would share that core."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        pass  # a cpuset narrower than the machine: keep what we are allowed


class SyncBaseline:
    """The fastest synchronization probe (microseconds) the harness processes of this Python
    process reported, per thread count: handed to the next process as --sync-baseline-us, so a
    process that starts inside a slow spell still knows what quiet looks like. Also the
    binaries found to predate the guard, so each is tried with its flags only once."""

    def __init__(self) -> None:
        self._fastest_us: dict[int, float] = {}
        self.predating: set[Path] = set()

    def argv(self, threads: int) -> list[str]:
        fastest = self._fastest_us.get(threads)
        return [] if fastest is None else ["--sync-baseline-us", f"{fastest:.3f}"]

    def report(self, threads: int, line: str) -> bool:
        """Fold a harness `SYNC <us>` line in; False when `line` is not one."""
        parts = line.split()
        if len(parts) != 2 or parts[0] != "SYNC":
            return False
        try:
            probe = float(parts[1])
        except ValueError:
            return False
        if probe > 0 and probe < self._fastest_us.get(threads, float("inf")):
            self._fastest_us[threads] = probe
        return True


SYNC_BASELINE = SyncBaseline()


def run_binary(binary: Path, jobs: Sequence[tuple[str, Sequence[str]]], protocol: Protocol,
               samples: int | None = None) -> dict[str, JobOutcome]:
    """Run `jobs` (job id, tokens) through one candidate binary, isolated in subprocesses.

    Results stream back one line per job; a job that outlives `protocol.timeout_s` is killed
    (`timeout`), a process that dies mid-job marks that job `crashed`, and the jobs after it
    run in a fresh process, so one bad shape never costs the others.
    """
    outcomes: dict[str, JobOutcome] = {}
    pending = list(jobs)
    binary = Path(binary)
    if binary in SYNC_BASELINE.predating:
        protocol = replace(protocol, sync_limit=0)
    while pending:
        try:
            done = _run_once(binary, pending, protocol, samples)
        except _PredatesSyncGuard:
            # a binary built before the guard (a rebenchmark of an older commit) rejects the
            # flag: it runs without it, as it was measured then
            SYNC_BASELINE.predating.add(binary)
            protocol = replace(protocol, sync_limit=0)
            continue
        outcomes.update(done)
        pending = [job for job in pending if job[0] not in outcomes]
    return outcomes


class _PredatesSyncGuard(Exception):
    """The binary's harness has no --sync-limit flag."""


def _run_once(binary: Path, jobs, protocol: Protocol, samples) -> dict[str, JobOutcome]:
    outcomes: dict[str, JobOutcome] = {}
    with tempfile.TemporaryDirectory(prefix="tilecast-jobs-") as tmp:
        jobs_path = Path(tmp) / "jobs.txt"
        jobs_path.write_text("".join(f"{job_id} {' '.join(tokens)}\n" for job_id, tokens in jobs))
        stderr_path = Path(tmp) / "stderr.txt"
        with open(stderr_path, "wb") as stderr:
            argv = protocol.argv(samples)
            if protocol.sync_limit:
                argv += SYNC_BASELINE.argv(protocol.threads)
            proc = subprocess.Popen([str(binary), *argv, "--jobs", str(jobs_path)],
                                    stdout=subprocess.PIPE, stderr=stderr, env=protocol.env(),
                                    start_new_session=True, preexec_fn=_release_affinity)
        expected = [job_id for job_id, _ in jobs]
        current = 0
        timed_out = False
        buffer = b""
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + protocol.timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                if not sel.select(timeout=min(remaining, 1.0)):
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break  # end of output: the process exited (or closed stdout)
                buffer += chunk
                while b"\n" in buffer:
                    raw, buffer = buffer.split(b"\n", 1)
                    text = raw.decode(errors="replace")
                    if SYNC_BASELINE.report(protocol.threads, text):
                        continue
                    parsed = _parse_line(text)
                    if parsed is None:
                        continue
                    job_id, outcome = parsed
                    outcomes[job_id] = outcome
                    while current < len(expected) and expected[current] in outcomes:
                        current += 1
                    deadline = time.monotonic() + protocol.timeout_s
        finally:
            sel.close()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # our own session: the binary and nothing else
            proc.wait()
            proc.stdout.close()
        if current < len(expected):
            job_id = expected[current]
            if timed_out:
                outcomes[job_id] = JobOutcome("timeout", f"no result within {protocol.timeout_s:g} s")
            else:
                tail = stderr_path.read_text(errors="replace")[-400:].strip()
                if (proc.returncode == 2 and not outcomes and protocol.sync_limit
                        and "unknown flag '--sync-limit'" in tail):
                    raise _PredatesSyncGuard(tail)
                if proc.returncode == 2 and not outcomes and _HARNESS_USAGE in tail:
                    # the command line itself was refused: every job would be, one process each
                    outcomes.update((pending, _usage_outcome(tail))
                                    for pending in expected[current:])
                else:
                    outcomes[job_id] = JobOutcome("crashed", _describe_exit(proc.returncode, tail))
    return outcomes


def cpu_stall_us() -> int | None:
    """Cumulative microseconds some task waited for a CPU (Linux pressure stall information,
    /proc/pressure/cpu "some total"); None where the kernel does not provide it."""
    try:
        with open("/proc/pressure/cpu") as f:
            first = f.readline()
    except OSError:
        return None
    for token in first.split():
        if token.startswith("total="):
            return int(token[6:])
    return None


def measure_callable(fn: Callable[[], object], protocol: Protocol,
                     samples: int | None = None) -> JobOutcome:
    """The harness's protocol applied to a Python callable (a peer such as torch.matmul).

    Repetitions per sample are sized from the fastest warm-up call, so a slow first call
    (lazy initialisation, page faults) cannot shrink a sample to a single noisy call. The
    contention guard is the harness's: disturbed samples are re-taken up to protocol.retakes."""
    start = time.perf_counter()
    fastest = float("inf")
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        fastest = min(fastest, t1 - t0)
        if (t1 - start) * 1e3 >= protocol.warmup_ms:
            break
    reps = min(max(1, math.ceil(protocol.min_sample_ms / 1e3 / max(fastest, 1e-9))), protocol.max_reps)
    times: list[float] = []
    disturbed: list[float] = []
    retaken = 0
    while len(times) + len(disturbed) < (samples or protocol.samples):
        stall_before = cpu_stall_us()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        seconds = time.perf_counter() - t0
        stall_after = cpu_stall_us()
        busy = (stall_before is not None and stall_after is not None
                and (stall_after - stall_before) * 1e-6 > protocol.stall_limit * seconds)
        if busy and retaken < protocol.retakes:
            retaken += 1
            continue
        (disturbed if busy else times).append(seconds / reps)
    return JobOutcome("ok", "", reps, times, retaken, disturbed)
