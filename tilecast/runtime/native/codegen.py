"""The native scorer's feature formulas, generated from a family's one definition
(tilecast.features.<family>.formulas) as a C++ header that gemm_features.cpp includes.

    python -m tilecast.runtime.native.generate           # rewrite the checked-in headers
    python -m tilecast.runtime.native.generate --check   # exit 1 when one is stale

Problem-wide nodes (no kernel column) are computed once per problem in `problem_terms`;
the others once per candidate in `row_features<fast>`, which the plumbing runs with `fast`
(-floor(-a / b) for ceil_div, flagging any operand for which that could differ from numpy's
floor division) and reruns exact when flagged. A log2 feature's argument goes to `logs` for
numpy's own log2 (see gemm_features.cpp). NativeGemmFeatures refuses to run a header that
differs from what the definition generates now, and tests/test_feature_formulas.py fails.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from tilecast.features.formula import OPS, Expr, Formula, topological
from tilecast.features.hardware import HARDWARE_FEATURES

NATIVE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Layout:
    """Where each feature goes: the engine's column order (problem, kernel, interaction,
    hardware), and the log2 features' places in `logs` (problem-wide ones first, then one
    block of rows per per-candidate one)."""
    inputs: tuple[str, ...]
    kernel_names: tuple[str, ...]
    columns: dict[str, int]
    scalar_logs: tuple[str, ...]
    row_logs: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """What the generator needs of a family's definition."""
    name: str                      # the header is <name>_features_formulas.hpp
    engine: str                    # "<engine name> v<version>", for the banner
    inputs: tuple[str, ...]        # the problem fields, in the order of `in`
    problem: Mapping[str, Formula]
    kernel_names: tuple[str, ...]
    interaction: Mapping[str, Formula]


def gemm() -> Family:
    """The GEMM definition (tilecast.features.gemm)."""
    from tilecast.features import gemm as definition
    engine = definition.GemmFeatureEngine
    return Family("gemm", f"{engine.name} v{engine.version}", tuple(definition.FIELD_CODES),
                  definition.PROBLEM_FORMULAS, definition.KERNEL_FEATURES,
                  definition.INTERACTION_FORMULAS)


FAMILIES = {"gemm": gemm}


def header_path(family: Family) -> Path:
    return NATIVE_DIR / f"{family.name}_features_formulas.hpp"


def _depends_on_kernel(nodes: Sequence[Expr]) -> set[int]:
    row: set[int] = set()
    for node in nodes:   # topological: operands first
        if node.op == "kernel" or any(id(arg) in row for arg in node.args):
            row.add(id(node))
    return row


def layout(family: Family) -> Layout:
    """The column and log placement of `family`'s features."""
    formulas = {**family.problem, **family.interaction}
    names = [*family.problem, *family.kernel_names, *family.interaction, *HARDWARE_FEATURES]
    row = _depends_on_kernel(topological({n: f.graph for n, f in formulas.items()}))
    logs = [name for name, formula in formulas.items() if formula.log2]
    return Layout(family.inputs, tuple(family.kernel_names),
                  {name: i for i, name in enumerate(names)},
                  tuple(n for n in logs if id(formulas[n].graph) not in row),
                  tuple(n for n in logs if id(formulas[n].graph) in row))


def _literal(value: float) -> str:
    text = repr(float(value))
    return f"({text})" if value < 0 else text


def header(family: Family) -> str:
    """The C++ header of `family`'s formulas; see the module docstring."""
    formulas = {**family.problem, **family.interaction}
    place = layout(family)
    nodes = topological({n: f.graph for n, f in formulas.items()})
    row = _depends_on_kernel(nodes)
    number = {id(node): i for i, node in enumerate(nodes)}
    # the problem-wide values a per-candidate node reads
    terms = [node for node in nodes if id(node) not in row and node.op != "const"
             and any(id(a) == id(node) for r in nodes if id(r) in row for a in r.args)]
    term_of = {id(node): i for i, node in enumerate(terms)}

    def operand(node: Expr, in_rows: bool) -> str:
        if node.op == "const":
            return _literal(node.value)
        if in_rows and id(node) in term_of:
            return f"p{term_of[id(node)]}"
        if node.op == "input":
            return f"in[{family.inputs.index(node.name)}]"
        if node.op == "hardware":
            return f"hw[{HARDWARE_FEATURES.index(node.name)}]"
        if node.op == "kernel":
            return f"kernel_{node.name}"
        return f"v{number[id(node)]}"

    def statements(in_rows: bool, indent: str) -> list[str]:
        return [f"{indent}const double v{number[id(node)]} = "
                + OPS[node.op].cpp_template.format(*(operand(a, in_rows) for a in node.args))
                + ";" for node in nodes
                if node.op in OPS and (id(node) in row) == in_rows]

    problem_code = statements(False, "  ")
    problem_code += [f"  terms[{i}] = {operand(node, False)};" for i, node in enumerate(terms)]
    row_code = []
    for name, formula in formulas.items():
        value = operand(formula.graph, id(formula.graph) in row)
        if id(formula.graph) in row:
            target = (f"row_logs[{place.row_logs.index(name)} * n_rows + r]" if formula.log2
                      else f"out[{place.columns[name]} * stride + r]")
            row_code.append(f"    {target} = {value};  // {name}")
        elif formula.log2:
            problem_code.append(f"  logs[{place.scalar_logs.index(name)}] = {value};  // {name}")
        else:
            problem_code.append(f"  for (int64_t r = 0; r < n_rows; ++r) "
                                f"out[{place.columns[name]} * stride + r] = {value};  // {name}")
    kernels_read = sorted({node.name for node in nodes if node.op == "kernel"},
                          key=family.kernel_names.index)
    loads = [f"    const double kernel_{name} = kernels[{family.kernel_names.index(name)} "
             f"* kstride + r];" for name in kernels_read]
    term_loads = [f"  const double p{i} = terms[{i}];" for i in range(len(terms))]

    def numbers(values) -> str:
        return "{" + ", ".join(str(v) for v in values) + "}"

    first = {"kernel": len(family.problem),
             "interaction": len(family.problem) + len(family.kernel_names)}
    return f"""// Generated by `python -m tilecast.runtime.native.generate` from the {family.name} \
feature
// formulas (tilecast.features.{family.name}, engine {family.engine}). Do not edit: change the
// formulas and run it again (tests/test_feature_formulas.py fails while this file is stale).
// Operations are spelled by tilecast.features.formula.OPS (cpp); the helpers are
// gemm_features.cpp's.

namespace formulas {{

// column blocks of the engine's order: problem, kernel, interaction, hardware
constexpr int64_t kColumns = {len(place.columns)};
constexpr int64_t kKernel = {first['kernel']}, kKernelCount = {len(family.kernel_names)};
constexpr int64_t kInputs = {len(family.inputs)}, kHardwareCount = {len(HARDWARE_FEATURES)};
constexpr int64_t kTerms = {max(1, len(terms))};
// `logs` holds kScalarLogs problem-wide log2 arguments, then kRowLogs blocks of n_rows
constexpr int64_t kScalarLogs = {len(place.scalar_logs)}, kRowLogs = {len(place.row_logs)};
constexpr int64_t kScalarLogColumns[kScalarLogs] = \
{numbers(place.columns[n] for n in place.scalar_logs)};
constexpr int64_t kRowLogColumns[kRowLogs] = {numbers(place.columns[n] for n in place.row_logs)};

// The problem-wide features of `in` ({', '.join(family.inputs)}) and the hardware
// vector `hw`: raw ones into every row of `out`, log2 arguments into logs[0, kScalarLogs),
// and the values row_features reads into `terms`.
inline void problem_terms(const double* in, const double* hw, double* __restrict terms,
                          double* __restrict out, int64_t stride, int64_t n_rows,
                          double* __restrict logs) {{
  constexpr bool fast = false;  // once per problem: numpy's algorithm
  int whole = 1;
  (void)whole;
  (void)hw;
{chr(10).join(problem_code)}
}}

// The per-candidate features of n_rows kernels (kernel column c of row r at
// kernels[c * kstride + r]) into `out`, their log2 arguments into row_logs. Returns 0 when
// a fast ceil_div met an operand where it could differ from numpy's (then rerun exact).
template <bool fast>
inline int row_features(const double* __restrict terms, const double* __restrict kernels,
                        int64_t kstride, int64_t n_rows, double* __restrict out,
                        int64_t stride, double* __restrict row_logs) {{
  int whole = 1;
{chr(10).join(term_loads)}
  // the output columns never overlap (stride >= n_rows): ivdep spares the alias checks
#pragma GCC ivdep
  for (int64_t r = 0; r < n_rows; ++r) {{
{chr(10).join(loads)}
{chr(10).join(statements(True, "    "))}
{chr(10).join(row_code)}
  }}
  return whole;
}}

}}  // namespace formulas
"""
