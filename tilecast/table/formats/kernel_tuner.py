"""Kernel Tuner's files: cache files (`.json`, or gzipped, including an "open" cache a run was
still writing) and T4 results files (`results` list, with an optional T4 metadata file),
told apart by their content.

Cache file: one kernel, one problem (`problem_size`), one device (`device_name`, or --device
when it is empty). Problem columns are `problem_size_0, problem_size_1, ...` (a scalar
problem_size is the one column `problem_size`; a callable one none), preceded by the
categorical `kernel_name` only when the files of one import differ in it (files of one kernel
keep the kernel's name out of every key). Configuration columns are `tune_params_keys`, in that
order. `time` is in milliseconds (Kernel Tuner's unit) and is the row's `median_s` (Kernel
Tuner's own summary of its runs: their mean); `times`, its runs, are its `samples_s`.
A failed configuration is a marker string in `time` (InvalidConfig, CompilationFailedConfig,
RuntimeFailedConfig: `unsupported`, `build_failed`, `crashed`); old Kernel Tuners wrote a huge
time (>= 1e20) instead, which does not say how it failed: `failed`.

T4 results file: configuration columns are the keys of `configuration`; no problem columns (T4
records none). The time is the `time` measurement in its unit (s, ms, us, ns); `invalidity`
gives the status. A T4 metadata file (top-level `metadata`) among the files names the device
(nvidia-smi's product name, rocm-smi's card series) of the results files in its directory.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from tilecast.table.dataset import Column, TableDataError, TableSchema, infer_kind
from tilecast.table.formats.common import (Imported, RawFile, check_names, log, read_raw,
                                           same_columns, seconds_per, source_entry,
                                           union_columns)

FORMAT = "kernel-tuner"
WHAT = "a Kernel Tuner cache file or T4 results file"
MS = 1e-3
# Kernel Tuner's failure markers (util.ErrorConfig subclasses, stored by class name) -> status
# (core.dataset.STATUS_TABLE)
FAILURE_MARKERS = {"InvalidConfig": "unsupported", "CompilationFailedConfig": "build_failed",
                   "RuntimeFailedConfig": "crashed"}
# before the markers, a failed configuration was stored with a huge time
OLD_FAILURE_TIME = 1e20
# T4 `invalidity` -> status
T4_INVALIDITY = {"correct": "ok", "compile": "build_failed", "runtime": "crashed",
                 "timeout": "timeout", "constraints": "unsupported", "correctness": "wrong_result"}
# where a T4 metadata file's device query names the device, lower-cased rocm-smi keys
ROCM_NAME_KEYS = ("card series", "device name", "card model", "marketing name")


@dataclass
class _FileRows:
    raw: RawFile
    kind: str
    problem_names: tuple[str, ...]
    config_names: tuple[str, ...]
    rows: list[dict]
    kernel_name: str | None = None


def read(paths: Sequence[Path], *, mapping: Mapping | None, device: str | None) -> Imported:
    """The rows of Kernel Tuner cache and T4 files `paths` (see the module docstring);
    `device` names the device of files that name none."""
    if mapping:
        raise TableDataError("--mapping is not used with --from kernel-tuner: the files name "
                             "their own columns")
    documents = [(raw, _parse_json(raw)) for raw in map(read_raw, paths)]
    devices_by_dir = _metadata_devices(documents)
    files: list[_FileRows] = []
    sources: list[dict] = []
    for raw, document in documents:
        if _is_t4_metadata(document):
            sources.append({**source_entry(raw, "kernel-tuner-t4-metadata", ()),
                            "device_label": devices_by_dir.get(raw.path.parent)})
            continue
        if isinstance(document, dict) and "cache" in document:
            parsed = _cache_rows(raw, document, device)
        elif isinstance(document, dict) and "results" in document:
            parsed = _t4_rows(raw, document, devices_by_dir.get(raw.path.parent) or device)
        else:
            raise TableDataError(f"{raw.path}: neither a cache file (no 'cache') nor T4 results "
                                 f"(no 'results'); expected {WHAT}")
        files.append(parsed)
        sources.append(source_entry(raw, f"{FORMAT}-{parsed.kind}",
                                    (row["status"] for row in parsed.rows)))
    if not files:
        raise TableDataError("only T4 metadata files given: add the T4 results files they "
                             "describe")
    _name_kernels(files)
    # caches whose problem columns differ combine: a column one lacks is missing in its rows
    problem_names, partial, notes = union_columns({f.raw.path: f.problem_names for f in files})
    config_names = same_columns({f.raw.path: f.config_names for f in files},
                                "tunable parameters (tune_params_keys)")
    rows = [row for f in files for row in f.rows]
    schema = TableSchema(
        problem=tuple(Column(n, infer_kind(r.get(n) for r in rows), n in partial)
                      for n in problem_names),
        config=tuple(Column(n, infer_kind(r[n] for r in rows)) for n in config_names))
    return Imported(schema=schema, rows=rows, sources=sources, notes=notes)


# -- JSON, open caches ---------------------------------------------------------------------

def _parse_json(raw: RawFile) -> Any:
    """The JSON document of `raw`; an open cache file (a run still writing it, or killed) is
    closed first as Kernel Tuner itself does, its last entry dropped when it is cut short."""
    text = raw.text(WHAT)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        first_error = err
    body = text.rstrip()
    for candidate, dropped in ((body, False), (body.rsplit("\n", 1)[0].rstrip(), True)):
        candidate = candidate[:-1] if candidate.endswith(",") else candidate
        try:
            document = json.loads(candidate + "}\n}")
        except json.JSONDecodeError:
            continue
        if isinstance(document, dict) and isinstance(document.get("cache"), dict):
            log.warning("%s: an open cache file (its tuning run had not finished): read its %d "
                        "complete entries%s", raw.path, len(document["cache"]),
                        ", the last one, cut short, left out" if dropped else "")
            return document
    raise TableDataError(f"{raw.path}: not valid JSON ({first_error.msg} at line "
                         f"{first_error.lineno} column {first_error.colno}); expected {WHAT}")


# -- cache files ---------------------------------------------------------------------------

def _scalar(value: Any) -> Any:
    """A parameter value as a key can spell it: lists and objects as compact JSON text."""
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return value


def _problem_columns(problem_size: Any, path: Path) -> dict[str, Any]:
    if problem_size is None or problem_size == "callable":
        return {}
    if isinstance(problem_size, (list, tuple)):
        return {f"problem_size_{i}": _scalar(v) for i, v in enumerate(problem_size)}
    if isinstance(problem_size, (int, float, str)) and not isinstance(problem_size, bool):
        return {"problem_size": problem_size}
    raise TableDataError(f"{path}: problem_size {problem_size!r} is not a number or a list")


def _values_from_key(key: str, names: Sequence[str], tune_params: Mapping, path: Path) -> dict:
    """The parameter values a cache key spells (`16,1`), typed by `tune_params` where a listed
    value prints the same; for entries that do not repeat their parameters."""
    parts = key.split(",")
    if len(parts) != len(names):
        raise TableDataError(f"{path} row {key}: the key has {len(parts)} values, "
                             f"tune_params_keys {len(names)}, and the entry lacks the parameters")
    values = {}
    for name, text in zip(names, parts):
        listed = {str(v): v for v in tune_params.get(name, [])}
        values[name] = _scalar(listed.get(text, text))
    return values


def _cache_time(entry: Mapping, key: str, path: Path) -> tuple[float, str, str]:
    """(median_s, status, reason) of one cache entry."""
    if "time" not in entry:
        raise TableDataError(f"{path} row {key}: column time: missing; every configuration "
                             "of a cache has a time or a failure marker")
    value = entry["time"]
    if isinstance(value, str):
        if value not in FAILURE_MARKERS:
            raise TableDataError(f"{path} row {key}: column time: unknown marker {value!r}; "
                                 f"known: {', '.join(FAILURE_MARKERS)} (or a time in ms)")
        return math.nan, FAILURE_MARKERS[value], value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TableDataError(f"{path} row {key}: column time: {value!r} is not a number of "
                             "milliseconds or a failure marker")
    if value >= OLD_FAILURE_TIME:
        return math.nan, "failed", f"time {value:g}: an old Kernel Tuner's failure marker"
    if not value > 0:     # also NaN
        raise TableDataError(f"{path} row {key}: column time: {value!r} is not a positive "
                             "number of milliseconds")
    return value * MS, "ok", ""


def _samples(times: Any, seconds: float, status: str) -> list[float] | None:
    """The usable per-run times of a `times` list, in seconds (`seconds` per unit of the
    list); None (the row's one time stands for it: table.dataset.measured) without a list,
    [] for a configuration that is not ok (its runs' times do not count)."""
    if status != "ok":
        return []
    if not isinstance(times, list) or not times:
        return None
    return [t * seconds for t in times
            if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
            and t > 0]


def _cache_rows(raw: RawFile, document: dict, device: str | None) -> _FileRows:
    path = raw.path
    cache, names = document.get("cache"), document.get("tune_params_keys")
    if not isinstance(cache, dict):
        raise TableDataError(f"{path}: 'cache' is not an object of configurations")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise TableDataError(f"{path}: 'tune_params_keys' is missing or not a list of names; "
                             f"expected {WHAT}")
    if not cache:
        raise TableDataError(f"{path}: the cache holds no configurations")
    check_names(names, path)
    label = str(document.get("device_name") or "").strip() or device
    if not label:
        raise TableDataError(f"{path}: device_name is empty; give --device NAME for it")
    if device and document.get("device_name") and device != label:
        log.info("%s: names its device %r; --device %r is for files that name none", path,
                 label, device)
    tune_params = document.get("tune_params") or {}
    problem = _problem_columns(document.get("problem_size"), path)
    source = str(path)
    rows = []
    for key, entry in cache.items():
        if not isinstance(entry, dict):
            raise TableDataError(f"{path} row {key}: the entry is not an object")
        if all(name in entry for name in names):
            config = {name: _scalar(entry[name]) for name in names}
        else:
            config = _values_from_key(key, names, tune_params, path)
        median_s, status, reason = _cache_time(entry, key, path)
        rows.append({**problem, **config, "device": label, "median_s": median_s,
                     "status": status, "reason": reason,
                     "samples_s": _samples(entry.get("times"), MS, status), "source": source,
                     "row": key})
    kernel = document.get("kernel_name")
    return _FileRows(raw, "cache", tuple(problem), tuple(names), rows,
                     kernel_name=str(kernel) if kernel is not None else None)


def _name_kernels(files: list[_FileRows]) -> None:
    """Put `kernel_name` first among the problem columns when cache files differ in it."""
    kernels = {f.kernel_name for f in files if f.kind == "cache"}
    if len(kernels) < 2:
        return
    for f in files:
        if f.kind != "cache" or f.kernel_name is None:
            raise TableDataError(f"{f.raw.path}: names no kernel_name, while the other files "
                                 f"name several ({sorted(k for k in kernels if k)})")
        f.problem_names = ("kernel_name",) + f.problem_names
        for row in f.rows:
            row["kernel_name"] = f.kernel_name


# -- T4 ------------------------------------------------------------------------------------

def _is_t4_metadata(document: Any) -> bool:
    return isinstance(document, dict) and "metadata" in document and "results" not in document


def _query_name(query: Any) -> str | None:
    """The device name in a T4 metadata file's device query (nvidia-smi or rocm-smi)."""
    if not isinstance(query, dict):
        return None
    gpus = ((query.get("nvidia-smi") or {}).get("nvidia_smi_log") or {}).get("gpu")
    gpus = gpus if isinstance(gpus, list) else [gpus] if gpus else []
    names = {str(g["product_name"]).strip() for g in gpus
             if isinstance(g, dict) and g.get("product_name")}
    for card in (query.get("rocm-smi") or {}).values():
        if isinstance(card, dict):
            lowered = {str(k).strip().lower(): v for k, v in card.items()}
            name = next((lowered[k] for k in ROCM_NAME_KEYS if lowered.get(k)), None)
            if name:
                names.add(str(name).strip())
    if len(names) > 1:
        raise TableDataError(f"the device query lists several devices {sorted(names)}; give "
                             "--device NAME and leave the metadata file out")
    return names.pop() if names else None


def _metadata_devices(documents: Sequence[tuple[RawFile, Any]]) -> dict[Path, str]:
    """Directory -> the device its T4 metadata file names."""
    found: dict[Path, list[tuple[Path, str | None]]] = defaultdict(list)
    for raw, document in documents:
        if _is_t4_metadata(document):
            environment = (document.get("metadata") or {}).get("environment") or {}
            try:
                name = _query_name(environment.get("device_query"))
            except TableDataError as err:
                raise TableDataError(f"{raw.path}: {err}") from None
            found[raw.path.parent].append((raw.path, name))
    devices = {}
    for directory, entries in found.items():
        if len(entries) > 1:
            raise TableDataError(f"{entries[0][0]} and {entries[1][0]}: two T4 metadata files in "
                                 "one directory; each describes the results files beside it")
        path, name = entries[0]
        if name:
            devices[directory] = name
        else:
            log.warning("%s: its device query (nvidia-smi, rocm-smi) names no device; the "
                        "results beside it take --device", path)
    return devices


def _t4_time(result: Mapping, where: str) -> tuple[float, float]:
    """(the `time` measurement in seconds, seconds per its unit: the unit of the result's
    `runtimes` too, as T4 writes them)."""
    measurements = result.get("measurements") or []
    time = next((m for m in measurements if isinstance(m, dict) and m.get("name") == "time"),
                None)
    if time is None:
        raise TableDataError(f"{where}: column time: no 'time' measurement")
    value = time.get("value")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise TableDataError(f"{where}: column time: {value!r} is not a positive number")
    unit_s = seconds_per(time.get("unit", ""), f"{where}: column time")
    return value * unit_s, unit_s


def _t4_rows(raw: RawFile, document: dict, label: str | None) -> _FileRows:
    path, results = raw.path, document.get("results")
    if not isinstance(results, list) or not results:
        raise TableDataError(f"{path}: 'results' is empty or not a list")
    if not label:
        raise TableDataError(f"{path}: T4 results name no device; give --device NAME, or the "
                             "T4 metadata file written with them (in the same directory)")
    first = results[0].get("configuration") if isinstance(results[0], dict) else None
    if not isinstance(first, dict) or not first:
        raise TableDataError(f"{path} row results[0]: no 'configuration' object")
    names = tuple(first)
    check_names(names, path)
    rows, source = [], str(path)
    for index, result in enumerate(results):
        where = f"{path} row results[{index}]"
        config = result.get("configuration") if isinstance(result, dict) else None
        if not isinstance(config, dict) or set(config) != set(names):
            raise TableDataError(f"{where}: configuration keys {sorted(config or {})} differ from "
                                 f"the first result's {sorted(names)}")
        invalidity = result.get("invalidity")
        if invalidity not in T4_INVALIDITY:
            raise TableDataError(f"{where}: invalidity {invalidity!r} is not one of "
                                 f"{', '.join(T4_INVALIDITY)}")
        status = T4_INVALIDITY[invalidity]
        median_s, unit_s = _t4_time(result, where) if status == "ok" else (math.nan, 0.0)
        runtimes = (result.get("times") or {}).get("runtimes")
        rows.append({**{n: _scalar(config[n]) for n in names}, "device": label,
                     "median_s": median_s, "status": status,
                     "reason": "" if status == "ok" else f"T4 invalidity {invalidity}",
                     "samples_s": _samples(runtimes, unit_s, status), "source": source,
                     "row": f"results[{index}]"})
    return _FileRows(raw, "t4", (), names, rows)
