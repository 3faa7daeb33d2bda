"""One Prefect task per pipeline stage. Each wraps the plain-Python stage in
`tilecast.workflows.pipeline`, which is tested without Prefect; the task adds retries, caching on
inputs + source, tags, logging and, for build and benchmark, their progress (an artifact and a
terminal bar, tilecast.tasks.progress). The benchmark tasks get their device's tag (its
concurrency limit keeps benchmarks on one device apart) from the flow that runs them
(tilecast.tasks.orchestration.on_device), since the device is a flow parameter."""
from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor

import hashlib

from prefect import task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE, CacheKeyFnPolicy

from tilecast.config import ConfigError, resolve_path
from tilecast.tasks.progress import StageProgress
from tilecast.workflows import pipeline, rebench


def _config_digest(_context, parameters: dict) -> str | None:
    """The config file's contents: the tasks take its path, so a run resumed (same run id)
    after the file was edited must not get the stages the old contents produced."""
    try:
        return hashlib.sha256(resolve_path(parameters["config"]).read_bytes()).hexdigest()
    except (KeyError, ConfigError, OSError):
        return None   # the stage itself reports a missing or unreadable config


CACHE = INPUTS + TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=_config_digest)

# The stages that compute in this process (torch peers while benchmarking, LightGBM, the
# native scorer) run on one thread: an OpenMP runtime runs ~3x slower once a second thread
# starts parallel regions (seen here: a LightGBM fit 0.56 s on the first thread, 1.7 s on
# any other), and the task runner gives every task a thread of its own. Builds (compiler
# processes) and converts keep fanning out on the runner's threads.
_COMPUTE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tilecast-compute")


def _compute(fn, *args):
    # the task's run context goes along, so the stage's logs reach the API under its task run
    # (without it they reached stderr only, with a warning per record)
    return _COMPUTE.submit(contextvars.copy_context().run, fn, *args).result()


def _ctx(config: str, workdir: str, registry: str, run_id: str, store: str | None = None,
         budget_minutes: float | None = None, threads: int | None = None) -> pipeline.RunContext:
    return pipeline.RunContext.create(config, workdir, registry, run_id=run_id, store=store,
                                      budget_minutes=budget_minutes, threads=threads)


@task(name="build-kernels", cache_policy=CACHE, tags=["build"], retries=0)
def build_kernels(config: str, workdir: str, registry: str, run_id: str, family: str,
                  store: str | None = None, threads: int | None = None) -> dict:
    """Compile the family's candidates into the content-hash cache."""
    with StageProgress("build", family) as progress:
        return pipeline.build_stage(_ctx(config, workdir, registry, run_id, store,
                                         threads=threads), family, progress)


@task(name="benchmark-candidates", cache_policy=CACHE, tags=["bench"],
      retries=2, retry_delay_seconds=[5, 30])
def benchmark_candidates(config: str, workdir: str, registry: str, run_id: str, family: str,
                         build: dict, device: str | None = None,
                         store: str | None = None, budget_minutes: float | None = None,
                         threads: int | None = None) -> dict:
    """Measure every built candidate on the problem sets, or on a budgeted night's plan
    (resumes from the raw file), holding the device (its tag's concurrency limit here, the
    host's device lock in the stage)."""
    with StageProgress("bench", family) as progress:
        return _compute(pipeline.bench_stage,
                        _ctx(config, workdir, registry, run_id, store, budget_minutes, threads),
                        family, device, progress)


@task(name="convert-to-parquet", cache_policy=CACHE, tags=["convert"])
def convert_to_parquet(config: str, workdir: str, registry: str, run_id: str, family: str,
                       bench: dict, store: str | None = None,
                       threads: int | None = None) -> dict:
    """Raw records -> the parquet dataset."""
    return pipeline.convert_stage(_ctx(config, workdir, registry, run_id, store,
                                       threads=threads), family)


@task(name="train-model", cache_policy=CACHE, tags=["train"])
def train_model(config: str, workdir: str, registry: str, run_id: str, family: str,
                convert: dict, store: str | None = None,
                threads: int | None = None) -> dict:
    """LightGBM on the training problems, GroupKFold on dims_key."""
    return _compute(pipeline.train_stage,
                    _ctx(config, workdir, registry, run_id, store, threads=threads),
                    family)


@task(name="evaluate-holdout", cache_policy=CACHE, tags=["evaluate"])
def evaluate_holdout(config: str, workdir: str, registry: str, run_id: str, family: str,
                     train: dict, store: str | None = None,
                     threads: int | None = None) -> dict:
    """Model vs the measured oracle and the static best on held-out problems."""
    return _compute(pipeline.evaluate_stage,
                    _ctx(config, workdir, registry, run_id, store, threads=threads),
                    family)


@task(name="write-report", cache_policy=CACHE, tags=["report"])
def write_report(config: str, workdir: str, registry: str, run_id: str,
                 evaluations: dict, store: str | None = None,
                 threads: int | None = None) -> dict:
    """evaluation.json, report.md and plots for every family."""
    return _compute(pipeline.report_stage,
                    _ctx(config, workdir, registry, run_id, store, threads=threads))


@task(name="publish-registry", cache_policy=CACHE, tags=["publish"])
def publish_registry(config: str, workdir: str, registry: str, run_id: str, family: str,
                     evaluation: dict, store: str | None = None,
                     threads: int | None = None) -> dict:
    """A new registry version; the production alias moves only if the gate passes."""
    return _compute(pipeline.publish_stage,
                    _ctx(config, workdir, registry, run_id, store, threads=threads),
                    family)


@task(name="rebench-family", cache_policy=NO_CACHE, tags=["bench"], retries=1,
      retry_delay_seconds=[10])
def rebench_family(plan, family: str, device: str | None = None):
    """Build, re-measure and compare one family's sentinel problems (a re-try resumes the
    measurement from its raw log)."""
    return _compute(rebench.run_family, plan, family, device)
