// The rowsum kernel (the tilecast-rowsum plugin): y[i] = sum_j x[i * ld + j] for the m rows of
// n fp32 values of x, rows ld >= n apart; y is m fp32 values. Shared by the benchmark binary
// (rowsum.cpp) and the in-process library (rowsum_lib.cpp).
//
// One variant per build, with the -D parameters:
//   RS_ACC       independent partial sums per row (1, 2, 4, 8, 16): the adds of one row form
//                RS_ACC chains, which the compiler may keep in vector lanes
//   RS_ROWS      rows summed in one pass (1, 2, 4): their loads interleave
//   RS_PARALLEL  0: one thread; 1: blocks of rows shared out over the OpenMP threads
#pragma once

#include <vector>

#include "harness.hpp"

#if !defined(RS_ACC) || !defined(RS_ROWS) || !defined(RS_PARALLEL)
#error "compile with -DRS_ACC=<1|2|4|8|16> -DRS_ROWS=<1|2|4> -DRS_PARALLEL=<0|1>"
#endif
static_assert(RS_ACC == 1 || RS_ACC == 2 || RS_ACC == 4 || RS_ACC == 8 || RS_ACC == 16,
              "RS_ACC must be 1, 2, 4, 8 or 16");
static_assert(RS_ROWS == 1 || RS_ROWS == 2 || RS_ROWS == 4, "RS_ROWS must be 1, 2 or 4");
static_assert(RS_PARALLEL == 0 || RS_PARALLEL == 1, "RS_PARALLEL must be 0 or 1");

namespace rowsum {

/// Sums ROWS rows of n values (ld apart) into y[0..ROWS), RS_ACC partial sums per row.
template <int ROWS>
inline void sum_rows(const float* x, long long ld, long long n, float* y) {
  float partial[ROWS][RS_ACC] = {};
  long long j = 0;
  for (; j + RS_ACC <= n; j += RS_ACC)
    for (int r = 0; r < ROWS; ++r)
      for (int a = 0; a < RS_ACC; ++a) partial[r][a] += x[r * ld + j + a];
  for (int r = 0; r < ROWS; ++r) {
    float total = 0.0f;
    for (int a = 0; a < RS_ACC; ++a) total += partial[r][a];
    for (long long tail = j; tail < n; ++tail) total += x[r * ld + tail];
    y[r] = total;
  }
}

/// The row sums of x into y, on `threads` OpenMP threads when the variant is parallel.
inline void rowsum(const float* x, long long m, long long n, long long ld, float* y, int threads) {
  const long long blocks = m / RS_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads) if (RS_PARALLEL)
  for (long long block = 0; block < blocks; ++block)
    sum_rows<RS_ROWS>(x + block * RS_ROWS * ld, ld, n, y + block * RS_ROWS);
  for (long long row = blocks * RS_ROWS; row < m; ++row) sum_rows<1>(x + row * ld, ld, n, y + row);
}

/// The compiled parameters, as `--describe` prints them.
inline std::vector<tc::Param> describe_params() {
  return {{"ACC", RS_ACC}, {"ROWS", RS_ROWS}, {"PARALLEL", RS_PARALLEL}};
}

}  // namespace rowsum
