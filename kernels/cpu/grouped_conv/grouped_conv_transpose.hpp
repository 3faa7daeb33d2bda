// An 8 x 8 block of floats transposed through the AVX registers: the conv library's relayouts
// between torch's layouts and channels-last (grouped_conv_lib.cpp) and pixel lanes' planar
// copies and stores (grouped_conv_lanes.hpp).
#pragma once

#ifdef __AVX__

#include <immintrin.h>

#include "grouped_conv_microkernel.hpp"

namespace tc::gconv {

/// The 8 x 8 block whose row j is a[j], transposed: put(i, its column i) for i = 0 .. 7.
template <class Put>
TC_INLINE void transpose_8x8(__m256 (&a)[8], Put&& put) {
  __m256 b[8];
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {  // pairs of rows interleaved
    b[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
    b[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {  // quads: lanes 0-1 of four rows, then 2-3
    a[i] = _mm256_shuffle_ps(b[i], b[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    a[i + 1] = _mm256_shuffle_ps(b[i], b[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    a[i + 2] = _mm256_shuffle_ps(b[i + 1], b[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    a[i + 3] = _mm256_shuffle_ps(b[i + 1], b[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // column i (< 4) in the low 128 bits of a[i] and a[i + 4], column i + 4 in their high ones
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) put(i, _mm256_permute2f128_ps(a[i], a[i + 4], 0x20));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) put(i + 4, _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
}

}  // namespace tc::gconv

#endif  // __AVX__
