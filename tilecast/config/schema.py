"""The schema of run configs (configs/*.yaml) and problem files (`tilecast evaluate --problems`):
pydantic models built from each family's own tables, checked before anything is built or
measured.

Two passes. The models check the document: strict whole numbers, numbers and booleans (no 2.5
for a count, no 'no' for a flag, no 96 for a list), ranges, ordered [lo, hi] pairs, candidate
values from the family's space, problem fields of the family, and no unknown or missing key.
Then `check_problems` builds every expanded problem through its family (its own cross-field
checks) after weighing its operands against this machine's memory, and `candidate_errors` asks
the family's space for at least one kernel. Every message reads
`<file>: <key path>: <what is wrong>`, naming the bad value and what is allowed.

tilecast.config.load reads the files and calls this module; it imports it only when a config
is read, so that importing the config module (every CLI command does) does not import pydantic.
"""
import functools
import math
import os
import re
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Iterable, Literal, Mapping, NoReturn

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic import create_model, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from tilecast.config.run import MAX_PROBLEMS, ConfigError, NightSettings, RunConfig
from tilecast.measurement.protocol import Protocol
from tilecast.families import FAMILIES, gemm, grouped_conv
from tilecast.spaces import disco as disco_kernels, grouped_conv as grouped_conv_kernels
from tilecast.families.disco import BASIS_ALIASES, DiscoFamily
from tilecast.families.gemm import GemmFamily
from tilecast.families.grouped_conv import GroupedConvFamily
from tilecast.registry.base import NAME_RE
from tilecast.core.artifact import TARGET_TRANSFORMS

# the largest problem dimension: a kernel indexes with 32-bit ints in places, and no dimension
# of a problem that fits in memory comes near it
MAX_DIMENSION = 2**31 - 1
# latitudes or longitudes of a DISCO grid: its quadrature is computed when the problem is
# built, before its operands could be weighed (the seed's largest grid is 721 x 1440)
MAX_GRID_POINTS = 1 << 15
# rings / sectors of a DISCO kernel shape: its basis is built (tens of ms at 3x3) when the
# problem is
MAX_KERNEL_SHAPE = 64
KERNEL_SHAPE_RE = re.compile(r"\d+(?:x\d+)?")
PROBLEM_KINDS = ("grid", "list", "random")
ERROR_TYPE = "tilecast"   # pydantic error type of this module's own messages


# -- value rules: a type for the JSON Schema, a check that names what is allowed -------------

def show(value: Any) -> str:
    """`repr(value)`, cut to 80 characters (a bad value may be a whole document)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(allowed: str, value: Any) -> NoReturn:
    raise PydanticCustomError(ERROR_TYPE, "expected {allowed}, got {got}",
                              {"allowed": allowed, "got": show(value)})


def _rule(annotation: Any, allowed: str, accept: Callable[[Any], bool], **constraints) -> Any:
    """A field type: `annotation` and `constraints` for pydantic and the JSON Schema, and a
    check run first that refuses, naming `allowed`, every value `accept` says no to."""
    def check(value):
        if not accept(value):
            _refuse(allowed, value)
        return value
    return Annotated[annotation, Field(description=allowed, **constraints), BeforeValidator(check)]


def allowed(rule: Any) -> str:
    """What a rule allows, in words (its description)."""
    return next(m.description for m in rule.__metadata__ if isinstance(m, FieldInfo))


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:   # an int beyond any float
        return False


def whole(minimum: int, maximum: int | None = None) -> Any:
    """A whole number (never a bool or a float, even 2.0) in [minimum, maximum]."""
    words = (f"a whole number >= {minimum}" if maximum is None
             else f"a whole number from {minimum} to {maximum}")
    return _rule(int, words, lambda v: _is_whole(v) and v >= minimum
                 and (maximum is None or v <= maximum), ge=minimum, le=maximum)


def number(words: str, accept: Callable[[float], bool], **constraints) -> Any:
    """A finite int or float that `accept` takes (words: what it allows)."""
    return _rule(float, f"a number {words}", lambda v: _is_number(v) and accept(v),
                 **constraints)


def choice(values: Iterable) -> Any:
    """One of `values`, of the same type (2.0 is not 2, True is not 1)."""
    values = tuple(values)
    words = "one of " + ", ".join(map(repr, values))
    return _rule(Literal[values], words,
                 lambda v: any(type(v) is type(c) and v == c for c in values))


def values_list(rule: Any) -> Any:
    """A non-empty list of values, each checked by `rule` (errors name its index)."""
    return _rule(list[rule], f"a non-empty list, each value {allowed(rule)}",
                 lambda v: isinstance(v, list) and len(v) > 0, min_length=1)


def ordered_pair(rule: Any) -> Any:
    """[lo, hi], both taken by `rule`, lo <= hi (a random problem's range)."""
    accept = TypeAdapter(rule)

    def fits(value) -> bool:
        try:
            accept.validate_python(value)
        except ValidationError:
            return False
        return True

    return _rule(list[int], f"[lo, hi]: two values, each {allowed(rule)}, with lo <= hi",
                 lambda v: isinstance(v, list) and len(v) == 2 and all(map(fits, v))
                 and v[0] <= v[1], min_length=2, max_length=2)


FLAG = _rule(bool, "true or false", lambda v: isinstance(v, bool))
TEXT = _rule(str, "a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()),
             min_length=1)
ANY_TEXT = _rule(str, "a string", lambda v: isinstance(v, str))
DIMENSION = whole(1, MAX_DIMENSION)
POSITIVE = number("> 0", lambda v: v > 0, gt=0)
NON_NEGATIVE = number(">= 0", lambda v: v >= 0, ge=0)
PERCENT = number("from 0 to 100", lambda v: 0 <= v <= 100, ge=0, le=100)
FRACTION = number("in (0, 1]", lambda v: 0 < v <= 1, gt=0, le=1)
WARM_START = _rule(str | int | None, "a registry alias (letters, digits, _ . -) or a version "
                   "number >= 1",
                   lambda v: v is None or (_is_whole(v) and v >= 1)
                   or (isinstance(v, str) and bool(NAME_RE.match(v)) and v not in (".", "..")))
# a family's workload file: a problems file (tilecast.config.load.read_problem_file), relative
# to the config's directory unless absolute
WORKLOAD = _rule(str | None, "a problems file's path (relative to the config)",
                 lambda v: v is None or (isinstance(v, str) and bool(v.strip())))
# `night:`, the budgeted night with a store (tilecast.store.plan.NightSettings: what each means)
NIGHT_RULES = {
    "budget_minutes": _rule(float | int | None, "a number > 0, or null (the fixed problem lists)",
                            lambda v: v is None or (_is_number(v) and v > 0)),
    "policy": choice(("active", "random")),
    "settle_nights": whole(1), "contested_pct": PERCENT, "remeasure_share": FRACTION,
    "sentinels": whole(0), "workload_share": number("from 0 to 1", lambda v: 0 <= v <= 1,
                                                    ge=0, le=1),
    "explore": whole(1, MAX_PROBLEMS), "members": whole(2, 64)}
NIGHT_DEFAULTS = {f.name: f.default for f in dataclass_fields(NightSettings)}
# the problem field rule of a family-less check (tilecast.config.load.expand_problems without
# a family): any scalar, the family checks it later
SCALAR = _rule(str | int | float, "a string or a number",
               lambda v: isinstance(v, str) or _is_number(v))


# -- sections: mappings with known keys ---------------------------------------------------------

class Section(BaseModel):
    """A mapping of known keys (YAML null reads as an empty mapping unless `null_is_empty` is
    off): an unknown key is an error naming it and the valid ones, a missing one an error
    naming it."""
    model_config = ConfigDict(extra="forbid", strict=True)
    noun: ClassVar[str] = "key"
    null_is_empty: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        return cls.precheck({} if data is None and cls.null_is_empty else data)

    @classmethod
    def precheck(cls, data: Any) -> Any:
        """The mapping as given; PydanticCustomError for a non-mapping or unknown keys."""
        if not isinstance(data, dict):
            raise PydanticCustomError(ERROR_TYPE, "expected a mapping of {keys}, got {got}",
                                      {"keys": ", ".join(cls.model_fields), "got": show(data)})
        unknown = sorted((key for key in data if key not in cls.model_fields), key=str)
        if unknown:
            raise PydanticCustomError(ERROR_TYPE, "unknown {noun}(s) {unknown}; valid: {valid}",
                                      {"noun": cls.noun, "unknown": show(unknown),
                                       "valid": str(sorted(cls.model_fields))})
        return data


class ProblemSection(Section):
    """One problem of a list entry: field -> value; a null item is an error, not {}."""
    null_is_empty: ClassVar[bool] = False


class AxesSection(Section):
    """Problem fields -> values (a grid's axes, a random entry's ranges): at least one."""
    noun: ClassVar[str] = "problem field"

    @classmethod
    def precheck(cls, data: Any) -> Any:
        data = super().precheck(data)
        if not data:
            raise PydanticCustomError(ERROR_TYPE, "expected at least one problem field; "
                                      "valid: {valid}", {"valid": ", ".join(cls.model_fields)})
        return data


class EntrySection(Section):
    """One problem entry: exactly one of grid / list / random, and fixed problem fields; a
    field is never both fixed and a grid axis or a random range."""

    @classmethod
    def precheck(cls, data: Any) -> Any:
        if isinstance(data, dict) and sum(kind in data for kind in PROBLEM_KINDS) != 1:
            raise PydanticCustomError(
                ERROR_TYPE, "needs exactly one of grid / list / random, got {keys}",
                {"keys": show(sorted(map(str, data)))})
        data = super().precheck(data)   # a mapping from here on
        kind = next(kind for kind in PROBLEM_KINDS if kind in data)
        varied = VARIED_FIELDS[kind](data[kind])
        both = sorted(set(varied) & set(data) - set(PROBLEM_KINDS), key=str) \
            if isinstance(varied, dict) else []
        if both:
            raise PydanticCustomError(ERROR_TYPE, "field(s) {both} both fixed and varied by the "
                                      "entry's {kind}; give each once",
                                      {"both": show(both), "kind": kind})
        return data


# entry kind -> the fields its body varies (a mapping of them), checked against the fixed ones
VARIED_FIELDS = {"grid": lambda body: body, "list": lambda body: None,
                 "random": lambda body: body.get("ranges") if isinstance(body, dict) else None}


class FamiliesSection(Section):
    """Family name -> its settings: at least one, each a name of tilecast.families.FAMILIES."""

    @classmethod
    def precheck(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted((name for name in data if name not in cls.model_fields), key=str)
            if unknown and unknown[0] in FAMILIES.refused:   # a plugin that cannot be used
                raise PydanticCustomError(ERROR_TYPE, "family {name} is unusable: {why}",
                                          {"name": show(unknown[0]),
                                           "why": FAMILIES.refused[unknown[0]]})
            if unknown:
                raise PydanticCustomError(ERROR_TYPE, "unknown family {name}; valid: {valid}",
                                          {"name": show(unknown[0]), "valid": ", ".join(FAMILIES)})
            if not data:
                raise PydanticCustomError(ERROR_TYPE, "expected at least one family; valid: "
                                          "{valid}", {"valid": ", ".join(FAMILIES)})
        return super().precheck(data)


def _entries(entry: type, when_empty: str, optional: bool = False) -> Any:
    """A list of problem entries; `when_empty` says what to do about an empty one."""
    def check(value):
        if value is None and optional:
            return value
        if not isinstance(value, list):
            _refuse("a list of problem entries (each with one of grid / list / random)", value)
        if not value:
            raise PydanticCustomError(ERROR_TYPE, "the entries expand to no problem; {what}",
                                      {"what": when_empty})
        return value
    annotation = list[entry] | None if optional else list[entry]
    return Annotated[annotation, Field(description="problem entries: grid / list / random"),
                     BeforeValidator(check)]


TRAIN_EMPTY = "give at least one entry (grid / list / random)"
SENTINEL_EMPTY = "give at least one, or drop the key to rebenchmark the holdout set"


# -- each family's rules: candidate options and problem fields, from its own tables -----------

def _gemm_rules(family: GemmFamily) -> tuple[dict, dict]:
    tiles = tuple(dict.fromkeys(f"{row.mr}x{row.nr}" for row in gemm.MICRO_KERNELS))
    block = whole(1, MAX_DIMENSION)
    options = {"dtype": choice(gemm.DTYPES), "isa": choice(gemm.ISAS), "tiles": choice(tiles),
               "mc": block, "nc": block, "kc": block, "parallel": choice(gemm.PARALLEL),
               "pack_a": FLAG, "prefetch": FLAG}
    fields = {"m": DIMENSION, "n": DIMENSION, "k": DIMENSION, "dtype": choice(gemm.DTYPES),
              "layout_a": choice(gemm.LAYOUTS), "layout_b": choice(gemm.LAYOUTS)}
    return options, fields


def _is_conv_tile(value: Any) -> bool:
    parts = value.split("x") if isinstance(value, str) else []
    if len(parts) != len(grouped_conv_kernels.TILE_RULES) or not all(p.isdigit() for p in parts):
        return False
    return all(lo <= int(part) <= hi and int(part) % multiple == 0 for part, (multiple, lo, hi)
               in zip(parts, grouped_conv_kernels.TILE_RULES.values()))


def _grouped_conv_rules(family: GroupedConvFamily) -> tuple[dict, dict]:
    spelled = "x".join(name.upper() for name in grouped_conv_kernels.TILE_RULES)
    tile_words = f"a '{spelled}' string, " + ", ".join(
        f"{name.upper()} a multiple of {multiple} from {lo} to {hi}"
        for name, (multiple, lo, hi) in grouped_conv_kernels.TILE_RULES.items())
    options = {"dtype": choice(grouped_conv_kernels.DTYPES),
               "ndim": choice(grouped_conv_kernels.NDIMS),
               "tiles": _rule(str, tile_words, _is_conv_tile),
               "gemm_tiles": _rule(str, tile_words, _is_conv_tile),
               "pipeline": choice(grouped_conv_kernels.PIPELINES),
               "wave_mode": choice(grouped_conv_kernels.WAVE_MODES),
               "has_dsb": FLAG, "has_si": FLAG}
    special = {"direction": choice([family.direction]),
               "dtype": choice(grouped_conv_kernels.DTYPES),
               "ndim": choice(grouped_conv_kernels.NDIMS),
               **{name: whole(0, MAX_DIMENSION) for name in grouped_conv.NONNEGATIVE_FIELDS}}
    fields = {name: special.get(name, DIMENSION) for name in family.problem_fields}
    return options, fields


def _is_kernel_shape(value: Any) -> bool:
    if _is_whole(value):
        parts = [value]
    elif isinstance(value, str) and KERNEL_SHAPE_RE.fullmatch(value.strip()):
        parts = value.strip().split("x")
    else:
        return False
    return all(1 <= int(part) <= MAX_KERNEL_SHAPE for part in parts)


def _disco_rules(family: DiscoFamily) -> tuple[dict, dict]:
    rows = {key: tiles for key, tiles in disco_kernels.TILES.items()
            if key[0] == family.direction}
    variants = tuple(dict.fromkeys(variant for _, variant, _ in rows))
    tiles = tuple(dict.fromkeys(f"{a}x{b}" for row in rows.values() for a, b in row))
    options = {"variant": choice(variants), "isa": choice(disco_kernels.ISAS),
               "tiles": choice(tiles), "lat_block": whole(1, disco_kernels.MAX_LAT_BLOCK)}
    grid = whole(1, MAX_GRID_POINTS)
    shape = _rule(str | int, f"a kernel shape: a whole number or an 'AxB' string, each number "
                  f"from 1 to {MAX_KERNEL_SHAPE}", _is_kernel_shape)
    fields = {"batch": DIMENSION, "channels": DIMENSION, "nlat_in": grid, "nlon_in": grid,
              "nlat_out": grid, "nlon_out": grid, "kernel_shape": shape,
              "basis": choice([*disco_kernels.BASES, *BASIS_ALIASES]),
              # the grids' names live with their quadratures (torch): the family checks them
              "grid_in": TEXT, "grid_out": TEXT,
              "theta_cutoff": number("in (0, pi]", lambda v: 0 < v <= math.pi, gt=0,
                                     le=math.pi),
              "precision": choice(disco_kernels.PRECISIONS)}
    return options, fields


# family class -> (candidate option rules, problem field rules)
FAMILY_RULES: dict[type, Callable[[Any], tuple[dict, dict]]] = {
    GemmFamily: _gemm_rules, GroupedConvFamily: _grouped_conv_rules, DiscoFamily: _disco_rules}

# a candidate option's value of a family without a FAMILY_RULES row
OPTION_VALUE = _rule(str | int | float | bool, "a string, a number, true or false",
                     lambda v: isinstance(v, (str, bool)) or _is_number(v))


def _plugin_rules(family: Any) -> tuple[dict, dict]:
    """The rules of a family without a FAMILY_RULES row (a plugin's, tilecast.families):
    its options and fields by name, any scalar value; the family's own candidate_space and
    problem check the values in the second pass."""
    return ({key: OPTION_VALUE for key in family.CANDIDATE_OPTIONS},
            {key: SCALAR for key in family.problem_fields})

# ModelSpec's keys (tilecast.stages.train, which imports pandas: tests check the two agree)
MODEL_RULES = {
    "num_leaves": whole(2, 131072), "learning_rate": POSITIVE, "n_estimators": whole(1),
    "min_data_in_leaf": whole(1), "feature_fraction": FRACTION, "bagging_fraction": FRACTION,
    "bagging_freq": whole(0), "lambda_l2": NON_NEGATIVE, "folds": whole(2),
    "early_stopping_rounds": whole(1), "seed": whole(0), "target": choice(TARGET_TRANSFORMS),
    "top_weight": NON_NEGATIVE, "shortlist": whole(0, 64)}

# protocol.threads: a count, or "auto" (this machine's cores), or a list of them: a night
# measures, trains and publishes once per count (a hardware class each)
def _thread_count(value: Any) -> bool:
    return value == "auto" or (_is_whole(value) and value >= 1)


THREADS = _rule(int | Literal["auto"] | list[int | Literal["auto"]],
                "a whole number >= 1, 'auto' (this machine's cores), or a non-empty list of "
                "them without repeats",
                lambda v: _thread_count(v) or (isinstance(v, list) and len(v) > 0
                                               and all(map(_thread_count, v))
                                               and len(set(map(str, v))) == len(v)))

# one per field of tilecast.measurement.protocol.Protocol, whose defaults the section takes
PROTOCOL_RULES = {
    "warmup_ms": POSITIVE, "min_sample_ms": POSITIVE, "samples": whole(1),
    "max_reps": whole(1), "flush_cache": FLAG, "threads": THREADS, "timeout_s": POSITIVE,
    "retakes": whole(0), "stall_limit": FRACTION,
    "sync_limit": number("0 (off) or > 1", lambda v: v == 0 or v > 1, ge=0)}


def family_rules(name: str) -> tuple[dict, dict]:
    """(candidate option -> rule, problem field -> rule) of a FAMILIES name; LookupError when
    the rules and the family's own options or fields disagree (a family grew a field)."""
    family = FAMILIES[name]
    options, fields = FAMILY_RULES.get(type(family), _plugin_rules)(family)
    for what, theirs, ours in (("candidate options", family.CANDIDATE_OPTIONS, options),
                               ("problem fields", family.problem_fields, fields)):
        if set(theirs) != set(ours):
            raise LookupError(f"the schema's {what} of family {name} {sorted(ours)} are not "
                              f"the family's {sorted(theirs)}; update FAMILY_RULES")
    return options, fields


def _title(name: str | None) -> str:
    return "".join(part.title() for part in (name or "any").split("_"))


def _optional(rules: Mapping[str, Any]) -> dict:
    # a default is never validated: an absent key reads None, an explicit null is refused
    return {key: (rule, None) for key, rule in rules.items()}


def _problem_rules(name: str | None) -> dict:
    if name is not None:
        return family_rules(name)[1]
    return {field: SCALAR for family in FAMILIES.values() for field in family.problem_fields}


@functools.cache
def entry_model(name: str | None) -> type[Section]:
    """The model of one problem entry of family `name` (None: any family's fields, any
    scalar values)."""
    fields = _problem_rules(name)
    title = _title(name)
    ranged = {key: rule for key, rule in fields.items()
              if rule is SCALAR or rule.__origin__ is int}
    problem = create_model(f"{title}Problem", __base__=ProblemSection, **_optional(fields))
    grid = create_model(f"{title}Grid", __base__=AxesSection,
                        **_optional({key: values_list(rule) for key, rule in fields.items()}))
    ranges = create_model(f"{title}Ranges", __base__=AxesSection,
                          **_optional({key: ordered_pair(DIMENSION) for key in ranged}))
    random = create_model(f"{title}Random", __base__=Section,
                          count=(whole(1, MAX_PROBLEMS), ...), seed=(whole(0), 0),
                          ranges=(ranges, ...))
    listed = _rule(list[problem], "a non-empty list of problems (mappings of field -> value)",
                   lambda v: isinstance(v, list) and len(v) > 0, min_length=1)
    return create_model(f"{title}Entry", __base__=EntrySection,
                        **_optional({"grid": grid, "list": listed, "random": random, **fields}))


def _section(name: str, rules: Mapping[str, Any], defaults: Mapping[str, Any]) -> type[Section]:
    return create_model(name, __base__=Section,
                        **{key: (rule, defaults.get(key)) for key, rule in rules.items()})


@functools.cache
def family_model(name: str) -> type[Section]:
    """The model of `families.<name>` of a run config."""
    options, _ = family_rules(name)
    title = _title(name)
    entry = entry_model(name)
    candidates = create_model(f"{title}Candidates", __base__=Section,
                              **_optional({key: values_list(rule) for key, rule in options.items()}))
    problem_sets = create_model(f"{title}ProblemSets", __base__=Section,
                                train=(_entries(entry, TRAIN_EMPTY), ...),
                                holdout=(_entries(entry, TRAIN_EMPTY), ...))
    model = create_model(f"{title}Model", __base__=Section, **_optional(MODEL_RULES))
    return create_model(   # in the order configs are written, which errors are listed in
        f"{title}Family", __base__=Section, budget=(whole(1), None), seed=(whole(0), 0),
        candidates=(candidates, ...), problems=(problem_sets, ...),
        sentinel=(_entries(entry, SENTINEL_EMPTY, optional=True), None),
        model=(model, Field(default_factory=model)), warm_start=(WARM_START, None),
        workload=(WORKLOAD, None))


@functools.cache
def config_model() -> type[Section]:
    """The model of a whole run config; its defaults are the run's (RunConfig, Protocol)."""
    protocol_defaults = {f.name: f.default for f in dataclass_fields(Protocol)}
    if set(protocol_defaults) != set(PROTOCOL_RULES):
        raise LookupError(f"PROTOCOL_RULES {sorted(PROTOCOL_RULES)} are not the fields of "
                          f"Protocol {sorted(protocol_defaults)}")
    protocol = _section("ProtocolSection", PROTOCOL_RULES, protocol_defaults)
    tune = _section("TuneSection", {"tie_threshold_pct": PERCENT, "finalists": whole(0),
                                    "confirm_samples": whole(0)},
                    {"tie_threshold_pct": 1.0, "finalists": 3, "confirm_samples": 5})
    build = _section("BuildSection", {"jobs": whole(1)}, {"jobs": 2})
    bench = _section("BenchSection", {
        "problems_per_batch": whole(1), "rounds": whole(1), "retry_disturbed": whole(0),
        "interleave": FLAG, "race_cycles": whole(0), "race_rounds": whole(1),
        "race_margin_pct": PERCENT, "race_keep_pct": PERCENT, "race_fresh_process": FLAG},
        {"problems_per_batch": 8, "rounds": 3, "retry_disturbed": 1, "interleave": True,
         "race_cycles": 16, "race_rounds": 3, "race_margin_pct": 25.0, "race_keep_pct": 5.0,
         "race_fresh_process": True})
    night = _section("NightSection", NIGHT_RULES, NIGHT_DEFAULTS)
    families = create_model("Families", __base__=FamiliesSection,
                            **_optional({name: family_model(name) for name in FAMILIES}))
    sections = {key: (model, Field(default_factory=model)) for key, model in
                (("protocol", protocol), ("tune", tune), ("build", build), ("bench", bench),
                 ("night", night))}
    # in the order configs are written, which is the order errors are listed in
    return create_model("RunConfigFile", __base__=Section, name=(TEXT, ...),
                        description=(ANY_TEXT, ""), **sections, families=(families, ...))


@functools.cache
def problem_file_model(name: str) -> type[Section]:
    """The model of a problems file of family `name`: `problems:` and a problem set's entries."""
    return create_model(f"{_title(name)}ProblemFile", __base__=Section,
                        problems=(_entries(entry_model(name), TRAIN_EMPTY), ...))


@functools.cache
def entries_adapter(name: str | None) -> TypeAdapter:
    """A validator of a list of problem entries of family `name` (None: any family)."""
    return TypeAdapter(_entries(entry_model(name), TRAIN_EMPTY))


def config_json_schema() -> dict:
    """The JSON Schema of a run config (`tilecast config schema`), from the same models."""
    return config_model().model_json_schema()


# -- messages ---------------------------------------------------------------------------------

def key_path(prefix: str, loc: Iterable) -> str:
    """`prefix` and a pydantic location as a key path: families.gemm.candidates.mc[0]."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f"{'.' if path and not path.endswith(': ') else ''}{part}"
    return path.removesuffix(": ")


def validate(validator: type[BaseModel] | TypeAdapter, data: Any,
             prefix: str) -> tuple[Any, list[str]]:
    """(the validated document, []) or (None, every schema error of `data` as one message a
    line: `prefix`, the key path, what is wrong; missing keys first, grouped by the mapping
    they are missing from)."""
    try:
        if isinstance(validator, TypeAdapter):
            return validator.validate_python(data), []
        return validator.model_validate(data), []
    except ValidationError as err:
        return None, format_errors(prefix, err)


def format_errors(prefix: str, error: ValidationError) -> list[str]:
    """The messages of a ValidationError (see `validate`)."""
    missing: dict[tuple, list] = {}
    lines = []
    for item in error.errors(include_url=False):
        loc = tuple(item["loc"])
        if item["type"] == "missing":
            missing.setdefault(loc[:-1], []).append(loc[-1])
            continue
        text = item["msg"] if item["type"] == ERROR_TYPE \
            else f"{item['msg']}, got {show(item.get('input'))}"
        lines.append(f"{key_path(prefix, loc)}: {text}")
    return [f"{key_path(prefix, parent)}: missing key(s) {sorted(keys, key=str)}"
            for parent, keys in missing.items()] + lines


# -- the second pass: problems through their family, memory, candidate spaces ------------------

def memory_bytes() -> int | None:
    """The memory this process may use, in bytes: physical memory (os.sysconf, else
    /proc/meminfo's MemTotal), less where a cgroup v2 limit is lower; None when unknown."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and (total is None or int(limit) < total):
        total = int(limit)
    return total if total and total > 0 else None


def _gib(size: int) -> str:
    return f"{size / 2**30:.3g} GiB"


def _spelled(family, values: Mapping) -> str:
    """A problem's given fields in the family's order, as `dims_key` spells them."""
    order = {name: index for index, name in enumerate(family.problem_fields)}
    keys = sorted(values, key=lambda key: order.get(key, len(order)))
    return show(",".join(f"{key}={values[key]}" for key in keys))


def check_problems(family, located: Iterable[tuple[str, dict]],
                   memory: int | None) -> tuple[list[tuple[str, Any]], list[str]]:
    """((key path, problem) for every problem the family builds, messages for the others):
    `located` holds (key path, field values) pairs; a problem whose operands
    (family.operand_bytes) need more than `memory` bytes is refused before it is built."""
    built, messages = [], []
    for path, values in located:
        try:
            needed = family.operand_bytes(values)
            if memory is not None and needed > memory:
                messages.append(f"{path}: problem {_spelled(family, values)} needs about {needed} bytes "
                                f"({_gib(needed)}) for its operands, more than the {memory} "
                                f"bytes ({_gib(memory)}) of memory here; make it smaller")
                continue
            built.append((path, family.problem(values)))
        except ValueError as err:   # FamilyError: the family's own checks
            messages.append(f"{path}: problem {_spelled(family, values)}: {err}")
    return built, messages


def candidate_errors(family, options: Mapping, hardware: Mapping) -> list[str]:
    """Why the candidate options give the family no kernel on `hardware` (flags {}: on any
    CPU), or []."""
    try:
        space = family.candidate_space(options, hardware)
    except ValueError as err:   # FamilyError
        return [str(err)]
    if space:
        return []
    where = " this CPU can run" if hardware.get("flags") else ""
    return [f"the options {show(dict(options))} allow no candidate kernel{where}"]
