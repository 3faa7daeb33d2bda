"""The formats `tilecast import --from` reads: an explicit table of format name -> reader
module, each with `read(paths, *, mapping, device) -> Imported` (formats/common.py). A module
that takes a mapping also has `load_mapping(path)`. The modules are imported when used, so
that naming the formats (the command line's choices) costs nothing.
"""
from __future__ import annotations

import importlib
from types import ModuleType

READERS = {
    "kernel-tuner": "tilecast.table.formats.kernel_tuner",    # cache files, T4 results
    "autoheuristic": "tilecast.table.formats.autoheuristic",  # PyTorch Inductor data files
    "ck-csv": "tilecast.table.formats.ck_csv",                # CK tile-engine GEMM, grouped conv
    "table": "tilecast.table.formats.generic",                # any CSV/parquet + YAML mapping
}


def reader(name: str) -> ModuleType:
    """The reader module of format `name`; TableDataError naming the valid formats."""
    if name not in READERS:
        from tilecast.table.dataset import TableDataError

        raise TableDataError(f"unknown format {name!r}; valid: {', '.join(READERS)}")
    return importlib.import_module(READERS[name])
