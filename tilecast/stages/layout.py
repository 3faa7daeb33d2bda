"""Where everything lives in a workdir W, and what a model artifact holds: the one source of
every workdir path and model file name (the stages, workflows, tasks and the CLI derive
theirs from here), and of the target transforms a model's feature_spec.json may name.

    W/build/<family>/events.json           one BuildEvent per candidate, binary paths
    W/cache/build/                         compiled candidates (unless $TILECAST_BUILD_CACHE)
    W/bench/<family>.jsonl                 raw records, every sample (resumable)
    W/scratch/<family>/                    benchmark inputs and outputs while measuring
    W/data/<family>.parquet                the dataset
    W/models/<family>/                     model.txt, feature_spec.json, train_manifest.json,
                                           candidates.json, shortlist.json
    W/eval/<family>/                       metrics.json, per_problem.parquet, peer.json,
                                           peer_per_problem.parquet
    W/report/                              evaluation.json, report.md, efficiency_<model>.png,
                                           roofline_<model>.png, publish_<family>.json,
                                           rebench_<family>.json, rebench.md
    W/rebench/                             a rebenchmark's sources, raw logs and scratch
                                           (tilecast.workflows.rebench)
    W/.prefect/                            Prefect's state for `tilecast run`

`tilecast evaluate` uses the same layout with the model's name in place of the family's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tilecast.core.artifact import (  # noqa: F401  a model artifact's files: W/models/<family>/
    CANDIDATES_FILE, FEATURE_SPEC_FILE, MANIFEST_FILE, MODEL_FILE, MODEL_FILES, SHORTLIST_FILE,
    TARGET_TRANSFORMS)
from tilecast.core.settings import settings
from tilecast.registry.base import METRICS_FILE  # noqa: F401 - W/eval/<family>/metrics.json too

# -- an evaluation: W/eval/<family>/ ----------------------------------------------------------

# METRICS_FILE (metrics.json) is the registry's name for a version's metrics, which publish
# uploads from here: one name for both (tilecast.registry.base)
PER_PROBLEM_FILE = "per_problem.parquet"
PEER_FILE = "peer.json"
PEER_PER_PROBLEM_FILE = "peer_per_problem.parquet"

# -- the report: W/report/ --------------------------------------------------------------------

EVALUATION_FILE = "evaluation.json"
REPORT_FILE = "report.md"
PLOT_FILE = "efficiency_{model}.png"        # one per model: its sorted per-problem efficiency
ROOFLINE_PLOT_FILE = "roofline_{model}.png"  # one per model: its held-out problems' roofline
REBENCH_REPORT_FILE = "rebench.md"


@dataclass(frozen=True)
class Workdir:
    """The paths of one workdir (see the module docstring); nothing is created here."""
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    def build_events(self, family: str) -> Path:
        return self.root / "build" / family / "events.json"

    @property
    def build_cache(self) -> Path:
        """$TILECAST_BUILD_CACHE (one cache for every workdir) when set, else W/cache/build."""
        return settings().build_cache or self.root / "cache" / "build"

    def raw_log(self, name: str) -> Path:
        return self.root / "bench" / f"{name}.jsonl"

    def scratch(self, name: str | None = None) -> Path:
        return self.root / "scratch" if name is None else self.root / "scratch" / name

    def dataset(self, name: str) -> Path:
        return self.root / "data" / f"{name}.parquet"

    def plan(self, name: str) -> Path:
        """A budgeted night's plan of what the family measures (tilecast.store.plan)."""
        return self.root / "plan" / f"{name}.json"

    def model_dir(self, name: str) -> Path:
        return self.root / "models" / name

    def eval_dir(self, name: str) -> Path:
        return self.root / "eval" / name

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    def publish_outcome(self, family: str) -> Path:
        return self.report_dir / f"publish_{family}.json"

    def plot(self, model: str) -> Path:
        return self.report_dir / PLOT_FILE.format(model=model)

    def roofline_plot(self, model: str) -> Path:
        return self.report_dir / ROOFLINE_PLOT_FILE.format(model=model)

    # -- a rebenchmark (tilecast.workflows.rebench) --

    @property
    def rebench_dir(self) -> Path:
        return self.root / "rebench"

    @property
    def rebench_sources(self) -> Path:
        """Where `git archive` unpacks a commit's kernels: <this>/<sha>/kernels/."""
        return self.rebench_dir / "src"

    def rebench_raw_log(self, family: str) -> Path:
        """The rebenchmark in progress (a re-run resumes it, or sets it aside in stale/)."""
        return self.rebench_dir / f"{family}.jsonl"

    @property
    def rebench_stale(self) -> Path:
        return self.rebench_dir / "stale"

    def rebench_finished(self, family: str, run_id: str) -> Path:
        return self.rebench_dir / "runs" / f"{family}-{run_id}.jsonl"

    def rebench_scratch(self, family: str) -> Path:
        return self.rebench_dir / "scratch" / family

    def rebench_report(self, family: str) -> Path:
        return self.report_dir / f"rebench_{family}.json"

    @property
    def prefect_home(self) -> Path:
        return self.root / ".prefect"
