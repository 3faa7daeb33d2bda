"""The device hardware table: what each device a dataset was measured on is made of.

A table-family model learns across devices from these figures: `features` turns a device into
a fixed vector (FEATURE_NAMES), `distance` says how unlike two devices are (the "most similar
measured device" baseline), `resolve` maps the spellings tools print (Kernel Tuner's
`device_name`, ...) to one canonical name. The table ships as devices.yaml beside this module
(its header documents the format); users add or replace entries with YAML files of the same
format (`--devices FILE`, TILECAST_DEVICES). A trained model keeps the entries of its devices
(`to_json`), so it loads later without the user's files.
"""
from __future__ import annotations

import difflib
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from tilecast.core.settings import DEVICES_ENV, settings
from tilecast.table.dataset import TableDataError

log = logging.getLogger("tilecast.table.devices")

SHIPPED = Path(__file__).with_name("devices.yaml")
FORMAT = "tilecast-devices"
VERSION = 1
VENDORS = ("nvidia", "amd", "intel", "apple", "other")   # a vendor's code is its index
KINDS = ("gpu", "cpu")                                    # a kind's code is its index
# words tools print around a device's name that do not tell devices apart
VENDOR_WORDS = frozenset({"nvidia", "amd", "intel", "geforce", "radeon", "instinct", "pro",
                          "tesla", "quadro", "gpu", "graphics"})
HOW_TO_ADD = ("add it to a YAML file (format: tilecast/table/devices.yaml) and pass "
              "--devices FILE or set TILECAST_DEVICES")
# what one differing categorical feature (vendor, kind) adds, in standard deviations: the gap
# between the two values of an evenly split two-valued feature once standardized
CATEGORY_GAP = 2.0
ERROR_TYPE = "tilecast"


class UnknownDeviceError(TableDataError):
    """A device label the table cannot name: unknown, or matching several devices."""


def _show(value: Any) -> str:
    return repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."


def _capability(value: Any) -> Any:
    if value is None or (isinstance(value, str) and re.fullmatch(r"\d+\.\d+", value)):
        return value
    raise PydanticCustomError(ERROR_TYPE, "expected a quoted 'major.minor' string such as "
                              "'8.0', got {got}", {"got": _show(value)})


Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Count = Annotated[int, Field(gt=0)]
Text = Annotated[str, Field(pattern=r"\S")]


class _Strict(BaseModel):
    # strict: no "900" for 900, no true for 1; ints are taken for floats
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PeakTflops(_Strict):
    """Dense peak TFLOP/s (int8: TOP/s) per precision; fp32 required."""
    fp64: Positive | None = None
    fp32: Positive
    tf32: Positive | None = None
    bf16: Positive | None = None
    fp16: Positive | None = None
    int8: Positive | None = None


class DeviceEntry(_Strict):
    """One device's figures (devices.yaml's header says what each means)."""
    vendor: Literal[VENDORS]
    kind: Literal[KINDS]
    aliases: list[Text] = []
    architecture: Text | None = None
    compute_capability: Annotated[str | None, BeforeValidator(_capability)] = None
    compute_units: Count
    clock_mhz: Positive
    peak_tflops: PeakTflops
    memory_bandwidth_gbs: Positive
    memory_gib: Positive | None = None
    l2_kib: Positive
    shared_memory_kib: Positive
    registers_kib: Positive | None = None
    warp_size: Count


# key -> the model of its value, whose keys an unknown key under it is shown
NESTED_MODELS = {"peak_tflops": PeakTflops}


def _messages(prefix: str, error: ValidationError) -> list[str]:
    """One `<prefix>.<key path>: <what is wrong>` line per error."""
    lines = []
    for item in error.errors(include_url=False):
        loc = item["loc"]
        path = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
        if item["type"] == "missing":
            text = "missing key"
        elif item["type"] == "extra_forbidden":
            model = NESTED_MODELS.get(loc[0], DeviceEntry) if len(loc) > 1 else DeviceEntry
            text = f"unknown key; valid: {', '.join(model.model_fields)}"
        elif item["type"] == ERROR_TYPE:
            text = item["msg"]
        else:
            text = f"{item['msg']}, got {_show(item.get('input'))}"
        lines.append(f"{path}: {text}")
    return lines


def _validate(document: Any, source: str) -> dict[str, DeviceEntry]:
    """The entries of one table document; TableDataError listing every error, one a line."""
    if not isinstance(document, Mapping) or not document:
        raise TableDataError(f"{source}: expected a mapping of device name -> entry (format: "
                             f"tilecast/table/devices.yaml), got {_show(document)}")
    entries, problems = {}, []
    for name, body in document.items():
        if not isinstance(name, str) or not name.strip():
            problems.append(f"{source}: {name!r}: a device name must be a non-empty string")
            continue
        try:
            entries[name] = DeviceEntry.model_validate(body)
        except ValidationError as err:
            problems += _messages(f"{source}: {name}", err)
    if problems:
        raise TableDataError("\n".join(problems))
    return entries


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping: safe_load keeps
    the last one silently, so a device pasted twice would lose its first entry unseen."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":   # `<<: *base` may repeat keys
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping", key_node.start_mark)
            seen.add(key if isinstance(key, (str, int, float)) else id(key_node))
        return super().construct_mapping(node, deep=deep)


def _read(path: Path) -> dict[str, DeviceEntry]:
    try:
        text = path.read_text()
    except OSError as err:
        raise TableDataError(f"{path}: cannot read this device table ({err.strerror}); give "
                             f"an existing YAML file to --devices or {DEVICES_ENV}") from None
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise TableDataError(f"{path}: not valid YAML: {err}") from None
    return _validate(document, str(path))


def _normalize(label: str) -> str:
    """`label` without case, punctuation, spaces and vendor words: "NVIDIA A100-PCIE-40GB"
    -> "a100pcie40gb"."""
    return "".join(word for word in re.findall(r"[a-z0-9]+", label.casefold())
                   if word not in VENDOR_WORDS)


def _log2(value: float | None) -> float:   # NaN for an optional figure not given
    return math.nan if value is None else math.log2(value)


@dataclass(frozen=True)
class Feature:
    """One dimension of a device's feature vector: how it is computed from an entry, and
    whether it is a category (compared by equality in `distance`, not by size)."""
    name: str
    value: Callable[[DeviceEntry], float]
    categorical: bool = False


FEATURES = (
    Feature("log2_compute_units", lambda e: math.log2(e.compute_units)),
    Feature("clock_mhz", lambda e: e.clock_mhz),
    Feature("log2_fp64_tflops", lambda e: _log2(e.peak_tflops.fp64)),
    Feature("log2_fp32_tflops", lambda e: math.log2(e.peak_tflops.fp32)),
    Feature("log2_fp16_tflops", lambda e: _log2(e.peak_tflops.fp16)),
    Feature("log2_bandwidth_gbs", lambda e: math.log2(e.memory_bandwidth_gbs)),
    Feature("log2_l2_kib", lambda e: math.log2(e.l2_kib)),
    Feature("log2_shared_memory_kib", lambda e: math.log2(e.shared_memory_kib)),
    Feature("warp_size", lambda e: float(e.warp_size)),
    # the roofline's ridge: FP32 FLOPs per DRAM byte a kernel needs to be compute bound
    Feature("log2_fp32_flops_per_byte",
            lambda e: math.log2(e.peak_tflops.fp32 * 1000 / e.memory_bandwidth_gbs)),
    Feature("compute_capability",
            lambda e: math.nan if e.compute_capability is None else float(e.compute_capability)),
    Feature("vendor_code", lambda e: float(VENDORS.index(e.vendor)), categorical=True),
    Feature("kind_code", lambda e: float(KINDS.index(e.kind)), categorical=True),
)


class DeviceTable:
    """Device name -> validated entry, with label resolution, feature vectors and a distance.
    Build one with `load`, `from_mapping` or `from_json`."""
    FEATURE_NAMES: tuple[str, ...] = tuple(feature.name for feature in FEATURES)

    def __init__(self, entries: Mapping[str, DeviceEntry], sources: Mapping[str, str]) -> None:
        self._entries = dict(entries)
        self._labels: dict[str, str] = {}           # casefolded name or alias -> name
        self._normalized: dict[str, set[str]] = {}  # _normalize(name or alias) -> names
        for name, entry in self._entries.items():
            for label in (name, *entry.aliases):
                owner = self._labels.setdefault(label.strip().casefold(), name)
                if owner != name:
                    where = name if label == name else f"{name}.aliases"
                    raise TableDataError(
                        f"{sources[name]}: {where}: {label!r} already names device {owner!r} "
                        f"({sources[owner]}); a label names one device: remove it from one")
                if _normalize(label):   # "NVIDIA" alone tells no device
                    self._normalized.setdefault(_normalize(label), set()).add(name)
        self._rows = {name: np.array([f.value(entry) for f in FEATURES], dtype=np.float64)
                      for name, entry in self._entries.items()}
        # each feature's standard deviation over the table's finite values (0: fewer than two)
        self._scale = np.array([float(np.std(column[np.isfinite(column)]))
                                if np.isfinite(column).sum() > 1 else 0.0
                                for column in np.array(list(self._rows.values())).T])

    @classmethod
    def load(cls, extra: Sequence[str | Path] = ()) -> "DeviceTable":
        """The shipped table, then the files in TILECAST_DEVICES (os.pathsep-separated), then
        `extra` (--devices): a later entry of the same name replaces an earlier one (logged).
        TableDataError `<file>: <key path>: <what is wrong>` for a bad file."""
        paths = [SHIPPED, *settings().device_tables, *(Path(p) for p in extra)]
        entries: dict[str, DeviceEntry] = {}
        sources: dict[str, str] = {}
        for path in paths:
            for name, entry in _read(path).items():
                if name in entries:
                    log.info("device %r of %s replaces the one of %s", name, path, sources[name])
                entries[name], sources[name] = entry, str(path)
        return cls(entries, sources)

    @classmethod
    def from_mapping(cls, entries: Mapping[str, Mapping],
                     source: str = "<mapping>") -> "DeviceTable":
        """A table of `entries` (name -> entry as in devices.yaml) alone, validated; errors
        are prefixed with `source`."""
        validated = _validate(entries, source)
        return cls(validated, dict.fromkeys(validated, source))

    def names(self) -> list[str]:
        """The canonical names, in the order the files list them."""
        return list(self._entries)

    def resolve(self, label: str) -> str:
        """The canonical name of `label`: a name or alias (any case), else the one entry whose
        name or alias matches it without case, punctuation, spaces and vendor words.
        UnknownDeviceError when none or several match."""
        if not isinstance(label, str):
            raise UnknownDeviceError(f"device label {_show(label)} is not a string")
        if label in self._entries:
            return label
        owner = self._labels.get(label.strip().casefold())
        if owner is not None:
            return owner
        owners = sorted(self._normalized.get(_normalize(label), ()))
        if len(owners) == 1:
            return owners[0]
        if owners:
            raise UnknownDeviceError(f"device label {label!r} matches several devices: "
                                     f"{', '.join(owners)}; give one of these names exactly, "
                                     "or make the label an alias of one")
        close = self._close_names(label)
        hint = (f"closest known: {', '.join(close)}" if close
                else f"no known name is close (known: {', '.join(self._entries)})")
        raise UnknownDeviceError(f"unknown device {label!r}; {hint}; to add it, {HOW_TO_ADD}")

    def _close_names(self, label: str, most: int = 5) -> list[str]:
        key = _normalize(label) or label.casefold()
        containing = [k for k in self._normalized if key and key in k]
        similar = difflib.get_close_matches(key, list(self._normalized), n=most, cutoff=0.5)
        names = [name for k in containing + similar for name in sorted(self._normalized[k])]
        return list(dict.fromkeys(names))[:most]

    def entry(self, name: str) -> dict:
        """The validated entry of `name` (or any label of it) as a plain dict; an optional
        figure not given is None."""
        return self._entries[self.resolve(name)].model_dump()

    def features(self, name: str) -> np.ndarray:
        """The float64 feature vector of `name` in FEATURE_NAMES order (NaN for a missing
        optional figure)."""
        return self._rows[self.resolve(name)].copy()

    def distance(self, a: str, b: str) -> float:
        """How unlike devices `a` and `b` are (feature_distance over this table's scale);
        0 for the same device."""
        a, b = self.resolve(a), self.resolve(b)
        if a == b:
            return 0.0
        return feature_distance(self._rows[a], self._rows[b], self._scale)

    @property
    def scale(self) -> np.ndarray:
        """Each feature's standard deviation over this table's finite values (0: fewer than
        two), the units `distance` measures in."""
        return self._scale.copy()

    def to_json(self, names: Iterable[str]) -> dict:
        """A JSON-able document of the entries of `names` (labels resolved), which
        `from_json` reads back: what a trained model stores of the devices it knows."""
        wanted = dict.fromkeys(self.resolve(name) for name in names)
        return {"format": FORMAT, "version": VERSION,
                "devices": {name: self._entries[name].model_dump(exclude_none=True)
                            for name in wanted}}

    @classmethod
    def from_json(cls, document: Mapping, source: str = "<stored devices>") -> "DeviceTable":
        """The table `to_json` wrote; TableDataError when `document` is not one."""
        if (not isinstance(document, Mapping) or document.get("format") != FORMAT
                or document.get("version") != VERSION):
            raise TableDataError(f"{source}: not a version {VERSION} {FORMAT} document "
                                 "(written by DeviceTable.to_json)")
        return cls.from_mapping(document.get("devices"), source)


#: which of FEATURE_NAMES are categories
CATEGORICAL = np.array([feature.categorical for feature in FEATURES])


def feature_distance(first: np.ndarray, second: np.ndarray, scale: np.ndarray) -> float:
    """How unlike two device feature vectors are: the Euclidean distance of their features,
    each numeric one divided by its `scale` (a dimension of scale 0 is left out), a differing
    category counting CATEGORY_GAP. A dimension missing on either side is left out and the
    sum scaled up by the share it had, so that a missing figure does not make a device look
    closer."""
    usable = CATEGORICAL | (scale > 0)
    present = usable & np.isfinite(first) & np.isfinite(second)
    if not present.any():
        return 0.0
    gaps = np.where(CATEGORICAL, (first != second) * CATEGORY_GAP,
                    (first - second) / np.where(scale > 0, scale, 1.0))
    squares = np.sum(gaps[present] ** 2) * usable.sum() / present.sum()
    return float(math.sqrt(squares))


def load_devices(extra: Sequence[str | Path] = ()) -> DeviceTable:
    """DeviceTable.load(extra): the shipped table and the user's files."""
    return DeviceTable.load(extra)
