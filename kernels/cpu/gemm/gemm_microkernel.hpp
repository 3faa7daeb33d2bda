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

#include <algorithm>

#include "gemm_config.hpp"
#include "gemm_simd.hpp"

namespace tc::gemm {

/// How far ahead (in k steps) the in-loop prefetches run. A packed A
/// micro-panel streams from L2, so it needs the larger distance; the B
/// micro-panel is mostly L1-resident after the first tile of a column.
constexpr int kPrefetchStepsA = 16;
constexpr int kPrefetchStepsB = 8;
/// One line of the next B micro-panel is fetched into L2 every this many k steps
/// (`Ahead::b_lines` of them a call); the next tile's C rows, one every two steps.
constexpr int kAheadStepsB = 4;
constexpr int kAheadStepsC = 2;

/// What the call after this one reads, fetched while this one computes: `a` and `b`
/// (the next A and B micro-panels) at the start; `c`, the next C tile (or null), row by
/// row over the first steps; `b_lines` lines from `b_later`, a slice of the B micro-panel
/// a later column of tiles reads, which would otherwise come from L3 when the B block
/// is larger than L2.
struct Ahead {
  const float* a;
  const float* b;
  const float* c;
  const float* b_later;
  int b_lines;
};

/// Where the micro-kernel reads A from. Packed: MR contiguous floats per k
/// step. Strided (TC_PACK_A=0): element (i, k) at base[i*row_stride + k*col_stride].
struct APanel {
  const float* base;
  index_t row_stride;
  index_t col_stride;
};

/// C[0:MR, 0:NR] (leading dimension ldc) = (accumulate ? C : 0) + A * B over kc
/// steps. `b` is a packed NR-column micro-panel (64-byte aligned rows of NR
/// floats); `next` names what the following calls will read (see Ahead).
template <class V, int MR, int NR, bool kPackedA, bool kUsePrefetch>
TC_INLINE void microkernel(index_t kc, APanel a_panel, const float* __restrict b,
                           float* __restrict c, index_t ldc, bool accumulate, const Ahead& next) {
  using reg = typename V::reg;
  constexpr int W = V::width;
  constexpr int NV = NR / W;
  // Packed A has compile-time strides, letting the compiler fold every
  // broadcast address into an immediate offset.
  const index_t a_rs = kPackedA ? 1 : a_panel.row_stride;
  const index_t a_cs = kPackedA ? MR : a_panel.col_stride;
  const float* __restrict a = a_panel.base;

#pragma GCC unroll 64
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 64
    for (int line = 0; line < (NR * 4 + 63) / 64; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + line * 16), _MM_HINT_T0);
  if constexpr (kUsePrefetch) {
    _mm_prefetch(reinterpret_cast<const char*>(next.a), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(next.b), _MM_HINT_T0);
  }
  constexpr int kLinesB = (NR * 4 + 63) / 64;  // 64-byte lines in one row of the B panel
  const index_t ahead_b_steps = kUsePrefetch ? index_t(next.b_lines) * kAheadStepsB : 0;
  const index_t ahead_c_steps = kUsePrefetch && next.c ? index_t(MR) * kAheadStepsC : 0;

  reg acc[MR][NV];
#pragma GCC unroll 64
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 64
    for (int j = 0; j < NV; ++j) acc[i][j] = V::zero();

  // One k step: the B row's vectors, then each A element broadcast into its row.
  auto step = [&]() __attribute__((always_inline)) {
    if constexpr (kUsePrefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(a + kPrefetchStepsA * a_cs), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int line = 0; line < kLinesB; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchStepsB * NR + line * 16), _MM_HINT_T0);
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
  };
  // The first steps also fetch what later calls read (into L2); the rest test nothing.
  const index_t head = std::min(kc, std::max(ahead_b_steps, ahead_c_steps));
  index_t p = 0;
  for (; p < head; ++p) {
    if (p < ahead_b_steps && p % kAheadStepsB == 0)
      _mm_prefetch(reinterpret_cast<const char*>(next.b_later + p / kAheadStepsB * 16), _MM_HINT_T1);
    if (p < ahead_c_steps && p % kAheadStepsC == 0) {
#pragma GCC unroll 8
      for (int line = 0; line < kLinesB; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(next.c + p / kAheadStepsC * ldc + line * 16), _MM_HINT_T1);
    }
    step();
  }
#pragma GCC unroll 4
  for (; p < kc; ++p) step();

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
