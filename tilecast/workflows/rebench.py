"""CI-triggered rebenchmark: re-measure each family's sentinel problems with every candidate
kernel, store the run in a history, and compare it with the previous run
(tilecast.workflows.regression). The workdir's paths come from tilecast.stages.layout:

    W/rebench/src/<sha>/kernels/          the kernel sources of --git-ref (git archive)
    W/rebench/<family>.jsonl              the run in progress: raw records; a re-run resumes it
                                          (same binaries and hardware) or sets it aside in stale/
    W/rebench/runs/<family>-<run>.jsonl   the raw log of a finished run
    H/<family>/<run_id>.jsonl             a finished run's records (atomic)
    H/<family>/latest.json                the last run: file, record count, sha256, hardware,
                                          source, and the run before it (the baseline)
    W/report/rebench_<family>.json        every pair and kernel verdict, baseline run id, sha
    W/report/rebench.md                   the "Rebenchmark" section (also returned as a string)

The baseline of a run is the history's latest run, whatever its problems or source; a run on
other hardware is stored but not compared (exit status 3).

Kernels are built like the build stage (same candidates, same content-hash cache) and measured
with the config's protocol through the benchmark stage's machinery (isolated binaries, torch
reference check, rounds, contention guard); the confirmation phase and the peer are left out,
and the sample count is raised where the protocol's would leave the tests without the power to
see any regression (`regression.required_samples`). Every bad input (unknown family or
problem, bad git ref, unreadable history) is a RebenchError before anything is compiled.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import tarfile
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Sequence

from tilecast.core import hardware, resources
from tilecast.core.atomic import atomic_write_json, atomic_write_text
from tilecast.config import ConfigError, RunConfig, load_config
from tilecast.core.device import default_device, exclusive
from tilecast.measurement.protocol import protocol_hash
from tilecast.measurement.rawlog import read_records
from tilecast.families import get_family
from tilecast.core.family import KERNELS_DIR, FamilyError
from tilecast.runtime.dispatch import parse_problem
from tilecast.core import build
from tilecast.stages import layout
from tilecast.stages.bench import BenchSettings, benchmark
from tilecast.workflows import regression
from tilecast.workflows.pipeline import RunContext, select_candidates

log = logging.getLogger("tilecast.workflows.rebench")

HISTORY_POINTER = "latest.json"
PROBLEM_SET = "sentinel"
MIN_ROUNDS = 4


class RebenchError(ValueError):
    """Bad rebenchmark input or state: an unknown problem, a bad git ref, an unreadable history."""


# -- kernel sources ----------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelSource:
    """Where the kernels are compiled from: the working tree, or one commit's kernels/ tree."""
    kind: str                 # "worktree", "installed" (a package's kernels) or "git"
    kernels_dir: Path
    sha: str                  # the commit (the working tree's HEAD, "unknown" outside git)
    repo: str
    ref: str | None = None
    dirty: bool = False       # the working tree's kernels/ differs from HEAD

    def describe(self) -> dict:
        return {"kind": self.kind, "ref": self.ref, "sha": self.sha, "repo": self.repo,
                "kernels_dir": str(self.kernels_dir), "dirty": self.dirty}

    def label(self) -> str:
        if self.kind == "git":
            return f"git {self.ref} = {self.sha[:12]}"
        if self.kind == "installed":
            return f"installed package at {self.kernels_dir}"
        return f"working tree at {self.sha[:12]}{' (kernels/ modified)' if self.dirty else ''}"


def _git(repo: Path, *args: str, binary: bool = False) -> subprocess.CompletedProcess:
    """`git -C repo args`; a missing git is a failed command (status 127), not an exception."""
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=120,
                              text=not binary)
    except (OSError, subprocess.TimeoutExpired) as err:
        message = f"git {' '.join(args)}: {err}"
        return subprocess.CompletedProcess(args, 127, b"" if binary else "",
                                           message.encode() if binary else message)


def resolve_source(workdir: str | Path, git_ref: str | None = None,
                   repo: str | Path | None = None) -> KernelSource:
    """The working tree's kernels (an installed package's own, without a checkout), or those
    of `git_ref` in `repo` (default: this project's checkout) unpacked with `git archive` into
    W/rebench/src/<sha>/."""
    checkout = resources.checkout()
    if git_ref is None:
        if repo is not None:
            raise RebenchError(f"repo {str(repo)!r} given without a git ref: name the commit to "
                               "build with --git-ref (the working tree is always this project's)")
        if checkout is None:
            return KernelSource("installed", KERNELS_DIR, "unknown", str(KERNELS_DIR.parent))
        head = _git(checkout, "rev-parse", "HEAD")
        status = _git(checkout, "status", "--porcelain", "--", str(KERNELS_DIR))
        return KernelSource("worktree", KERNELS_DIR, head.stdout.strip() if head.returncode == 0
                            else "unknown", str(checkout), None,
                            bool(status.returncode == 0 and status.stdout.strip()))
    if repo is None and checkout is None:
        raise RebenchError(f"git ref {git_ref!r} needs a git repository of tilecast, and this "
                           f"tilecast is an installed package ({KERNELS_DIR.parent}), not a "
                           "checkout: name a clone with --repo, or leave out --git-ref to "
                           "measure the installed kernels")
    repo_path = Path(repo).resolve() if repo is not None else checkout
    if not git_ref.strip() or git_ref.startswith("-"):
        raise RebenchError(f"git ref {git_ref!r} is not a ref; give a commit, branch or tag")
    if not repo_path.is_dir() or _git(repo_path, "rev-parse", "--git-dir").returncode != 0:
        raise RebenchError(f"{repo_path} is not a git repository; --repo must name one "
                           "(default: this project's)")
    resolved = _git(repo_path, "rev-parse", "--verify", "--quiet", f"{git_ref}^{{commit}}")
    if resolved.returncode != 0 or not resolved.stdout.strip():
        raise RebenchError(f"git ref {git_ref!r} does not name a commit in {repo_path}; "
                           "give a commit sha, branch or tag that exists there")
    sha = resolved.stdout.strip()
    subdir = resources.KERNELS_SUBDIR
    root = layout.Workdir(workdir).rebench_sources
    target = root / sha
    if not (target / subdir).is_dir():
        _unpack(repo_path, sha, subdir, root, target)
    return KernelSource("git", target / subdir, sha, str(repo_path), git_ref)


def _unpack(repo: Path, sha: str, subdir: str, root: Path, target: Path) -> None:
    """`git archive <sha> <subdir>` extracted beside `target`, then moved into place."""
    archive = _git(repo, "archive", "--format=tar", sha, "--", subdir, binary=True)
    if archive.returncode != 0:
        raise RebenchError(f"git archive of {subdir}/ at {sha[:12]} in {repo} failed: "
                           f"{archive.stderr.decode(errors='replace').strip()}")
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{sha}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp"
    try:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            try:
                tar.extractall(staging, filter="data")
            except TypeError:  # a Python without extraction filters (before 3.10.12 / 3.11.4)
                tar.extractall(staging)
        if not (staging / subdir).is_dir():
            raise RebenchError(f"commit {sha[:12]} of {repo} has no {subdir}/ directory")
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / subdir).is_dir():  # not a concurrent unpack of the same commit
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# -- problems ----------------------------------------------------------------------------------

def sentinel_problems(config: RunConfig, names: Sequence[str],
                      wanted: Sequence[str | Mapping] | None = None) -> dict[str, list]:
    """Each family's sentinel problems (config key `sentinel`, default the holdout set),
    restricted to `wanted` (dims keys or 'm=..,n=..' strings, parsed like `tilecast select
    --problem`) when given. A wanted problem in no family's sentinel set is a RebenchError
    naming it; a family none of them belongs to is left out."""
    sets: dict[str, dict[str, object]] = {}
    for name in names:
        family = get_family(name)
        sets[name] = {}
        for values in config.families[name].sentinel:
            problem = family.problem(values)
            sets[name].setdefault(family.dims_key(problem), problem)
        if not sets[name]:
            raise RebenchError(f"family {name} of {config.path} has no sentinel problem (no "
                               "`sentinel` key and an empty holdout set); add a `sentinel` list")
    if wanted is None:
        return {name: list(problems.values()) for name, problems in sets.items()}
    chosen: dict[str, dict[str, object]] = {name: {} for name in names}
    for entry in wanted:
        found, why = False, []
        for name in names:
            family = get_family(name)
            try:
                problem = parse_problem(entry, family) if isinstance(entry, str) \
                    else family.problem(entry)
                key = family.dims_key(problem)
            except (FamilyError, ValueError, TypeError) as err:
                why.append(f"{name}: {err}")
                continue
            if key in sets[name]:
                chosen[name][key] = sets[name][key]
                found = True
        if not found:
            known = [key for problems in sets.values() for key in problems]
            raise RebenchError(
                f"problem {entry!r} is not a sentinel problem of {', '.join(names)}"
                + (f" ({'; '.join(why)})" if why else "")
                + f"; sentinel problems: {', '.join(known[:12])}{' ...' if len(known) > 12 else ''}"
                "; pick from these or add it to the family's `sentinel` in the config")
    return {name: list(problems.values()) for name, problems in chosen.items() if problems}


# -- history -----------------------------------------------------------------------------------

def _pointer_path(history: Path, name: str) -> Path:
    return Path(history) / name / HISTORY_POINTER


def read_pointer(history: str | Path, name: str) -> dict | None:
    """The family's latest.json (None when the family has no history yet)."""
    path = _pointer_path(Path(history), name)
    if not path.exists():
        return None
    try:
        pointer = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RebenchError(f"history pointer {path} is unreadable ({err}); it is truncated or "
                           "corrupt: restore it, or remove it to start the history afresh") from None
    missing = [k for k in ("run_id", "file", "records", "sha256", "hardware") if k not in pointer] \
        if isinstance(pointer, dict) else ["everything"]
    if missing:
        raise RebenchError(f"history pointer {path} lacks {missing}: restore it, or remove it to "
                           "start the history afresh")
    return pointer


def load_run(history: str | Path, name: str, entry: Mapping) -> regression.RunRecords:
    """A stored run, checked against its pointer entry (record count and sha256): a truncated
    or edited history file is a RebenchError, never a silently shorter baseline."""
    path = Path(history) / name / str(entry["file"])
    try:
        data = path.read_bytes()
    except OSError as err:
        raise RebenchError(f"history file {path} of run {entry['run_id']} is unreadable: "
                           f"{err}") from None
    records = []
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise RebenchError(f"history file {path}: line {number} is not a JSON record; the file "
                               "is truncated or corrupt: restore it or remove the history")
        records.append(record)
    digest = hashlib.sha256(data).hexdigest()
    if len(records) != entry["records"] or digest != entry["sha256"]:
        raise RebenchError(f"history file {path} holds {len(records)} records (sha256 "
                           f"{digest[:12]}), its pointer says {entry['records']} "
                           f"({entry['sha256'][:12]}): "
                           "it is truncated or was modified; restore it or remove the history")
    return regression.RunRecords(str(entry["run_id"]), str(entry["hardware"]),
                                 str(entry.get("git_sha", "unknown")), records)


def store_run(history: str | Path, name: str, run: regression.RunRecords, info: Mapping) -> dict:
    """Write H/<family>/<run_id>.jsonl, then point H/<family>/latest.json at it (both atomic);
    the previous pointer is kept inside the new one. Returns the new pointer."""
    directory = Path(history) / name
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n" for r in run.records)
    data = text.encode("utf-8")
    file_name = f"{run.run_id}.jsonl"
    atomic_write_text(directory / file_name, text)
    previous = read_pointer(history, name)
    if previous is not None:
        previous = {k: v for k, v in previous.items() if k != "previous"}
    pointer = {**info, "run_id": run.run_id, "file": file_name, "records": len(run.records),
               "sha256": hashlib.sha256(data).hexdigest(), "hardware": run.hardware,
               "git_sha": run.git_sha, "previous": previous}
    atomic_write_json(directory / HISTORY_POINTER, pointer)
    return pointer


# -- the run -----------------------------------------------------------------------------------

@dataclass
class RebenchPlan:
    """A validated rebenchmark: what to build from, which problems, the thresholds."""
    config: RunConfig
    workdir: Path
    history: Path
    problems: dict[str, list]
    source: KernelSource
    hardware: dict
    alpha: float
    min_effect: float
    samples: int | None = None
    run_id: str = ""

    @property
    def families(self) -> list[str]:
        return list(self.problems)

    @property
    def layout(self) -> layout.Workdir:
        """Where the rebenchmark's files live in its workdir (tilecast.stages.layout)."""
        return layout.Workdir(self.workdir)


def plan(config: str | Path, workdir: str | Path, history: str | Path,
         families: Sequence[str] | None = None, problems: Sequence[str | Mapping] | None = None,
         git_ref: str | None = None, repo: str | Path | None = None,
         alpha: float = regression.DEFAULT_ALPHA, min_effect: float = regression.DEFAULT_MIN_EFFECT,
         samples: int | None = None) -> RebenchPlan:
    """Validate everything (config, families, problems, thresholds, git ref, the history's
    integrity) before anything is compiled or measured."""
    try:
        regression.check_thresholds(alpha, min_effect)
    except ValueError as err:
        raise RebenchError(str(err)) from None
    if samples is not None and (isinstance(samples, bool) or int(samples) < 2):
        raise RebenchError(f"samples={samples!r} must be at least 2 (a test needs two a side)")
    cfg = load_config(config)
    names = list(families) if families else list(cfg.families)
    unknown = [n for n in names if n not in cfg.families]
    if unknown:
        raise ConfigError(f"family {unknown[0]!r} is not in config {cfg.path}; it has: "
                          f"{', '.join(cfg.families)}")
    chosen = sentinel_problems(cfg, names, problems)
    workdir, history = Path(workdir).resolve(), Path(history).resolve()
    for name in chosen:  # a corrupt history fails now, not after the measurements
        pointer = read_pointer(history, name)
        for entry in (pointer, (pointer or {}).get("previous")):
            if entry:
                load_run(history, name, entry)
    source = resolve_source(workdir, git_ref, repo)
    run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    return RebenchPlan(cfg, workdir, history, chosen, source,
                       hardware.profile(cfg.protocol.threads), float(alpha), float(min_effect),
                       None if samples is None else int(samples), run_id)


def _build(p: RebenchPlan, name: str) -> list[build.Built]:
    # the pipeline's context for candidate selection and the build cache; no registry is used
    ctx = RunContext(config=p.config, workdir=p.workdir, registry=p.history, run_id=p.run_id,
                     hardware=p.hardware, git_sha=p.source.sha)
    configs = select_candidates(ctx, name)
    log.info("rebench %s: building %d candidates from %s", name, len(configs), p.source.label())
    return build.build_candidates(get_family(name), configs, ctx.build_cache,
                                  jobs=p.config.build_jobs, progress=build.log_progress,
                                  kernels_dir=p.source.kernels_dir if p.source.kind == "git" else None)


def _run_id_for(p: RebenchPlan, raw: Path, identity: Mapping) -> str:
    """Resume the unfinished run in `raw` when it measured the same binaries on the same
    hardware; set any other unfinished log aside (never mix two sources' samples)."""
    existing = read_records(raw)
    if not existing:
        return p.run_id
    ids = {r.get("run_id") for r in existing}
    if len(ids) == 1 and all(r.get(k) == v for r in existing for k, v in identity.items()):
        run_id = ids.pop()
        log.info("rebench: resuming run %s from %s (%d records already measured)", run_id, raw,
                 len(existing))
        return run_id
    stale = p.layout.rebench_stale / f"{raw.stem}-{sorted(map(str, ids))[0]}.jsonl"
    stale.parent.mkdir(parents=True, exist_ok=True)
    os.replace(raw, stale)
    log.warning("rebench: %s held an unfinished run of other binaries or hardware; moved to %s",
                raw, stale)
    return p.run_id


def _measure(p: RebenchPlan, name: str, builts: list[build.Built],
             device: str | None = None) -> tuple[regression.RunRecords, int, Path]:
    """Every built kernel on every sentinel problem through the benchmark stage, holding the
    device (tilecast.core.device); returns the run's records, the samples per pair and the raw log."""
    family, fc = get_family(name), p.config.families[name]
    problems = p.problems[name]
    n_tests = len(builts) * len(problems) + len(builts)
    needed = regression.required_samples(n_tests, p.alpha)
    samples = p.samples or max(p.config.protocol.samples, needed)
    if samples < needed:
        log.warning("rebench %s: %d samples per pair cannot make %d tests significant at "
                    "alpha %g; %d would", name, samples, n_tests, p.alpha, needed)
    digest = hashlib.sha256("\n".join(sorted(f"{b.kernel}:{b.cache_key}" for b in builts))
                            .encode()).hexdigest()[:16]
    identity = {"hardware": p.hardware["fingerprint"], "source_digest": digest,
                "git_sha": p.source.sha}
    raw = p.layout.rebench_raw_log(name)
    run_id = _run_id_for(p, raw, identity)
    # the pair test's replicates are rounds (processes): at least 4 a side, 2 samples each
    rounds = max(p.config.rounds, MIN_ROUNDS)
    samples = max(samples, 2 * rounds)
    # no in-process libraries: every pair is timed the isolated way, so the config's
    # interleave and race settings do not apply; no confirm phase, no peer
    settings = BenchSettings.from_config(p.config, seed=fc.seed,
                                         protocol=replace(p.config.protocol, samples=samples),
                                         finalists=0, confirm_samples=0, rounds=rounds,
                                         measure_peer=False)
    log.info("rebench %s: %d kernels x %d sentinel problems, %d samples per pair", name,
             len(builts), len(problems), samples)
    with exclusive(device or default_device()):
        benchmark(family, builts, [(PROBLEM_SET, q) for q in problems], raw,
                  p.layout.rebench_scratch(name),
                  {"run_id": run_id, **identity, "source": p.source.kind}, settings)

    kernels, keys = {b.kernel for b in builts}, {family.dims_key(q) for q in problems}
    # a run resumed with another sample count re-measured its pairs: only this protocol's count
    current = protocol_hash(settings.protocol)
    records = [r for r in read_records(raw) if r.get("run_id") == run_id
               and r.get("protocol_hash") == current
               and r.get("role") == "candidate" and r.get("phase") == "screen"
               and r.get("kernel") in kernels and r.get("dims_key") in keys]
    have = {(r["kernel"], r["dims_key"]) for r in records}
    missing = [(b.kernel, family.dims_key(q)) for b in builts for q in problems
               if family.applicable(b.config, q) and (b.kernel, family.dims_key(q)) not in have]
    if missing:
        raise RebenchError(f"rebench {name}: {len(missing)} pairs have no record in {raw}, e.g. "
                           f"{missing[0]}; re-run to measure them")
    return regression.RunRecords(run_id, p.hardware["fingerprint"], p.source.sha, records), samples, raw


def run_family(p: RebenchPlan, name: str, device: str | None = None) -> regression.Comparison:
    """Build, measure, store and compare one family; writes W/report/rebench_<family>.json."""
    builts = _build(p, name)
    new, samples, raw = _measure(p, name, builts, device)
    pointer = read_pointer(p.history, name)
    # a run stored just before an interruption is not its own baseline
    already_stored = pointer is not None and pointer["run_id"] == new.run_id
    baseline_entry = pointer.get("previous") if already_stored else pointer
    baseline = load_run(p.history, name, baseline_entry) if baseline_entry else None
    problems = sorted({str(r["dims_key"]) for r in new.records})
    if not already_stored:
        store_run(p.history, name, new, {
            "family": name, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": str(p.config.path), "source": p.source.describe(), "samples": samples,
            "problems": problems, "kernels": sorted(b.kernel for b in builts)})
    comparison = regression.compare(new, baseline, name, p.alpha, p.min_effect)
    report = {**comparison.to_dict(), "git_sha": p.source.sha, "source": p.source.describe(),
              "hardware": new.hardware, "samples": samples, "problems": problems,
              "baseline": None if baseline_entry is None else
              {k: baseline_entry.get(k) for k in ("run_id", "git_sha", "hardware", "created", "source")},
              "history_file": str(p.history / name / f"{new.run_id}.jsonl")}
    p.layout.report_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(p.layout.rebench_report(name), report)
    finished = p.layout.rebench_finished(name, new.run_id)
    finished.parent.mkdir(parents=True, exist_ok=True)
    os.replace(raw, finished)  # the next rebench starts a new run
    log.info("rebench %s: %s", name, comparison.message)
    return comparison


@dataclass
class RebenchResult:
    """A whole rebenchmark: one comparison per family, the markdown report, the exit status."""
    comparisons: list[regression.Comparison]
    markdown: str
    exit_status: int
    reports: dict[str, Path] = field(default_factory=dict)


def header(p: RebenchPlan, comparison: regression.Comparison) -> str:
    """The line under a family's title: run, source, hardware, baseline."""
    return (f"Run `{comparison.run_id}` from {p.source.label()} on hardware "
            f"`{p.hardware['fingerprint']}`; baseline: "
            f"{'`' + comparison.baseline_run_id + '`' if comparison.baseline_run_id else 'none'}.")


REPORT_MARK = "<!-- tilecast rebench -->"


def write_markdown(p: RebenchPlan, comparisons: Sequence[regression.Comparison]) -> str:
    """The "Rebenchmark" markdown of these comparisons, written to W/report/rebench.md and as
    the last section of W/report/report.md (replacing an earlier rebenchmark's section; the
    run report before it, if this workdir has one, is kept)."""
    text = regression.render_markdown(comparisons, {c.family: header(p, c) for c in comparisons})
    directory = p.layout.report_dir
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / layout.REBENCH_REPORT_FILE, text)
    report = directory / layout.REPORT_FILE
    before = report.read_text().split(REPORT_MARK)[0] if report.exists() else "# tilecast report\n\n"
    atomic_write_text(report, before.rstrip("\n") + "\n\n" + REPORT_MARK + "\n" + text)
    return text


def rebench(config: str | Path, workdir: str | Path, history: str | Path,
            families: Sequence[str] | None = None, problems: Sequence[str | Mapping] | None = None,
            git_ref: str | None = None, repo: str | Path | None = None,
            alpha: float = regression.DEFAULT_ALPHA,
            min_effect: float = regression.DEFAULT_MIN_EFFECT,
            samples: int | None = None) -> RebenchResult:
    """The whole rebenchmark (plan, then every family, then the markdown); see the module
    docstring. exit_status: 0 nothing regressed, 1 regression(s), 3 not comparable."""
    p = plan(config, workdir, history, families, problems, git_ref, repo, alpha, min_effect, samples)
    comparisons = [run_family(p, name) for name in p.families]
    markdown = write_markdown(p, comparisons)
    return RebenchResult(comparisons, markdown, regression.exit_status(comparisons),
                         {c.family: p.layout.rebench_report(c.family) for c in comparisons})
