"""Regression detection between two benchmark runs of the same kernels (the rebenchmark's core).

Per (kernel, problem) pair: the ratio of the median times new / old and a two-sided Welch
t-test on the logs of the two runs' per-round medians (each round is a process of its own:
the replicate that carries run-to-run noise; samples within a process are not independent
of it, and a test over them calls a 7 % difference between two runs of the same binary on
this VM significant). Records without round medians (older ones) fall back to a Mann-Whitney
U test on the samples. Per kernel: the geometric mean of its pairs' ratios, tested on the
pairs' round medians together (a Welch test stratified by problem: each problem's difference
of mean log round medians, averaged; a rank test across the three sentinel problems of a
rebenchmark could never reach alpha, and one disturbed round could leave a kernel ten times
slower "unchanged"), or with a Wilcoxon signed-rank test on the pairs' log ratios across
problems where records have no round medians. Every test of a run
(pairs and kernels together) is corrected with Benjamini-Hochberg. A verdict needs both a
significant test (q <= alpha) and a practical effect (a time ratio of at least 1 + min_effect,
or at most 1 / (1 + min_effect)), so neither noise with a big median shift nor a tiny shift
measured very precisely counts. A kernel regresses when its pairs regress on the whole or
when any one pair does (one badly slower problem is never averaged away), and a pair whose
kernel ran in the baseline but fails now (build, crash, wrong result) is a regression.
Runs on different hardware are not compared at all.

Pure functions over records; no I/O (tilecast.workflows.rebench measures, stores and writes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from tilecast.core import stats

REGRESSION, IMPROVEMENT, UNCHANGED = "regression", "improvement", "unchanged"
NOT_COMPARABLE, ADDED, REMOVED, NO_BASELINE = "not comparable", "added", "removed", "no baseline"

# Exit statuses of `tilecast rebench` (2 is the CLI's usage / bad-input status).
EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, EXIT_NOT_COMPARABLE = 0, 1, 2, 3

DEFAULT_ALPHA = 0.01
DEFAULT_MIN_EFFECT = 0.05


@dataclass(frozen=True)
class RunRecords:
    """One run's benchmark records (rawlog format) and what identifies the run."""
    run_id: str
    hardware: str
    git_sha: str
    records: Sequence[Mapping]


@dataclass
class Comparison:
    """A family's new run against its baseline: a verdict per pair, per kernel and overall."""
    family: str
    run_id: str
    baseline_run_id: str | None
    verdict: str
    message: str
    alpha: float
    min_effect: float
    kernels: list[dict] = field(default_factory=list)
    pairs: list[dict] = field(default_factory=list)

    @property
    def exit_status(self) -> int:
        return {REGRESSION: EXIT_REGRESSION, NOT_COMPARABLE: EXIT_NOT_COMPARABLE}.get(
            self.verdict, EXIT_OK)

    def to_dict(self) -> dict:
        counts = {}
        for kernel in self.kernels:
            counts[kernel["verdict"]] = counts.get(kernel["verdict"], 0) + 1
        return {"family": self.family, "run_id": self.run_id,
                "baseline_run_id": self.baseline_run_id, "verdict": self.verdict,
                "message": self.message, "exit_status": self.exit_status, "alpha": self.alpha,
                "min_effect": self.min_effect, "kernel_verdicts": counts,
                "kernels": self.kernels, "pairs": self.pairs}


def check_thresholds(alpha: float, min_effect: float) -> None:
    """ValueError naming the value unless 0 < alpha < 1 and 0 <= min_effect < 10."""
    if not (isinstance(alpha, (int, float)) and 0.0 < alpha < 1.0):
        raise ValueError(f"alpha={alpha!r} must be a significance level in (0, 1), e.g. 0.01")
    if not (isinstance(min_effect, (int, float)) and 0.0 <= min_effect < 10.0):
        raise ValueError(f"min_effect={min_effect!r} must be a fraction >= 0, e.g. 0.05 for 5 %")


def required_samples(n_tests: int, alpha: float, margin: float = 4.0) -> int:
    """Samples per side so that a fully separated pair stays significant after correcting
    `n_tests` tests: the exact two-sided Mann-Whitney p-value 2 / C(2n, n) must be at most
    alpha / (n_tests * margin); the margin leaves room for an overlapping sample or two.
    Fewer samples would make a rebenchmark unable to see any regression at all."""
    check_thresholds(alpha, 0.0)
    n = 2
    while 2.0 / math.comb(2 * n, n) > alpha / (max(1, n_tests) * margin):
        n += 1
    return n


def _samples(record: Mapping) -> list[float]:
    """The samples a record's median came from (undisturbed, else the disturbed ones)."""
    return stats.scored_samples(record.get("samples_s") or [],
                                record.get("disturbed_samples_s") or [])


def _table(records: Iterable[Mapping]) -> dict[tuple[str, str], Mapping]:
    """(kernel, dims_key) -> screening record of a candidate (peers and confirmations left out)."""
    table = {}
    for record in records:
        if record.get("role", "candidate") == "candidate" and record.get("phase", "screen") == "screen":
            table[str(record["kernel"]), str(record["dims_key"])] = record
    return table


def _rounds(record: Mapping) -> list[float]:
    """The record's per-round medians (one per process run of the job; absent in old records)."""
    return [x for x in stats.usable(record.get("round_medians_s") or []) if x > 0]


def _usable(record: Mapping | None) -> list[float] | None:
    """A record's samples when it is ok with a positive median, else None."""
    if record is None or record.get("status") != "ok":
        return None
    samples = _samples(record)
    return samples if samples and stats.median(samples) > 0 else None


def _pair(kernel: str, key: str, old: Mapping | None, new: Mapping | None) -> dict:
    """A pair's measurements and test; its verdict is settled after the correction."""
    pair = {"kernel": kernel, "problem": key,
            "old_status": old.get("status") if old else None,
            "new_status": new.get("status") if new else None,
            "old_median_s": None, "new_median_s": None, "ratio": None,
            "n_old": 0, "n_new": 0, "test": None, "p": None, "q": None, "verdict": None,
            "reason": ""}
    if old is None or new is None:
        pair.update(verdict=ADDED if old is None else REMOVED,
                    reason="problem measured only in the new run" if old is None
                    else "problem measured only in the baseline")
        return pair
    old_samples, new_samples = _usable(old), _usable(new)
    if old_samples and new_samples:
        old_median, new_median = stats.median(old_samples), stats.median(new_samples)
        pair.update(old_median_s=old_median, new_median_s=new_median,
                    ratio=new_median / old_median, n_old=len(old_samples), n_new=len(new_samples))
        old_rounds, new_rounds = _rounds(old), _rounds(new)
        if len(old_rounds) >= 2 and len(new_rounds) >= 2:
            # replicates are processes, not samples: samples of one process share its memory
            # placement and the machine's state of that moment, so a test over samples would
            # call any run-to-run difference significant
            pair.update(p=stats.welch_log_p(new_rounds, old_rounds), test="welch-log-rounds",
                        n_old=len(old_rounds), n_new=len(new_rounds))
        elif min(len(old_samples), len(new_samples)) < 2:
            pair.update(verdict=NOT_COMPARABLE, reason="fewer than 2 samples on a side: no test")
        else:
            pair.update(p=stats.mann_whitney_p(new_samples, old_samples), test="mann-whitney")
    elif old_samples:
        why = f": {new.get('reason')}" if new.get("reason") else ""
        pair.update(verdict=REGRESSION, reason=f"broken: {new.get('status')}{why}"[:300])
    elif new_samples:
        pair.update(verdict=IMPROVEMENT, reason=f"fixed: was {old.get('status')}")
    else:
        pair.update(verdict=NOT_COMPARABLE,
                    reason=f"no valid measurement in either run (old {old.get('status')}, "
                           f"new {new.get('status')})")
    return pair


def _effect(ratio: float, q: float | None, alpha: float, min_effect: float) -> tuple[str, str]:
    """Verdict and reason of a tested ratio: significance AND a practical effect."""
    if q is None or q > alpha:
        return UNCHANGED, f"not significant (q={_num(q)} > alpha={alpha:g})"
    if ratio >= 1.0 + min_effect:
        return REGRESSION, f"{ratio:.3f}x slower (q={_num(q)})"
    if ratio <= 1.0 / (1.0 + min_effect):
        return IMPROVEMENT, f"{1 / ratio:.3f}x faster (q={_num(q)})"
    return UNCHANGED, f"significant but within the {min_effect:.0%} practical threshold"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def _kernel(kernel: str, pairs: list[dict], old_table: Mapping, new_table: Mapping) -> dict:
    """A kernel's summary over its pairs; the test and verdict come after the correction."""
    ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
    rounds = [(_rounds(new_table[kernel, p["problem"]]), _rounds(old_table[kernel, p["problem"]]))
              for p in pairs if p["test"] == "welch-log-rounds"]
    if rounds and len(rounds) == len(ratios):
        test, p_value = "welch-log-rounds-by-problem", stats.stratified_welch_log_p(rounds)
    elif len(ratios) >= 2:
        test, p_value = "wilcoxon-problems", stats.wilcoxon_p([math.log(r) for r in ratios])
    else:
        test, p_value = None, None
    return {"kernel": kernel, "problems": len(ratios),
            "geomean_ratio": stats.geometric_mean(ratios) if ratios else None,
            "worst_ratio": max(ratios) if ratios else None,
            "best_ratio": min(ratios) if ratios else None,
            "test": test, "p": p_value, "q": None, "verdict": None, "reason": "",
            "regressed_problems": [], "improved_problems": []}


def _kernel_verdict(entry: dict, pairs: list[dict], alpha: float, min_effect: float) -> None:
    regressed = [p for p in pairs if p["verdict"] == REGRESSION]
    improved = [p for p in pairs if p["verdict"] == IMPROVEMENT]
    entry["regressed_problems"] = [p["problem"] for p in regressed]
    entry["improved_problems"] = [p["problem"] for p in improved]
    overall, why = (_effect(entry["geomean_ratio"], entry["q"], alpha, min_effect)
                    if entry["geomean_ratio"] is not None else (None, ""))
    broken = [p for p in regressed if p["reason"].startswith("broken")]
    if broken:
        entry.update(verdict=REGRESSION, reason=f"broken on {len(broken)} problem(s), e.g. "
                                                f"{broken[0]['problem']}: {broken[0]['reason']}")
    elif regressed:
        worst = max(regressed, key=lambda p: p["ratio"])
        entry.update(verdict=REGRESSION, reason=f"slower on {len(regressed)}/{len(pairs)} "
                                                f"problem(s), worst {worst['ratio']:.3f}x on "
                                                f"{worst['problem']}")
    elif overall == REGRESSION:
        entry.update(verdict=REGRESSION, reason=f"slower across problems: geomean {why}")
    elif overall == IMPROVEMENT or improved:
        entry.update(verdict=IMPROVEMENT,
                     reason=f"faster across problems: geomean {why}" if overall == IMPROVEMENT
                     else f"faster on {len(improved)}/{len(pairs)} problem(s)")
    elif any(p["verdict"] == UNCHANGED for p in pairs):
        entry.update(verdict=UNCHANGED, reason=why or "no pair changed")
    else:
        entry.update(verdict=NOT_COMPARABLE, reason="no problem measured validly in both runs")


def compare(new: RunRecords, baseline: RunRecords | None, family: str,
            alpha: float = DEFAULT_ALPHA, min_effect: float = DEFAULT_MIN_EFFECT) -> Comparison:
    """The new run against the baseline (None: a first run, nothing to compare with)."""
    check_thresholds(alpha, min_effect)
    new_table = _table(new.records)
    kernels_new = sorted({k for k, _ in new_table})
    result = Comparison(family, new.run_id, baseline.run_id if baseline else None, UNCHANGED, "",
                        alpha, min_effect)
    if baseline is None:
        result.verdict = NO_BASELINE
        result.message = (f"no baseline: first rebenchmark of {family}; {len(kernels_new)} "
                          "kernels stored as the baseline of the next one")
        result.kernels = [{"kernel": k, "verdict": NO_BASELINE} for k in kernels_new]
        return result
    if baseline.hardware != new.hardware:
        result.verdict = NOT_COMPARABLE
        result.message = (f"not comparable: hardware fingerprint {new.hardware} differs from the "
                          f"baseline's {baseline.hardware} (run {baseline.run_id}); timings of "
                          "different machines say nothing about the code. This run is the "
                          "baseline of the next rebenchmark on this machine.")
        result.kernels = [{"kernel": k, "verdict": NOT_COMPARABLE} for k in kernels_new]
        return result
    old_table = _table(baseline.records)
    kernels_old = sorted({k for k, _ in old_table})
    by_kernel: dict[str, list[dict]] = {}
    for kernel in sorted(set(kernels_new) & set(kernels_old)):
        keys = sorted({key for k, key in new_table if k == kernel}
                      | {key for k, key in old_table if k == kernel})
        by_kernel[kernel] = [_pair(kernel, key, old_table.get((kernel, key)),
                                   new_table.get((kernel, key))) for key in keys]
    entries = {kernel: _kernel(kernel, pairs, old_table, new_table)
               for kernel, pairs in by_kernel.items()}

    tests = [p for pairs in by_kernel.values() for p in pairs] + list(entries.values())
    for test, q in zip(tests, stats.benjamini_hochberg([t["p"] for t in tests])):
        test["q"] = q
    for pairs in by_kernel.values():
        for pair in pairs:
            if pair["verdict"] is None:
                pair["verdict"], pair["reason"] = _effect(pair["ratio"], pair["q"], alpha, min_effect)
    for kernel, entry in entries.items():
        _kernel_verdict(entry, [p for p in by_kernel[kernel] if p["verdict"] not in (ADDED, REMOVED)],
                        alpha, min_effect)

    result.pairs = [p for pairs in by_kernel.values() for p in pairs]
    result.kernels = sorted(
        list(entries.values())
        + [{"kernel": k, "verdict": ADDED, "reason": "not in the baseline"}
           for k in sorted(set(kernels_new) - set(kernels_old))]
        + [{"kernel": k, "verdict": REMOVED, "reason": "not in the new run"}
           for k in sorted(set(kernels_old) - set(kernels_new))],
        key=lambda e: e["kernel"])
    verdicts = [e["verdict"] for e in entries.values()]
    tested = sum(p["verdict"] in (REGRESSION, IMPROVEMENT, UNCHANGED) for p in result.pairs)
    if REGRESSION in verdicts:
        result.verdict = REGRESSION
    elif not tested:
        result.verdict = NOT_COMPARABLE
    elif IMPROVEMENT in verdicts:
        result.verdict = IMPROVEMENT
    result.message = _summary(result, tested)
    return result


def _summary(result: Comparison, tested: int) -> str:
    counts: dict[str, int] = {}
    for entry in result.kernels:
        counts[entry["verdict"]] = counts.get(entry["verdict"], 0) + 1
    told = ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
    if result.verdict == NOT_COMPARABLE:
        return (f"not comparable: no (kernel, problem) pair was measured validly in both this "
                f"run and the baseline {result.baseline_run_id} ({told})")
    return (f"{result.verdict}: {len(result.kernels)} kernels ({told}); {tested} pairs compared "
            f"with baseline {result.baseline_run_id}")


def exit_status(comparisons: Iterable[Comparison]) -> int:
    """1 when any family regressed, else 3 when any was not comparable, else 0."""
    statuses = {c.exit_status for c in comparisons}
    for status in (EXIT_REGRESSION, EXIT_NOT_COMPARABLE):
        if status in statuses:
            return status
    return EXIT_OK


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _time(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f} us"


def family_markdown(comparison: Comparison, header: str = "") -> str:
    """One family's section: the verdict, a table of every kernel (problems compared,
    geometric-mean and worst time ratio new/old, the kernel test's p, BH q, verdict and why), then
    the regressed pairs. `header` (e.g. the source and samples) goes under the title."""
    c = comparison
    lines = [f"## {c.family}: {c.verdict.upper()}", ""]
    if header:
        lines += [header, ""]
    lines += [c.message, ""]
    if c.verdict == NO_BASELINE or (c.verdict == NOT_COMPARABLE and not c.pairs):
        lines += [f"Kernels measured: {len(c.kernels)}.", ""]
        return "\n".join(lines)
    lines += [f"Ratios are time new / old (> 1 is slower). A verdict needs q <= {c.alpha:g} "
              f"(Benjamini-Hochberg over all tests of the run) and a change of at least "
              f"{c.min_effect:.0%}; a kernel regresses when any one problem does.", "",
              "| kernel | problems | geomean ratio | worst ratio | p | q | verdict | why |",
              "|---|---:|---:|---:|---:|---:|---|---|"]
    for k in c.kernels:
        lines.append(f"| `{k['kernel']}` | {k.get('problems', '-')} | {_ratio(k.get('geomean_ratio'))} "
                     f"| {_ratio(k.get('worst_ratio'))} | {_num(k.get('p'))} | {_num(k.get('q'))} "
                     f"| {k['verdict']} | {k.get('reason', '').replace('|', '/')} |")
    regressed = [p for p in c.pairs if p["verdict"] == REGRESSION]
    lines += ["", f"### Regressed pairs ({len(regressed)})", ""]
    if regressed:
        lines += ["| kernel | problem | old median | new median | ratio | p | q | why |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        for p in sorted(regressed, key=lambda p: (-(p["ratio"] or math.inf), p["kernel"])):
            lines.append(f"| `{p['kernel']}` | `{p['problem']}` | {_time(p['old_median_s'])} "
                         f"| {_time(p['new_median_s'])} | {_ratio(p['ratio'])} | {_num(p['p'])} "
                         f"| {_num(p['q'])} | {p['reason'].replace('|', '/')} |")
    else:
        lines.append("None.")
    lines.append("")
    return "\n".join(lines)


def render_markdown(comparisons: Sequence[Comparison], headers: Mapping[str, str] | None = None) -> str:
    """The "Rebenchmark" report: the overall exit status, then one section per family."""
    headers = headers or {}
    status = exit_status(comparisons)
    meaning = {EXIT_OK: "nothing regressed", EXIT_REGRESSION: "regression(s) found",
               EXIT_NOT_COMPARABLE: "not comparable with the baseline"}[status]
    parts = ["# Rebenchmark", "", f"Exit status {status}: {meaning}.", ""]
    parts += [family_markdown(c, headers.get(c.family, "")) for c in comparisons]
    return "\n".join(parts).rstrip() + "\n"
