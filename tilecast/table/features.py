"""Features of a table-family row (problem, configuration, device), fixed by the dataset's schema.

The feature list is derived from the schema alone (its columns, kinds and order), so two
models of one schema have the same names in the same order:

    numeric problem column p        p, log2(|p|+1)
    pairs of numeric problem cols   a*b, a/b   for the first MAX_PROBLEM_PAIRS pairs
    all numeric problem columns     log2 of the product of (|p|+1): the problem's size
    numeric config column c         c, log2(|c|+1)
    categorical column (either)     its integer code among the categories seen in training
    numeric (problem, config) pair  p/c and fit(p,c) = p / (ceil(p/c)*c), the share of the
                                    padded problem a tile of c covers that is real work,
                                    for the first MAX_FIT_PAIRS pairs
    device                          DeviceTable.FEATURE_NAMES, prefixed `device:`
    parts of structured choice      a categorical configuration whose values spell numeric
    names (fitted)                  parts, `type=triton_BLOCK-M=16_BLOCK-K=128_numwarps=4`
                                    (Inductor's, AutoHeuristic's choices): each part q found
                                    in enough of the training values gives q and log2(q)
                                    (missing where a value lacks it); a part whose name ends
                                    in a numeric problem column's (BLOCK-M and m) gives
                                    p/q and fit(p,q) as a numeric column would, and each two
                                    such parts the tiles ceil(p1/q1)*ceil(p2/q2) over the
                                    device's compute units (waves) and the last wave's share
                                    of them (tail)

Caps: a schema with 10 numeric problem columns has 45 pairs and, with 15 numeric
configuration columns, 150 (problem, config) pairs; every pair costs two features, so only
the first MAX_PROBLEM_PAIRS problem pairs (15: every pair of the first 6 columns) and the first
MAX_FIT_PAIRS (problem, config) pairs (48, configuration columns outermost, both in schema
order) become features. The list is in feature_spec.json.

Undefined values are missing (NaN), which LightGBM sends down its learned missing branch:
a ratio over zero, a fit with a non-positive value. A categorical value not seen in training
is missing too; LightGBM's categorical splits send a missing value with the categories the
split does not list (the "other" side).

Vectorized: a block is computed once per distinct problem, configuration or device and
gathered to the rows; the pair features are numpy expressions over whole columns. Matrices are
float32 (LightGBM reads them as they are), so a grid of 300 problems x 5,000 configurations of
one device with ~80 features is ~480 MB; `grid` callers should go problem block by block.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from tilecast.table.dataset import Column, TableDataError, TableSchema

MAX_PROBLEM_PAIRS = 15
MAX_FIT_PAIRS = 48
DEVICE_PREFIX = "device:"
DTYPE = np.float32
#: a numeric part of a structured choice name: NAME=NUMBER (NAME may hold '-')
PART = re.compile(r"(?<![A-Za-z0-9-])([A-Za-z][A-Za-z0-9-]*)=([-+]?[0-9]+(?:\.[0-9]+)?)(?![0-9.])")
#: a part is a feature when this share of a column's training values spell it
MIN_PART_SHARE = 0.1
MAX_PARTS = 8            # per categorical configuration column
COMPUTE_UNITS = "log2_compute_units"
#: whether a new engine looks for choice parts (benchmarks/autoheuristic.py --no-parts turns
#: it off to measure what they give)
CHOICE_PARTS = True


def choice_parts(value: str) -> dict[str, float]:
    """The numeric NAME=NUMBER parts of a structured choice name, e.g. {"BLOCK-M": 16.0, ...}
    of `type=triton_BLOCK-M=16_BLOCK-K=128_numwarps=4`; {} for a plain name."""
    return {name: float(number) for name, number in PART.findall(str(value))}


def _tail_token(name: str) -> str:
    return re.split(r"[-_ .]", name.strip().lower())[-1]


def _log2(values: np.ndarray) -> np.ndarray:
    return np.log2(np.abs(values) + 1.0)


def _ratio(top: np.ndarray, bottom: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(bottom != 0, top / np.where(bottom != 0, bottom, 1.0), np.nan)


def _fit(size: np.ndarray, tile: np.ndarray) -> np.ndarray:
    """size / (ceil(size / tile) * tile): 1.0 when the tile divides the size, NaN when either is
    not positive."""
    valid = (size > 0) & (tile > 0)
    safe_tile = np.where(valid, tile, 1.0)
    safe_size = np.where(valid, size, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        padded = np.ceil(safe_size / safe_tile) * safe_tile
        return np.where(valid, safe_size / padded, np.nan)


@dataclass(frozen=True)
class Blocks:
    """Which schema columns feed which feature groups (derived from the schema alone)."""
    problem_numeric: tuple[str, ...]
    problem_categorical: tuple[str, ...]
    config_numeric: tuple[str, ...]
    config_categorical: tuple[str, ...]
    problem_pairs: tuple[tuple[str, str], ...]
    fit_pairs: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, schema: TableSchema) -> "Blocks":
        def names(columns: Sequence[Column], kind: str) -> tuple[str, ...]:
            return tuple(c.name for c in columns if c.kind == kind)

        problem_numeric = names(schema.problem, "numeric")
        config_numeric = names(schema.config, "numeric")
        fit_pairs = [(p, c) for c in config_numeric for p in problem_numeric]
        return cls(problem_numeric=problem_numeric,
                   problem_categorical=names(schema.problem, "categorical"),
                   config_numeric=config_numeric,
                   config_categorical=names(schema.config, "categorical"),
                   problem_pairs=tuple(combinations(problem_numeric, 2))[:MAX_PROBLEM_PAIRS],
                   fit_pairs=tuple(fit_pairs[:MAX_FIT_PAIRS]))


class TableFeatures:
    """The feature engine of one schema and device table.

    `fit(frame)` learns the categories of the categorical columns (sorted, stored in
    `categories_`); `problem_features`, `config_features`, `rows` and `grid` build matrices.
    `device_table` gives device features; a query may pass another table for a device this
    one lacks."""

    def __init__(self, schema: TableSchema, device_table, categories: Mapping | None = None,
                 parts: bool | None = None):
        self.schema = schema
        self.device_table = device_table
        self.blocks = Blocks.of(schema)
        self.use_parts = CHOICE_PARTS if parts is None else bool(parts)
        self.categories_: dict[str, list[str]] | None = (
            None if categories is None else {k: [str(v) for v in vs]
                                             for k, vs in categories.items()})
        self._codes: dict[str, dict[str, int]] = {}
        self.parts_: list[tuple[str, str]] = []          # (config column, part name)
        self.part_fits_: list[tuple[str, str, str]] = []  # (problem column, column, part)
        if self.categories_ is not None:
            self._index_categories()
        else:
            self._name()

    def _name(self) -> None:
        """The feature names, from the schema and (once fitted) the choice parts found."""
        self.problem_names = self._problem_names()
        self.config_names = self._config_names() + [
            n for c, q in self.parts_ for n in (f"{c}.{q}", f"log2({c}.{q})")]
        self.fit_names = [name for p, c in self.blocks.fit_pairs for name in (f"{p}/{c}",
                                                                             f"fit({p},{c})")]
        self.fit_names += [n for p, c, q in self.part_fits_
                           for n in (f"{p}/{c}.{q}", f"fit({p},{c}.{q})")]
        self.device_names = [DEVICE_PREFIX + n for n in self.device_table.FEATURE_NAMES]
        self.wave_pairs = list(combinations(range(len(self.part_fits_)), 2)) \
            if COMPUTE_UNITS in self.device_table.FEATURE_NAMES else []
        self.wave_names = [n for a, b in self.wave_pairs
                           for n in (f"waves({self.part_fits_[a][0]},{self.part_fits_[b][0]})",
                                     f"tail({self.part_fits_[a][0]},{self.part_fits_[b][0]})")]
        self.names = (self.problem_names + self.config_names + self.fit_names
                      + self.device_names + self.wave_names)
        repeated = sorted({n for n in self.names if self.names.count(n) > 1})
        if repeated:
            raise TableDataError(f"the schema's column names make feature name(s) {repeated} "
                                 "twice; rename the columns (e.g. one called 'log2(m)')")

    # -- names ---------------------------------------------------------------------------

    def _problem_names(self) -> list[str]:
        blocks = self.blocks
        names = [n for p in blocks.problem_numeric for n in (p, f"log2({p})")]
        names += [n for a, b in blocks.problem_pairs for n in (f"{a}*{b}", f"{a}/{b}")]
        if blocks.problem_numeric:
            names.append("log2(size)")
        return names + list(blocks.problem_categorical)

    def _config_names(self) -> list[str]:
        blocks = self.blocks
        names = [n for c in blocks.config_numeric for n in (c, f"log2({c})")]
        return names + list(blocks.config_categorical)

    @property
    def categorical_indices(self) -> list[int]:
        """Positions of the categorical codes in `names` (LightGBM's categorical_feature)."""
        wanted = set(self.blocks.problem_categorical + self.blocks.config_categorical)
        return [i for i, name in enumerate(self.names) if name in wanted]

    # -- categories ----------------------------------------------------------------------

    def fit(self, frame: pd.DataFrame) -> "TableFeatures":
        """Learn the categories of every categorical column from `frame` (sorted); returns self."""
        columns = self.blocks.problem_categorical + self.blocks.config_categorical
        self.categories_ = {c: sorted(set(frame[c].astype(str))) for c in columns}
        self._index_categories()
        return self

    def _index_categories(self) -> None:
        self._codes = {column: {value: code for code, value in enumerate(values)}
                       for column, values in self.categories_.items()}
        self._find_parts()
        self._name()

    def _find_parts(self) -> None:
        """The choice parts of the categorical configuration columns' training values (module
        docstring), and the ones matching a numeric problem column by name."""
        self.parts_, self.part_fits_, self._part_values = [], [], {}
        if not self.use_parts:
            return
        problems = {p.lower(): p for p in self.blocks.problem_numeric}
        for column in self.blocks.config_categorical:
            values = self.categories_.get(column, [])
            parsed = {v: choice_parts(v) for v in values}
            counts: dict[str, int] = {}
            for parts in parsed.values():
                for name in parts:
                    counts[name] = counts.get(name, 0) + 1
            kept = sorted(n for n, k in counts.items()
                          if k >= max(2, MIN_PART_SHARE * len(values))
                          and len({parsed[v].get(n) for v in values if n in parsed[v]}) > 1)
            kept = kept[:MAX_PARTS]
            self.parts_ += [(column, name) for name in kept]
            self.part_fits_ += [(problems[_tail_token(name)], column, name) for name in kept
                                if _tail_token(name) in problems]
            self._part_values[column] = {name: {v: parsed[v].get(name, np.nan) for v in values}
                                         for name in kept}

    def _part_tiles(self, configs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The matched parts' numbers of configurations given as column -> values, keyed
        `column.part` (what fit_features and wave_features read as tiles)."""
        return {f"{c}.{q}": self._part(c, q, configs[c]) for _, c, q in self.part_fits_}

    def _part(self, column: str, name: str, values) -> np.ndarray:
        """A choice part's numbers for `values` of `column` (NaN where absent or unseen)."""
        known = self._part_values[column][name]
        return pd.Series(np.asarray(values)).astype(str).map(known).to_numpy(dtype=np.float64)

    def _check_fitted(self) -> None:
        if self.categories_ is None:
            raise RuntimeError("TableFeatures is not fitted: call fit(frame) first")

    def _codes_of(self, column: str, values) -> np.ndarray:
        """Integer codes of `values` (NaN for a category unseen in training)."""
        codes = self._codes[column]
        return np.array([codes.get(str(v), np.nan) for v in values], dtype=np.float64)

    # -- blocks --------------------------------------------------------------------------

    def problem_features(self, problems: Mapping[str, Any]) -> np.ndarray:
        """(P, len(problem_names)) for P problems given as column -> P values."""
        self._check_fitted()
        blocks = self.blocks
        numeric = {p: np.asarray(problems[p], dtype=np.float64) for p in blocks.problem_numeric}
        count = len(next(iter(problems.values()))) if problems else 1
        out = []
        for p in blocks.problem_numeric:
            out += [numeric[p], _log2(numeric[p])]
        for a, b in blocks.problem_pairs:
            out += [numeric[a] * numeric[b], _ratio(numeric[a], numeric[b])]
        if blocks.problem_numeric:
            out.append(sum(_log2(numeric[p]) for p in blocks.problem_numeric))
        out += [self._codes_of(c, problems[c]) for c in blocks.problem_categorical]
        return _stack(out, count)

    def config_features(self, configs: Mapping[str, Any]) -> np.ndarray:
        """(C, len(config_names)) for C configurations given as column -> C values."""
        self._check_fitted()
        blocks = self.blocks
        count = len(next(iter(configs.values())))
        out = []
        for c in blocks.config_numeric:
            values = np.asarray(configs[c], dtype=np.float64)
            out += [values, _log2(values)]
        out += [self._codes_of(c, configs[c]) for c in blocks.config_categorical]
        for column, name in self.parts_:
            values = self._part(column, name, configs[column])
            out += [values, _log2(values)]
        return _stack(out, count)

    def fit_features(self, problems: Mapping[str, np.ndarray],
                     configs: Mapping[str, np.ndarray]) -> np.ndarray:
        """(N, len(fit_names)) for N rows: problem and configuration columns aligned row by row
        (with the matched parts' numbers, _part_tiles)."""
        out = []
        for p, c in self.blocks.fit_pairs:
            size = np.asarray(problems[p], dtype=np.float64)
            tile = np.asarray(configs[c], dtype=np.float64)
            out += [_ratio(size, tile), _fit(size, tile)]
        for p, c, q in self.part_fits_:
            size = np.asarray(problems[p], dtype=np.float64)
            tile = configs[f"{c}.{q}"]
            out += [_ratio(size, tile), _fit(size, tile)]
        count = len(next(iter(configs.values())))
        return _stack(out, count)

    def wave_features(self, problems: Mapping[str, np.ndarray], configs: Mapping[str, np.ndarray],
                      log2_units: np.ndarray) -> np.ndarray:
        """(N, len(wave_names)): per two matched parts, the tiles over the compute units
        (waves) and the last wave's share of them (tail; 1.0 when the tiles fill it)."""
        tiles = []
        for p, c, q in self.part_fits_:
            size = np.asarray(problems[p], dtype=np.float64)
            tile = configs[f"{c}.{q}"]
            with np.errstate(divide="ignore", invalid="ignore"):
                tiles.append(np.where((size > 0) & (tile > 0), np.ceil(size / tile), np.nan))
        units = np.exp2(np.asarray(log2_units, dtype=np.float64))
        out = []
        for a, b in self.wave_pairs:
            waves = tiles[a] * tiles[b] / units
            tail = waves - np.floor(waves)
            out += [waves, np.where(tail == 0, 1.0, tail)]
        count = len(np.asarray(log2_units).reshape(-1))
        return _stack(out, count)

    def device_features(self, devices: Sequence[str], table=None) -> np.ndarray:
        """(D, len(device_names)) for canonical device names, from `table` (default: this
        engine's device table)."""
        table = table or self.device_table
        return np.array([np.asarray(table.features(d), dtype=np.float64) for d in devices],
                        dtype=np.float64).reshape(len(devices), len(self.device_names))

    # -- matrices ------------------------------------------------------------------------

    def rows(self, frame: pd.DataFrame, device_table=None) -> np.ndarray:
        """(N, len(names)) for N rows holding the problem and configuration columns and
        `device` (canonical names): each block computed once per distinct value."""
        self._check_fitted()
        problem_cols = list(self.schema.problem_names)
        config_cols = list(self.schema.config_names)
        missing = [c for c in problem_cols + config_cols + ["device"] if c not in frame.columns]
        if missing:
            raise TableDataError(f"rows lack column(s) {missing}")
        out = np.empty((len(frame), len(self.names)), dtype=DTYPE)
        stops = np.cumsum([0, len(self.problem_names), len(self.config_names),
                           len(self.fit_names), len(self.device_names), len(self.wave_names)])
        for (start, stop), columns, key, block in (
                ((stops[0], stops[1]), problem_cols, "dims_key", self.problem_features),
                ((stops[1], stops[2]), config_cols, "kernel", self.config_features)):
            index, unique = _distinct(frame, columns, key)
            out[:, start:stop] = block(unique)[index]
        fit_columns = {p for p, _ in self.blocks.fit_pairs} | {c for _, c in self.blocks.fit_pairs}
        fit_columns |= {p for p, _, _ in self.part_fits_}
        values = {c: frame[c].to_numpy() for c in fit_columns}
        if self.part_fits_:   # parsed once per distinct configuration, gathered to the rows
            index, unique = _distinct(frame, config_cols, "kernel")
            values.update({k: v[index] for k, v in self._part_tiles(unique).items()})
        out[:, stops[2]:stops[3]] = self.fit_features(values, values) if fit_columns else \
            np.empty((len(frame), 0))
        device_index, devices = pd.factorize(frame["device"].astype(str))
        device_block = self.device_features(list(devices), device_table)[device_index]
        out[:, stops[3]:stops[4]] = device_block
        if self.wave_names:
            units = device_block[:, self.device_table.FEATURE_NAMES.index(COMPUTE_UNITS)]
            out[:, stops[4]:] = self.wave_features(values, values, units)
        return out

    def grid(self, problems: pd.DataFrame, configs: pd.DataFrame, device: str,
             device_table=None) -> np.ndarray:
        """(P*C, len(names)) for every problem (rows of `problems`) with every configuration
        (rows of `configs`) on one device, problem-major: row p*C + c."""
        self._check_fitted()
        n_problems, n_configs = len(problems), len(configs)
        problem_block = self.problem_features({c: problems[c].to_numpy()
                                               for c in self.schema.problem_names})
        config_block = self.config_features({c: configs[c].to_numpy()
                                             for c in self.schema.config_names})
        out = np.empty((n_problems * n_configs, len(self.names)), dtype=DTYPE)
        view = out.reshape(n_problems, n_configs, len(self.names))
        stops = np.cumsum([0, len(self.problem_names), len(self.config_names),
                           len(self.fit_names), len(self.device_names), len(self.wave_names)])
        view[:, :, stops[0]:stops[1]] = problem_block[:, None, :]
        view[:, :, stops[1]:stops[2]] = config_block[None, :, :]
        sizes = {p: np.repeat(problems[p].to_numpy(dtype=np.float64), n_configs)
                 for p in {p for p, _ in self.blocks.fit_pairs}
                 | {p for p, _, _ in self.part_fits_}}
        tiles = {c: np.tile(configs[c].to_numpy(dtype=np.float64), n_problems)
                 for _, c in self.blocks.fit_pairs}
        tiles.update({k: np.tile(v, n_problems) for k, v in self._part_tiles(
            {c: configs[c].to_numpy() for _, c, _ in self.part_fits_}).items()})
        if self.fit_names:
            out[:, stops[2]:stops[3]] = self.fit_features(sizes, tiles)
        device_row = self.device_features([device], device_table)[0]
        out[:, stops[3]:stops[4]] = device_row
        if self.wave_names:
            units = np.full(len(out), device_row[self.device_table.FEATURE_NAMES.index(
                COMPUTE_UNITS)])
            out[:, stops[4]:] = self.wave_features(sizes, tiles, units)
        return out

    # -- persistence ---------------------------------------------------------------------

    def to_json(self) -> dict:
        """The engine's part of feature_spec.json (the device table is stored apart)."""
        self._check_fitted()
        return {"schema": self.schema.to_json(), "categories": self.categories_,
                "choice_parts": self.use_parts, "feature_names": list(self.names),
                "categorical_features": self.categorical_indices,
                "max_problem_pairs": MAX_PROBLEM_PAIRS, "max_fit_pairs": MAX_FIT_PAIRS}

    @classmethod
    def from_json(cls, document: Mapping, device_table) -> "TableFeatures":
        """The engine stored by to_json; TableDataError when the stored feature names are not
        the ones this code derives from the stored schema (a model of another tilecast)."""
        engine = cls(TableSchema.from_json(document["schema"]), device_table,
                     categories=document["categories"],
                     parts=bool(document.get("choice_parts", False)))
        if list(document["feature_names"]) != engine.names:
            raise TableDataError("the model's feature names differ from the ones this tilecast "
                                 "derives from its schema; retrain the model with this version")
        return engine


def _stack(columns: list[np.ndarray], count: int) -> np.ndarray:
    if not columns:
        return np.empty((count, 0), dtype=np.float64)
    return np.column_stack([np.broadcast_to(c, (count,)) for c in columns])


def _distinct(frame: pd.DataFrame, columns: list[str], key: str) -> tuple[np.ndarray, dict]:
    """(row -> distinct index, column -> distinct values) of `frame[columns]`; by the `key`
    column (a dataset's dims_key or kernel, which spells those columns) when the frame has it:
    one string column factorizes faster than several."""
    if not columns:
        return np.zeros(len(frame), dtype=np.intp), {}
    if key in frame.columns:
        codes = pd.factorize(frame[key])[0]
    elif len(columns) == 1:
        codes = pd.factorize(frame[columns[0]])[0]
    else:
        codes = frame.groupby(columns, sort=False, dropna=False).ngroup().to_numpy()
    _, first = np.unique(codes, return_index=True)
    return codes, {c: frame[c].to_numpy()[first] for c in columns}

