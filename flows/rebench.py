"""The CI-triggered rebenchmark: re-measure the sentinel problems with every kernel (of the
working tree or a git ref), compare with the previous rebenchmark, and report regressions and
improvements per kernel (a Prefect artifact, W/report/rebench.md and report.md).

The flow run ends Completed when nothing regressed, Failed otherwise (regressions, or a
baseline it cannot be compared with), so `prefect deployment run ... --watch` exits non-zero
for CI; `tilecast rebench` gives the same verdict as exit status 0 / 1 / 3 without Prefect."""
from __future__ import annotations

from prefect import flow
from prefect.states import Completed, Failed

from tilecast.tasks import orchestration, stages
from tilecast.workflows import pipeline, rebench, regression
from tilecast.core.device import default_device


@flow(name="tilecast-rebenchmark", log_prints=True)
def rebenchmark(config: str = "quick", workdir: str = "work/rebench-{date}",
                history: str = "rebench-history", families: list[str] | None = None,
                git_ref: str | None = None, repo: str | None = None,
                problems: list[str] | None = None,
                alpha: float = regression.DEFAULT_ALPHA,
                min_effect: float = regression.DEFAULT_MIN_EFFECT, device: str | None = None):
    """`families`: a subset of the config's (default all); `git_ref`: build the kernels of
    that commit of `repo` (default: this checkout); `problems`: a subset of the sentinel
    problems (dims_keys or `m=..,n=..,k=..`)."""
    plan = rebench.plan(config, pipeline.expand_workdir(workdir), history, families, problems,
                        git_ref, repo, alpha=alpha, min_effect=min_effect)
    device = device or default_device()
    orchestration.ensure_device_limit(device)
    task = orchestration.on_device(stages.rebench_family, device)
    futures, previous = [], []
    for name in plan.families:  # one device: one family at a time
        futures.append(task.submit(plan, name, device, wait_for=previous))
        previous = [futures[-1]]
    comparisons = [f.result() for f in futures]
    markdown = rebench.write_markdown(plan, comparisons)
    status = regression.exit_status(comparisons)
    orchestration.rebench_artifact(plan.run_id, markdown)
    summary = {"run_id": plan.run_id, "exit_status": status, "source": plan.source.describe(),
               "families": {c.family: {"verdict": c.verdict, "message": c.message,
                                       "baseline": c.baseline_run_id} for c in comparisons}}
    print(markdown)
    if status == regression.EXIT_OK:
        return Completed(message="no regression", data=summary)
    return Failed(message="; ".join(f"{c.family}: {c.message}" for c in comparisons
                                    if c.exit_status != regression.EXIT_OK), data=summary)
