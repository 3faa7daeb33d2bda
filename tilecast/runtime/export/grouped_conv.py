"""What `tilecast export` needs of the grouped-conv families (forward, bwd_data, bwd_weight;
2D and 3D) besides their feature formulas, which are the engine's own
(tilecast.features.grouped_conv.formulas, one graph per direction, GroupedConvFeatureEngine
version 1): the selector's arguments, the problems it accepts and which kernels apply to one.

The arguments are make_problem's fields: the dtype as its code, ndim (2 or 3) and every shape
field, a 2D problem with trivial depth fields (Di = Z = 1, stride_d = dilation_d = 1,
pad_d = 0). The direction is the model's: one selector per direction.

Range. GroupedConvFamily.problem accepts any size; the engine forms its counts (output dims,
tensor elements, implicit-GEMM sizes) as whole numbers, which the formulas hold as float64,
exact below 2**53. The selector therefore answers OUT_OF_RANGE for a problem with a field
above MAX_FIELD or a tensor (input, weight, output) of more than MAX_ELEMENTS elements (a
petabyte of fp32): every count of a problem it answers is then below 2**53.

Applicability (GroupedConvFamily.applicable, applicability_key): a kernel runs problems of its
dtype and ndim, dw ones depthwise problems only, winograd ones 2D 3x3 stride-1 undilated
ones only. The selector's key codes (dtype, ndim, depthwise, winograd); each code's candidates
are found at export by asking the family itself about a problem of that key.

Two features raise a logarithm again, as the engine always has (im2col_expansion and
working_set_l3_ratio: 2 ** log2(x)); the C computes them with the C library's log2 and pow.
numpy's SIMD log2 can differ from the C library's in the last bit, so on those two features
the C can differ from the dispatcher by an ulp or so: a choice changes only where such a
value falls within that distance of a split threshold.
"""
from __future__ import annotations

from tilecast.features import grouped_conv as definition
from tilecast.features.formula import Expr, Formula, apply, problem_field
from tilecast.features.grouped_conv import (DTYPE_CODES, INTERACTION_FEATURES, KERNEL_FEATURES,
                                            PROBLEM_FEATURES, SHAPE_FIELDS)
from tilecast.features.hardware import HARDWARE_FEATURES
from tilecast.families.grouped_conv import NONNEGATIVE_FIELDS, SPATIAL_D_DEFAULTS
from tilecast.runtime.export.selector import ExportError

__all__ = ["DTYPE_CODES", "KERNEL_FEATURES"]

_ENGINE = definition.GroupedConvFeatureEngine
WRITTEN_FOR = (_ENGINE.name, _ENGINE.version, (*PROBLEM_FEATURES, *KERNEL_FEATURES,
                                               *INTERACTION_FEATURES, *HARDWARE_FEATURES))
MAX_FIELD = 1 << 24
MAX_ELEMENTS = 1 << 48

# The selector's arguments, in order: (name, C type, codes or None), the formulas' inputs.
INPUTS = (("dtype", "int", DTYPE_CODES), ("ndim", "int", None),
          *((name, "int64_t", None) for name in SHAPE_FIELDS))
LIMITS = {"ndim": [2, 3], "min_field": 1, "min_pad": 0, "max_field": MAX_FIELD,
          "max_tensor_elements": MAX_ELEMENTS, "trivial_depth_2d": dict(SPATIAL_D_DEFAULTS)}
# the family's applicability_key, in its order, which the selector's key codes
APPLICABILITY_KEY = ("direction", "dtype", "ndim", "is_depthwise", "is_winograd")


def c_validation() -> str:
    """The C body of tc_valid(dtype, ndim, N, ..., dilation_w): 0 when GroupedConvFamily
    .problem refuses the problem, 2 when it is beyond the selector's exact range (module
    docstring), else 1. Element counts are multiplied in double: exact while they are at
    most MAX_ELEMENTS (every factor is a whole number of at most MAX_FIELD), and above it
    when they are not, as rounding never takes a product below a power of two it exceeds."""
    names = [name for name, _, _ in INPUTS]
    codes = " && ".join(f"dtype != {code}" for code in sorted(DTYPE_CODES.values()))
    minimum = "\n".join(
        f"  if ({name} < {0 if name in NONNEGATIVE_FIELDS else 1}) return 0;"
        for name in SHAPE_FIELDS)
    trivial = " || ".join(f"{name} != {value}" for name, value in SPATIAL_D_DEFAULTS.items())
    too_large = " ||\n      ".join(f"{name} > TC_MAX_FIELD" for name in names[2:])
    axes = (("Di", "pad_d", "dilation_d", "Z", "stride_d"),
            ("Hi", "pad_h", "dilation_h", "Y", "stride_h"),
            ("Wi", "pad_w", "dilation_w", "X", "stride_w"))
    outputs = "\n".join(
        f"  out[{i}] = floor((double)({size} + 2 * {pad} - {dil} * ({filt} - 1) - 1) / "
        f"(double){stride}) + 1.0;\n  if (out[{i}] < 0.0) out[{i}] = 0.0;"
        for i, (size, pad, dil, filt, stride) in enumerate(axes))
    return f"""#define TC_MAX_FIELD INT64_C({MAX_FIELD})
#define TC_MAX_ELEMENTS {float(MAX_ELEMENTS)!r}
  double out[3], input, weight, output;
  if ({codes}) return 0;
  if (ndim != 2 && ndim != 3) return 0;
{minimum}
  if (ndim == 2 && ({trivial})) return 0;
  /* beyond the exact range: a field above {MAX_FIELD} or a tensor above {MAX_ELEMENTS} elements */
  if ({too_large}) return 2;
{outputs}
  input = (double)N * (double)Di * (double)Hi * (double)Wi * (double)G * (double)C;
  weight = (double)G * (double)K * (double)Z * (double)Y * (double)X * (double)C;
  output = (double)N * out[0] * out[1] * out[2] * (double)G * (double)K;
  if (input > TC_MAX_ELEMENTS || weight > TC_MAX_ELEMENTS || output > TC_MAX_ELEMENTS) return 2;
  return 1;
#undef TC_MAX_FIELD
#undef TC_MAX_ELEMENTS"""


def applicability(family) -> tuple[Expr, list]:
    """(key, [(code, a problem of that key, or None where no problem has it)]): the key is
    ((dtype code * 2 + is 3D) * 2 + depthwise) * 2 + winograd, GroupedConvProblem
    .is_depthwise and .is_winograd as graphs. ExportError when the family's
    applicability_key no longer reads what this key codes."""
    field = {name: problem_field(name) for name in ("dtype", "ndim", *SHAPE_FIELDS)}
    depthwise = apply("eq", field["C"], 1.0) * apply("eq", field["K"], 1.0)
    winograd = apply("eq", field["ndim"], 2.0)
    for name, value in (("Y", 3.0), ("X", 3.0), ("stride_h", 1.0), ("stride_w", 1.0),
                        ("dilation_h", 1.0), ("dilation_w", 1.0)):
        winograd = winograd * apply("eq", field[name], value)
    key = ((field["dtype"] * 2.0 + apply("eq", field["ndim"], 3.0)) * 2.0 + depthwise) * 2.0 \
        + winograd
    representatives = []
    for dtype, dtype_code in DTYPE_CODES.items():
        for ndim in (2, 3):
            for is_depthwise in (False, True):
                for is_winograd in (False, True):
                    code = ((dtype_code * 2 + (ndim == 3)) * 2 + is_depthwise) * 2 + is_winograd
                    problem = _representative(family, dtype, ndim, is_depthwise, is_winograd)
                    representatives.append((code, problem))
    return key, representatives


def _representative(family, dtype: str, ndim: int, is_depthwise: bool, is_winograd: bool):
    """A problem of the family with that applicability key; None when no problem has it."""
    if is_winograd and ndim != 2:
        return None
    channels = 1 if is_depthwise else 2
    filt = 3 if is_winograd else 1
    values = {"dtype": dtype, "ndim": ndim, "C": channels, "K": channels, "Hi": 8, "Wi": 8,
              "Y": filt, "X": filt, **({"Di": 4, "Z": 1} if ndim == 3 else {})}
    problem = family.problem(values)
    expected = (family.direction, dtype, ndim, is_depthwise, is_winograd)
    if family.applicability_key(problem) != expected:
        raise ExportError(f"{family.name}.applicability_key gives "
                          f"{family.applicability_key(problem)} for a problem of "
                          f"{dict(zip(APPLICABILITY_KEY, expected))}; the exporter's key codes "
                          f"{APPLICABILITY_KEY}: update tilecast.runtime.export.grouped_conv")
    return problem


def features(family) -> dict[str, Formula]:
    """{feature name: Formula} of the problem and interaction features of the family's
    direction: the engine's."""
    problem, interaction = definition.FORMULAS[family.direction]
    return {**problem, **interaction}
