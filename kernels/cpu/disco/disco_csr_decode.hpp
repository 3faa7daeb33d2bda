// What every CPU DISCO entry does before a kernel runs, shared by the runtime library
// (disco_csr.cpp) and the benchmark harness (disco_bench.cpp): the status and storage codes,
// the shape and CSR checks, and decoding psi's columns into the kernels' (line, quotient)
// form (the huge-page advice for a fresh output is in disco_csr_shape.hpp).
#pragma once

#include <omp.h>

#include <cstdint>

#include "disco_csr_shape.hpp"

namespace tc::disco {

enum Status : int {
  kOk = 0,
  kBadShape = 1,
  kBadOffsets = 2,
  kEntryOutOfRange = 3,
  kBadStorage = 4,
  kBadVariant = 5,  // a register tile the library does not instantiate, or lat_block < 1
};

/// The storage type codes the entry points take (tilecast/disco/native.py holds the same).
enum Storage : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline Status check_dims(const Dims& d) {
  const bool positive = d.bc > 0 && d.hi > 0 && d.wi > 0 && d.k > 0 && d.ho > 0 && d.wo > 0;
  return positive && d.wi % d.wo == 0 ? kOk : kBadShape;
}

/// roff must start at 0, never decrease and end at nnz.
inline Status check_offsets(const std::int64_t* roff, index_t rows, index_t nnz) {
  if (roff[0] != 0 || roff[rows] != nnz) return kBadOffsets;
  for (index_t r = 0; r < rows; ++r)
    if (roff[r + 1] < roff[r]) return kBadOffsets;
  return kOk;
}

inline int resolve_threads(int threads) { return threads > 0 ? threads : omp_get_max_threads(); }

/// Decodes each forward entry's phase line (hi * s + p) and quotient q; false if a column
/// lies outside the input grid.
inline bool decode_forward(const std::int64_t* col, index_t nnz, const Dims& d, int threads,
                           std::int32_t* line, std::int32_t* quot) {
  const index_t s = d.stride();
  bool out_of_range = false;
#pragma omp parallel for num_threads(threads) reduction(|| : out_of_range)
  for (index_t e = 0; e < nnz; ++e) {
    const index_t c = col[e];
    if (c < 0 || c >= d.hi * d.wi) {
      out_of_range = true;
      continue;
    }
    const index_t h = c / d.wi, w = c % d.wi;
    line[e] = static_cast<std::int32_t>(h * s + w % s);
    quot[e] = static_cast<std::int32_t>(w / s);
  }
  return !out_of_range;
}

/// Decodes each transposed entry's quotient q = col mod Wo; false if a column lies outside gy.
inline bool decode_transpose(const std::int64_t* tcol, index_t nnz, const Dims& d, int threads,
                             std::int32_t* quot) {
  bool out_of_range = false;
#pragma omp parallel for num_threads(threads) reduction(|| : out_of_range)
  for (index_t e = 0; e < nnz; ++e) {
    const index_t c = tcol[e];
    if (c < 0 || c >= d.k * d.ho * d.wo) {
      out_of_range = true;
      continue;
    }
    quot[e] = static_cast<std::int32_t>(c % d.wo);
  }
  return !out_of_range;
}

}  // namespace tc::disco
