"""The GEMM engine's features (tilecast.features.gemm, GemmFeatureEngine version 2) as
expression graphs for the exporter, and what the exported selector takes as a problem.

Each formula repeats gemm.py's, operation for operation, so float64 evaluation gives the
engine's bits. The kernel features and the hardware features are not repeated: the exporter
takes them from the engine itself. WRITTEN_FOR pins the engine this file follows: a model of
any other engine is refused rather than exported with stale formulas.

Problems are GemmFamily.problem's: m, n, k >= 1 with A, B and C (fp32) at most
MAX_OPERAND_BYTES, so every size and byte count below is a whole number below 2**53 and
exact in float64, as in the engine's Python integers; log2 is left to the exporter (its
splits compare the argument, see tilecast.runtime.export.forest).
"""
from __future__ import annotations

from tilecast.families.gemm import MAX_OPERAND_BYTES
from tilecast.families.gemm_isa import DTYPES, LAYOUTS
from tilecast.features.gemm import INTERACTION_FEATURES, KERNEL_FEATURES, PROBLEM_FEATURES
from tilecast.features.hardware import HARDWARE_FEATURES
from tilecast.runtime.export.program import Expr, apply, kernel_column, problem_field

WRITTEN_FOR = ("gemm", 2, (*PROBLEM_FEATURES, *KERNEL_FEATURES, *INTERACTION_FEATURES,
                           *HARDWARE_FEATURES))
FAMILY = "gemm"

# The selector's arguments, in order: (name, C type, codes or None). A coded field takes the
# index of its value (dtype: its TC_DTYPE code).
DTYPE_CODES = {name: dtype.code for name, dtype in DTYPES.items()}
LAYOUT_CODES = {name: index for index, name in enumerate(LAYOUTS)}
INPUTS = (("m", "int64_t", None), ("n", "int64_t", None), ("k", "int64_t", None),
          ("dtype", "int", DTYPE_CODES), ("layout_a", "int", LAYOUT_CODES),
          ("layout_b", "int", LAYOUT_CODES))
INPUTS_BY_NAME = {name: codes for name, _, codes in INPUTS}
# what GemmFamily.problem accepts: every size >= 1 and 4 * (mk + kn + mn) <= MAX_OPERAND_BYTES
LIMITS = {"min_size": 1, "max_operand_elements": MAX_OPERAND_BYTES // 4}
# a candidate applies to a problem of its own dtype (GemmFamily.applicable)
APPLICABILITY_FIELD = "dtype"


def c_validation() -> str:
    """The C body of tc_valid(m, n, k, dtype, layout_a, layout_b): 1 when GemmFamily.problem
    accepts the problem. The products are checked by division first, so nothing overflows."""
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


def problem_values(problem) -> dict[str, float]:
    """A GemmProblem as the selector's inputs (floats; coded fields as their codes)."""
    return {"m": float(problem.m), "n": float(problem.n), "k": float(problem.k),
            "dtype": float(DTYPE_CODES[problem.dtype]),
            "layout_a": float(LAYOUT_CODES[problem.layout_a]),
            "layout_b": float(LAYOUT_CODES[problem.layout_b])}


def kernel_codes(config) -> dict[str, int]:
    """The coded fields of a kernel that applicability compares with the problem's."""
    return {"dtype": DTYPE_CODES[config.dtype]}


def features(hardware: dict[str, float]) -> dict[str, tuple[Expr, bool]]:
    """{feature name: (graph, log2)} for the problem and interaction features; log2 means
    the feature is np.log2 of the graph. `hardware` is the engine's `hw` (feature -> value)."""
    hardware = {name: float(value) for name, value in hardware.items()}  # not numpy scalars
    m, n, k = problem_field("m"), problem_field("n"), problem_field("k")
    col = float(LAYOUT_CODES["col"])
    is_bf16 = apply("eq", problem_field("dtype"), DTYPE_CODES["bf16"])
    a_col = apply("eq", problem_field("layout_a"), col)
    b_col = apply("eq", problem_field("layout_b"), col)

    # _problem_terms
    elt = apply("select", is_bf16, 2.0, 4.0)
    flops = 2.0 * m * n * k
    nbytes = elt * (m * k + k * n) + 4.0 * m * n

    # _interaction_terms
    kf = {name: kernel_column(name) for name in KERNEL_FEATURES}
    mr, nr, mc, nc, kc = kf["mr"], kf["nr"], kf["mc"], kf["nc"], kf["kc"]
    par_m, par_n, par_k = kf["par_m"], kf["par_n"], kf["par_k"]
    threads = max(hardware["hw_threads"], 1.0)
    m_tiles, n_tiles = apply("ceil_div", m, mr), apply("ceil_div", n, nr)
    m_eff, n_eff = m / (m_tiles * mr), n / (n_tiles * nr)
    k_thread = apply("select", apply("gt", par_k, 0.0), apply("ceil_div", k, threads), k)
    k_blocks = apply("ceil_div", k_thread, kc)
    k_tail = (k_blocks * kc - k_thread) / (k_blocks * kc)
    m_blocks, n_blocks = apply("ceil_div", m, mc), apply("ceil_div", n, nc)
    n_panels = apply("ceil_div", apply("min", n, nc), nr)
    units = par_m * m_tiles + par_n * n_panels + par_k * apply("min", threads, k)
    units = apply("max", units, 1.0)
    balance = units / (apply("ceil_div", units, threads) * threads)
    busy = apply("min", units, threads) / threads
    barriers = (par_m * n_blocks * k_blocks + par_n * n_blocks * k_blocks * m_blocks * 2.0
                + par_k * 1.0) + 1.0
    kc_eff = apply("min", kc, k_thread)
    a_block = apply("min", mc, m_tiles * mr) * kc_eff * 4.0
    b_panel = kc_eff * apply("min", nc, n_tiles * nr) * 4.0
    b_micro = kc_eff * nr * 4.0
    l1, l2, l3 = (max(hardware[name] * 1024, 1.0)
                  for name in ("hw_l1d_kib", "hw_l2_kib", "hw_l3_kib"))
    a_pack = kf["pack_a"] * m * k * n_blocks / flops
    c_traffic = m * n * k_blocks * (1.0 + par_k * (threads - 1)) / flops
    est_s = flops / (threads * 32 * hardware["hw_clock_mhz"] * 1e6 * busy * m_eff * n_eff
                     + 1.0)
    a_col_unpacked = (1.0 - kf["pack_a"]) * a_col

    raw, log2 = False, True
    return {
        # PROBLEM_COLUMNS
        "m": (m, raw), "n": (n, raw), "k": (k, raw),
        "log2_m": (m, log2), "log2_n": (n, log2), "log2_k": (k, log2),
        "log2_flops": (flops, log2), "log2_bytes": (nbytes, log2),
        "log2_intensity": (flops / nbytes, log2), "log2_m_over_n": (m / n, log2),
        "log2_min_mn": (apply("min", m, n), log2),
        "is_bf16": (is_bf16, raw), "a_col_major": (a_col, raw), "b_col_major": (b_col, raw),
        # INTERACTION_COLUMNS
        "m_tile_eff": (m_eff, raw), "n_tile_eff": (n_eff, raw), "tile_eff": (m_eff * n_eff, raw),
        "log2_m_tiles": (m_tiles, log2), "log2_n_tiles": (n_tiles, log2),
        "k_blocks": (k_blocks, raw), "k_tail_frac": (k_tail, raw),
        "m_blocks": (m_blocks, raw), "n_blocks": (n_blocks, raw),
        "log2_par_units": (units, log2), "par_balance": (balance, raw),
        "par_busy_frac": (busy, raw), "log2_barriers": (barriers, log2),
        "log2_barriers_per_mflop": (barriers / (flops / 1e6), log2),
        "k_per_thread": (k_thread, raw), "a_block_l2_ratio": (a_block / l2, raw),
        "b_panel_l3_ratio": (b_panel / l3, raw), "b_micro_l1_ratio": (b_micro / l1, raw),
        "log2_flops_per_thread": (flops / threads, log2),
        "splitk_reduce_ratio": (par_k * (m * n * threads) / flops, raw),
        "a_pack_traffic_ratio": (a_pack, raw), "b_pack_traffic_ratio": (k * n / flops, raw),
        "c_traffic_ratio": (c_traffic, raw), "a_strided_unpacked": (a_col_unpacked, raw),
        "a_col_unpacked": (a_col_unpacked * mr, raw),
        "log2_est_ms": (est_s * 1e3 + 1e-9, log2),
    }
