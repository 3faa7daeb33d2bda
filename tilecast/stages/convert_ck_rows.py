"""The one parser of a CK tile-engine grouped-conv benchmark CSV, which both of its readers
build on: `tilecast convert --from ck-csv` (convert_ck: records of the grouped-conv families)
and `tilecast import --from ck-csv` (table.formats.ck_csv: a table dataset).

`parse_conv_csv` takes the CSV as read (every field a string) and gives one row per CSV row:
its line (the header is line 1), kernel name, shape, latency in seconds, non_zero, and the
tile engine's own TFLOP/s, with each kernel name parsed once by the grouped-conv families'
parser. What is wrong with the file as a whole is a DatasetError naming the file, the rows
and the column: a missing column, no rows, a blank or unknown kernel name, a shape field that
is not a whole number, a non_zero that is not a boolean. A latency that is not a positive
finite number is not an error here: the row says so (`latency_s` NaN, `latency_ms` as
written), and each reader decides (convert leaves the row out, import refuses the file).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tilecast.core.dataset import DatasetError
from tilecast.core.family import FamilyError
from tilecast.families.grouped_conv import SPATIAL_D_DEFAULTS
from tilecast.spaces.grouped_conv import parse_kernel_name

CK_COLUMNS = ("kernel", "problem_idx", "N", "C", "K", "G", "Di", "Hi", "Wi", "Z", "Y", "X",
              "stride_d", "stride_h", "stride_w", "pad_d", "pad_h", "pad_w", "dilation_d",
              "dilation_h", "dilation_w", "latency_ms", "tflops", "non_zero")
SHAPE_COLUMNS = CK_COLUMNS[2:21]
# what the parser reads: problem_idx is generation order (never a key; the seed's lesson) and
# tflops the tile engine's own figure, kept where the file has it
READ_COLUMNS = ("kernel", *SHAPE_COLUMNS, "latency_ms", "non_zero")
TRUE_VALUES, FALSE_VALUES = {"true", "1", "1.0", "yes"}, {"false", "0", "0.0", "no"}
FIRST_LINE = 2      # line 1 is the header
# how many rows a message names before "..."
SHOWN_ROWS = 10
EXPECTED = "expected a CK tile-engine benchmark CSV"


@dataclass(frozen=True)
class ConvCsv:
    """A parsed grouped-conv CSV: `rows` has `line`, `kernel`, the SHAPE_COLUMNS (int, None
    where blank; a 2D kernel's blank depth fields hold the 2D values), `latency_s` (NaN where
    `latency_ms`, kept as written, is not a positive finite number), `non_zero` (bool) and
    `source_tflops` (NaN where not a number or absent); `configs` maps each kernel name to
    its parsed configuration."""
    path: Path
    rows: pd.DataFrame
    configs: dict[str, Any]

    def unusable(self) -> list[tuple[int, str]]:
        """(CSV line, latency_ms as written) of each row without a usable latency."""
        bad = self.rows[self.rows["latency_s"].isna()]
        return list(zip(bad["line"].tolist(), bad["latency_ms"].tolist()))


def rows_named(lines: list[tuple[int, object]]) -> str:
    """`line (value), ...` of at most SHOWN_ROWS rows, then how many in all."""
    shown = ", ".join(f"{line} ({value})" for line, value in lines[:SHOWN_ROWS])
    return shown + (f", ... ({len(lines)} in all)" if len(lines) > SHOWN_ROWS else "")


def read_conv_csv(path: Path) -> pd.DataFrame:
    """The CSV at `path`, every field a string; DatasetError naming the file when it does not
    exist, is a directory, binary, not UTF-8, empty or not well-formed."""
    if not path.exists():
        raise DatasetError(f"CK tile-engine CSV {path} does not exist")
    if path.is_dir():
        raise DatasetError(f"{path} is a directory; {EXPECTED}")
    try:
        with open(path, "rb") as handle:
            head = handle.read(1 << 16)
    except OSError as err:
        raise DatasetError(f"cannot read {path}: {err.strerror or err}") from None
    nul = head.find(b"\0")
    if nul >= 0:
        raise DatasetError(f"{path}: binary data (a NUL byte at offset {nul}), not CSV text; "
                           f"{EXPECTED}")
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except pd.errors.EmptyDataError:
        raise DatasetError(f"{path}: empty file; {EXPECTED}") from None
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at "
                           f"offset {err.start}); {EXPECTED}") from None
    except pd.errors.ParserError as err:
        raise DatasetError(f"{path}: not a well-formed CSV ({str(err).strip()}); "
                           f"{EXPECTED}") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    return frame


def parse_conv_csv(path: Path, frame: pd.DataFrame) -> ConvCsv:
    """The rows of grouped-conv CSV `frame` (read from `path`, every field a string); see the
    module docstring."""
    missing = [c for c in READ_COLUMNS if c not in frame.columns]
    if missing:
        raise DatasetError(f"{path}: missing column(s) {missing}; a CK tile-engine grouped-conv "
                           f"CSV has {', '.join(CK_COLUMNS)}")
    if frame.empty:
        raise DatasetError(f"{path}: no benchmark rows")
    frame = frame.reset_index(drop=True)
    text = {c: frame[c].astype(str).str.strip() for c in READ_COLUMNS}
    lines = pd.Series(range(FIRST_LINE, FIRST_LINE + len(frame)))
    names = text["kernel"]
    if (names == "").any():
        raise DatasetError(f"{path}: column kernel: blank kernel name at row(s) "
                           f"{rows_named(list(zip(lines[names == ''], names[names == ''])))}")
    configs = _configs(path, names)
    rows = pd.DataFrame({"line": lines, "kernel": names})
    two_d = names.map(lambda name: configs[name].ndim_spatial == 2)
    for column in SHAPE_COLUMNS:
        rows[column] = _whole_numbers(path, column, text[column], lines,
                                      SPATIAL_D_DEFAULTS.get(column), two_d)
    latency_ms = pd.to_numeric(text["latency_ms"], errors="coerce")
    rows["latency_s"] = (latency_ms / 1e3).where((latency_ms > 0) & np.isfinite(latency_ms))
    rows["latency_ms"] = text["latency_ms"]
    truth = text["non_zero"].str.lower()
    unknown = ~truth.isin(TRUE_VALUES | FALSE_VALUES)
    if unknown.any():
        raise DatasetError(f"{path}: column non_zero: not a boolean (true/false/1/0) at row(s) "
                           f"{rows_named(list(zip(lines[unknown], frame['non_zero'][unknown])))}")
    rows["non_zero"] = truth.isin(TRUE_VALUES)
    tflops = (pd.to_numeric(frame["tflops"].astype(str).str.strip(), errors="coerce")
              if "tflops" in frame.columns else pd.Series(math.nan, index=frame.index))
    rows["source_tflops"] = tflops.where(np.isfinite(tflops))
    return ConvCsv(path=path, rows=rows, configs=configs)


def _configs(path: Path, names: pd.Series) -> dict[str, Any]:
    """Each kernel name parsed once; DatasetError naming every name no family knows."""
    configs, unknown = {}, {}
    for name in dict.fromkeys(names):
        try:
            configs[name] = parse_kernel_name(name)
        except FamilyError as err:
            unknown[name] = str(err)
    if unknown:
        shown = list(unknown)[:5]
        raise DatasetError(f"{path}: {len(unknown)} unknown kernel name(s), e.g. {shown} "
                           f"(first: {unknown[shown[0]]}); no file written")
    return configs


def _whole_numbers(path: Path, column: str, text: pd.Series, lines: pd.Series,
                   two_d_value: int | None, two_d: pd.Series) -> pd.Series:
    """Shape column `column` as ints (None where blank; a 2D kernel's blank depth field takes
    `two_d_value`); DatasetError naming the first row whose field is not a whole number."""
    if two_d_value is not None:
        text = text.mask((text == "") & two_d, str(two_d_value))
    numbers = pd.to_numeric(text.where(text != ""), errors="coerce")
    whole = numbers.notna() & np.isfinite(numbers) & (numbers == np.floor(numbers))
    bad = (text != "") & ~whole
    if bad.any():
        first = bad.idxmax()
        raise DatasetError(f"{path} row {lines[first]}: bad shape field ({column}="
                           f"{text[first]!r} is not a whole number)")
    return pd.Series([int(n) if w else None for n, w in zip(numbers, whole)], dtype=object)
