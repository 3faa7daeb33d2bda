// The GEMM feature engine (tilecast/features/gemm.py) for every candidate of one problem: the
// plumbing around gemm_features_formulas.hpp, which is generated from the engine's formulas
// (tilecast.runtime.native.codegen), so the two cannot drift. Float64 without fused
// multiply-adds (built with -ffp-contract=off), with numpy's floor division, minimum and
// maximum (the helpers below, named by tilecast.features.formula.OPS). Only log2 is left to
// numpy, whose SIMD log2 can differ from libm's in the last bit: tc_gemm_features writes
// every log2 argument to `logs`, the caller applies np.log2 in place, and tc_gemm_put_logs
// stores the results. The matrix then equals the numpy engine's bit for bit.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

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

// The engines' ceil_div, -(-a // b). `fast`: -floor(-a / b), branch-free so that the row loop
// vectorizes; it equals numpy's when a and b are whole numbers below 2^53 and b != 0 (a
// non-integer quotient is at least 1/|b| from the next integer, more than half an ulp of
// |a/b| < 2^53/|b|, so rounding never carries it across one). `whole` is cleared for any
// other operands, and the caller reruns the rows with fast = false.
template <bool fast>
inline double tc_ceil_div(double a, double b, int& whole) {
  if (!fast) return -floor_divide(-a, b);
  constexpr double kExact = 9007199254740992.0;  // 2^53
  whole &= (a == std::floor(a)) & (b == std::floor(b)) & (std::fabs(a) < kExact) &
           (std::fabs(b) < kExact) & (b != 0.0);
  return -std::floor(-a / b);
}

// np.minimum / np.maximum (NaN propagates from either side)
inline double tc_minimum(double a, double b) { return ((a <= b) | (a != a)) ? a : b; }
inline double tc_maximum(double a, double b) { return ((a >= b) | (a != a)) ? a : b; }

#include "gemm_features_formulas.hpp"

using formulas::kInputs;
using formulas::kKernel;
using formulas::kKernelCount;
using formulas::kRowLogColumns;
using formulas::kRowLogs;
using formulas::kScalarLogColumns;
using formulas::kScalarLogs;

}  // namespace

extern "C" {

// Features of the candidates `rows` (null: 0..n_rows-1) of the problem `inputs` (m, n, k and
// the field codes, tilecast.features.gemm.problem_values order) into the column-major
// matrix `out` (feature c of row r at out[c * stride + r]), except the log2 features, whose
// arguments go to logs[kScalarLogs + kRowLogs * n_rows], and the hardware features, which
// the caller stores once (they are the same for every row and problem). kernel_columns holds
// the engine's kernel_features matrix column by column (feature j of kernel i at
// [j * n_kernels + i]); hardware is the engine's hardware vector. Returns 0, or -1 when a
// size is outside [1, 2^30] or a row is out of range.
int tc_gemm_features(const double* inputs, const double* kernel_columns, int64_t n_kernels,
                     const int64_t* rows, int64_t n_rows, int32_t copy_kernels,
                     const double* hardware, double* out, int64_t stride, double* logs) {
  constexpr double kMaxDim = 1073741824.0;  // 2^30, as before the formulas were generated
  for (int64_t i = 0; i < 3; ++i)
    if (!(inputs[i] >= 1.0 && inputs[i] <= kMaxDim)) return -1;
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

  double terms[formulas::kTerms];
  formulas::problem_terms(inputs, hardware, terms, out, stride, n_rows, logs);
  const double* kernels = out + kKernel * stride;
  if (!formulas::row_features<true>(terms, kernels, stride, n_rows, out, stride,
                                    logs + kScalarLogs))
    formulas::row_features<false>(terms, kernels, stride, n_rows, out, stride,
                                  logs + kScalarLogs);
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

// The layout this library was built with, for the caller to check against its own.
int64_t tc_gemm_layout(int64_t what) {
  const int64_t values[] = {formulas::kColumns, kInputs, kScalarLogs, kRowLogs};
  return what >= 0 && what < 4 ? values[what] : -1;
}

}  // extern "C"
