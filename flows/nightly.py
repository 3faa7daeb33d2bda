"""The DAG: build -> benchmark -> convert -> train -> evaluate -> (report, publish), per family,
all as tasks of one flow (each extra flow or subflow costs about a second).

Scheduling on the benchmark device: the builds of every family fan out first (compiling
while measuring would disturb the samples); the benchmarks then run one at a time on the
device (chained here, and across flow runs by the device tag's concurrency limit); converts,
trainings and evaluations fan out once the device's benchmarks are done."""
from __future__ import annotations

from prefect import flow

from tilecast.tasks import orchestration, stages
from tilecast.workflows import pipeline
from tilecast.core.device import default_device
from tilecast.store.store import Store


@flow(name="tilecast-nightly", log_prints=True)
def nightly(config: str = "nightly", workdir: str = "work/nightly", registry: str = "registry",
            run_id: str | None = None, device: str | None = None,
            store: str | None = None, budget_minutes: float | None = None) -> dict:
    """Run every stage for every family of `config`; returns the report's summary.
    `run_id` resumes a run (its finished tasks are cached); `device` names the benchmark
    device (default: this host's CPU); `store` (a path or URL) keeps the night's records
    and trains on the labels pooled over its nights (tilecast.store); with a store, a night
    of `budget_minutes` (default: the config's night.budget_minutes) measures what its plan
    chooses rather than the config's lists (tilecast.store.plan)."""
    ctx = pipeline.RunContext.create(config, workdir, registry, run_id=run_id, store=store,
                                     budget_minutes=budget_minutes)
    if ctx.store:
        Store(ctx.store).create()   # unreachable or unwritable: fail before anything is built
    device = device or default_device()
    orchestration.ensure_device_limit(device)
    args = (str(ctx.config.path), str(ctx.workdir), str(ctx.registry), ctx.run_id)
    families = list(ctx.config.families)

    builds = {f: stages.build_kernels.submit(*args, f, store=ctx.store) for f in families}
    bench_task = orchestration.on_device(stages.benchmark_candidates, device)
    benches, previous = {}, list(builds.values())
    for f in families:
        benches[f] = bench_task.submit(*args, f, builds[f], device, store=ctx.store,
                                     budget_minutes=budget_minutes, wait_for=previous)
        previous = [benches[f]]
    for future in benches.values():  # nothing else in flight while the device measures
        future.wait()
    converts = {f: stages.convert_to_parquet.submit(*args, f, benches[f], store=ctx.store)
                for f in families}
    trains = {f: stages.train_model.submit(*args, f, converts[f], store=ctx.store)
              for f in families}
    evaluations = {f: stages.evaluate_holdout.submit(*args, f, trains[f], store=ctx.store)
                   for f in families}
    report = stages.write_report.submit(*args, {f: evaluations[f] for f in families},
                                        store=ctx.store)
    publishes = {f: stages.publish_registry.submit(*args, f, evaluations[f], store=ctx.store,
                                                   wait_for=[report])
                 for f in families}

    summaries = {f: {"build": builds[f].result(), "bench": benches[f].result(),
                     "convert": converts[f].result(), "train": trains[f].result(),
                     "evaluate": evaluations[f].result()} for f in families}
    published = {f: publishes[f].result() for f in families}
    report = report.result()
    try:
        orchestration.publish_artifacts(ctx.run_id, report["report_dir"], published)
    except Exception as err:  # the run's results are on disk and published; say what is missing
        print(f"WARNING: could not create the run's Prefect artifacts: {err!r}")
    return {"run_id": ctx.run_id, "device": device, "stages": summaries, "report": report,
            "published": published}
