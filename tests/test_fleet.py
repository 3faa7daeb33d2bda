"""A night over a fleet (tilecast.fleet, tilecast.workflows.fleet): shards, leases and the
parent's supervision with known answers. The supervisor is driven here by a scripted
submitter (what each attempt's machine does, as lease documents in a real store); the real
thing, workers of a Prefect process pool measuring tiny shards, is tests/test_fleet_pool.py."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from tilecast.measurement.protocol import Protocol
from tilecast.families import get_family
from tilecast.fleet import lease as leases
from tilecast.fleet.shards import Item, Shard, cut, list_items
from tilecast.store import nights
from tilecast.store.store import Store, StoreError
from tilecast.workflows import fleet
from tests.test_store import CLASS, night

GEMM = get_family("gemm")
T0 = datetime(2026, 12, 7, 1, 0, tzinfo=timezone.utc)


def item(m, seconds):
    return Item("train", {"m": m, "n": 64, "k": 64}, seconds)


def test_cut_balances_seconds_keeps_the_nights_order_and_sends_nobody_nothing():
    items = [item(1, 10.0), item(2, 1.0), item(3, 9.0), item(4, 2.0), item(5, 8.0), item(6, 3.0)]
    shards = cut("gemm", items, 2)
    assert [s.name for s in shards] == ["gemm-1-of-2", "gemm-2-of-2"]
    assert sorted(s.seconds for s in shards) == [16.0, 17.0]   # longest first, least loaded
    for shard in shards:   # each shard in the night's order
        order = [items.index(i) for i in shard.items]
        assert order == sorted(order)
    assert sorted(i.values["m"] for s in shards for i in s.items) == [1, 2, 3, 4, 5, 6]
    assert [len(s.items) for s in cut("gemm", items[:2], 5)] == [1, 1]
    with pytest.raises(ValueError, match="at least 1"):
        cut("gemm", items, 0)


def test_a_shard_travels_as_json_and_bad_ones_are_refused():
    shard = cut("gemm", [item(7, 1.0), item(9, 2.0)], 1)[0]
    back = Shard.from_json(shard.to_json())
    assert back == shard
    assert [GEMM.dims_key(p) for _, p in back.pairs(GEMM)] == [
        GEMM.dims_key(GEMM.problem({"m": 7, "n": 64, "k": 64})),
        GEMM.dims_key(GEMM.problem({"m": 9, "n": 64, "k": 64}))]
    with pytest.raises(ValueError, match="outside"):
        Shard.from_json({**shard.to_json(), "index": 3})
    with pytest.raises(ValueError, match="not a shard"):
        Shard.from_json({"family": "gemm"})
    with pytest.raises(ValueError, match="unknown problem set"):
        Shard.from_json({**shard.to_json(), "items": [{"problem_set": "test",
                                                       "values": {"m": 1}, "seconds": 1}]})


def test_a_night_of_lists_is_costed_by_its_work():
    protocol = Protocol(warmup_ms=10, min_sample_ms=6, samples=6, threads=2)
    pairs = [("train", GEMM.problem({"m": 8, "n": 8, "k": 8})),
             ("holdout", GEMM.problem({"m": 1024, "n": 1024, "k": 1024}))]
    small, big = list_items(GEMM, pairs, protocol, kernels=4)
    # the small one costs the protocol's floor: 4 kernels x (6 samples x 6 ms + 10 ms warm-up)
    assert small.seconds == pytest.approx(4 * (6 * 0.006 + 0.010))
    assert big.seconds > small.seconds and big.problem_set == "holdout"
    assert big.values == {"m": 1024, "n": 1024, "k": 1024, **{
        f: getattr(pairs[1][1], f) for f in GEMM.problem_fields if f not in "mnk"}}


def test_store_documents_are_whole_json_beside_the_records(tmp_path):
    store = Store(tmp_path / "s").create()
    store.put_json("fleet/n1/gemm-1-of-2/current.json", {"attempt": 1})
    assert store.get_json("fleet/n1/gemm-1-of-2/current.json") == {"attempt": 1}
    assert store.get_json("fleet/n1/none.json") is None
    assert store.list_json("fleet/n1/gemm-1-of-2") == ["current.json"]
    for bad in ("records/x.json", "../x.json", "fleet/a b.json", ""):
        with pytest.raises(StoreError, match="cannot name a document"):
            store.put_json(bad, {})
    (tmp_path / "s" / "fleet" / "n1" / "list.json").write_text("[1]")
    with pytest.raises(StoreError, match="not a JSON object"):
        store.get_json("fleet/n1/list.json")
    store.put_profile({"hardware_class": CLASS, "cores": 2})
    store.put_profile({"hardware_class": CLASS, "cores": 64})   # the first writer's stays
    assert store.profile(CLASS) == {"hardware_class": CLASS, "cores": 2}
    assert store.check() == []   # documents are not damage
    nights.append_frame(store, night("n1", {8: {"k1": 1e-5}}), GEMM, CLASS)
    nights.append_frame(store, night("n2", {8: {"k1": 1e-5}, 16: {"k1": 2e-5}}), GEMM, CLASS)
    assert len(nights.read_frame(store, CLASS, "gemm", "n2")) == 2
    assert len(nights.read_frame(store, CLASS, "gemm")) == 3


def test_a_lease_beats_and_knows_when_it_was_replaced(tmp_path):
    store = Store(tmp_path / "s").create()
    lease = leases.Lease(store, "n1", "gemm-1-of-1", 1)
    assert lease.superseded() is None            # before the parent wrote anything
    leases.set_current(store, "n1", "gemm-1-of-1", 1, "run-a")
    with lease.beating(every_s=0.05):
        first = leases.attempt_doc(store, "n1", "gemm-1-of-1", 1)["heartbeat"]
        import time
        time.sleep(0.3)
        later = leases.attempt_doc(store, "n1", "gemm-1-of-1", 1)
        assert later["state"] == "running" and later["heartbeat"] > first
    assert lease.superseded() is None
    leases.set_current(store, "n1", "gemm-1-of-1", 2, "run-b")
    assert "attempt 2 replaced" in lease.superseded()
    leases.set_current(store, "n1", "gemm-1-of-1", 2, "run-b", closed=True)
    assert "closed" in leases.Lease(store, "n1", "gemm-1-of-1", 2).superseded()
    assert leases.age_s(None) == float("inf")
    assert leases.age_s({"heartbeat": T0.isoformat()}, T0 + timedelta(seconds=5)) == 5.0
    with pytest.raises(ValueError, match="lease state"):
        lease.write("sleeping")


class Scripted:
    """A submitter whose runs do what `script[(shard, attempt)]` says, one poll at a time:
    a list of steps, each ("pending"|"running"|"done"|"silent"|"crash"|"refused")."""

    def __init__(self, store, night_id, script, clock):
        self.store, self.night, self.script, self.clock = store, night_id, script, clock
        self.runs, self.cancelled = {}, []

    def submit(self, name, key, parameters):
        handle = f"{name}#{parameters['attempt']}"
        assert key == f"{self.night}/{name}/{parameters['attempt']}"
        self.runs[handle] = list(self.script.get((name, parameters["attempt"]), ["done"]))
        return handle

    def state(self, handle):
        name, attempt = handle.split("#")
        steps = self.runs[handle]
        step = steps.pop(0) if len(steps) > 1 else steps[0]
        lease = leases.Lease(self.store, self.night, name, int(attempt), clock=self.clock)
        if step == "running":
            lease.write("running")
            return "running", ""
        if step in ("silent", "starting"):   # gone (its heartbeat ages), or not begun
            return "running", ""
        if step == "done":
            lease.write("done", records=3, host=f"host-{attempt}")
            return "completed", ""
        if step == "crash":
            return "failed", "Crashed: worker gone"
        if step == "refused":
            lease.write("refused", message="wrong class")
            return "failed", "FleetError"
        return "pending", ""

    def cancel(self, handle):
        self.cancelled.append(handle)


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += timedelta(seconds=seconds)


def supervise(tmp_path, script, shards=("a", "b"), **timing):
    store = Store(tmp_path / "s").create()
    clock = Clock()
    items = [item(m, 1.0) for m in range(1, len(shards) + 1)]
    pieces = cut("gemm", items, len(shards))
    names = {p.name: s for p, s in zip(pieces, shards)}
    submitter = Scripted(store, "n1", {(next(k for k, v in names.items() if v == s), a): steps
                                       for (s, a), steps in script.items()}, clock)
    settings = {"deadline": T0 + timedelta(seconds=100), "lease_s": 20, "grace_s": 30,
                "poll_s": 5, "retries": 2, **timing}
    states = fleet.supervise(store, "n1", pieces, submitter,
                             lambda shard, attempt: {"attempt": attempt}, fleet.Timing(**settings),
                             clock=clock, sleep=clock.sleep)
    return {names[s.shard]: s for s in states}, submitter, store, clock


def test_every_shard_done_on_its_first_attempt(tmp_path):
    states, submitter, _, clock = supervise(tmp_path, {("a", 1): ["pending", "running", "done"]})
    assert {k: (s.state, s.attempt, s.records) for k, s in states.items()} == {
        "a": ("done", 1, 3), "b": ("done", 1, 3)}
    assert submitter.cancelled == [] and clock.now == T0 + timedelta(seconds=10)


def test_a_crashed_or_refused_attempt_goes_to_another_and_a_silent_one_after_its_lease(tmp_path):
    script = {("a", 1): ["running", "crash"], ("a", 2): ["refused"], ("a", 3): ["done"],
              ("b", 1): ["running", "silent"], ("b", 2): ["running", "done"]}
    states, submitter, store, clock = supervise(tmp_path, script)
    a, b = states["a"], states["b"]
    assert (a.state, a.attempt, a.host) == ("done", 3, "host-3")
    assert "crashed" not in a.attempts[1]["why"] and "failed" in a.attempts[1]["why"]
    assert "refused" in a.attempts[2]["why"] and "wrong class" in a.attempts[2]["why"]
    assert (b.state, b.attempt) == ("done", 2) and "silent for more than 20 s" in b.attempts[1]["why"]
    assert set(submitter.cancelled) == {"gemm-1-of-2#1", "gemm-1-of-2#2", "gemm-2-of-2#1"}
    assert leases.machines(store, "n1") == 2 and leases.machines(store, "n0") == 0
    # the replaced attempt may no longer append
    assert "replaced" in leases.Lease(store, "n1", "gemm-2-of-2", 1).superseded()


def test_a_run_starting_slowly_is_silent_only_after_its_lease(tmp_path):
    # "starting": running with no lease written (a process importing): not silent at once
    states, submitter, _, clock = supervise(
        tmp_path, {("a", 1): ["starting", "starting", "running", "done"],
                   ("b", 1): ["starting"] * 6 + ["done"]})
    assert (states["a"].state, states["a"].attempt) == ("done", 1)
    # b said nothing for 25 s > the 20 s lease: given to another attempt
    assert states["b"].attempt == 2 and "never wrote its lease" in states["b"].attempts[1]["why"]


def test_a_shard_no_worker_takes_is_missing_at_the_deadline_and_attempts_run_out(tmp_path):
    script = {("a", 1): ["pending"], ("b", 1): ["crash"], ("b", 2): ["crash"], ("b", 3): ["crash"]}
    states, _, store, clock = supervise(tmp_path, script)
    assert states["a"].state == "missing" and "no worker took it" in states["a"].message
    assert states["b"].state == "missing" and "no attempts left" in states["b"].message
    assert states["b"].attempt == 3
    assert leases.current(store, "n1", "gemm-1-of-2")["closed"] is True
    assert clock.now == T0 + timedelta(seconds=100)
    lines = fleet.missing_lines({"gemm": list(states.values())})
    assert len(lines) == 2 and "1 problems unmeasured" in lines[0]


def test_a_shard_still_running_past_the_grace_is_closed(tmp_path):
    states, submitter, store, clock = supervise(tmp_path, {("a", 1): ["running"]})
    assert states["a"].state == "missing" and "after the night's deadline" in states["a"].message
    assert states["b"].state == "done"
    assert submitter.cancelled == ["gemm-1-of-2#1"]
    assert clock.now >= T0 + timedelta(seconds=130)
    assert "closed" in leases.Lease(store, "n1", "gemm-1-of-2", 1).superseded()


def test_a_restarted_parent_resumes_the_same_attempts(tmp_path):
    store = Store(tmp_path / "s").create()
    pieces = cut("gemm", [item(1, 1.0), item(2, 1.0)], 2)
    leases.set_current(store, "n1", pieces[0].name, 2, "gemm-1-of-2#2")
    leases.Lease(store, "n1", pieces[0].name, 2).write("done", records=5)
    leases.set_current(store, "n1", pieces[1].name, 1, "gemm-2-of-2#1")
    clock = Clock()
    submitter = Scripted(store, "n1", {}, clock)
    submitter.runs["gemm-2-of-2#1"] = ["running", "done"]
    states = fleet.supervise(store, "n1", pieces, submitter, lambda s, a: {"attempt": a},
                             fleet.Timing(T0 + timedelta(seconds=100), 20, 30, 5, 2),
                             clock=clock, sleep=clock.sleep)
    assert [(s.state, s.attempt, s.records) for s in states] == [("done", 2, 5), ("done", 1, 3)]
    assert submitter.runs.keys() == {"gemm-2-of-2#1"}    # nothing submitted again


def test_fleet_settings_refuse_nonsense():
    with pytest.raises(Exception, match="shards must be at least 1"):
        fleet.Pool("c", "d/e", shards=0)
    with pytest.raises(Exception, match="lease_s must be > 0"):
        fleet.FleetSettings(lease_s=0)


def test_a_shard_of_another_class_is_refused_before_anything_is_built(tmp_path):
    from pathlib import Path

    store = Store(tmp_path / "s").create()
    tiny = Path(__file__).parent / "configs" / "tiny.yaml"
    shard = cut("gemm", [item(8, 1.0)], 1)[0]
    other = leases.night_key("other-class-1c-1t-0", "n1")
    leases.set_current(store, other, shard.name, 1, "run")
    with pytest.raises(fleet.FleetError, match="is for class other-class-1c-1t-0; this machine"):
        fleet.run_shard(str(tiny), str(tmp_path / "s"), str(tmp_path / "r"), str(tmp_path / "w"),
                        "n1", shard.to_json(), "other-class-1c-1t-0", attempt=1)
    refused = leases.attempt_doc(store, other, shard.name, 1)
    assert refused["state"] == "refused" and "refused before measuring" in refused["message"]
    assert not (tmp_path / "w" / "build").exists()
    # an attempt the parent replaced starts nothing either
    from tilecast.core.hardware import profile
    leases.set_current(store, leases.night_key(profile(2)["hardware_class"], "n1"), shard.name, 2,
                       "run-2")
    with pytest.raises(fleet.FleetError, match="replaced this attempt"):
        fleet.run_shard(str(tiny), str(tmp_path / "s"), str(tmp_path / "r"), str(tmp_path / "w"),
                        "n1", shard.to_json(), profile(2)["hardware_class"], attempt=1)
    assert not (tmp_path / "w" / "build").exists()


def test_a_shard_cut_by_other_code_is_refused(tmp_path):
    from pathlib import Path

    store = Store(tmp_path / "s").create()
    tiny = Path(__file__).parent / "configs" / "tiny.yaml"
    shard = cut("gemm", [item(8, 1.0)], 1)[0]
    from tilecast.core.hardware import profile
    mine = fleet.code_identity()
    with pytest.raises(fleet.FleetError, match="was cut by other code: tilecast"):
        fleet.run_shard(str(tiny), str(tmp_path / "s"), str(tmp_path / "r"), str(tmp_path / "w"),
                        "n1", shard.to_json(), profile(2)["hardware_class"],
                        code={**mine, "version": "0.0.1"})
    mine_key = leases.night_key(profile(2)["hardware_class"], "n1")
    assert leases.attempt_doc(store, mine_key, shard.name, 1)["state"] == "refused"
    if mine["git_sha"] != "unknown":
        with pytest.raises(fleet.FleetError, match="commit"):
            fleet.run_shard(str(tiny), str(tmp_path / "s"), str(tmp_path / "r"),
                            str(tmp_path / "w"), "n1", shard.to_json(),
                            profile(2)["hardware_class"], code={**mine, "git_sha": "f" * 40})
    assert fleet._code_differs(mine) is None and fleet._code_differs(None) is None
    assert not (tmp_path / "w" / "build").exists()


def test_a_pool_is_read_as_class_deployment_and_machines():
    assert fleet.Pool.parse("amd-x-2c-2t-ab=tilecast-shard/shard-x:4") == fleet.Pool(
        "amd-x-2c-2t-ab", "tilecast-shard/shard-x", 4)
    assert fleet.Pool.parse("c=d/e").shards == 2
    for bad in ("c", "=d/e", "c=", "c=d/e:many"):
        with pytest.raises(Exception, match="expected CLASS=DEPLOYMENT"):
            fleet.Pool.parse(bad)
    with pytest.raises(Exception, match="at least 1"):
        fleet.Pool("c", "d/e", 0)


class InProcess:
    """A pool's machines as this process under a CPU affinity: one core and two are two
    hardware classes of this CPU (tilecast.core.hardware.profile counts the cores it may use).
    Each shard is measured, for real, when it is submitted."""

    def __init__(self, cpus):
        self.cpus, self.handles = set(cpus), {}

    def submit(self, name, key, parameters):
        import os

        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.cpus)
        try:
            fleet.run_shard(**parameters)
            outcome = ("completed", "")
        except fleet.FleetError as err:
            outcome = ("failed", str(err))
        finally:
            os.sched_setaffinity(0, before)
        self.handles[key] = outcome
        return key

    def state(self, handle):
        return self.handles[handle]

    def cancel(self, handle):
        pass


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_mixed_fleet_is_one_night_one_model_per_class(tmp_path):
    import os
    from pathlib import Path

    import yaml

    from tilecast.core.hardware import profile

    tiny = yaml.safe_load((Path(__file__).parent / "configs" / "tiny.yaml").read_text())
    tiny["families"]["gemm"]["problems"] = {
        "train": [{"grid": {"m": [1, 24, 96], "n": [16], "k": [32, 160]}}],
        "holdout": [{"list": [{"m": 7, "n": 50, "k": 100}, {"m": 33, "n": 33, "k": 33}]}]}
    config = tmp_path / "mixed.yaml"
    config.write_text(yaml.safe_dump(tiny))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        one_core = profile(2)["hardware_class"]
    finally:
        os.sched_setaffinity(0, before)
    both = profile(2)["hardware_class"]
    assert one_core != both
    machines = {"shard/one": InProcess({min(before)}), "shard/both": InProcess(before)}
    pools = [fleet.Pool(one_core, "shard/one", 1), fleet.Pool(None, "shard/both", 1)]
    store, registry, work = tmp_path / "store", tmp_path / "registry", tmp_path / "night"
    summary = fleet.night(str(config), str(work), str(registry), str(store), pools,
                          machines.__getitem__,
                          fleet.FleetSettings(shard_workdir=str(tmp_path / "shards")),
                          sleep=lambda s: None)
    assert summary["failed"] == {} and set(summary["classes"]) == {one_core, both}
    for cls in (one_core, both):
        tonight = summary["classes"][cls]
        assert [s["state"] for s in tonight["families"]["gemm"]["shards"]] == ["done"]
        records = nights.read_frame(Store(store), cls, "gemm", summary["run_id"])
        assert records["dims_key"].nunique() == 8          # every problem, on its class
        assert (registry / f"gemm@{cls}" / "versions" / "1").is_dir()
        assert (work / cls / "report" / "report.md").is_file()
        assert Store(store).profile(cls)["hardware_class"] == cls
    # one pool per class
    with pytest.raises(Exception, match="one pool per class"):
        fleet.night(str(config), str(tmp_path / "again"), str(registry), str(store),
                    [fleet.Pool(both, "a/b", 1), fleet.Pool(None, "c/d", 1)],
                    machines.__getitem__)


def test_workers_of_one_host_claim_disjoint_slots_of_its_cores(tmp_path):
    import os

    from tilecast.fleet import slots

    assert slots.layout({0, 1, 2, 3, 4}, 2) == [(0, 1), (2, 3)]     # the remainder unused
    assert slots.layout({5, 7}, 1) == [(5,), (7,)]
    first = slots.claim(tmp_path, 2, allowed={0, 1, 2, 3})
    second = slots.claim(tmp_path, 2, allowed={0, 1, 2, 3})
    assert (first.index, first.cpus, second.index, second.cpus) == (0, (0, 1), 1, (2, 3))
    assert second.device("node7") == "cpu@node7:2-3"
    assert slots.Slot(0, (4,), -1).device("n") == "cpu@n:4"
    with pytest.raises(slots.SlotError, match="all 2 slots of 2 CPUs"):
        slots.claim(tmp_path, 2, allowed={0, 1, 2, 3})
    os.close(first.fd)                          # a worker gone: its slot is free at once
    assert slots.claim(tmp_path, 2, allowed={0, 1, 2, 3}).index == 0
    with pytest.raises(slots.SlotError, match="may use 4"):
        slots.layout({0, 1, 2, 3}, 5)
