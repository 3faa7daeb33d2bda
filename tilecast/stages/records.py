"""Team records: measurements a team's own benchmark harness wrote, in the record schema of
docs/guide/records.md (whose tables `schema_markdown` writes from RECORD_FIELDS and
FILLED_FIELDS below), read from JSON lines or CSV, checked row by row and made into the raw
records tilecast's own benchmark writes, for any registered family (plugins included).

A bad row is never dropped or guessed at: every error of every row is collected, each naming
the file, the line and the field, and the file converts only when it has none.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from tilecast.config.run import PROBLEM_SETS
from tilecast.core import stats
from tilecast.core.dataset import (PHASES, ROLES, SCHEMA_VERSION, STATUS_TABLE, STATUSES,
                                    DatasetError)
from tilecast.core.family import FamilyError

# How many row errors a RecordsError lists before "... and N more".
SHOWN_ERRORS = 10
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = (".csv",)


class RecordsError(DatasetError):
    """A team's records file that cannot be converted: its rows' errors, line by line."""


class FieldError(ValueError):
    """One field of one row is wrong: the message says how, naming the value."""


@dataclass(frozen=True)
class RecordField:
    """One field of a team's record: how its value is read (`kind`, a key of READERS), when
    it is required, its unit, what it means, and what an absent optional one becomes."""
    name: str
    kind: str
    required: str      # "yes", "when ok" (status ok), or "no"
    unit: str
    meaning: str
    default: str = ""
    choices: tuple[str, ...] = ()


def _text(value: Any, field: RecordField) -> str:
    if not isinstance(value, str):
        raise FieldError(f"expected a string, got {value!r}")
    return value


def _choice(value: Any, field: RecordField) -> str:
    if value not in field.choices:
        raise FieldError(f"{value!r} is not one of {', '.join(field.choices)}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise FieldError(f"expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FieldError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise FieldError(f"expected a finite number, got {value!r}")
    return number


def _seconds(value: Any, field: RecordField) -> float:
    number = _number(value)
    if number <= 0:
        raise FieldError(f"{value!r} seconds: a time must be > 0")
    return number


def _non_negative(value: Any, field: RecordField) -> float:
    number = _number(value)
    if number < 0:
        raise FieldError(f"{value!r} must be >= 0")
    return number


def _count(value: Any, field: RecordField) -> int:
    number = _number(value)
    if not number.is_integer() or number < 1:
        raise FieldError(f"expected a whole number >= 1, got {value!r}")
    return int(number)


def _seconds_list(value: Any, field: RecordField) -> list[float]:
    # CSV: one cell of space-separated values; JSON: an array
    values = value.split() if isinstance(value, str) else value
    if not isinstance(values, list) or not values:
        raise FieldError(f"expected a non-empty list of times (JSON: an array; CSV: values "
                         f"separated by spaces), got {value!r}")
    return [_seconds(item, field) for item in values]


def _time(value: Any, field: RecordField) -> str:
    text = _text(value, field)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise FieldError(f"{text!r} is not an ISO 8601 time (e.g. 2026-12-07T21:00:00Z)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)   # documented: a time without zone is UTC
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds")


# kind -> (reader, type as documented)
READERS: dict[str, tuple[Callable[[Any, RecordField], Any], str]] = {
    "text": (_text, "string"),
    "choice": (_choice, "string"),
    "seconds": (_seconds, "number > 0"),
    "non_negative": (_non_negative, "number >= 0"),
    "count": (_count, "integer >= 1"),
    "seconds_list": (_seconds_list, "list of numbers > 0"),
    "time": (_time, "string, ISO 8601"),
}

# The fields a team writes, in the documented order. The problem's own fields (the family's
# problem_fields) sit beside them, under their own names.
RECORD_FIELDS: tuple[RecordField, ...] = (
    RecordField("family", "text", "yes", "", "a registered kernel family, built in or a plugin's "
                "(an unknown name's error lists them)"),
    RecordField("kernel", "text", "yes", "", "a candidate's kernel name in the family's grammar "
                "(its configuration is read from it); a peer's label, e.g. `torch.matmul`"),
    RecordField("status", "choice", "yes", "", "what happened (the status table below)",
                choices=STATUSES),
    RecordField("median_s", "seconds", "when ok", "s", "median time of one call; only an "
                "`ok` record carries times"),
    RecordField("samples_s", "seconds_list", "no", "s", "every sample's time per call (CSV: one "
                "cell, values separated by spaces)", "[median_s]"),
    RecordField("mad_s", "non_negative", "no", "s", "median absolute deviation of the samples",
                "MAD of samples_s"),
    RecordField("reps_per_sample", "count", "no", "calls", "back-to-back calls timed per sample",
                "1"),
    RecordField("max_error", "non_negative", "no", "", "norm-relative error of the output "
                "against a reference: \\|out - ref\\|_F / \\|ref\\|_F", "empty (not checked)"),
    RecordField("threads", "count", "no", "", "threads the kernel ran with", "1"),
    RecordField("reason", "text", "no", "", "why, for a status other than `ok`", "empty"),
    RecordField("problem_set", "choice", "no", "", "which set the problem belongs to",
                "train", choices=PROBLEM_SETS),
    RecordField("role", "choice", "no", "", "`candidate`: a kernel of the family; `peer`: a "
                "reference library, kept for ratios, never trained on", "candidate",
                choices=ROLES),
    RecordField("phase", "choice", "no", "", "`screen`, or `confirm` for a finalist's fresh "
                "samples", "screen", choices=PHASES),
    RecordField("run_id", "text", "no", "", "the run that measured it", "records-<file name>"),
    RecordField("time", "time", "no", "", "when it was measured (no zone: UTC)",
                "the file's modification time"),
    RecordField("hardware", "text", "no", "", "the machine's fingerprint or name",
                "unspecified"),
    RecordField("git_sha", "text", "no", "", "the kernels' source revision", "empty"),
)
FIELDS = {field.name: field for field in RECORD_FIELDS}

# The fields of a tilecast raw record that convert fills in: never given by a team.
FILLED_FIELDS: tuple[tuple[str, str], ...] = (
    ("schema_version", f"{SCHEMA_VERSION}, this tilecast's raw-record schema version"),
    ("dims_key", "the family's `field=value,...` key of the problem: the join key"),
    ("<config fields>", "the candidate's configuration, parsed from its kernel name"),
    ("tflops", "the family's FLOP count / median_s / 1e12 (ok records)"),
    ("gbps", "the family's bytes moved / median_s / 1e9 (ok records)"),
    ("timing", "`imported`: measured by someone else's harness"),
    ("protocol_hash", "null: not tilecast's measurement protocol"),
    ("build_key", "null: not a binary tilecast built"),
    ("binary_bytes", "0"),
    ("retaken", "0"),
    ("disturbed_samples_s", "[]"),
    ("round_medians_s", "[]"),
    ("window_factors", "[]"),
    ("window_probes_us", "[]"),
)


def _same(given: Any, value: Any) -> bool:
    """Whether a row's config-field value spells the kernel name's (`1`, `true` for True)."""
    if isinstance(value, bool):
        return str(given).lower() in (str(value).lower(), str(int(value)))
    return str(given) == str(value)


def _read_fields(row: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """(the row's record fields read by their kinds, the errors of the bad or missing ones)."""
    values, errors = {}, []
    for name, field in FIELDS.items():
        if name not in row:
            if field.required == "yes":
                errors.append(f"field {name!r}: missing (required)")
            continue
        try:
            values[name] = READERS[field.kind][0](row[name], field)
        except FieldError as err:
            errors.append(f"field {name!r}: {err}")
    status = values.get("status")
    timed = [name for name in ("median_s", "samples_s", "mad_s") if name in row]
    if status == "ok" and "median_s" not in row:
        errors.append("field 'median_s': missing (required when status is 'ok')")
    elif status is not None and status != "ok" and timed:
        errors.append(f"field(s) {timed}: a {status!r} record carries no time; leave them empty")
    return values, errors


def _kernel_errors(family, config, problem, values: dict, given: Mapping) -> list[str]:
    """What a candidate's row says against its kernel name: config fields that disagree with
    the name, and `ok` for a kernel that cannot run the problem."""
    spelled = family.config_dict(config)
    errors = [f"field {key!r}: {given[key]!r} disagrees with kernel {values['kernel']!r} "
              f"({spelled[key]!r})" for key in family.config_fields
              if key in given and key not in family.problem_fields
              and not _same(given[key], spelled[key])]
    why = family.unsupported_reason(config, problem) if problem is not None else None
    if values.get("status") == "ok" and why:
        errors.append(f"field 'status': 'ok', but kernel {values['kernel']!r} cannot run this "
                      f"problem ({why}): record it as 'unsupported'")
    return errors


def team_record(row: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict:
    """A raw record from one row (field -> value; absent fields left out), or FieldError
    naming every bad field of the row (one `field 'x': ...` per line of its message)."""
    from tilecast.families import get_family   # the plugins are read when a row needs them

    values, errors = _read_fields(row)
    if "family" not in values:
        raise FieldError("\n".join(errors))
    try:
        family = get_family(values["family"])
    except FamilyError as err:
        raise FieldError("\n".join([*errors, f"field 'family': {err}"])) from None
    given = {key: row[key] for key in row if key not in FIELDS}
    unknown = sorted(set(given) - set(family.problem_fields) - set(family.config_fields))
    if unknown:
        errors.append(f"field(s) {unknown}: not record fields nor {family.name} problem or "
                      f"config fields; valid: {', '.join([*FIELDS, *family.problem_fields])}")
    problem = config = None
    try:
        problem = family.problem({key: given[key] for key in family.problem_fields if key in given})
    except FamilyError as err:
        errors.append(f"problem: {err}")
    if values.get("role", "candidate") == "candidate" and "kernel" in values:
        try:
            config = family.parse_name(values["kernel"])
        except FamilyError as err:
            errors.append(f"field 'kernel': {err}")
    if config is not None:
        errors += _kernel_errors(family, config, problem, values, given)
    if errors:
        raise FieldError("\n".join(errors))
    return _raw_record(family, problem, config, {**defaults, **values})


def _raw_record(family, problem, config, values: dict) -> dict:
    """The raw record, as tilecast.stages.bench writes one, of a checked row."""
    ok = values["status"] == "ok"
    samples = values.get("samples_s", [values["median_s"]] if ok else [])
    median_s = values.get("median_s")
    record = {
        "schema_version": SCHEMA_VERSION, "time": values["time"], "run_id": values["run_id"],
        "git_sha": values.get("git_sha", ""), "hardware": values.get("hardware", "unspecified"),
        "protocol_hash": None, "build_key": None, "family": family.name,
        "problem_set": values.get("problem_set", "train"), "dims_key": family.dims_key(problem),
        **family.problem_dict(problem), "kernel": values["kernel"],
        "role": values.get("role", "candidate"), "phase": values.get("phase", "screen"),
        "status": values["status"], "reason": values.get("reason", ""), "samples_s": samples,
        "reps_per_sample": values.get("reps_per_sample", 1), "median_s": median_s,
        "mad_s": values.get("mad_s", stats.mad(samples) if ok else None),
        "tflops": family.flops(problem) / median_s / 1e12 if ok else None,
        "gbps": family.bytes_moved(problem) / median_s / 1e9 if ok else None,
        "max_error": values.get("max_error"), "threads": values.get("threads", 1),
        "binary_bytes": 0, "retaken": 0, "disturbed_samples_s": [], "round_medians_s": [],
        "timing": "imported", "window_factors": [], "window_probes_us": [],
    }
    if config is not None:
        for key, value in family.config_dict(config).items():
            record.setdefault(key, value)   # problem fields (e.g. dtype) win: they are equal
    return record


def _jsonl_rows(path: Path):
    """(line number, row or FieldError) of each non-blank line of a JSON-lines file."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                yield number, FieldError(f"not JSON ({err.msg} at column {err.colno})")
                continue
            if not isinstance(row, dict):
                yield number, FieldError(f"expected a JSON object of field -> value, got "
                                         f"{type(row).__name__}")
                continue
            yield number, {key: value for key, value in row.items() if value is not None}


def _csv_rows(path: Path):
    """(line number, row or FieldError) of each data row of a CSV file with a header."""
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if not header:
            return
        repeated = sorted({name for name in header if header.count(name) > 1})
        if repeated:
            yield reader.line_num, FieldError(f"header names column(s) {repeated} twice")
            return
        for cells in reader:
            if not any(cell.strip() for cell in cells):
                continue
            if len(cells) != len(header):
                yield reader.line_num, FieldError(f"{len(cells)} cells, the header has "
                                                  f"{len(header)}")
                continue
            yield reader.line_num, {name: cell for name, cell in zip(header, cells)
                                    if cell.strip() != ""}


ROW_READERS = {**{suffix: _jsonl_rows for suffix in JSONL_SUFFIXES},
               **{suffix: _csv_rows for suffix in CSV_SUFFIXES}}


def read_team_records(path: str | Path) -> list[dict]:
    """The raw records of a team's records file (JSON lines or CSV, by its suffix); a
    RecordsError listing each bad row's line and fields when any row is bad, or none is there."""
    path = Path(path)
    reader = ROW_READERS.get(path.suffix.lower())
    if reader is None:
        raise RecordsError(f"{path}: unknown records format {path.suffix!r}; valid suffixes: "
                           f"{', '.join(ROW_READERS)}")
    modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    defaults = {"run_id": f"records-{path.name}",
                "time": modified.isoformat(timespec="milliseconds")}
    records, errors = [], []
    for number, row in reader(path):
        try:
            if isinstance(row, FieldError):
                raise row
            records.append(team_record(row, defaults))
        except FieldError as err:
            errors += [f"line {number}: {line}" for line in str(err).splitlines()]
    if errors:
        shown = errors[:SHOWN_ERRORS]
        more = f"\n... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise RecordsError(f"{path}: {len(errors)} error(s) in its records (the schema: "
                           f"docs/guide/records.md):\n" + "\n".join(shown) + more)
    if not records:
        raise RecordsError(f"{path}: no records (an empty file, or a CSV header alone)")
    return records


def schema_markdown() -> str:
    """The tables of docs/guide/records.md: the fields a team writes, the statuses, and the
    fields convert fills in (the test suite checks that the guide holds exactly these)."""
    lines = ["| field | type | required | unit | meaning | when absent |",
             "|---|---|---|---|---|---|"]
    for field in RECORD_FIELDS:
        kind = READERS[field.kind][1]
        if field.choices:
            kind += ": " + ", ".join(f"`{choice}`" for choice in field.choices)
        lines.append(f"| `{field.name}` | {kind} | {field.required} | {field.unit} | "
                     f"{field.meaning} | {field.default} |")
    lines.append("| each problem field of the family | as the family reads it | as the family "
                 "requires |  | the problem (the family checks it) | the family's default |")
    lines += ["", "| status | meaning |", "|---|---|"]
    lines += [f"| `{s.name}` | {s.meaning} |" for s in STATUS_TABLE if s.record]
    lines += ["", "| filled-in field | value |", "|---|---|"]
    lines += [f"| `{name}` | {value} |" for name, value in FILLED_FIELDS]
    return "\n".join(lines) + "\n"
