"""The one dataset schema: the columns every measurement row shares, with one name, one unit and
one meaning in both kinds of measurement dataset, defined here once.

tilecast has two kinds of measurement dataset: the pipeline's benchmark records
(tilecast.core.dataset.RECORD_COLUMNS, one row per record of a kernel measured on a problem in
one phase) and imported table datasets (tilecast.table.dataset.ROW_COLUMNS, one row per
configuration of a problem on a device). Both build their column tuples from
MEASUREMENT_COLUMNS below, plus each kind's own columns, so a shared concept cannot be spelled
two ways.

Where the machine was measured on is the one concept the two kinds rightly name differently
(MACHINE_COLUMNS): a record holds tilecast's `hardware` fingerprint of the machine it ran on,
an imported row the `device` its source names. They are different things, never joined.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeasurementColumn:
    """One column of a measurement row: its name, its unit ("" when it has none) and what it
    holds."""
    name: str
    unit: str
    meaning: str


# In the order both kinds hold them.
MEASUREMENT_COLUMNS = (
    MeasurementColumn("dims_key", "", "the problem's key: every shape field, one string; the "
                      "only join key between files and the group of a cross-validation"),
    MeasurementColumn("kernel", "", "the kernel's (configuration's) key: the kernel's name, or "
                      "an imported configuration's `name=value,...`"),
    MeasurementColumn("status", "", "what happened to it there: a code of tilecast.core.status."
                      "STATUS_TABLE; only `ok` makes its time count"),
    MeasurementColumn("reason", "", "why it is not ok, in words (the error, the source's "
                      "marker); \"\" when ok"),
    MeasurementColumn("samples_s", "s", "the times measured, in the order measured: its "
                      "length is how many measurements the row stands for. A record's samples "
                      "(each the mean of reps_per_sample back-to-back runs); an imported row's "
                      "usable repeats (positive, finite): the source rows of one slot, each "
                      "the time the source gives (its own average of its runs), or the per-run "
                      "times a source lists (Kernel Tuner's `times`). Empty when none is known; "
                      "a row that is not ok may hold times of its runs that did not fail, and "
                      "they never count"),
    MeasurementColumn("median_s", "s", "the row's time: the median of samples_s (a record's "
                      "finalist pools its phases' samples; a record whose every sample was "
                      "disturbed, of disturbed_samples_s). Two exceptions: a Kernel Tuner "
                      "entry holds Kernel Tuner's own `time` (the mean of its runs), and a "
                      "version-1 table dataset the time it was imported with. NaN when not ok"),
    MeasurementColumn("mad_s", "s", "the spread of samples_s: the median absolute deviation "
                      "from their median, unscaled (tilecast.core.stats.mad); 0 for one "
                      "sample, NaN when there is none or the row is not ok"),
)
MEASUREMENT_NAMES = tuple(c.name for c in MEASUREMENT_COLUMNS)

# Which machine a row was measured on: one column per kind, spelled apart on purpose.
MACHINE_COLUMNS = (
    MeasurementColumn("hardware", "", "a benchmark record's: the 12-hex fingerprint of the "
                      "machine it ran on (tilecast.core.hardware.fingerprint: CPU model, cores, "
                      "threads, caches, ISA)"),
    MeasurementColumn("device", "", "an imported row's: the device's name as its source gives "
                      "it (e.g. `NVIDIA A100-PCIE-40GB`), resolved against the device table "
                      "for features"),
)


def meaning(name: str) -> MeasurementColumn:
    """The definition of shared or machine column `name`; KeyError naming the valid ones."""
    for column in MEASUREMENT_COLUMNS + MACHINE_COLUMNS:
        if column.name == name:
            return column
    raise KeyError(f"no measurement column {name!r}; valid: "
                   f"{', '.join(c.name for c in MEASUREMENT_COLUMNS + MACHINE_COLUMNS)}")
