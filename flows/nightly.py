"""The DAG: build -> benchmark -> convert -> train -> evaluate -> (report, publish), per family,
all as tasks of one flow (each extra flow or subflow costs about a second)."""
from __future__ import annotations

from prefect import flow

from tasks import stages
from tilecast import pipeline


@flow(name="tilecast-nightly", log_prints=True)
def nightly(config: str = "nightly", workdir: str = "work/nightly", registry: str = "registry",
            run_id: str | None = None) -> dict:
    """Run every stage for every family of `config`; returns the report's summary."""
    ctx = pipeline.RunContext.create(config, workdir, registry, run_id=run_id)
    args = (str(ctx.config.path), str(ctx.workdir), str(ctx.registry), ctx.run_id)
    summaries, evaluations, published = {}, {}, {}
    for family in ctx.config.families:
        built = stages.build_kernels(*args, family)
        bench = stages.benchmark_candidates(*args, family, built)
        data = stages.convert_to_parquet(*args, family, bench)
        model = stages.train_model(*args, family, data)
        evaluations[family] = stages.evaluate_holdout(*args, family, model)
        summaries[family] = {"build": built, "bench": bench, "convert": data, "train": model,
                             "evaluate": evaluations[family]}
    report = stages.write_report(*args, evaluations)
    for family, evaluation in evaluations.items():
        published[family] = stages.publish_registry(*args, family, evaluation)
    return {"run_id": ctx.run_id, "stages": summaries, "report": report, "published": published}
