"""What the flows need from Prefect beyond tasks: the benchmark device's concurrency limit,
the task runner by name, and the artifacts people read after a run.

A benchmark measures wall time on a device; two benchmarks on one device at once corrupt
each other's samples. Every benchmark task carries the device's tag (`device:<name>`, from
tilecast.core.device: the default name is this host's CPU; `on_device` adds it to a task),
and the tag gets a concurrency limit of 1 on the Prefect server, so
benchmark tasks of different flow runs (a nightly and a CI rebenchmark on the same worker)
never overlap. Within one flow run the benchmarks are also chained, so they never wait on the
limit's polling."""
from __future__ import annotations

import base64
import logging
from pathlib import Path

from prefect.artifacts import create_markdown_artifact
from prefect.client.base import ServerType
from prefect.client.orchestration import get_client
from prefect.exceptions import ObjectNotFound
from prefect.task_runners import ThreadPoolTaskRunner

from tilecast.core.device import device_tag
from tilecast.core.settings import settings
from tilecast.stages import layout

log = logging.getLogger("tilecast.orchestration")

TASK_RUNNERS = ("threads", "dask")


def on_device(task, device: str | None = None):
    """`task` with the tag of `device` (default: this host's CPU) added to its own tags: the
    tag whose concurrency limit keeps benchmarks on one device apart."""
    return task.with_options(tags=[*task.tags, device_tag(device)])


def ensure_device_limit(device: str, limit: int = 1) -> None:
    """Create the tag concurrency limit of `device` on the current Prefect server if it is
    missing; a limit someone set by hand on a shared server (e.g. 0 to pause benchmarks) is
    left as it is. On the embedded server the limit is made anew."""
    tag = device_tag(device)
    # the command's own server (tilecast.flows.embedded_server; $TILECAST_EMBEDDED_SERVER) is as
    # private as Prefect's ephemeral one
    own_server = settings().embedded_server
    with get_client(sync_client=True) as client:
        if own_server or client.server_type == ServerType.EPHEMERAL:
            # this process's own server: no one else holds the device's slot, but a killed
            # run of the same workdir left its slot taken (leases live in server memory)
            try:
                client.delete_concurrency_limit_by_tag(tag)
            except ObjectNotFound:
                pass
        try:
            existing = client.read_concurrency_limit_by_tag(tag)
        except ObjectNotFound:
            client.create_concurrency_limit(tag=tag, concurrency_limit=limit)
            log.info("created concurrency limit %s = %d", tag, limit)
            return
    log.info("concurrency limit %s = %s (kept)", tag, existing.concurrency_limit)


def task_runner(name: str, *, workers: int | None = None):
    """`threads` (Prefect's default pool) or `dask`: a Dask LocalCluster of `workers`
    processes on this machine. (A remote Dask scheduler is not offered: its workers would read
    their own hardware and take their own device locks while writing this machine's paths; a
    night over many machines is tilecast.workflows.fleet.)"""
    if name == "threads":
        return ThreadPoolTaskRunner()
    if name == "dask":
        # imports dask.distributed: only a dask run needs it
        from prefect_dask import DaskTaskRunner

        return DaskTaskRunner(cluster_class="distributed.LocalCluster",
                              cluster_kwargs={"n_workers": workers or 2, "threads_per_worker": 2,
                                              "processes": True, "dashboard_address": None})
    raise ValueError(f"unknown task runner {name!r}; valid: {', '.join(TASK_RUNNERS)}")


def publish_artifacts(run_id: str, report_dir: str, published: dict) -> None:
    """Markdown artifacts of a finished run: the evaluation report with its plots, and the
    registry versions published (with the gate's reason)."""
    directory = Path(report_dir)
    report = (directory / layout.REPORT_FILE).read_text()
    for plot in sorted(directory.glob(layout.PLOT_FILE.format(model="*"))):
        encoded = base64.b64encode(plot.read_bytes()).decode()
        report += f"\n![{plot.stem}](data:image/png;base64,{encoded})\n"
    create_markdown_artifact(key="tilecast-evaluation", markdown=report,
                             description=f"evaluation of run {run_id}")
    lines = ["# Registry versions published", "", f"run `{run_id}`", "",
             "| model | version | promoted | aliases | reason |", "|---|---|---|---|---|"]
    for family, outcome in published.items():
        lines.append(f"| {family} | {outcome['version']} | {outcome['promoted']} | "
                     f"{', '.join(outcome['aliases']) or '-'} | "
                     f"{str(outcome['reason']).replace('|', '/')} |")
    create_markdown_artifact(key="tilecast-registry", markdown="\n".join(lines) + "\n",
                             description=f"registry versions of run {run_id}")


def rebench_artifact(run_id: str, markdown: str) -> None:
    """The rebenchmark's per-kernel table as a markdown artifact."""
    create_markdown_artifact(key="tilecast-rebench", markdown=markdown,
                             description=f"rebenchmark {run_id}: regressions and improvements")

