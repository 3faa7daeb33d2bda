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
    counts = pipeline.thread_counts(config)
    ctx = pipeline.RunContext.create(config, workdir, registry, run_id=run_id, store=store,
                                     budget_minutes=budget_minutes)
    if ctx.store:
        Store(ctx.store).create()   # unreachable or unwritable: fail before anything is built
    device = device or default_device()
    orchestration.ensure_device_limit(device)
    # every task makes its context from these; a config measuring with several thread counts
    # runs the DAG once per count, one after the other (a hardware class each, its own
    # workdir W/threads-<count>), so that nothing computes while another count measures
    base = ctx.workdir if len(counts) == 1 else ctx.workdir.parent   # W, not W/threads-<n>
    args = (str(ctx.config.path), str(base), str(ctx.registry), ctx.run_id)
    runs = {t: _night(args, list(ctx.config.families), device, ctx.store, budget_minutes,
                      None if len(counts) == 1 else t)
            for t in counts}
    if len(counts) == 1:
        return {"run_id": ctx.run_id, "device": device, **runs[counts[0]]}
    return {"run_id": ctx.run_id, "device": device, "threads": runs}


def _night(args: tuple, families: list[str], device: str, store: str | None,
           budget_minutes: float | None, threads: int | None) -> dict:
    """The DAG of every family at one thread count (None: the config's only one)."""
    more = {"store": store, "threads": threads}
    builds = {f: stages.build_kernels.submit(*args, f, **more) for f in families}
    bench_task = orchestration.on_device(stages.benchmark_candidates, device)
    benches, previous = {}, list(builds.values())
    for f in families:
        benches[f] = bench_task.submit(*args, f, builds[f], device, **more,
                                     budget_minutes=budget_minutes, wait_for=previous)
        previous = [benches[f]]
    for future in benches.values():  # nothing else in flight while the device measures
        future.wait()
    converts = {f: stages.convert_to_parquet.submit(*args, f, benches[f], **more)
                for f in families}
    trains = {f: stages.train_model.submit(*args, f, converts[f], **more) for f in families}
    evaluations = {f: stages.evaluate_holdout.submit(*args, f, trains[f], **more)
                   for f in families}
    report = stages.write_report.submit(*args, {f: evaluations[f] for f in families}, **more)
    publishes = {f: stages.publish_registry.submit(*args, f, evaluations[f], **more,
                                                   wait_for=[report])
                 for f in families}

    summaries = {f: {"build": builds[f].result(), "bench": benches[f].result(),
                     "convert": converts[f].result(), "train": trains[f].result(),
                     "evaluate": evaluations[f].result()} for f in families}
    published = {f: publishes[f].result() for f in families}
    report = report.result()
    try:
        orchestration.publish_artifacts(args[3], report["report_dir"], published)
    except Exception as err:  # the run's results are on disk and published; say what is missing
        print(f"WARNING: could not create the run's Prefect artifacts: {err!r}")
    return {"stages": summaries, "report": report, "published": published}
