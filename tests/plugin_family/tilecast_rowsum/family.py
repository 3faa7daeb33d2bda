"""The rowsum family: y[i] = sum_j x[i, j] over the m rows of an fp32 matrix whose rows lie ld
apart (ld >= n: a row-major matrix, or a view of the first n columns of a wider one).

It is written the way a team outside tilecast writes a family: on tilecast's public pieces
only (the Family protocol and FamilyBase of tilecast.core.family, the harness header the
binary includes, EngineBase for features), with its own kernel source in this package, and
registered through its distribution's `tilecast.families` entry point.
"""
from __future__ import annotations

import ctypes
import itertools
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from tilecast.core.family import (KERNELS_DIR, BuildSpec, FamilyBase, FamilyError,
                                  PreparedProblem, integer_field, library_timer, reject_unknown,
                                  table_choice)

from tilecast_rowsum.features import RowsumFeatureEngine

SOURCES = Path(__file__).resolve().parent / "kernels"
HARNESS_DIR = KERNELS_DIR / "cpu" / "common"   # tilecast's harness.hpp, inprocess_entry.hpp

# The candidate space's tables: each value is one -D parameter of rowsum.cpp.
DTYPES = {"fp32": 1e-4}                  # dtype -> tolerance (norm-relative, vs float64)
ACCUMULATORS = (1, 2, 4, 8, 16)          # RS_ACC
ROWS = (1, 2, 4)                         # RS_ROWS
PARALLEL = {"serial": 0, "threads": 1}   # RS_PARALLEL
CANDIDATE_OPTIONS = ("dtype", "accumulators", "rows", "parallel")
# a problem's x and y at most this many bytes (fp32), so every count stays exact in float64
MAX_OPERAND_BYTES = 2 ** 40

NAME_RE = re.compile(r"^rowsum_(?P<dtype>[a-z0-9]+)_acc(?P<accumulators>\d+)"
                     r"_r(?P<rows>\d+)_(?P<parallel>[a-z]+)$")
NAME_GRAMMAR = "rowsum_{dtype}_acc{accumulators}_r{rows}_{serial|threads}"


@dataclass(frozen=True, order=True)
class RowsumConfig:
    """Every compile-time parameter of one rowsum binary."""
    dtype: str
    accumulators: int
    rows: int
    parallel: str


@dataclass(frozen=True, order=True)
class RowsumProblem:
    """m row sums of n values each, rows ld values apart."""
    m: int
    n: int
    ld: int


def validate_config(cfg: RowsumConfig) -> RowsumConfig:
    """cfg, or FamilyError naming the field, its value and the valid ones."""
    context = f"rowsum config {cfg}"
    table_choice(cfg.dtype, DTYPES, "dtype", context)
    table_choice(cfg.accumulators, ACCUMULATORS, "accumulators", context)
    table_choice(cfg.rows, ROWS, "rows", context)
    table_choice(cfg.parallel, PARALLEL, "parallel scheme", context)
    return cfg


class RowsumFamily(FamilyBase):
    """The rowsum family (see the module docstring)."""
    name = "rowsum"
    problem_fields = tuple(f.name for f in fields(RowsumProblem))
    config_fields = tuple(f.name for f in fields(RowsumConfig))
    CANDIDATE_OPTIONS = CANDIDATE_OPTIONS

    # -- names ---------------------------------------------------------------------------
    def kernel_name(self, cfg: RowsumConfig) -> str:
        """The variant's unique name; parse_name(kernel_name(cfg)) == cfg."""
        validate_config(cfg)
        return f"rowsum_{cfg.dtype}_acc{cfg.accumulators}_r{cfg.rows}_{cfg.parallel}"

    def parse_name(self, name: str) -> RowsumConfig:
        """The config a kernel name spells; FamilyError naming what is wrong otherwise."""
        match = NAME_RE.match(name)
        if not match:
            raise FamilyError(f"not a rowsum kernel name: {name!r}; expected {NAME_GRAMMAR}")
        parts = match.groupdict()
        cfg = RowsumConfig(parts["dtype"], int(parts["accumulators"]), int(parts["rows"]),
                           parts["parallel"])
        try:
            return validate_config(cfg)
        except FamilyError as err:
            raise FamilyError(f"invalid kernel name {name!r}: {err}") from None

    # -- candidates ----------------------------------------------------------------------
    def candidate_space(self, options: Mapping[str, Sequence], hardware: Mapping) -> list:
        """Every variant the options allow (each option a list of its table's values;
        default: the whole table), sorted. Every variant runs on every x86 CPU."""
        reject_unknown(options, CANDIDATE_OPTIONS, "rowsum candidate option")
        chosen = {"dtype": list(DTYPES), "accumulators": list(ACCUMULATORS),
                  "rows": list(ROWS), "parallel": list(PARALLEL)}
        chosen.update({key: list(values) for key, values in options.items() if values})
        configs = {validate_config(RowsumConfig(*values)) for values in itertools.product(
            chosen["dtype"], chosen["accumulators"], chosen["rows"], chosen["parallel"])}
        return sorted(configs)

    def build_spec(self, cfg: RowsumConfig) -> BuildSpec:
        validate_config(cfg)
        return BuildSpec(source=SOURCES / "rowsum.cpp", include_dirs=(HARNESS_DIR,),
                         defines={"RS_ACC": cfg.accumulators, "RS_ROWS": cfg.rows,
                                  "RS_PARALLEL": PARALLEL[cfg.parallel]},
                         library_source=SOURCES / "rowsum_lib.cpp",
                         unit=SOURCES / "rowsum_variant.cpp")

    # -- problems ------------------------------------------------------------------------
    def problem(self, values: Mapping[str, Any]) -> RowsumProblem:
        """A RowsumProblem from a mapping (config entry, `k=v` pairs, dataset row); ld
        defaults to n (a plain row-major matrix)."""
        reject_unknown(values, self.problem_fields, "rowsum problem field")
        missing = [name for name in ("m", "n") if name not in values]
        if missing:
            raise FamilyError(f"rowsum problem is missing field(s) {missing} in {dict(values)}")
        m = integer_field("rowsum problem", "m", values["m"], minimum=1)
        n = integer_field("rowsum problem", "n", values["n"], minimum=1)
        ld = integer_field("rowsum problem", "ld", values.get("ld", n), minimum=1)
        if ld < n:
            raise FamilyError(f"rowsum problem field ld={ld} must be >= n={n} (rows overlap)")
        if 4 * (m * ld + m) > MAX_OPERAND_BYTES:
            raise FamilyError(f"rowsum problem m={m}, ld={ld}: its operands take more than "
                              f"{MAX_OPERAND_BYTES} bytes")
        return RowsumProblem(m, n, ld)

    def applicability_key(self, problem: RowsumProblem):
        """Every variant runs every problem: one candidate mask for all."""
        return "all"

    def unsupported_reason(self, cfg: RowsumConfig, problem: RowsumProblem) -> str | None:
        return None   # the remainder rows and columns have their own loops

    def slices(self, problem: RowsumProblem) -> tuple[str, ...]:
        """Report slices: short rows (a few vectors), and strided rows (ld > n)."""
        tags = ["short_rows" if problem.n <= 64 else "long_rows"]
        if problem.ld > problem.n:
            tags.append("strided")
        return tuple(tags)

    def flops(self, problem: RowsumProblem) -> float:
        return float(problem.m * problem.n)

    def bytes_moved(self, problem: RowsumProblem) -> float:
        return 4.0 * (problem.m * problem.n + problem.m)

    def operand_bytes(self, values: Mapping[str, Any]) -> int:
        """x (fp32, m x ld), y (fp32) and y's float64 reference."""
        p = self.problem(values)
        return 4 * p.m * p.ld + (4 + 8) * p.m

    def tolerance(self, problem: RowsumProblem) -> float:
        return DTYPES["fp32"]

    # -- inputs, reference, peer ---------------------------------------------------------
    def prepare(self, problem: RowsumProblem, directory: Path, seed: int) -> PreparedProblem:
        """Write x (m x ld, fp32) and compute the float64 torch reference of its row sums."""
        import torch   # only preparing a problem needs torch

        directory.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(problem.m, problem.ld, generator=generator)
        reference = x[:, :problem.n].double().sum(dim=1).numpy()
        x_path, y_path = directory / "x.bin", directory / "y.bin"
        x.numpy().tofile(x_path)
        job = (str(problem.m), str(problem.n), str(problem.ld), str(x_path), str(y_path))
        return PreparedProblem(problem=problem, job_args=job, output_path=y_path,
                               reference=reference, tensors={"x": x[:, :problem.n]})

    def output_tensor(self, prepared: PreparedProblem):
        """y for the interleaved protocol: m fp32 values, shared by a problem's candidates."""
        import torch

        return torch.empty(prepared.problem.m, dtype=torch.float32)

    def timer(self, library: Path, prepared: PreparedProblem, threads: int, output):
        """time(reps) -> seconds per call through the variant's in-process library
        (`tilecast_rowsum_time`, rowsum_lib.cpp) on the prepared x, writing y into `output`:
        what tilecast's interleaved protocol times candidates side by side with."""
        entry = ctypes.CDLL(str(library)).tilecast_rowsum_time
        index = ctypes.c_longlong
        entry.argtypes = [ctypes.c_void_p, index, index, index, ctypes.c_void_p, ctypes.c_int,
                          ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, index]
        entry.restype = ctypes.c_int
        p, x = prepared.problem, prepared.tensors["x"]   # x: the first n columns, rows ld apart
        return library_timer(entry, (x.data_ptr(), p.m, p.n, p.ld, output.data_ptr()), threads,
                             owners=(x, output))

    def peer(self, prepared: PreparedProblem, threads: int):
        """torch.sum over the same rows with the same thread count: (name, callable)."""
        import torch

        torch.set_num_threads(threads)
        x = prepared.tensors["x"]
        out = torch.empty(prepared.problem.m, dtype=torch.float32)
        return "torch.sum", lambda: torch.sum(x, dim=1, out=out)

    def feature_engine(self, hardware: Mapping) -> RowsumFeatureEngine:
        return RowsumFeatureEngine(hardware)


FAMILY = RowsumFamily()
