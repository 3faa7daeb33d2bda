// The register-blocked micro-kernel: an MR x NR tile of C += A-panel * B-panel.
//
// Written once as a template over (vector wrapper, MR, NR): every loop over
// the tile has a compile-time trip count and is fully unrolled, so the
// MR * NR/width accumulators are scalarised into named registers (checked
// with objdump: no accumulator spills for 14x32 AVX-512 / 6x16 AVX2).
//
// Per k step: load NR/width vectors of the packed B row, then for each of the
// MR rows broadcast one A element and FMA it into that row's accumulators.
#pragma once

#include <xmmintrin.h>

#include "gemm_config.hpp"
#include "gemm_simd.hpp"

namespace tc::gemm {

/// How far ahead (in k steps) the in-loop prefetches run. A packed A
/// micro-panel streams from L2, so it needs the larger distance; the B
/// micro-panel is mostly L1-resident after the first tile of a column.
constexpr int kPrefetchStepsA = 16;
constexpr int kPrefetchStepsB = 8;

/// Where the micro-kernel reads A from. Packed: MR contiguous floats per k
/// step. Strided (TC_PACK_A=0): element (i, k) at base[i*row_stride + k*col_stride].
struct APanel {
  const float* base;
  index_t row_stride;
  index_t col_stride;
};

/// C[0:MR, 0:NR] (leading dimension ldc) = (accumulate ? C : 0) + A * B over kc
/// steps. `b` is a packed NR-column micro-panel (64-byte aligned rows of NR
/// floats); `a_next`/`b_next` are the panels the following call will read,
/// touched early so they are in cache when it starts.
template <class V, int MR, int NR, bool kPackedA, bool kUsePrefetch>
TC_INLINE void microkernel(index_t kc, APanel a_panel, const float* __restrict b,
                           float* __restrict c, index_t ldc, bool accumulate,
                           const float* a_next, const float* b_next) {
  using reg = typename V::reg;
  constexpr int W = V::width;
  constexpr int NV = NR / W;
  // Packed A has compile-time strides, letting the compiler fold every
  // broadcast address into an immediate offset.
  const index_t a_rs = kPackedA ? 1 : a_panel.row_stride;
  const index_t a_cs = kPackedA ? MR : a_panel.col_stride;
  const float* __restrict a = a_panel.base;

  if constexpr (kUsePrefetch) {
#pragma GCC unroll 64
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 64
      for (int line = 0; line < (NR * 4 + 63) / 64; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + line * 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a_next), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b_next), _MM_HINT_T0);
  }

  reg acc[MR][NV];
#pragma GCC unroll 64
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 64
    for (int j = 0; j < NV; ++j) acc[i][j] = V::zero();

#pragma GCC unroll 4
  for (index_t p = 0; p < kc; ++p) {
    if constexpr (kUsePrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(a + kPrefetchStepsA * a_cs), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchStepsB * NR), _MM_HINT_T0);
    }
    reg b_row[NV];
#pragma GCC unroll 64
    for (int j = 0; j < NV; ++j) b_row[j] = V::load_aligned(b + j * W);
#pragma GCC unroll 64
    for (int i = 0; i < MR; ++i) {
      const reg a_elem = V::broadcast(a + i * a_rs);
#pragma GCC unroll 64
      for (int j = 0; j < NV; ++j) acc[i][j] = V::fma(a_elem, b_row[j], acc[i][j]);
    }
    a += a_cs;
    b += NR;
  }

  if (accumulate) {
#pragma GCC unroll 64
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 64
      for (int j = 0; j < NV; ++j)
        V::store(c + i * ldc + j * W, V::add(acc[i][j], V::load(c + i * ldc + j * W)));
  } else {
#pragma GCC unroll 64
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 64
      for (int j = 0; j < NV; ++j) V::store(c + i * ldc + j * W, acc[i][j]);
  }
}

}  // namespace tc::gemm
