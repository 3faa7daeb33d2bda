// The GEMM feature engine (tilecast/features/gemm.py, GemmFeatureEngine version 2) for every
// candidate of one problem: the same formulas in the same order, in float64 without fused
// multiply-adds (built with -ffp-contract=off), with numpy's floor-division, minimum and
// maximum. Only log2 is left to numpy, whose SIMD log2 can differ from libm's in the last
// bit: tc_gemm_features writes every log2 argument to `logs`, the caller applies np.log2 in
// place, and tc_gemm_put_logs stores the results. The matrix then equals the numpy engine's
// bit for bit. Keep this file in step with gemm.py; gemm_features.py checks the engine's
// name, version and feature names before using it.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// column blocks of the engine's order: problem, kernel, interaction, hardware
constexpr int64_t kProblem = 0, kKernel = 14, kInteraction = 30, kHardware = 56;
constexpr int64_t kKernelCount = 16, kHardwareCount = 8;
// kernel feature columns (KERNEL_FEATURES order)
enum Kernel { kMr = 1, kNr = 2, kMc = 3, kNc = 4, kKc = 5, kParM = 7, kParN = 8, kParK = 9,
              kPackA = 10 };
// `logs` holds kScalarLogs problem-wide arguments, then kRowLogs arguments per row
constexpr int64_t kScalarLogs = 9, kRowLogs = 6;
// where each log2 goes: the problem-wide ones (8 problem features, log2_flops_per_thread)
constexpr int64_t kScalarLogColumns[kScalarLogs] = {3, 4, 5, 6, 7, 8, 9, 10, kInteraction + 18};
// the per-row ones: log2_m_tiles, log2_n_tiles, log2_par_units, log2_barriers,
// log2_barriers_per_mflop, log2_est_ms
constexpr int64_t kRowLogColumns[kRowLogs] = {kInteraction + 3, kInteraction + 4,
                                              kInteraction + 9, kInteraction + 12,
                                              kInteraction + 13, kInteraction + 25};

// numpy's float floor division (npy_divmod; Python's float // is the same algorithm)
inline double floor_divide(double a, double b) {
  if (b == 0.0) return a / b;
  double mod = std::fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0.0) {
    if ((b < 0) != (mod < 0)) div -= 1.0;
  }
  double floordiv;
  if (div != 0.0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, a / b);
  }
  return floordiv;
}

// gemm.py _ceil_div: -(-a // b)
inline double ceil_div(double a, double b) { return -floor_divide(-a, b); }

// np.minimum / np.maximum (NaN propagates from either side)
inline double np_minimum(double a, double b) { return ((a <= b) | (a != a)) ? a : b; }
inline double np_maximum(double a, double b) { return ((a >= b) | (a != a)) ? a : b; }

// Python's built-in max(a, b) / min(a, b): the first argument unless the second beats it
inline double py_max(double a, double b) { return b > a ? b : a; }
inline double py_min(double a, double b) { return b < a ? b : a; }

// the kernel features that divide in `interactions`
constexpr int kDivisors[] = {kMr, kNr, kMc, kNc, kKc};

// Whether every value is an integer in [1, 2^53). When m, n, k, the thread count and the
// kernel's tile sizes all are, every floor division below has nonzero integer operands below
// 2^53, and floor(a / b) equals numpy's floor division: a non-integer quotient is at least
// 1/|b| from the next integer, more than half an ulp of |a/b| < 2^53/|b|, so rounding the
// quotient never carries it across an integer.
inline bool counts(const double* values, int64_t n) {
  bool all = true;
  for (int64_t i = 0; i < n; ++i)
    all &= (values[i] >= 1.0) & (values[i] < 9007199254740992.0) &
           (values[i] == std::floor(values[i]));
  return all;
}

struct Problem {
  double m, n, k, flops, threads, k_split, k_units, l1, l2, l3, b_pack, c_scale, est_scale,
      a_col, splitk_scale;
};

// The interaction features of n_rows kernels (feature j of row r at kernels[j * kstride + r])
// into `out`, and their log2 arguments into row_logs. `integers`: every operand of a floor
// division is a count (see `counts`), and the loop is branch-free so that it vectorizes.
template <bool integers>
void interactions(const Problem& p, const double* __restrict kernels, int64_t kstride,
                  int64_t n_rows, double* __restrict out, int64_t stride,
                  double* __restrict row_logs) {
  const auto cdiv = [](double a, double b) {
    return integers ? -std::floor(-a / b) : ceil_div(a, b);
  };
  // with counts every value here is finite, so NaN has no say in minimum and maximum
  const auto vmin = [](double a, double b) {
    return integers ? (a <= b ? a : b) : np_minimum(a, b);
  };
  const auto vmax = [](double a, double b) {
    return integers ? (a >= b ? a : b) : np_maximum(a, b);
  };
  double* __restrict o = out + kInteraction * stride;
  // the output columns never overlap (stride >= n_rows); ivdep spares 25 alias checks
#pragma GCC ivdep
  for (int64_t r = 0; r < n_rows; ++r) {
    const double mr = kernels[kMr * kstride + r], nr = kernels[kNr * kstride + r];
    const double mc = kernels[kMc * kstride + r], nc = kernels[kNc * kstride + r];
    const double kc = kernels[kKc * kstride + r];
    const double par_m = kernels[kParM * kstride + r], par_n = kernels[kParN * kstride + r];
    const double par_k = kernels[kParK * kstride + r];
    const double pack_a = kernels[kPackA * kstride + r];

    const double m_tiles = cdiv(p.m, mr), n_tiles = cdiv(p.n, nr);
    const double m_eff = p.m / (m_tiles * mr), n_eff = p.n / (n_tiles * nr);
    const double k_thread = par_k > 0 ? p.k_split : p.k;
    const double k_blocks = cdiv(k_thread, kc);
    const double k_tail = (k_blocks * kc - k_thread) / (k_blocks * kc);
    const double m_blocks = cdiv(p.m, mc), n_blocks = cdiv(p.n, nc);
    const double n_panels = cdiv(vmin(p.n, nc), nr);
    const double units = vmax(par_m * m_tiles + par_n * n_panels + par_k * p.k_units, 1.0);
    const double balance = units / (cdiv(units, p.threads) * p.threads);
    const double busy = vmin(units, p.threads) / p.threads;
    const double barriers =
        (par_m * n_blocks * k_blocks + par_n * n_blocks * k_blocks * m_blocks * 2 + par_k * 1.0) +
        1.0;
    const double kc_eff = vmin(kc, k_thread);
    const double a_block = vmin(mc, m_tiles * mr) * kc_eff * 4;
    const double b_panel = kc_eff * vmin(nc, n_tiles * nr) * 4;
    const double b_micro = kc_eff * nr * 4;
    const double est_s = p.flops / (p.est_scale * busy * m_eff * n_eff + 1.0);

    // INTERACTION_FEATURES order; the log2 ones are filled by tc_gemm_put_logs
    o[0 * stride + r] = m_eff;
    o[1 * stride + r] = n_eff;
    o[2 * stride + r] = m_eff * n_eff;
    o[5 * stride + r] = k_blocks;
    o[6 * stride + r] = k_tail;
    o[7 * stride + r] = m_blocks;
    o[8 * stride + r] = n_blocks;
    o[10 * stride + r] = balance;
    o[11 * stride + r] = busy;
    o[14 * stride + r] = k_thread;
    o[15 * stride + r] = a_block / p.l2;
    o[16 * stride + r] = b_panel / p.l3;
    o[17 * stride + r] = b_micro / p.l1;
    o[19 * stride + r] = par_k * p.splitk_scale / p.flops;
    o[20 * stride + r] = pack_a * p.m * p.k * n_blocks / p.flops;
    o[21 * stride + r] = p.b_pack;
    o[22 * stride + r] = p.m * p.n * k_blocks * (1 + par_k * p.c_scale) / p.flops;
    o[23 * stride + r] = (1 - pack_a) * p.a_col;
    o[24 * stride + r] = (1 - pack_a) * p.a_col * mr;

    row_logs[0 * n_rows + r] = m_tiles;
    row_logs[1 * n_rows + r] = n_tiles;
    row_logs[2 * n_rows + r] = units;
    row_logs[3 * n_rows + r] = barriers;
    row_logs[4 * n_rows + r] = barriers / (p.flops / 1e6);
    row_logs[5 * n_rows + r] = est_s * 1e3 + 1e-9;
  }
}

}  // namespace

extern "C" {

// Features of the candidates `rows` (null: 0..n_rows-1) of one problem into the column-major
// matrix `out` (feature c of row r at out[c * stride + r]), except the log2 features, whose
// arguments go to logs[kScalarLogs + kRowLogs * n_rows], and the hardware features, which
// the caller stores once (they are the same for every row and problem). kernel_columns holds
// the engine's kernel_features matrix column by column (feature j of kernel i at
// [j * n_kernels + i]); hardware is the engine's hardware vector. Returns 0, or -1 when a
// dimension exceeds 2^30 (the byte count would leave int64) or a row is out of range.
int tc_gemm_features(int64_t m, int64_t n, int64_t k, int32_t is_bf16, int32_t a_col,
                     int32_t b_col, const double* kernel_columns, int64_t n_kernels,
                     const int64_t* rows, int64_t n_rows, int32_t copy_kernels,
                     const double* hardware, double* out, int64_t stride, double* logs) {
  constexpr int64_t kMaxDim = int64_t{1} << 30;
  if (m < 1 || n < 1 || k < 1 || m > kMaxDim || n > kMaxDim || k > kMaxDim) return -1;
  if (stride < n_rows) return -1;
  for (int64_t r = 0; rows && r < n_rows; ++r)
    if (rows[r] < 0 || rows[r] >= n_kernels) return -1;

  // the kernel features of the rows, column by column: the kernel matrix itself for all
  // rows, else gathered; the caller knows when `out` holds them already (copy_kernels 0)
  for (int64_t c = 0; c < kKernelCount && copy_kernels; ++c) {
    double* column = out + (kKernel + c) * stride;
    const double* source = kernel_columns + c * n_kernels;
    if (rows)
      for (int64_t r = 0; r < n_rows; ++r) column[r] = source[rows[r]];
    else
      std::memcpy(column, source, sizeof(double) * static_cast<size_t>(n_rows));
  }

  // problem_features
  const int64_t element = is_bf16 ? 2 : 4;
  const double fm = static_cast<double>(m), fn = static_cast<double>(n),
               fk = static_cast<double>(k);
  const double flops = 2.0 * fm * fn * fk;
  const double nbytes = static_cast<double>(element * (m * k + k * n) + 4 * m * n);
  const double problem_row[14] = {fm, fn, fk, 0, 0, 0, 0, 0, 0, 0, 0,
                                  is_bf16 ? 1.0 : 0.0, a_col ? 1.0 : 0.0, b_col ? 1.0 : 0.0};
  for (int64_t c = 0; c < 14; ++c)
    for (int64_t r = 0; r < n_rows; ++r) out[(kProblem + c) * stride + r] = problem_row[c];

  // combine: the problem-wide terms, each as gemm.py computes it
  Problem p;
  p.m = fm;
  p.n = fn;
  p.k = fk;
  p.flops = flops;
  p.threads = py_max(hardware[0], 1.0);
  p.k_split = ceil_div(fk, p.threads);
  p.k_units = py_min(p.threads, fk);
  p.l1 = py_max(hardware[2] * 1024, 1.0);
  p.l2 = py_max(hardware[3] * 1024, 1.0);
  p.l3 = py_max(hardware[4] * 1024, 1.0);
  p.b_pack = fk * fn / flops;
  p.c_scale = p.threads - 1;
  p.est_scale = p.threads * 32 * hardware[5] * 1e6;
  p.a_col = a_col ? 1.0 : 0.0;
  p.splitk_scale = fm * fn * p.threads;

  logs[0] = fm;
  logs[1] = fn;
  logs[2] = fk;
  logs[3] = flops;
  logs[4] = nbytes;
  logs[5] = flops / nbytes;
  logs[6] = fm / fn;
  logs[7] = static_cast<double>(m < n ? m : n);
  logs[8] = flops / p.threads;

  const double* kernels = out + kKernel * stride;
  bool integers = counts(&p.threads, 1);
  for (const int c : kDivisors) integers &= counts(kernels + c * stride, n_rows);
  if (integers)
    interactions<true>(p, kernels, stride, n_rows, out, stride, logs + kScalarLogs);
  else
    interactions<false>(p, kernels, stride, n_rows, out, stride, logs + kScalarLogs);
  return 0;
}

// Store the log2 values (np.log2 applied to what tc_gemm_features wrote) in their columns.
void tc_gemm_put_logs(const double* logs, int64_t n_rows, double* out, int64_t stride) {
  for (int64_t i = 0; i < kScalarLogs; ++i)
    for (int64_t r = 0; r < n_rows; ++r) out[kScalarLogColumns[i] * stride + r] = logs[i];
  for (int64_t i = 0; i < kRowLogs; ++i)
    for (int64_t r = 0; r < n_rows; ++r)
      out[kRowLogColumns[i] * stride + r] = logs[kScalarLogs + i * n_rows + r];
}

}  // extern "C"
