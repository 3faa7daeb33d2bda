"""What `tilecast export` needs of the GEMM family besides its feature formulas, which are
the engine's own (tilecast.features.gemm.formulas, GemmFeatureEngine version 2): the
selector's arguments, the problems it accepts and which kernels apply to one (the problem's
dtype: its code is the applicability key).

The kernel features and the hardware features are taken from the engine itself (the
hardware ones as constants). WRITTEN_FOR names the engine the definition belongs to: a
model of any other engine (another version, other feature names) is refused rather than
exported with formulas that are not its own.

Problems are GemmFamily.problem's: m, n, k >= 1 with A, B and C (fp32) at most
MAX_OPERAND_BYTES, so every size and byte count is a whole number below 2**53 and exact in
float64; log2 is left to the exporter (its splits compare the argument, see
tilecast.runtime.export.forest).
"""
from __future__ import annotations

from tilecast.families.gemm import MAX_OPERAND_BYTES
from tilecast.features import gemm as definition
from tilecast.features.formula import Expr, Formula, problem_field
from tilecast.features.gemm import (DTYPE_CODES, INTERACTION_FEATURES, KERNEL_FEATURES,
                                    LAYOUT_CODES, PROBLEM_FEATURES)
from tilecast.features.hardware import HARDWARE_FEATURES

__all__ = ["DTYPE_CODES", "LAYOUT_CODES", "KERNEL_FEATURES"]  # the selector reads these here

_ENGINE = definition.GemmFeatureEngine
WRITTEN_FOR = (_ENGINE.name, _ENGINE.version, (*PROBLEM_FEATURES, *KERNEL_FEATURES,
                                               *INTERACTION_FEATURES, *HARDWARE_FEATURES))
FAMILY = "gemm"

# The selector's arguments, in order: (name, C type, codes or None), the formulas' inputs.
# A coded field takes the index of its value (dtype: its TC_DTYPE code).
C_TYPES = {"m": "int64_t", "n": "int64_t", "k": "int64_t"}
INPUTS = tuple((name, C_TYPES.get(name, "int"), codes)
               for name, codes in definition.FIELD_CODES.items())
# what GemmFamily.problem accepts: every size >= 1 and 4 * (mk + kn + mn) <= MAX_OPERAND_BYTES
LIMITS = {"min_size": 1, "max_operand_elements": MAX_OPERAND_BYTES // 4}


def c_validation() -> str:
    """The C body of tc_valid(m, n, k, dtype, layout_a, layout_b): 1 when GemmFamily.problem
    accepts the problem, else 0 (every problem it accepts is within the selector's exact
    range). The products are checked by division first, so nothing overflows."""
    codes = "\n".join(
        f"  if ({' && '.join(f'{name} != {code}' for code in sorted(set(table.values())))}) "
        "return 0;" for name, _, table in INPUTS if table)
    return f"""  /* every size >= {LIMITS['min_size']}; A, B and C (fp32) within \
{MAX_OPERAND_BYTES} bytes:
     mk + kn + mn <= {LIMITS['max_operand_elements']} */
  const uint64_t limit = UINT64_C({LIMITS['max_operand_elements']});
  uint64_t um, un, uk;
  if (m < {LIMITS['min_size']} || n < {LIMITS['min_size']} || k < {LIMITS['min_size']}) return 0;
  um = (uint64_t)m;
  un = (uint64_t)n;
  uk = (uint64_t)k;
  if (um > limit / uk || uk > limit / un || um > limit / un) return 0;
  if (um * uk + uk * un + um * un > limit) return 0;
{codes}
  return 1;"""


def applicability(family) -> tuple[Expr, list]:
    """(key, [(code, a problem of that key)]): the key is the dtype code; a candidate applies
    to a problem of its own dtype (GemmFamily.applicable, applicability_key)."""
    return problem_field("dtype"), [
        (code, family.problem({"m": 1, "n": 1, "k": 1, "dtype": name}))
        for name, code in DTYPE_CODES.items()]


def features(family) -> dict[str, Formula]:
    """{feature name: Formula} of the problem and interaction features: the engine's."""
    return {**definition.PROBLEM_FORMULAS, **definition.INTERACTION_FORMULAS}
