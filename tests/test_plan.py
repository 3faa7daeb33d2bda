"""A budgeted night's plan (tilecast.store.plan, tilecast.store.members): known answers on small
generated nights; the measured end to end is tests/test_end_to_end.py's store test."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tilecast.core import dataset
from tilecast.config import ConfigError, FamilyConfig, NightSettings
from tilecast.measurement.protocol import Protocol
from tilecast.families import get_family
from tilecast.store import labels, plan
from tilecast.store.members import regret
from tests.test_store import night

GEMM = get_family("gemm")
PROTOCOL = Protocol(warmup_ms=10, min_sample_ms=6, samples=6, threads=2)


def key(m, n=64, k=64):
    return f"m={m},n={n},k={k},dtype=fp32,layout_a=row,layout_b=row"


def shape(m, n=64, k=64):
    return {"m": m, "n": n, "k": k}


def test_members_that_agree_have_no_regret_and_a_split_vote_has_its_loss():
    assert regret(np.array([[1.0, 0.5, 0.2], [2.0, 1.0, 0.1]])) == 0.0
    # each member's pick is half as fast by the other's reckoning
    assert regret(np.array([[1.0, 0.5], [0.5, 1.0]])) == pytest.approx(0.5)
    # three members: two agree on kernel 0, one picks kernel 1 (0.9 of 0 by the first two)
    split = np.array([[1.0, 0.9], [1.0, 0.9], [0.8, 1.0]])
    pairs = [0, 0.1, 0, 0.1, 0.2, 0.2]   # (a, b) losses, a != b: 0->1, 0->2, 1->0, 1->2, 2->0, 2->1
    assert regret(split) == pytest.approx(np.mean(pairs))
    assert regret(np.empty((3, 0))) == 0.0


def test_labels_to_settle_are_young_held_out_ones_then_the_closest_young_contests():
    status = pd.DataFrame([
        {"dims_key": "h-old", "nights": 3, "gap_pct": 0.1},   # held out, settled
        {"dims_key": "h-new", "nights": 1, "gap_pct": 9.0},   # held out, young: re-measured
        {"dims_key": "close-2", "nights": 2, "gap_pct": 0.5},
        {"dims_key": "close-1", "nights": 1, "gap_pct": 1.5},
        {"dims_key": "closer-1", "nights": 1, "gap_pct": 0.2},
        {"dims_key": "clear-1", "nights": 1, "gap_pct": 8.0},  # no contest
        {"dims_key": "settled", "nights": 3, "gap_pct": 0.1},  # contested but enough nights
    ]).assign(seconds=[np.array([1e-3])] * 7)
    settle = plan.to_settle(status, {"h-old", "h-new"}, NightSettings(settle_nights=3,
                                                                     contested_pct=2.0))
    assert settle["dims_key"].tolist() == ["h-new", "closer-1", "close-1", "close-2"]
    assert settle["reason"].tolist() == ["held-out", "contested", "contested", "contested"]


def test_label_status_reads_the_gap_and_the_nights_of_the_best_two():
    records = pd.concat([night("n1", {8: {"a": 1.00e-5, "b": 1.01e-5, "c": 2e-5},
                                      16: {"a": 1e-5}}, time_="2026-12-01T01:00:00"),
                         night("n2", {8: {"a": 1.00e-5, "b": 1.01e-5}},
                               time_="2026-12-02T01:00:00")], ignore_index=True)
    status = plan.label_status(labels.pooled_final(records)).set_index("dims_key")
    assert status.loc[key(8), "nights"] == 2
    assert status.loc[key(8), "gap_pct"] == pytest.approx(1.0, rel=1e-6)
    assert status.loc[key(16), "gap_pct"] == np.inf and status.loc[key(16), "nights"] == 1


def test_the_cost_model_is_calibrated_on_a_nights_span():
    cost = plan.CostModel.of(PROTOCOL)
    # two kernels at 1 ms and 10 ms: 6 x (6 ms + 10 ms) + 2 x 10 ms warmup
    assert cost.raw(np.array([1e-3, 10e-3])) == pytest.approx(6 * 16e-3 + 20e-3)
    records = night("n1", {8: {"a": 1e-3, "b": 10e-3}}, time_="2026-12-01T01:00:00")
    later = night("n1", {16: {"a": 1e-3, "b": 10e-3}}, time_="2026-12-01T01:00:30")
    calibrated = cost.calibrated(pd.concat([records, later], ignore_index=True))
    assert calibrated.calibration == pytest.approx(30.0 / (2 * cost.raw(np.array([1e-3, 10e-3]))))
    assert cost.calibrated(records.iloc[0:0]).calibration == 1.0   # no night: as it was
    # a night over three machines: its 30 s span was 90 s of measuring
    fleet = cost.calibrated(pd.concat([records, later], ignore_index=True),
                            machines=lambda night: {"n1": 3}.get(night, 0))
    assert fleet.calibration == pytest.approx(3 * calibrated.calibration)


def test_exploration_draws_new_shapes_each_night_within_the_configs_ranges():
    entries = [{"random": {"count": 30, "seed": 4, "ranges": {"m": [1, 64], "n": [8, 512],
                                                              "k": [4, 64]}}},
               {"random": {"count": 10, "seed": 5, "ranges": {"m": [1, 64], "n": [1, 8],
                                                              "k": [4, 64]}},
                "layout_a": "col"},
               {"grid": {"m": [1, 2], "n": [3], "k": [4]}}]
    one, two = (plan.exploration(GEMM, entries, 200, seed) for seed in (1, 2))
    assert len(one) == 200 and one != two
    assert all(1 <= s["m"] <= 64 and 1 <= s["n"] <= 512 and 4 <= s["k"] <= 64 for s in one)
    cols = [s for s in one if s["layout_a"] == "col"]
    assert len(cols) == 50 and all(s["n"] <= 8 for s in cols)   # a quarter, as in the config
    assert plan.exploration(GEMM, entries[2:], 10, 1) == []      # nothing random, nothing drawn


def test_a_shape_near_one_chosen_on_every_dimension_is_its_neighbour():
    spread = plan.Spread()
    spread.add({**shape(100), "layout_a": "row"})
    assert spread.near({**shape(120, 70, 60), "layout_a": "row"})      # within sqrt(2) each
    assert not spread.near({**shape(150), "layout_a": "row"})          # m 1.5x apart
    assert not spread.near({**shape(100), "layout_a": "col"})          # another layout


def _config(**problems) -> FamilyConfig:
    sets = {"train": [shape(m) for m in (8, 16, 24)], "holdout": [shape(100), shape(200)],
            **problems}
    return FamilyConfig(
        name="gemm", candidates={}, budget=4, seed=1,
        problems={"train": sets["train"], "holdout": sets["holdout"]},
        sentinel=[shape(300), shape(100)],
        workload=[shape(512), shape(520), shape(1024), shape(200)],
        entries={"train": [{"random": {"count": 40, "seed": 3,
                                       "ranges": {"m": [1, 4096], "n": [1, 4096],
                                                  "k": [4, 4096]}}}]})


def _stored():
    """Two nights: 8 and 16 a close contest, 24 a clear one, 100 held out (once); kernel a
    runs 1e-5 s per unit of m (m = 600 takes the 6 ms floor of a sample)."""
    def at(m, *ratios):
        return {m: {"a": m * 1e-5, "b": m * 1e-5 * ratios[0]}}

    first = {**at(8, 1.005), **at(16, 1.01), **at(24, 2.0)}
    rows = [night("n1", {**first, **at(100, 3.0)}, time_="2026-12-01T01:00:00"),
            night("n1", at(32, 3.0), time_="2026-12-01T01:00:10"),
            night("n2", first, time_="2026-12-02T01:00:00"),
            night("n2", at(32, 3.0), time_="2026-12-02T01:00:10")]
    return pd.concat(rows, ignore_index=True)


def _seconds_per_problem():
    """What a problem under the floor costs (two kernels faster than 6 ms), calibrated on
    _stored."""
    cost = plan.CostModel.of(PROTOCOL).calibrated(_stored())
    return cost.seconds(np.array([1e-3, 1e-3]))


def test_a_night_settles_labels_then_watches_sentinels_then_takes_new_shapes_in_its_budget():
    each = _seconds_per_problem()
    settings = NightSettings(budget_minutes=14 * each / 60, policy="random", settle_nights=3,
                             remeasure_share=0.4, sentinels=2, workload_share=0.5, explore=40)
    chosen = plan.plan_night(GEMM, None, _config(), settings, PROTOCOL, _stored(), ["a", "b"],
                             spec=None, seed=7)
    reasons = [c.reason for c in chosen.chosen]
    # re-measuring: the held-out 100 and 200 (never measured), then the contests 8 and 16
    # (fewest nights, then the closest: 8's 0.5 % before 16's 1 %); 24's is no contest.
    # 40 % of 14 problems' time is 5.6 of them: all four
    # (200 never measured comes first, then the measured ones in their order)
    assert [c.dims_key for c in chosen.chosen[:4]] == [key(200), key(100), key(8), key(16)]
    assert reasons[:4] == ["held-out", "held-out", "contested", "contested"]
    assert reasons[4] == "sentinel" and chosen.chosen[4].dims_key == key(300)  # 100 is taken
    rest = reasons[5:]
    assert set(rest) <= {"workload", "explore"} and "workload" in rest and "explore" in rest
    assert chosen.seconds <= chosen.budget_s + 1e-9
    train = [c for c in chosen.chosen if c.problem_set == "train"]
    assert key(200) not in {c.dims_key for c in train}       # a held-out workload shape
    assert any("held out" in note for note in chosen.notes)
    # the workload's fresh shapes (512 and its neighbour 520, 1024; 200 is held out) take at
    # most half of the time left; a new shape costs its work at the kernels' typical speed
    settled = sum(c.seconds for c in chosen.chosen[:5])
    workload = [c for c in chosen.chosen if c.reason == "workload"]
    assert 1 <= len(workload) <= 2
    assert sum(c.seconds for c in workload) <= 0.5 * (chosen.budget_s - settled) + 1e-9
    final = labels.pooled_final(_stored())
    speed = dataset.valid(final).groupby("kernel")["tflops"].median()
    cost = plan.CostModel.of(PROTOCOL).calibrated(_stored())
    work = GEMM.flops(GEMM.problem(workload[0].values))
    assert workload[0].seconds == pytest.approx(
        cost.seconds(np.array([work / speed[k] / 1e12 for k in ("a", "b")])), rel=1e-3)
    # never a shape the store holds as a new one, never two neighbours
    new = [c for c in chosen.chosen if c.reason in ("workload", "explore")]
    assert not {c.dims_key for c in new} & {key(m) for m in (8, 16, 24, 32, 100)}
    assert key(520) not in {c.dims_key for c in new} or key(512) not in {c.dims_key for c in new}
    assert len({c.dims_key for c in chosen.chosen}) == len(chosen.chosen)


def test_a_small_budget_re_measures_within_its_share_and_a_plan_round_trips():
    each = _seconds_per_problem()
    settings = NightSettings(budget_minutes=5 * each / 60, policy="random", remeasure_share=0.4,
                             sentinels=0, explore=10)
    chosen = plan.plan_night(GEMM, None, _config(), settings, PROTOCOL, _stored(), ["a", "b"],
                             spec=None, seed=7)
    settling = [c for c in chosen.chosen if c.reason in ("held-out", "contested")]
    assert sum(c.seconds for c in settling) <= 0.4 * chosen.budget_s + 1e-9
    assert len(settling) == 2
    back = plan.NightPlan.from_json(chosen.to_json())
    assert back == chosen
    assert [ps for ps, _ in back.problems(GEMM)] == [c.problem_set for c in chosen.chosen]
    assert "random night" in back.lines()[0]


def test_a_night_without_a_budget_is_refused():
    with pytest.raises(ConfigError, match="budget_minutes"):
        plan.plan_night(GEMM, None, _config(), NightSettings(), PROTOCOL, _stored(), ["a"],
                        spec=None, seed=1)


def test_the_config_s_night_section_and_workload_file_are_checked(tmp_path):
    from tilecast.config import load_config

    base = tmp_path / "c.yaml"
    text = (Path(__file__).parent / "configs" / "tiny_night.yaml").read_text()
    (tmp_path / "workloads").mkdir()
    (tmp_path / "workloads" / "tiny.yaml").write_text(
        "problems:\n  - list: [{m: 8, n: 120, k: 48}]\n")
    base.write_text(text)
    config = load_config(base)
    assert config.night.budget_minutes == 0.5 and config.families["gemm"].workload[0]["m"] == 8
    base.write_text(text.replace("policy: active", "").replace(
        "night: {budget_minutes: 0.5", "night: {budget_minutes: -1, policy: greedy"))
    with pytest.raises(ConfigError) as err:
        load_config(base)
    assert "night.budget_minutes" in str(err.value) and "night.policy" in str(err.value)
    base.write_text(text.replace("workloads/tiny.yaml", "missing.yaml"))
    with pytest.raises(ConfigError, match="families.gemm.workload: workload file .*missing.yaml "
                                          "does not exist"):
        load_config(base)
    (tmp_path / "workloads" / "tiny.yaml").write_text("problems:\n  - list: [{m: 0, n: 1, k: 1}]\n")
    base.write_text(text)
    with pytest.raises(ConfigError, match="workload file .*problems\\[0\\]"):
        load_config(base)
    assert dataclasses.replace(config.night, policy="random").policy == "random"


def test_protocol_threads_may_list_the_counts_a_night_measures_with(tmp_path):
    from tilecast.config import load_config
    from tilecast.core.hardware import cpu_count

    text = (Path(__file__).parent / "configs" / "tiny.yaml").read_text()
    config = tmp_path / "c.yaml"
    config.write_text(text.replace("threads: 2,", "threads: [1, 2],"))
    loaded = load_config(config)
    assert loaded.thread_counts == (1, 2) and loaded.protocol.threads == 1
    config.write_text(text.replace("threads: 2,", "threads: [2, 2],"))
    with pytest.raises(ConfigError, match="protocol.threads.*without repeats"):
        load_config(config)
    config.write_text(text.replace("threads: 2,", "threads: [],"))
    with pytest.raises(ConfigError, match="protocol.threads"):
        load_config(config)
    config.write_text(text.replace("threads: 2,", f"threads: [auto, {cpu_count()}],"))
    with pytest.raises(ConfigError, match="names one thread count twice"):
        load_config(config)
    from tilecast.workflows import pipeline

    config.write_text(text.replace("threads: 2,", "threads: [1, 2],"))
    ctx = pipeline.RunContext.create(config, tmp_path / "w", tmp_path / "r", threads=2)
    assert ctx.workdir == (tmp_path / "w" / "threads-2").resolve()
    assert ctx.config.protocol.threads == 2 and ctx.hardware["threads"] == 2
    with pytest.raises(ConfigError, match="not 3"):
        pipeline.RunContext.create(config, tmp_path / "w", tmp_path / "r", threads=3)


def test_replay_picks_spread_shapes_and_finds_where_a_policy_reaches_the_other():
    from tilecast.workflows import replay

    ranked = [shape(100), shape(110), shape(300), shape(120), shape(900)]
    # 110 and 120 are neighbours of 100: passed over while others are left, then taken
    assert replay.pick(GEMM, ranked, 3) == [key(100), key(300), key(900)]
    assert replay.pick(GEMM, ranked, 4) == [key(100), key(300), key(900), key(110)]
    # a step's second part (exploration after the workload's) keeps away from the first's
    spread = plan.Spread()
    spread.add(shape(300))
    assert replay.pick(GEMM, ranked, 2, spread) == [key(100), key(900)]
    assert replay.pick(GEMM, ranked, 0, plan.Spread()) == []
    table = pd.DataFrame([
        {"policy": "random", "step": 0, "problems": 10, "measurements": 100,
         "mean_efficiency": 0.90},
        {"policy": "random", "step": 1, "problems": 20, "measurements": 200,
         "mean_efficiency": 0.93},
        {"policy": "random", "step": 2, "problems": 30, "measurements": 300,
         "mean_efficiency": 0.95},
        {"policy": "active", "step": 0, "problems": 10, "measurements": 100,
         "mean_efficiency": 0.90},
        {"policy": "active", "step": 1, "problems": 20, "measurements": 200,
         "mean_efficiency": 0.951},
        {"policy": "active", "step": 2, "problems": 30, "measurements": 300,
         "mean_efficiency": 0.96}])
    hit = replay.reached(table)
    assert hit == {"target": 0.95, "problems": 20, "measurements": 200,
                   "share": pytest.approx(2 / 3)}
    never = replay.reached(table.assign(mean_efficiency=np.where(
        table["policy"] == "active", 0.5, table["mean_efficiency"])))
    assert never["share"] is None
