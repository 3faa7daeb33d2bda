"""Run configurations (configs/*.yaml): problem sets, candidate spaces, budgets, model specs.

Every key is checked; an unknown or malformed one is an error that names the file and the
key, never a silently ignored setting.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import yaml

from tilecast.core.measure import Protocol, ProtocolError
from tilecast.families import FAMILIES

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
PROBLEM_SETS = ("train", "holdout")


class ConfigError(ValueError):
    """A malformed run configuration."""


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
    interleave: bool = True    # time a batch's candidates side by side (tilecast.core.interleave)
    race_cycles: int = 16      # interleaved: more cycles for each problem's contenders
    race_margin_pct: float = 10.0


def _count(where: str, values: Mapping, key: str, default: int, minimum: int) -> int:
    """An integer setting, `default` when absent; a clear error when it is not a whole number
    or below `minimum`."""
    value = values.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}.{key}: expected a whole number >= {minimum}, got {value!r}")
    return value


def _check_keys(where: str, values: Mapping, required: set, optional: set) -> None:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(values).__name__} {values!r}")
    missing = required - set(values)
    if missing:
        raise ConfigError(f"{where}: missing key(s) {sorted(missing)}")
    unknown = set(values) - required - optional
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; "
                          f"valid: {sorted(required | optional)}")


def expand_problems(where: str, entries: list) -> list[dict]:
    """Expand problem entries into field mappings. An entry is one of:
    `{grid: {field: [values]}, <fixed fields>}` (cartesian product),
    `{list: [{field: value}, ...], <fixed fields>}`, or
    `{random: {count, seed, ranges: {field: [lo, hi]}}, <fixed fields>}` (log-uniform ints)."""
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: expected a list of problem entries, got {entries!r}")
    problems: list[dict] = []
    for i, entry in enumerate(entries):
        here = f"{where}[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{here}: expected a mapping, got {entry!r}")
        kinds = [k for k in ("grid", "list", "random") if k in entry]
        if len(kinds) != 1:
            raise ConfigError(f"{here}: needs exactly one of grid / list / random, got {sorted(entry)}")
        kind = kinds[0]
        fixed = {k: v for k, v in entry.items() if k != kind}
        body = entry[kind]
        if kind == "grid":
            if not isinstance(body, Mapping) or not body:
                raise ConfigError(f"{here}.grid: expected a mapping of field -> list of values")
            keys = list(body)
            for combo in itertools.product(*(body[k] if isinstance(body[k], list) else [body[k]]
                                             for k in keys)):
                problems.append({**fixed, **dict(zip(keys, combo))})
        elif kind == "list":
            if not isinstance(body, list):
                raise ConfigError(f"{here}.list: expected a list of mappings")
            for item in body:
                if not isinstance(item, Mapping):
                    raise ConfigError(f"{here}.list: expected a mapping, got {item!r}")
                problems.append({**fixed, **item})
        else:
            _check_keys(f"{here}.random", body, {"count", "ranges"}, {"seed"})
            problems.extend({**fixed, **p} for p in _random_problems(here, body))
    return problems


def _random_problems(where: str, body: Mapping) -> list[dict]:
    rng = np.random.default_rng(int(body.get("seed", 0)))
    ranges = body["ranges"]
    out = []
    for _ in range(int(body["count"])):
        item = {}
        for key, bounds in ranges.items():
            if not (isinstance(bounds, list) and len(bounds) == 2 and 1 <= bounds[0] <= bounds[1]):
                raise ConfigError(f"{where}.random.ranges.{key}: expected [lo, hi] with 1 <= lo <= hi")
            lo, hi = math.log(bounds[0]), math.log(bounds[1])
            item[key] = int(round(math.exp(rng.uniform(lo, hi))))
        out.append(item)
    return out


def _family_config(where: str, name: str, values: Mapping) -> FamilyConfig:
    _check_keys(where, values, {"candidates", "problems"},
                {"budget", "seed", "model", "warm_start", "sentinel"})
    problems = values["problems"]
    _check_keys(f"{where}.problems", problems, set(PROBLEM_SETS), set())
    expanded = {ps: expand_problems(f"{where}.problems.{ps}", problems[ps]) for ps in PROBLEM_SETS}
    if values.get("sentinel") is None:
        sentinel = list(expanded["holdout"])
    else:
        sentinel = expand_problems(f"{where}.sentinel", values["sentinel"])
        if not sentinel:
            raise ConfigError(f"{where}.sentinel: the entries expand to no problem; give at "
                              "least one, or drop the key to rebenchmark the holdout set")
    return FamilyConfig(name=name, candidates=dict(values["candidates"] or {}),
                        budget=int(values.get("budget", 10**9)), seed=int(values.get("seed", 0)),
                        problems=expanded, model=dict(values.get("model") or {}),
                        warm_start=None if values.get("warm_start") is None
                        else str(values["warm_start"]),
                        sentinel=sentinel)


def resolve_path(path: str | Path) -> Path:
    """A config path as given, or a bare name (`quick`) looked up in configs/."""
    candidate = Path(path)
    if candidate.exists():
        return candidate
    named = CONFIGS_DIR / f"{path}.yaml"
    if named.exists():
        return named
    raise ConfigError(f"config {str(path)!r} not found (looked at {candidate} and {named}); "
                      f"available: {', '.join(sorted(p.stem for p in CONFIGS_DIR.glob('*.yaml')))}")


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a run config; ConfigError names the file and the offending key."""
    path = resolve_path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    where = str(path)
    _check_keys(where, raw or {}, {"name", "families"},
                {"protocol", "tune", "build", "bench", "description"})
    try:
        protocol = Protocol.from_mapping(raw.get("protocol") or {})
    except (ProtocolError, TypeError) as err:
        raise ConfigError(f"{where}.protocol: {err}") from None
    tune_cfg = raw.get("tune") or {}
    _check_keys(f"{where}.tune", tune_cfg, set(),
                {"tie_threshold_pct", "finalists", "confirm_samples"})
    build_cfg = raw.get("build") or {}
    _check_keys(f"{where}.build", build_cfg, set(), {"jobs"})
    bench_cfg = raw.get("bench") or {}
    _check_keys(f"{where}.bench", bench_cfg, set(), {"problems_per_batch", "rounds",
                                                       "retry_disturbed", "interleave",
                                                       "race_cycles", "race_margin_pct"})
    interleave = bench_cfg.get("interleave", True)
    if not isinstance(interleave, bool):
        raise ConfigError(f"{where}.bench.interleave: expected true or false, got {interleave!r}")
    margin = bench_cfg.get("race_margin_pct", 10.0)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin <= 100:
        raise ConfigError(f"{where}.bench.race_margin_pct: expected a number from 0 to 100, "
                          f"got {margin!r}")
    families_raw = raw["families"]
    if not isinstance(families_raw, Mapping) or not families_raw:
        raise ConfigError(f"{where}.families: expected a non-empty mapping of family name -> settings")
    families = {}
    for name, values in families_raw.items():
        if name not in FAMILIES:
            raise ConfigError(f"{where}.families: unknown family {name!r}; valid: {', '.join(FAMILIES)}")
        families[name] = _family_config(f"{where}.families.{name}", name, values)
    return RunConfig(name=str(raw["name"]), path=path, protocol=protocol,
                     tie_threshold_pct=float(tune_cfg.get("tie_threshold_pct", 1.0)),
                     finalists=_count(f"{where}.tune", tune_cfg, "finalists", 3, 0),
                     confirm_samples=_count(f"{where}.tune", tune_cfg, "confirm_samples", 5, 0),
                     build_jobs=_count(f"{where}.build", build_cfg, "jobs", 2, 1),
                     problems_per_batch=_count(f"{where}.bench", bench_cfg, "problems_per_batch", 8, 1),
                     rounds=_count(f"{where}.bench", bench_cfg, "rounds", 3, 1),
                     retry_disturbed=_count(f"{where}.bench", bench_cfg, "retry_disturbed", 1, 0),
                     interleave=interleave,
                     race_cycles=_count(f"{where}.bench", bench_cfg, "race_cycles", 16, 0),
                     race_margin_pct=float(margin), families=families)
