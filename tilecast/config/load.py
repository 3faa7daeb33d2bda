"""Run configurations (configs/*.yaml): problem sets, candidate spaces, budgets, model specs.

A config passes its schema (tilecast.config.schema) before anything is built or measured: an
unknown, missing or malformed key is an error naming the file, the key path, the bad value and
what is allowed, never a silently ignored, truncated or clamped setting. Then every problem is
built through its family and weighed against this machine's memory, and each family's
candidate options must give at least one kernel. ConfigError lists every error found, one a
line (the first line is a whole message).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import yaml

from tilecast.core import resources
from tilecast.core.hardware import cpu_count
from tilecast.measurement.protocol import AUTO_THREADS, Protocol, ProtocolError
from tilecast.config.run import (  # noqa: F401  (the loader's names, as before)
    CONFIG_SUFFIXES, CONFIGS_DIR, MAX_PROBLEMS, PROBLEM_SETS, SHOWN_ERRORS, UNLIMITED_BUDGET,
    ConfigError, FamilyConfig, NightSettings, RunConfig)
from tilecast.families import FAMILIES

def _raise_if(errors: list[str]) -> None:
    """ConfigError listing `errors` (at most SHOWN_ERRORS of them), unless there are none."""
    if errors:
        shown = errors[:SHOWN_ERRORS]
        more = len(errors) - len(shown)
        raise ConfigError("\n".join(shown + ([f"... and {more} more"] if more else [])))


# -- problem entries ------------------------------------------------------------------------

@dataclass(frozen=True)
class EntryKind:
    """How one kind of problem entry counts and expands its body into (key path suffix,
    field values) pairs."""
    count: Callable[[Any], int]
    expand: Callable[[Any], Iterator[tuple[str, dict]]]


def _grid(body: Mapping) -> Iterator[tuple[str, dict]]:
    keys = list(body)
    for combo in itertools.product(*(body[key] for key in keys)):
        yield ".grid", dict(zip(keys, combo))


def _listed(body: list) -> Iterator[tuple[str, dict]]:
    for index, item in enumerate(body):
        yield f".list[{index}]", dict(item)


def _drawn(body: Mapping) -> Iterator[tuple[str, dict]]:
    """`count` problems, each range [lo, hi] drawn log-uniformly and rounded."""
    rng = np.random.default_rng(body.get("seed", 0))
    for _ in range(body["count"]):
        item = {}
        for key, (lo, hi) in body["ranges"].items():
            item[key] = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        yield ".random", item


ENTRY_KINDS = {"grid": EntryKind(lambda body: math.prod(map(len, body.values())), _grid),
               "list": EntryKind(len, _listed),
               "random": EntryKind(lambda body: body["count"], _drawn)}


def _located(where: str, entries: list) -> Iterator[tuple[str, dict]]:
    """(key path, field values) of every problem of schema-checked entries."""
    for index, entry in enumerate(entries):
        kind = next(k for k in ENTRY_KINDS if k in entry)
        fixed = {key: value for key, value in entry.items() if key != kind}
        for suffix, values in ENTRY_KINDS[kind].expand(entry[kind]):
            yield f"{where}[{index}]{suffix}", {**fixed, **values}


def _size_errors(where: str, entries: list) -> list[str]:
    """An error when schema-checked entries expand to more than MAX_PROBLEMS problems,
    counted before they are expanded."""
    total = sum(ENTRY_KINDS[kind].count(entry[kind]) for entry in entries
                for kind in ENTRY_KINDS if kind in entry)
    if total <= MAX_PROBLEMS:
        return []
    return [f"{where}: the entries expand to {total} problems, more than the {MAX_PROBLEMS} "
            "one set may hold; narrow the grids or lower the counts"]


def expand_problems(where: str, entries: Any, family=None) -> list[dict]:
    """Expand problem entries into field mappings. An entry is one of:
    `{grid: {field: [values]}, <fixed fields>}` (cartesian product),
    `{list: [{field: value}, ...], <fixed fields>}`, or
    `{random: {count, seed, ranges: {field: [lo, hi]}}, <fixed fields>}` (log-uniform ints).
    The entries are checked against the schema first, with `family`'s problem fields and
    their types when given (any family's fields otherwise); ConfigError names `where`, the
    entry and the key."""
    from tilecast.config import schema   # pydantic: see the schema module's docstring

    adapter = schema.entries_adapter(None if family is None else family.name)
    _raise_if(schema.validate(adapter, entries, where)[1])
    _raise_if(_size_errors(where, entries))
    return [values for _, values in _located(where, entries)]


# -- files ----------------------------------------------------------------------------------

MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error rather than the last
    one silently winning (keys a `<<:` merge brings in may still be overridden)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = (key_node.tag, key_node.value)   # tags resolved: 1 and '1' differ
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found the key {key_node.value!r} twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path, what: str) -> Any:
    """The YAML document of a file; ConfigError for a file that cannot be read or parsed."""
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory, expected a YAML file") from None
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be read: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
                          f"offset {err.start}); a {what} is YAML text") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    # PyYAML raises ValueError for a timestamp that is no date (2001-13-45)
    except (yaml.YAMLError, ValueError) as err:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None


def shipped_configs() -> list[str]:
    """The names `--config NAME` accepts: the shipped configs (configs/ of a checkout, the
    package's copy when installed)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def resolve_path(path: str | Path) -> Path:
    """A config file as given, or a bare name (`quick`: no directory, no suffix) looked up
    among the shipped configs; a file of that name in the working directory comes first."""
    candidate = Path(path)
    if candidate.exists():
        return candidate
    available = f"available: {', '.join(shipped_configs()) or 'none'}"
    if len(candidate.parts) != 1 or candidate.suffix in CONFIG_SUFFIXES:
        raise ConfigError(f"config file {candidate} not found; a config is a YAML file or the "
                          f"name of a shipped config ({available})")
    named = CONFIGS_DIR / f"{path}.yaml"
    if named.exists():
        return named
    raise ConfigError(f"config {str(path)!r} not found: no file {candidate} here and no "
                      f"shipped config {named.name} in {CONFIGS_DIR}; {available}")


def _family_config(where: str, name: str, body: Mapping,
                   memory: int | None) -> tuple[FamilyConfig, list[str]]:
    """A schema-checked family section as a FamilyConfig, and the errors of its second pass:
    candidate space, problems built through the family and weighed, holdout kept apart."""
    from tilecast.config import schema   # pydantic: see the schema module's docstring

    family = FAMILIES[name]
    at = f"{where}: families.{name}"
    candidates = dict(body["candidates"] or {})
    errors = [f"{at}.candidates: {message}"
              for message in schema.candidate_errors(family, candidates, {})]
    sets = {ps: (f"{at}.problems.{ps}", body["problems"][ps]) for ps in PROBLEM_SETS}
    if body.get("sentinel") is not None:
        sets["sentinel"] = (f"{at}.sentinel", body["sentinel"])
    expanded, dims_keys = {}, {}
    for key, (path, entries) in sets.items():
        too_many = _size_errors(path, entries)
        errors += too_many
        located = [] if too_many else list(_located(path, entries))
        built, problem_errors = schema.check_problems(family, located, memory)
        errors += problem_errors
        expanded[key] = [values for _, values in located]
        dims_keys[key] = {family.dims_key(problem): path for path, problem in built}
    overlap = sorted(set(dims_keys["train"]) & set(dims_keys["holdout"]))
    if overlap:
        errors.append(f"{dims_keys['holdout'][overlap[0]]}: holdout problem {overlap[0]} is "
                      f"also a training problem ({len(overlap)} in all); holdouts must never "
                      "be trained on")
    workload = []
    if body.get("workload") is not None:
        workload, workload_errors = _workload(where, f"{at}.workload", body["workload"], family,
                                              memory)
        errors += workload_errors
    warm_start = body.get("warm_start")
    return FamilyConfig(name=name, candidates=candidates,
                        budget=body.get("budget") or UNLIMITED_BUDGET, seed=body.get("seed", 0),
                        problems={ps: expanded[ps] for ps in PROBLEM_SETS},
                        model=dict(body.get("model") or {}),
                        warm_start=None if warm_start is None else str(warm_start),
                        sentinel=expanded.get("sentinel", list(expanded["holdout"])),
                        workload=workload,
                        entries={ps: list(body["problems"][ps]) for ps in PROBLEM_SETS}), errors


def _workload(where: str, at: str, file: str, family, memory: int | None
              ) -> tuple[list[dict], list[str]]:
    """The field values of a workload file's problems (a problems file, relative to the
    config's directory), and the errors that keep them out."""
    from tilecast.config import schema   # pydantic: see the schema module's docstring

    path = Path(file).expanduser()
    path = path if path.is_absolute() else Path(where).parent / path
    try:
        document = _read_yaml(path, "workload file")
    except ConfigError as err:
        return [], [f"{at}: {err}"]
    prefix = f"workload file {path}: "
    found = schema.validate(schema.problem_file_model(family.name), document, prefix)[1]
    found = found or _size_errors(f"{prefix}problems", document["problems"])
    if found:
        return [], found
    located = list(_located(f"{prefix}problems", document["problems"]))
    built, errors = schema.check_problems(family, located, memory)
    return [family.problem_dict(problem) for _, problem in built], errors


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a run config (see the module docstring); ConfigError lists every
    error found, each naming the file, the key path, the bad value and what is allowed."""
    from tilecast.config import schema   # pydantic: see the schema module's docstring

    path = resolve_path(path)
    where = str(path)
    raw = _read_yaml(path, "config")
    document, found = schema.validate(schema.config_model(), raw, f"{where}: ")
    _raise_if(found)
    memory = schema.memory_bytes()
    families, errors = {}, []
    for name, body in raw["families"].items():
        families[name], family_errors = _family_config(where, name, body or {}, memory)
        errors += family_errors
    _raise_if(errors)
    given = dict(raw.get("protocol") or {})
    counts = given.get("threads", AUTO_THREADS)
    counts = counts if isinstance(counts, list) else [counts]
    try:
        protocol = Protocol.from_mapping({**given, "threads": counts[0]})
        thread_counts = tuple(Protocol(threads=c).threads for c in counts)
    except ProtocolError as err:
        raise ConfigError(f"{where}: protocol: {err}") from None
    if len(set(thread_counts)) != len(thread_counts):
        raise ConfigError(f"{where}: protocol.threads: {counts} names one thread count twice "
                          f"on this machine ({cpu_count()} cores)")
    tune, bench = document.tune, document.bench
    return RunConfig(name=document.name, path=path, protocol=protocol,
                     tie_threshold_pct=float(tune.tie_threshold_pct), finalists=tune.finalists,
                     confirm_samples=tune.confirm_samples, build_jobs=document.build.jobs,
                     problems_per_batch=bench.problems_per_batch, rounds=bench.rounds,
                     retry_disturbed=bench.retry_disturbed, interleave=bench.interleave,
                     race_cycles=bench.race_cycles, race_rounds=bench.race_rounds,
                     race_margin_pct=float(bench.race_margin_pct),
                     race_keep_pct=float(bench.race_keep_pct),
                     race_fresh_process=bench.race_fresh_process,
                     night=NightSettings(**document.night.model_dump()),
                     thread_counts=thread_counts,
                     families=families)


def read_problem_file(path: str | Path, family) -> list:
    """The family's problems a problems file lists (`problems:` and the entries of a config's
    problem set; `tilecast evaluate --problems`), checked as a config's are: the schema, each
    problem built through the family and weighed against this machine's memory. ConfigError
    names the file, the key path, the bad value and what is allowed."""
    from tilecast.config import schema   # pydantic: see the schema module's docstring

    path = Path(path)
    prefix = f"problems file {path}: "
    document = _read_yaml(path, "problems file")
    _raise_if(schema.validate(schema.problem_file_model(family.name), document, prefix)[1])
    _raise_if(_size_errors(f"{prefix}problems", document["problems"]))
    located = list(_located(f"{prefix}problems", document["problems"]))
    built, errors = schema.check_problems(family, located, schema.memory_bytes())
    _raise_if(errors)
    return [problem for _, problem in built]


def check_config_file(path: str | Path) -> RunConfig:
    """Validate a run config without running anything (`tilecast config check`): everything
    `load_config` checks, and that each family's candidates include a kernel this CPU runs.
    ConfigError lists every problem found, one a line."""
    from tilecast.config import schema   # pydantic: see the schema module's docstring
    from tilecast.core import hardware   # reads /proc: only this command needs it

    config = load_config(path)
    profile = hardware.profile(config.protocol.threads)
    found = [f"{config.path}: families.{name}.candidates: {message}"
             for name, family_config in config.families.items()
             for message in schema.candidate_errors(FAMILIES[name], family_config.candidates, profile)]
    if found:
        raise ConfigError("\n".join(found))
    return config
