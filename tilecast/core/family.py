"""The protocol every kernel family implements (tilecast.families holds the families), and the
value objects the stages pass around: the ground floor's contract, importing nothing above it."""
from __future__ import annotations

import operator

import ctypes
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Mapping, Protocol, Sequence

import numpy as np

from tilecast.core import resources

#: the kernel sources, in a checkout or an installed package (tilecast.core.resources)
KERNELS_DIR = resources.kernels_dir()


class FamilyError(ValueError):
    """Bad input for a family: an unknown kernel name, problem field or option."""


def table_choice(value, table, what: str, context: str):
    """value if it is a key of `table`, else FamilyError naming it, where, and the valid ones."""
    if value not in table:
        raise FamilyError(f"unknown {what} {value!r} in {context}; "
                          f"valid: {', '.join(map(str, table))}")
    return value


def reject_unknown(given: Iterable[str], valid: Sequence[str], what: str) -> None:
    """FamilyError naming the keys of `given` that are not in `valid` (problem fields,
    candidate options), and the valid ones."""
    unknown = set(given) - set(valid)
    if unknown:
        raise FamilyError(f"unknown {what}(s) {sorted(unknown)}; valid: {', '.join(valid)}")


def integer_field(context: str, name: str, value, minimum: int | None = None) -> int:
    """`value` as an int when it is a whole number (an int, a numpy integer, "64", 64.0), else
    FamilyError naming `context` field `name` and the value; also when below `minimum`."""
    if isinstance(value, bool):
        raise FamilyError(f"{context} field {name}={value!r} is not an integer")
    try:
        # an int stays exact (float() would round above 2**53); "64" and 64.0 are whole too
        number = operator.index(value)
    except TypeError:
        try:
            as_float = float(value)
        except (TypeError, ValueError, OverflowError):
            as_float = float("nan")
        if not as_float.is_integer() or abs(as_float) >= 2 ** 53:
            raise FamilyError(f"{context} field {name}={value!r} is not an integer") from None
        number = int(as_float)
    if minimum is not None and number < minimum:
        raise FamilyError(f"{context} field {name}={number} must be >= {minimum}")
    return number


@dataclass(frozen=True)
class SharedUnit:
    """A translation unit that many variants link beside their own `unit`: compiled once
    for every variant with the same `defines` (a subset of theirs), into `<stem>-<key>.o`
    (gemm: the GEMV-class path, one object per dtype, ISA, scheme and prefetch)."""
    source: Path
    defines: Mapping[str, int]
    stem: str


@dataclass(frozen=True)
class BuildSpec:
    """What the builder compiles for one candidate: a source file and its -D defines.
    `library_source`, where the family has one, is the in-process entry over the same kernel
    code, compiled with the same defines into a shared library (tilecast.core.build, shared mode).
    `unit`, where the family has one, is both in one translation unit: the builder compiles it
    once into an object and links the executable and the library from it, with the objects
    of `shared_units` (the code the unit leaves to them)."""
    source: Path
    defines: Mapping[str, int]
    include_dirs: tuple[Path, ...] = ()
    library_source: Path | None = None
    unit: Path | None = None
    shared_units: tuple[SharedUnit, ...] = ()


@dataclass(frozen=True)
class PreparedProblem:
    """Input files of one problem on disk, the job tokens a kernel binary reads, and the
    torch reference its output is checked against."""
    problem: Any
    job_args: tuple[str, ...]      # tokens after the job id, output path last
    output_path: Path
    reference: np.ndarray
    tensors: Mapping[str, Any] = field(default_factory=dict)  # torch tensors for the peer


class FeatureEngine(Protocol):
    """Turns (problem, kernel) pairs into a numeric matrix with a fixed, named column order."""
    name: str
    version: int

    def feature_names(self) -> list[str]: ...

    def kernel_features(self, configs: Sequence[Any]) -> np.ndarray: ...

    def problem_features(self, problem: Any) -> np.ndarray: ...

    def combine(self, problem: Any, problem_row: np.ndarray, kernel_matrix: np.ndarray,
                configs: Sequence[Any]) -> np.ndarray: ...


class Family(Protocol):
    """One kernel family: candidates, names, build, inputs, reference, counts, features."""
    name: str
    problem_fields: tuple[str, ...]
    config_fields: tuple[str, ...]

    def candidate_space(self, options: Mapping[str, Sequence], hardware: Mapping) -> list: ...
    def kernel_name(self, config: Any) -> str: ...
    def parse_name(self, name: str) -> Any: ...
    def config_dict(self, config: Any) -> dict: ...
    def build_spec(self, config: Any) -> BuildSpec: ...
    def problem(self, fields: Mapping[str, Any]) -> Any: ...
    def problem_dict(self, problem: Any) -> dict: ...
    def dims_key(self, problem: Any) -> str: ...
    def applicable(self, config: Any, problem: Any) -> bool: ...
    def applicability_key(self, problem: Any) -> Hashable | None: ...
    def unsupported_reason(self, config: Any, problem: Any) -> str | None: ...
    def prepare(self, problem: Any, directory: Path, seed: int) -> PreparedProblem: ...
    def read_output(self, prepared: PreparedProblem) -> np.ndarray: ...
    def tolerance(self, problem: Any) -> float: ...
    def slices(self, problem: Any) -> tuple[str, ...]: ...
    def flops(self, problem: Any) -> float: ...
    def bytes_moved(self, problem: Any) -> float: ...
    def operand_bytes(self, values: Mapping[str, Any]) -> int: ...
    def peer(self, prepared: PreparedProblem, threads: int): ...
    def has_peer(self) -> bool: ...
    def feature_engine(self, hardware: Mapping) -> FeatureEngine: ...


class FamilyBase:
    """The defaults every family shares; a family subclasses it, sets `name`,
    `problem_fields` and `config_fields`, and overrides what it does differently."""
    name: str
    problem_fields: tuple[str, ...]
    config_fields: tuple[str, ...]

    @property
    def dims_fields(self) -> tuple[str, ...]:
        """The problem fields `dims_key` spells (all of them unless the family fixes some)."""
        return self.problem_fields

    def config_dict(self, config: Any) -> dict:
        """The config's fields as a plain dict (a dataset row's kernel columns)."""
        return asdict(config)

    def problem_dict(self, problem: Any) -> dict:
        """The problem's fields as a plain dict; `problem(problem_dict(p)) == p`."""
        return asdict(problem)

    def dims_key(self, problem: Any) -> str:
        """Canonical `field=value,...` string of `dims_fields`: the join key and CV group."""
        return ",".join(f"{name}={getattr(problem, name)}" for name in self.dims_fields)

    def applicable(self, config: Any, problem: Any) -> bool:
        """Whether the kernel is a candidate for the problem at all. Default: it has no
        unsupported_reason; a family whose reasons are costly (or cover more than the
        kernel's own limits) overrides this with a check on fields alone."""
        return self.unsupported_reason(config, problem) is None

    def applicability_key(self, problem: Any) -> Hashable | None:
        """What `applicable` reads of a problem: equal keys must give equal candidate masks,
        so a dispatcher computes one mask per key. None: no such key, masks per query."""
        return None

    def read_output(self, prepared: PreparedProblem) -> np.ndarray:
        """The kernel's float32 output in the reference's shape (see read_float32_output)."""
        return read_float32_output(prepared)

    def has_peer(self) -> bool:
        """Whether the peer can run here; by default it is torch, always importable."""
        return True


def library_timer(entry, leading_args: Sequence, threads: int,
                  owners: Sequence = ()) -> Callable[[int], float]:
    """time(reps) -> seconds per call through an in-process entry point whose arguments end
    in (threads, reps, double* seconds, char* message, message length) and which returns a
    nonzero status on failure: RuntimeError with its status and message then. `owners` are
    the buffers the pointers in `leading_args` point into: the timer keeps them alive."""
    seconds = ctypes.c_double()
    message = ctypes.create_string_buffer(512)

    def time_calls(reps: int) -> float:
        status = entry(*leading_args, threads, reps, ctypes.byref(seconds), message,
                       len(message))
        if status != 0:
            raise RuntimeError(f"status {status}: {message.value.decode(errors='replace')}")
        return seconds.value

    time_calls.owners = tuple(owners)  # the buffers live as long as the timer
    return time_calls


def read_float32_output(prepared: PreparedProblem) -> np.ndarray:
    """The kernel's raw float32 output file in the reference's shape; FamilyError naming the
    file and both sizes when it holds another number of floats (a truncated or foreign file)."""
    expected = prepared.reference.shape
    data = np.fromfile(prepared.output_path, dtype=np.float32)
    if data.size != int(np.prod(expected)):
        raise FamilyError(f"kernel output {prepared.output_path} holds {data.size} floats, "
                          f"expected {int(np.prod(expected))} {tuple(expected)}")
    return data.reshape(expected)


def norm_relative_error(output: np.ndarray, reference: np.ndarray) -> float:
    """||output - reference||_F / ||reference||_F in float64; inf when shapes differ or the
    output holds NaN/inf, so a broken kernel can never pass the tolerance."""
    if output.shape != reference.shape:
        return float("inf")
    out = output.astype(np.float64, copy=False)
    if not np.all(np.isfinite(out)):
        return float("inf")
    ref = reference.astype(np.float64, copy=False)
    denom = float(np.linalg.norm(ref))
    diff = float(np.linalg.norm(out - ref))
    return diff / denom if denom > 0 else diff
