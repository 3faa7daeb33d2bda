"""What a run configuration is once read (tilecast.config.load reads and checks it): the
run, each family's part, the budgeted night's settings, and the error a malformed config or
problems file raises.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tilecast.core import resources
from tilecast.measurement.protocol import Protocol

#: the shipped configs, in a checkout or an installed package (tilecast.core.resources)
CONFIGS_DIR = resources.configs_dir()
#: suffixes that make a --config value a file path rather than a shipped config's name
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
PROBLEM_SETS = ("train", "holdout")
SHOWN_ERRORS = 20          # lines of a ConfigError; the rest are counted
UNLIMITED_BUDGET = 10**9   # no `budget`: every candidate of the space
# problems one problem set (or problems file) may expand to, counted before expanding
MAX_PROBLEMS = 100_000


class ConfigError(ValueError):
    """A malformed run configuration or problems file."""


@dataclass(frozen=True)
class FamilyConfig:
    """One family's part of a run: which candidates, on which problems, with which model."""
    name: str
    candidates: dict
    budget: int
    seed: int
    problems: dict[str, list[dict]]
    model: dict = field(default_factory=dict)
    # continue training from this registry version (an alias or a number); None: from scratch
    warm_start: str | None = None
    # the rebenchmark's problems (`tilecast rebench`); the config's holdout set when absent
    sentinel: list[dict] = field(default_factory=list)
    # the problems the family's users run (its `workload` file), which a budgeted night
    # measures where its model is least sure (tilecast.store.plan); none when absent
    workload: list[dict] = field(default_factory=list)
    # the problem sets' entries as written (grid / list / random): a budgeted night redraws
    # the random ones to explore
    entries: dict[str, list] = field(default_factory=dict)


@dataclass(frozen=True)
class NightSettings:
    """`night:` of a config: how a night with a measurement store spends its time
    (tilecast.store.plan). Without a budget, or without a store, a night measures the
    config's problem lists as they are."""
    budget_minutes: float | None = None   # measuring time a night; None: the fixed lists
    policy: str = "active"        # new shapes where the model is least sure, or "random"
    settle_nights: int = 3        # a label is contested until it has this many nights ...
    contested_pct: float = 2.0    # ... while its runner-up is within this of its best
    remeasure_share: float = 0.4  # at most this share of the budget re-measures labels
    sentinels: int = 8            # drift sentinels measured every night (the sentinel set's first)
    workload_share: float = 0.5   # of the new shapes' time, this share for the workload file's
    explore: int = 2000           # exploration shapes drawn and scored a night
    members: int = 5              # models fitted on resampled problems, whose disagreement guides


@dataclass(frozen=True)
class RunConfig:
    """A whole run; see configs/quick.yaml for an annotated example."""
    name: str
    path: Path
    protocol: Protocol
    tie_threshold_pct: float
    finalists: int
    confirm_samples: int
    build_jobs: int
    problems_per_batch: int
    rounds: int
    families: dict[str, FamilyConfig]
    retry_disturbed: int = 1
    interleave: bool = True    # time a batch's candidates side by side (tilecast.measurement.interleave)
    race_cycles: int = 16      # interleaved: more cycles for each problem's contenders
    race_rounds: int = 3       # ... in this many rounds spread over the rest of the run
    race_margin_pct: float = 25.0
    race_keep_pct: float = 5.0  # after a race round, contenders this close to its best go on
    race_fresh_process: bool = True   # each race round in a new worker, operands placed anew
    night: NightSettings = NightSettings()
    # protocol.threads as a list: every count a night measures with (the protocol holds the
    # first); a single count otherwise
    thread_counts: tuple[int, ...] = ()
