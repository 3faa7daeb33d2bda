"""The whole DAG through the console script, as a user runs it: `tilecast run` (Prefect flow,
embedded server) on a tiny config, then `tilecast select`; a re-run measures nothing again."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TINY = Path(__file__).parent / "configs" / "tiny.yaml"
TILECAST = [sys.executable, "-m", "tilecast.flows.cli"]
REPO = Path(__file__).resolve().parents[1]


def _run(*args, check=True):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*TILECAST, *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)
    if check and proc.returncode != 0:
        pytest.fail(f"tilecast {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@pytest.mark.slow
def test_run_then_select_then_rerun(tmp_path):
    work, registry = tmp_path / "work", tmp_path / "registry"
    first = _run("run", "--config", str(TINY), "--workdir", str(work), "--registry", str(registry))
    summary = json.loads(first.stdout)
    assert summary["published"]["gemm"]["version"] == 1
    assert "bench gemm: batch" in first.stderr  # progress shown during the benchmark
    # ... and sent to the run's embedded server, under the benchmark's task run
    assert "without a flow run id" not in first.stderr and "Error logging to API" not in first.stderr
    with sqlite3.connect(work / ".prefect" / "prefect.db") as db:
        logged = db.execute("SELECT count(*) FROM log WHERE message LIKE 'bench gemm: batch%' "
                            "AND task_run_id IS NOT NULL").fetchone()[0]
    assert logged >= 1

    evaluation = json.loads((work / "report" / "evaluation.json").read_text())
    gemm = evaluation["models"]["gemm"]
    for key in ("n_problems", "mean_efficiency", "median_efficiency", "p10_efficiency",
                "min_efficiency", "top1", "top5", "static_best"):
        assert key in gemm, key
    assert gemm["n_problems"] == 3 and 0 < gemm["mean_efficiency"] <= 1
    report = (work / "report" / "report.md").read_text()
    assert report.startswith("# tilecast") and "### Measurement noise of this run" in report
    assert gemm["noise"]["n_problems"] >= 3 and gemm["noise"]["timing"] == {"interleaved": 1.0}
    raw = [json.loads(line) for line in (work / "bench" / "gemm.jsonl").read_text().splitlines()]
    timed = [r for r in raw if r["role"] == "candidate" and r["status"] == "ok"]
    assert timed and all(r["timing"] == "interleaved" and len(r["window_factors"])
                         == len(r["samples_s"]) for r in timed)
    assert (work / "report" / "efficiency_gemm.png").stat().st_size > 1000
    # the roofline: each held-out problem under ceilings measured at report time
    roof = gemm["roofline"]
    assert roof["n_problems"] == 3 and roof["fma_peak_gflops"] > 0 and roof["read_bandwidth_gbps"] > 0
    assert 0 < roof["median_chosen_of_roof"] <= roof["median_best_of_roof"]
    assert "### Roofline (held-out problems)" in report
    assert (work / "report" / "roofline_gemm.png").stat().st_size > 1000

    # published under this machine's hardware class; `--model gemm` serves it here
    from tilecast.core.hardware import profile
    model = summary["published"]["gemm"]["model"]
    assert model == f"gemm@{profile(2)['hardware_class']}"
    candidates = json.loads((registry / model / "versions" / "1" / "candidates.json").read_text())
    chosen = _run("select", "--registry", str(registry), "--model", "gemm",
                  "--problem", "m=40,n=70,k=90").stdout.strip()
    assert chosen in candidates["kernels"]
    as_json = json.loads(_run("select", "--registry", str(registry), "--model", "gemm",
                              "--problem", "m=40,n=70,k=90", "--json").stdout)
    assert as_json["kernel"] == chosen and as_json["version"] == 1 and as_json["predicted_tflops"] > 0
    assert as_json["model"] == model

    # the version carries its shortlist (checksummed with the rest); evaluate scored it
    version = registry / model / "versions" / "1"
    shortlist = json.loads((version / "shortlist.json").read_text())
    assert shortlist["format"] == "tilecast-shortlist" and shortlist["leaves"]
    assert "shortlist.json" in json.loads((version / "checksums.json").read_text())["files"]
    sizes = json.loads((work / "eval" / "gemm" / "metrics.json").read_text())["shortlist"]["sizes"]
    assert "1" in sizes and all(0 <= v["mean_efficiency"] <= 1 for v in sizes.values())
    listed = _run("select", "--registry", str(registry), "--model", "gemm", "--problem",
                  "m=40,n=70,k=90", "--shortlist", "1").stdout.strip()
    assert listed in candidates["kernels"]

    bad = _run("select", "--registry", str(registry), "--model", "gemm", "--problem", "m=4,n=x,k=1",
               check=False)
    assert bad.returncode == 2 and "n='x'" in bad.stderr

    # the published model on a user's own problems: oracle measured, choices scored
    mine = tmp_path / "mine.yaml"
    mine.write_text("problems:\n  - list: [{m: 5, n: 40, k: 64}, {m: 70, n: 9, k: 30}]\n"
                    "  - grid: {m: [12], n: [12, 90], k: [50]}\n")
    evaluated = _run("evaluate", "--registry", str(registry), "--model", "gemm", "--problems",
                     str(mine), "--workdir", str(tmp_path / "eval"), "--config", str(TINY))
    metrics = json.loads(evaluated.stdout)
    assert metrics["n_problems"] == 4 and metrics["version"] == 1
    assert 0 < metrics["mean_efficiency"] <= 1 and 0 <= metrics["top1"] <= metrics["top5"] <= 1
    assert "gemm v1 on 4 problems: mean efficiency" in evaluated.stderr
    import pandas as pd
    table = pd.read_parquet(tmp_path / "eval" / "eval" / "gemm" / "per_problem.parquet")
    row = table.set_index("dims_key").loc["m=5,n=40,k=64,dtype=fp32,layout_a=row,layout_b=row"]
    assert row["chosen_kernel"] == _run("select", "--registry", str(registry), "--model", "gemm",
                                        "--problem", "m=5,n=40,k=64").stdout.strip()
    mine.write_text("problems:\n  - list: [{m: 5, n: 0, k: 64}]\n")
    bad = _run("evaluate", "--registry", str(registry), "--model", "gemm", "--problems", str(mine),
               "--workdir", str(tmp_path / "eval"), "--config", str(TINY), check=False)
    assert bad.returncode == 2 and "problems[0].list[0].n" in bad.stderr and "Traceback" not in bad.stderr

    # the nightly's second night: same measurements, training continued from production
    warm_config = tmp_path / "tiny_warm.yaml"
    config = yaml.safe_load(TINY.read_text())
    config["families"]["gemm"]["warm_start"] = "production"
    warm_config.write_text(yaml.safe_dump(config))
    second = _run("run", "--plain", "--config", str(warm_config), "--workdir", str(work),
                  "--registry", str(registry))
    again = json.loads(second.stdout)
    assert again["stages"]["gemm"]["train"]["warm_start_version"] == 1
    manifest = json.loads((registry / model / "versions" / "2" / "train_manifest.json").read_text())
    assert manifest["lineage"][0]["base"]["version"] == 1 and manifest["base_trees"] > 0
    published = again["published"]["gemm"]
    assert "same holdout, 3 problems" in published["reason"] and published["baseline_version"] == 1
    assert published["aliases"] == (["production"] if published["promoted"] else ["candidate"])
    assert summary["stages"]["gemm"]["bench"]["new_records"] > 0
    assert again["stages"]["gemm"]["bench"]["new_records"] == 0  # warm: nothing re-measured
    assert again["stages"]["gemm"]["build"]["cached"] == again["stages"]["gemm"]["build"]["candidates"]
    assert again["published"]["gemm"]["version"] == 2


def test_bad_config_is_a_message_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nfamilies: {gemm: {candidates: {}, problems: {train: []}}}\n")
    proc = _run("run", "--config", str(bad), "--workdir", str(tmp_path / "w"), check=False)
    assert proc.returncode == 2
    assert "missing key(s) ['holdout']" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_grouped_conv_forward_runs_through_the_whole_pipeline(tmp_path):
    work, registry = tmp_path / "work", tmp_path / "registry"
    config = Path(__file__).parent / "configs" / "tiny_conv.yaml"
    summary = json.loads(_run("run", "--plain", "--config", str(config), "--workdir", str(work),
                              "--registry", str(registry)).stdout)
    stages = summary["stages"]["grouped_conv_forward"]
    assert stages["build"]["ok"] == stages["build"]["candidates"] == 5
    assert stages["bench"]["statuses"].get("ok", 0) > 0
    assert set(stages["bench"]["statuses"]) <= {"ok", "unsupported"}
    model = json.loads((work / "report" / "evaluation.json").read_text())["models"]
    assert model["grouped_conv_forward"]["n_problems"] == 3
    chosen = _run("select", "--registry", str(registry), "--model", "grouped_conv_forward",
                  "--problem", "C=8,K=8,Hi=10,Wi=10,Y=3,X=3,pad_h=1,pad_w=1").stdout.strip()
    assert chosen.startswith("grouped_conv_forward_fp32_2d_")


@pytest.mark.slow
def test_the_flow_runs_on_a_dask_local_cluster(tmp_path):
    """Scale-out: the same flow with its tasks on a Dask LocalCluster (worker processes)."""
    work, registry = tmp_path / "work", tmp_path / "registry"
    proc = _run("run", "--config", str(TINY), "--workdir", str(work), "--registry", str(registry),
                "--task-runner", "dask", "--dask-workers", "2")
    summary = json.loads(proc.stdout)
    assert "Creating a new Dask cluster" in proc.stderr
    assert summary["published"]["gemm"]["version"] == 1
    assert summary["stages"]["gemm"]["bench"]["new_records"] > 0
    assert (work / "report" / "evaluation.json").exists()


@pytest.mark.slow
def test_nights_accumulate_in_a_store_and_models_train_on_their_pooled_labels(tmp_path):
    """Two nights (the flow, then --plain) in fresh workdirs, one store: the second trains and
    is judged on labels pooled over both; `store add` of a workdir adds nothing new."""
    from tilecast.store.nights import summary
    from tilecast.store.store import Store

    store, registry = tmp_path / "store", tmp_path / "registry"
    evaluations = []
    for night, plain in (("n1", ()), ("n2", ("--plain",))):
        work = tmp_path / night
        run = json.loads(_run("run", *plain, "--config", str(TINY), "--workdir", str(work),
                              "--registry", str(registry), "--store", str(store)).stdout)
        assert run["stages"]["gemm"]["convert"]["stored"]["new_files"] == 1
        evaluations.append(json.loads((work / "report" / "evaluation.json").read_text())
                           ["models"]["gemm"])
        report = (work / "report" / "report.md").read_text()
        assert "### Labels pooled over nights" in report and "### Change points" in report
    [held] = summary(Store(store))
    assert held["nights"] == 2 and held["problems"] == 15 and held["kernels"] == 4
    first, second = (e["pooled_labels"] for e in evaluations)
    assert first["holdout"]["median_nights"] == 1 and second["holdout"]["median_nights"] == 2
    assert second["train"]["median_nights"] == 2 and second["train"]["pairs"] >= 40
    assert evaluations[1]["n_problems"] == 3
    added = _run("store", "add", str(store), str(tmp_path / "n1")).stdout
    assert "in 0 new file(s)" in added
    # the store is refused before anything is built when it cannot be written
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = _run("run", "--config", str(TINY), "--workdir", str(tmp_path / "n3"),
                "--store", str(blocker / "store"), check=False)
    assert proc.returncode == 2 and "cannot be written" in proc.stderr
    assert not (tmp_path / "n3" / "build").exists()


TINY_NIGHT = Path(__file__).parent / "configs" / "tiny_night.yaml"


@pytest.mark.slow
def test_a_budgeted_night_measures_its_plan_and_a_replay_compares_policies(tmp_path):
    """tiny_night.yaml into one store: the first night (an empty store) measures the config's
    lists; the second (the flow, --budget-minutes) plans and measures exactly its plan, and
    its report draws the plan and the model night by night; `tilecast plan` shows the next
    night's; `tilecast replay` runs both policies over the store."""
    import pandas as pd

    store, registry = tmp_path / "store", tmp_path / "registry"
    common = ("--config", str(TINY_NIGHT), "--registry", str(registry), "--store", str(store))
    first = json.loads(_run("run", "--plain", "--workdir", str(tmp_path / "n1"), *common).stdout)
    assert not (tmp_path / "n1" / "plan").exists()
    assert first["stages"]["gemm"]["convert"]["problems"] == 19   # 12 grid + 4 drawn + 3 held out
    second = _run("run", "--workdir", str(tmp_path / "n2"), *common, "--budget-minutes", "0.4")
    plan = json.loads((tmp_path / "n2" / "plan" / "gemm.json").read_text())
    assert plan["budget_s"] == pytest.approx(24.0) and plan["seconds"] <= 24.0
    counts = plan["counts"]
    assert counts["held-out"] == 3 and counts["sentinel"] == 2 and counts["explore"] >= 1
    assert counts["workload"] >= 1
    keys = [c["dims_key"] for c in plan["chosen"]]
    measured = pd.read_parquet(tmp_path / "n2" / "data" / "gemm.parquet")
    assert set(measured["dims_key"]) == set(keys)
    held = {"m=7,n=50,k=100,dtype=fp32,layout_a=row,layout_b=row",
            "m=60,n=20,k=200,dtype=fp32,layout_a=row,layout_b=row",
            "m=33,n=33,k=33,dtype=fp32,layout_a=row,layout_b=row"}
    assert set(measured.loc[measured["problem_set"] == "holdout", "dims_key"]) >= held
    assert not held & set(measured.loc[measured["problem_set"] == "train", "dims_key"])
    assert "plan gemm: active night, 0.4 min budget" in second.stderr
    gemm = json.loads((tmp_path / "n2" / "report" / "evaluation.json").read_text())["models"]["gemm"]
    assert gemm["night_plan"]["counts"] == counts and gemm["night_plan"]["measured_s"] > 0
    assert [row["version"] for row in gemm["nights"]] == [1]
    assert gemm["train_problems"] > 16
    report = (tmp_path / "n2" / "report" / "report.md").read_text()
    assert "### Tonight's plan" in report and "### The model night by night" in report
    assert "| tonight |" in report.replace("  ", " ")

    shown = _run("plan", "--store", str(store), "--config", str(TINY_NIGHT), "--show", "3").stdout
    assert "gemm: active night, 0.5 min budget" in shown and "held-out" in shown
    out = tmp_path / "replay.json"
    replayed = _run("replay", str(store), "--config", str(TINY_NIGHT), "--start", "6", "--step",
                    "3", "--steps", "2", "--seeds", "1", "--rounds", "20", "--out", str(out))
    lines = replayed.stdout.splitlines()
    assert "2 nights" in lines[0] and "3 held-out" in lines[0]
    assert [line.split(" |")[0] for line in lines[2:5]] == ["6", "9", "12"]
    assert "active reaches random's final mean" in lines[-2]
    assert "regret reaches random's final mean" in lines[-1]
    points = json.loads(out.read_text())["points"]
    assert len(points) == 9 and {p["policy"] for p in points} == {"active", "regret", "random"}
    starts = [p for p in points if p["step"] == 0]
    assert len({p["mean_efficiency"] for p in starts}) == 1   # the same start


@pytest.mark.slow
def test_a_list_of_thread_counts_measures_and_publishes_each_as_its_own_class(tmp_path):
    """protocol.threads: [1, 2]: one night, run once per count in W/threads-<count>, each a
    hardware class of its own in the store and the registry."""
    from tilecast.store.nights import summary
    from tilecast.store.store import Store

    config = tmp_path / "threads.yaml"
    config.write_text(TINY.read_text().replace("threads: 2,", "threads: [1, 2],"))
    work, registry, store = tmp_path / "work", tmp_path / "registry", tmp_path / "store"
    run = json.loads(_run("run", "--plain", "--config", str(config), "--workdir", str(work),
                          "--registry", str(registry), "--store", str(store)).stdout)
    assert set(run["threads"]) == {"1", "2"}
    models = {run["threads"][t]["published"]["gemm"]["model"] for t in ("1", "2")}
    assert len(models) == 2 and all(m.startswith("gemm@") for m in models)
    assert any("-1t-" in m for m in models) and any("-2t-" in m for m in models)
    for t in (1, 2):
        raw = [json.loads(line) for line in
               (work / f"threads-{t}" / "bench" / "gemm.jsonl").read_text().splitlines()]
        assert {r["threads"] for r in raw if r["role"] == "candidate"} == {t}
    classes = {row["hardware_class"] for row in summary(Store(store))}
    assert classes == {m.split("@", 1)[1] for m in models}
    listed = _run("registry", "list", "--registry", str(registry)).stdout
    assert all(m.split("@", 1)[1] in listed for m in models)
