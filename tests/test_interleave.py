"""The interleaved protocol: candidates of a batch timed side by side in one worker process.
Every pair gets its cycles of real samples; wrong numbers, a missing library and a dead
worker are records or a fallback, never a guess or a dead pipeline."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tilecast.stages import bench
from tilecast.measurement import interleave
from tilecast.stages.bench import BenchSettings, benchmark, in_process_libraries
from tilecast.core.build import build_candidates
from tilecast.families import get_family
from tilecast.families.gemm import GemmConfig
from tilecast.families.grouped_conv import GroupedConvConfig
from tilecast.measurement.protocol import Protocol
from tilecast.measurement.rawlog import read_records

GEMM = get_family("gemm")
PROTOCOL = Protocol(warmup_ms=1, min_sample_ms=1, samples=3, threads=2, timeout_s=20)
GEMM_CONFIGS = [GemmConfig("fp32", "avx2", 6, 16, 96, 512, 128, "m", True, True),
                GemmConfig("fp32", "avx2", 4, 24, 96, 504, 256, "k", False, False)]
SHAPES = [(16, 32, 64), (5, 7, 9), (100, 3, 40)]
CONV_CONFIGS = [GroupedConvConfig("forward", "fp32", 2, 16, 16, 16, "im2col", "interwave", True, True),
                GroupedConvConfig("bwd_weight", "fp32", 2, 16, 16, 8, "im2col", "intrawave", False, False)]
CONV_PROBLEM = {"G": 2, "C": 4, "K": 8, "Hi": 9, "Wi": 7, "Y": 3, "X": 3, "pad_h": 1, "pad_w": 1}


@pytest.fixture(scope="module")
def gemm_builds(build_cache, hw):
    if not {"avx2", "fma"} <= set(hw["flags"]):
        pytest.skip("the variants here need AVX2 and FMA, which this CPU lacks")
    builts = build_candidates(GEMM, GEMM_CONFIGS, build_cache, jobs=2)
    libraries = in_process_libraries(GEMM, builts, build_cache, jobs=2)
    assert set(libraries) == {b.kernel for b in builts}
    return builts, libraries


def _plan(family, libraries, problems, cycles=4, seed=3):
    keys = [family.dims_key(family.problem(fields)) for fields in problems]
    return interleave.Plan(
        family=family.name, libraries={k: str(v) for k, v in libraries.items()},
        problems=[(key, fields, 7 + i) for i, (key, fields) in enumerate(zip(keys, problems))],
        pairs=[(kernel, key) for kernel in libraries for key in keys], cycles=cycles,
        protocol=asdict(PROTOCOL), seed=seed)


def test_every_pair_gets_its_cycles_of_checked_samples_in_a_worker(tmp_path, gemm_builds):
    _, libraries = gemm_builds
    problems = [{"m": m, "n": n, "k": k} for m, n, k in SHAPES]
    plan = _plan(GEMM, libraries, problems, cycles=4)
    timings = interleave.measure(plan, tmp_path, PROTOCOL)
    assert set(timings) == {tuple(pair) for pair in plan.pairs}
    for timing in timings.values():
        assert timing.status == "ok", timing.reason
        assert timing.reps >= 1 and timing.max_error < 1e-4
        # contended samples are kept apart and made up for by extra cycles (retakes)
        assert len(timing.samples_s) == 4 or timing.disturbed_samples_s
        assert all(0 < s < 1 for s in timing.samples_s + timing.disturbed_samples_s)
        # each clean sample carries its window: cycle, factor and the barrier probe before it
        assert len(timing.window_probes_us) == len(timing.samples_s) == len(timing.sample_cycles)
        assert all(0 < probe < 1e6 for probe in timing.window_probes_us)
    assert not any(tmp_path.iterdir())   # the worker's plan, data and result are gone


def test_wrong_numbers_and_a_missing_library_are_recorded(tmp_path, gemm_builds, monkeypatch):
    _, libraries = gemm_builds
    broken, missing = sorted(libraries)
    real_timer = type(GEMM).timer

    def zeroing_timer(self, library, prepared, threads, output):
        time_calls = real_timer(self, library, prepared, threads, output)
        if Path(library) != Path(libraries[broken]):
            return time_calls

        def wrong(reps):
            seconds = time_calls(reps)
            output.zero_()      # a kernel that forgets to write C
            return seconds
        return wrong

    monkeypatch.setattr(type(GEMM), "timer", zeroing_timer)
    plan = _plan(GEMM, {broken: libraries[broken], missing: tmp_path / "gone.so"},
                 [{"m": 16, "n": 32, "k": 64}], cycles=2)
    result = interleave.run(plan, tmp_path / "data")
    by_kernel = {name.split("|")[0]: values for name, values in result.items()}
    assert by_kernel[broken]["status"] == "wrong_result"
    assert "norm-relative error 1 > tolerance" in by_kernel[broken]["reason"]
    assert by_kernel[missing]["status"] == "crashed"
    assert "in-process library" in by_kernel[missing]["reason"]
    assert not by_kernel[broken]["samples_s"] and not by_kernel[missing]["samples_s"]


def test_grouped_conv_candidates_are_timed_in_process_and_match_torch(tmp_path, build_cache, hw):
    if not {"avx2", "fma"} <= set(hw["flags"]):
        pytest.skip("the variants here need AVX2 and FMA, which this CPU lacks")
    for config in CONV_CONFIGS:
        family = get_family(f"grouped_conv_{config.direction}")
        built = build_candidates(family, [config], build_cache, jobs=1)
        libraries = in_process_libraries(family, built, build_cache, jobs=1)
        plan = _plan(family, libraries, [CONV_PROBLEM], cycles=2)
        result = interleave.run(plan, tmp_path / config.direction)
        (values,) = result.values()
        assert values["status"] == "ok", values["reason"]
        assert values["max_error"] < 1e-4 and len(values["samples_s"]) >= 1


def _bench(tmp_path, builts, settings, progress=None):
    raw = tmp_path / "gemm.jsonl"
    problems = [("train", GEMM.problem({"m": m, "n": n, "k": k})) for m, n, k in SHAPES]
    benchmark(GEMM, builts, problems, raw, tmp_path / "scratch",
              {"run_id": "t", "git_sha": "0", "hardware": "h"}, settings, progress)
    return [r for r in read_records(raw) if r["role"] == "candidate"]


def test_bench_labels_come_from_the_interleaved_samples(tmp_path, gemm_builds):
    builts, libraries = gemm_builds
    settings = BenchSettings(protocol=PROTOCOL, finalists=2, confirm_samples=2,
                             problems_per_batch=3, libraries=libraries, race_cycles=2)
    steps = []

    def progress(done, total, message):
        steps.append((done, total, message.split(",")[0]))

    records = _bench(tmp_path, builts, settings, progress)
    screen = [r for r in records if r["phase"] == "screen"]
    assert len(screen) == 6 and {r["timing"] for r in records} == {"interleaved"}
    # progress counts the batch and the race's rounds (2 cycles in 3 rounds: 2) as one series
    assert steps == [(1, 3, "bench gemm: batch 1/1 done"),
                     (2, 3, "bench gemm: race round 1/2 done"),
                     (3, 3, "bench gemm: race round 2/2 done")]
    assert all(r["status"] == "ok" and r["tflops"] > 0 for r in screen)
    # the isolated validation sample is not part of the label: exactly the protocol's count
    assert all(len(r["samples_s"]) == 3 or r["disturbed_samples_s"] for r in screen)
    assert all(len(r["round_medians_s"]) >= 1 for r in screen)
    # once all batches are screened, each problem's contenders (two candidates a problem: both)
    # are raced: 2 cycles over the 3 rounds, each round on the screen's scale
    confirm = [r for r in records if r["phase"] == "confirm"]
    assert {(r["kernel"], r["dims_key"]) for r in confirm} == {(r["kernel"], r["dims_key"]) for r in screen}
    assert all(r["timing"] == "interleaved" and r["status"] == "ok" for r in confirm)
    assert all(len(r["samples_s"]) == 2 or r["disturbed_samples_s"] for r in confirm)
    assert all(len(r["round_medians_s"]) == 2 for r in confirm if len(r["samples_s"]) == 2)
    # a re-run measures nothing again, the race included
    assert len(_bench(tmp_path, builts, settings)) == len(records)


def test_a_run_resumed_without_interleaving_keeps_the_screen_labels(tmp_path, gemm_builds, caplog):
    builts, libraries = gemm_builds
    screened = BenchSettings(protocol=PROTOCOL, problems_per_batch=3, libraries=libraries,
                             race_cycles=0)
    records = _bench(tmp_path, builts, screened)
    assert records and not [r for r in records if r["phase"] == "confirm"]
    # resumed with interleave off: nothing re-measured, nothing raced, and it says so
    resumed = BenchSettings(protocol=PROTOCOL, problems_per_batch=3, interleave=False, race_cycles=2)
    with caplog.at_level("WARNING", logger="tilecast.stages.bench"):
        again = _bench(tmp_path, builts, resumed)
    assert len(again) == len(records)
    assert "cannot be raced" in caplog.text


def test_only_a_problems_contenders_are_raced():
    levels = {"a": 1.0, "b": 1.05, "c": 1.09, "d": 1.2, "e": 3.0}
    assert interleave.contenders(levels, 0.10) == ["a", "b", "c"]
    # a wider margin takes more; never fewer than MIN_PAIRS_FOR_FACTOR, never more than RACE_MAX
    assert interleave.contenders(levels, 0.25) == ["a", "b", "c", "d"]
    assert interleave.contenders({"x": 2.0, "y": 1.0, "z": 9.0, "w": 5.0}, 0.0) == ["y", "x", "w"]
    many = {f"k{i:02d}": 1.0 + i / 1000 for i in range(20)}
    assert interleave.contenders(many, 0.5) == [f"k{i:02d}" for i in range(interleave.RACE_MAX)]
    assert interleave.contenders({}, 0.1) == []


def test_after_a_round_only_the_close_contenders_race_on():
    def timing(samples, status="ok"):
        return interleave.PairTiming(status=status, samples_s=list(samples))
    round_ = {"a": timing([1.0, 1.02, 0.98]), "b": timing([1.04, 1.03, 1.05]),
              "c": timing([1.3, 1.2, 1.25]), "d": timing([1.5, 1.6, 1.55]),
              "e": timing([0.5], status="wrong_result"), "f": timing([])}
    # within 5 % of the round's best; the best MIN_PAIRS_FOR_FACTOR stay for the window factor
    assert interleave.survivors(round_, 0.05) == ["a", "b", "c"]
    assert interleave.survivors(round_, 0.60) == ["a", "b", "c", "d"]
    assert interleave.survivors({"e": round_["e"], "f": round_["f"]}, 0.05) == []


def test_the_race_takes_contenders_wide_and_narrows_them_round_by_round():
    """_race with a stand-in worker (the seconds below are what it 'measures'): the screen
    put the real winner 'b' 20 % behind, inside the 25 % margin; after the first round only
    the contenders within 5 % of that round's best race on."""
    from types import SimpleNamespace
    problem = GEMM.problem({"m": 8, "n": 8, "k": 8})
    key = GEMM.dims_key(problem)
    screen_s = {"a": 1.0, "b": 1.2, "c": 1.1, "d": 1.05, "slow": 1.4}
    race_s = {"a": 1.0, "b": 0.9, "c": 1.2, "d": 0.93, "slow": 1.0}
    builts = [SimpleNamespace(kernel=k, config=None, binary=Path(k), cache_key=k,
                              event=SimpleNamespace(binary_bytes=1)) for k in screen_s]
    done = {(key, k, "screen"): {"timing": "interleaved", "status": "ok", "median_s": t,
                                 "samples_s": [t] * 3} for k, t in screen_s.items()}
    plans, written = [], {}

    class Worker:
        def close(self):
            pass

        def measure(self, plan):
            plans.append(sorted(kernel for kernel, _ in plan.pairs))
            return {(kernel, k): interleave.PairTiming(reps=1, samples_s=[race_s[kernel]] * plan.cycles)
                    for kernel, k in plan.pairs}

    class Recorder:
        def write(self, ps, problem, kernel, config, role, phase, outcome, *args, **kwargs):
            written[kernel] = outcome
            return {}

    # the race's rounds are its own: one isolated round does not make it one race round
    settings = BenchSettings(protocol=PROTOCOL, rounds=1, race_cycles=6, race_rounds=3,
                             race_margin_pct=25, race_keep_pct=5,
                             libraries={k: Path(k) for k in screen_s})
    steps = []
    bench._race(GEMM, builts, [("train", problem)], done, Recorder(), settings, Worker(),
                lambda done, total, message: steps.append((done, total, message.split(",")[0])))
    assert plans == [["a", "b", "c", "d"], ["a", "b", "d"], ["a", "b", "d"]]
    assert steps == [(n, 3, f"bench gemm: race round {n}/3 done") for n in (1, 2, 3)]
    # 'a' is 11 % behind 'b' in the first round, but stays: the window factor needs three
    assert {k: len(o.samples_s) for k, o in written.items()} == {"a": 6, "b": 6, "c": 2, "d": 6}


def test_with_fresh_processes_each_race_round_has_its_own_worker_and_placement():
    from types import SimpleNamespace
    problem = GEMM.problem({"m": 8, "n": 8, "k": 8})
    key = GEMM.dims_key(problem)
    screen_s = {"a": 1.0, "b": 1.01, "c": 1.02}
    builts = [SimpleNamespace(kernel=k, config=None, binary=Path(k), cache_key=k,
                              event=SimpleNamespace(binary_bytes=1)) for k in screen_s]
    done = {(key, k, "screen"): {"timing": "interleaved", "status": "ok", "median_s": t,
                                 "samples_s": [t] * 3} for k, t in screen_s.items()}
    events = []

    class Worker:
        def close(self):
            events.append("close")

        def measure(self, plan):
            events.append(plan.placement_seed)
            return {(kernel, k): interleave.PairTiming(reps=1, samples_s=[screen_s[kernel]] * plan.cycles)
                    for kernel, k in plan.pairs}

    class Recorder:
        def write(self, *args, **kwargs):
            return {}

    for fresh in (False, True):
        events.clear()
        settings = BenchSettings(protocol=PROTOCOL, race_cycles=6, race_rounds=3,
                                 race_fresh_process=fresh, libraries={k: Path(k) for k in screen_s})
        bench._race(GEMM, builts, [("train", problem)], dict(done), Recorder(), settings,
                    Worker(), lambda *args: None)
        if fresh:   # a new process before every round, and a placement of its own
            assert events[0::2] == ["close"] * 3
            seeds = events[1::2]
            assert len(seeds) == 3 and None not in seeds and len(set(seeds)) == 3
        else:       # one worker for the whole race, operands where the family put them
            assert events == [None, None, None]


@pytest.mark.parametrize("transposed", [False, True])
def test_a_placed_operand_holds_the_same_numbers_at_a_random_offset_in_a_page(transposed):
    import random
    original = torch.randn(37, 53)
    if transposed:
        original = original.t()   # a column-major operand: a transposed view
    rng = random.Random(5)
    shifts = set()
    for _ in range(20):
        placed = interleave._placed(original, rng)
        assert placed.stride() == original.stride() and torch.equal(placed, original)
        assert placed.data_ptr() != original.data_ptr()
        offset = placed.storage_offset() * placed.element_size()
        assert offset % interleave.PLACEMENT_STEP == 0 and 0 <= offset < interleave.PLACEMENT_SPAN
        shifts.add(offset)
    assert len(shifts) > 10


def test_a_placed_plan_checks_and_times_every_pair(tmp_path, gemm_builds):
    _, libraries = gemm_builds
    problems = [{"m": 16, "n": 32, "k": 64, "layout_a": "col"}, {"m": 5, "n": 7, "k": 9, "layout_b": "col"}]
    plan = interleave.Plan(**{**asdict(_plan(GEMM, libraries, problems, cycles=2)), "placement_seed": 11})
    timings = interleave.measure(plan, tmp_path, PROTOCOL)
    for timing in timings.values():
        assert timing.status == "ok", timing.reason
        assert timing.max_error < 1e-4 and len(timing.samples_s) + len(timing.disturbed_samples_s) >= 2


def test_a_race_round_is_put_on_the_screens_scale():
    # the round ran in a state 2x slower for both contenders, and ranked them the other way
    screen = {"a": {"samples_s": [1.0, 1.0, 1.0]}, "b": {"samples_s": [1.1, 1.1, 1.1]}}
    timings = {"a": interleave.PairTiming(reps=5, samples_s=[2.4, 2.4], window_factors=[1.0, 1.5]),
               "b": interleave.PairTiming(reps=7, samples_s=[2.0, 2.0], window_factors=[1.0, 1.5])}
    outcomes = {("a", "p"): bench.JobOutcome("ok"), ("b", "p"): bench.JobOutcome("ok")}
    errors, medians = {}, defaultdict(list)
    bench._fold_round(screen, timings, "p", outcomes, errors, medians)
    # scale: median of screen/round ratios (1/2.4, 1.1/2.0) = their geometric mean
    scale = math.sqrt(1.0 / 2.4 * 1.1 / 2.0)
    assert outcomes["a", "p"].samples_s == pytest.approx([2.4 * scale] * 2)
    assert outcomes["b", "p"].samples_s == pytest.approx([2.0 * scale] * 2)
    assert outcomes["b", "p"].samples_s[0] < outcomes["a", "p"].samples_s[0]
    # raw times stay recoverable: sample * factor
    assert outcomes["a", "p"].window_factors == pytest.approx([1 / scale, 1.5 / scale])
    assert outcomes["a", "p"].reps == 5 and medians["b", "p"] == pytest.approx([2.0 * scale])
    # a contender that fails in a round is failed for good
    timings["b"] = interleave.PairTiming(status="crashed", reason="in-process library: gone")
    bench._fold_round(screen, timings, "p", outcomes, errors, medians)
    assert outcomes["b", "p"].status == "crashed" and len(outcomes["a", "p"].samples_s) == 4
def test_a_dead_worker_leaves_the_batch_to_the_isolated_protocol(tmp_path, gemm_builds,
                                                                 monkeypatch, caplog):
    builts, libraries = gemm_builds

    def dies(self, plan, timeout_s=None):
        raise interleave.InterleaveError("interleaved worker exited with status -9")

    monkeypatch.setattr(interleave.Worker, "measure", dies)
    settings = BenchSettings(protocol=PROTOCOL, finalists=0, confirm_samples=0,
                             problems_per_batch=3, libraries=libraries, measure_peer=False)
    with caplog.at_level("WARNING", logger="tilecast.stages.bench"):
        records = _bench(tmp_path, builts, settings)
    assert "interleaved timing failed" in caplog.text
    assert {r["timing"] for r in records} == {"isolated"}
    assert all(r["status"] == "ok" and len(r["samples_s"]) + len(r["disturbed_samples_s"]) >= 3
               for r in records)


def test_one_worker_serves_plan_after_plan_and_a_dead_one_is_replaced(tmp_path, gemm_builds):
    _, libraries = gemm_builds
    plan = _plan(GEMM, libraries, [{"m": 16, "n": 32, "k": 64}], cycles=2)
    with interleave.Worker(PROTOCOL, tmp_path) as worker:
        first = worker.measure(plan)
        pid = worker._proc.pid
        assert worker.measure(plan).keys() == first.keys() and worker._proc.pid == pid
        worker._proc.kill()           # a worker that died between plans
        worker._proc.wait()
        again = worker.measure(plan)
        assert worker._proc.pid != pid and all(t.status == "ok" for t in again.values())
        bad = interleave.Plan(**{**asdict(plan), "family": "no_such_family"})
        with pytest.raises(interleave.InterleaveError, match="unknown family|no_such_family"):
            worker.measure(bad)
        assert all(t.status == "ok" for t in worker.measure(plan).values())
    assert not any(tmp_path.iterdir())


def test_a_family_without_a_timer_or_a_library_is_timed_apart(tmp_path, gemm_builds):
    builts, libraries = gemm_builds
    partial = dict(list(libraries.items())[:1])
    settings = BenchSettings(protocol=PROTOCOL, finalists=0, confirm_samples=0,
                             problems_per_batch=3, libraries=partial, measure_peer=False)
    records = _bench(tmp_path, builts, settings)
    assert {r["timing"] for r in records} == {"isolated"}   # a batch is never split
    assert not interleave.supports(get_family("disco_forward"))
    assert interleave.supports(GEMM)


def test_a_window_that_slowed_every_candidate_does_not_decide_the_ranking():
    # four kernels of one problem, four cycles; in cycles 1 and 2 the machine ran every
    # candidate about 3x slower (the fastest kernel was sampled in those two only)
    base = {"fast": 1.0, "mid": 1.1, "slow": 1.3, "slower": 1.5}
    slowdown = {0: 1.0, 1: 3.0, 2: 2.9, 3: 1.0}
    timings = []
    for name, seconds in base.items():
        cycles = [1, 2] if name == "fast" else [0, 1, 2, 3]
        timings.append(interleave.PairTiming(samples_s=[seconds * slowdown[c] for c in cycles],
                                             sample_cycles=cycles))
    # raw medians rank "fast" (two slow windows: 2.95) last; in-window times rank it first
    interleave._window_factors(timings)
    medians = [sorted(t.samples_s)[len(t.samples_s) // 2] for t in timings]
    assert medians[0] < medians[1] < medians[2] < medians[3]
    assert [t / medians[1] for t in medians] == pytest.approx([1 / 1.1, 1, 1.3 / 1.1, 1.5 / 1.1], rel=0.02)
    assert timings[1].window_factors[1] / timings[1].window_factors[0] == pytest.approx(3.0, rel=0.02)
    lone = [interleave.PairTiming(samples_s=[2.0, 4.0], sample_cycles=[0, 1])]
    interleave._window_factors(lone)   # too few pairs to tell a window: left as measured
    assert lone[0].samples_s == [2.0, 4.0] and lone[0].window_factors == [1.0, 1.0]
