"""The protocol every kernel family implements, and the value objects the stages pass around."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"


class FamilyError(ValueError):
    """Bad input for a family: an unknown kernel name, problem field or option."""


def table_choice(value, table, what: str, context: str):
    """value if it is a key of `table`, else FamilyError naming it, where, and the valid ones."""
    if value not in table:
        raise FamilyError(f"unknown {what} {value!r} in {context}; "
                          f"valid: {', '.join(map(str, table))}")
    return value


@dataclass(frozen=True)
class BuildSpec:
    """What the builder compiles for one candidate: a source file and its -D defines.
    `library_source`, where the family has one, is the in-process entry over the same kernel
    code, compiled with the same defines into a shared library (tilecast.stages.build, shared mode)."""
    source: Path
    defines: Mapping[str, int]
    include_dirs: tuple[Path, ...] = ()
    library_source: Path | None = None


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
    def unsupported_reason(self, config: Any, problem: Any) -> str | None: ...
    def prepare(self, problem: Any, directory: Path, seed: int) -> PreparedProblem: ...
    def read_output(self, prepared: PreparedProblem) -> np.ndarray: ...
    def tolerance(self, problem: Any) -> float: ...
    def slices(self, problem: Any) -> tuple[str, ...]: ...
    def flops(self, problem: Any) -> float: ...
    def bytes_moved(self, problem: Any) -> float: ...
    def peer(self, prepared: PreparedProblem, threads: int): ...
    def has_peer(self) -> bool: ...
    def feature_engine(self, hardware: Mapping) -> FeatureEngine: ...


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
