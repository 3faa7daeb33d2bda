// The register tile shared by every pipeline: MR x NR fp32 accumulators
// (NV = NR / lanes vectors per row: zmm with AVX-512, ymm with AVX2) and the three ways of
// feeding it.
//
//   tile_packed   A packed as kc x MR, B packed as kc x NR (im2col pipeline)
//   tile_rows     A gathered in place: row i reads rows[i][0:len] (direct fwd/bwd_data)
//   tile_strided  A row i at a[p*a_step + i], B row at b[p*b_step] (direct bwd_weight)
//
// All are force-inlined into callers with compile-time MR/NV, so the
// accumulators stay in registers (8 x 2 zmm + 2 B vectors + 1 broadcast).
#pragma once

#include <immintrin.h>

#include "../gemm/gemm_simd.hpp"
#include "grouped_conv_config.hpp"

namespace tc::gconv {

#ifdef __AVX512F__
using Vec = tc::gemm::VecAvx512;
#else
using Vec = tc::gemm::VecAvx2;
#endif
using reg = Vec::reg;
constexpr int kLanes = Vec::width;
static_assert(kLanes == kSimdLanes, "the micro-tile's lanes (grouped_conv_config.hpp) are the ISA's");

template <int MR, int NV>
struct Tile {
  reg acc[MR][NV];

  TC_INLINE void zero() {
#pragma GCC unroll 64
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = Vec::zero();
  }
};

using MicroTile = Tile<kMR, kNV>;

template <int MR, int NV>
TC_INLINE void tile_packed(Tile<MR, NV>& tile, index_t kc, const float* __restrict a,
                           const float* __restrict b) {
#pragma GCC unroll 2
  for (index_t p = 0; p < kc; ++p) {
    reg b_row[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) b_row[j] = Vec::load(b + j * kLanes);
#pragma GCC unroll 64
    for (int i = 0; i < MR; ++i) {
      const reg a_elem = Vec::broadcast(a + i);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) tile.acc[i][j] = Vec::fma(a_elem, b_row[j], tile.acc[i][j]);
    }
    a += MR;
    b += NV * kLanes;
  }
}

template <int MR, int NV>
TC_INLINE void tile_rows(Tile<MR, NV>& tile, index_t len, const float* const* rows,
                         const float* __restrict b) {
  const float* row[MR];
#pragma GCC unroll 64
  for (int i = 0; i < MR; ++i) row[i] = rows[i];
#pragma GCC unroll 2
  for (index_t l = 0; l < len; ++l) {
    reg b_row[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) b_row[j] = Vec::load(b + j * kLanes);
#pragma GCC unroll 64
    for (int i = 0; i < MR; ++i) {
      const reg a_elem = Vec::broadcast(row[i] + l);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) tile.acc[i][j] = Vec::fma(a_elem, b_row[j], tile.acc[i][j]);
    }
    b += NV * kLanes;
  }
}

template <int MR, int NV>
TC_INLINE void tile_strided(Tile<MR, NV>& tile, index_t count, const float* __restrict a,
                            index_t a_step, const float* __restrict b, index_t b_step) {
#pragma GCC unroll 2
  for (index_t p = 0; p < count; ++p) {
    reg b_row[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) b_row[j] = Vec::load(b + j * kLanes);
#pragma GCC unroll 64
    for (int i = 0; i < MR; ++i) {
      const reg a_elem = Vec::broadcast(a + i);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) tile.acc[i][j] = Vec::fma(a_elem, b_row[j], tile.acc[i][j]);
    }
    a += a_step;
    b += b_step;
  }
}

using tc::gemm::transpose8x8;  // shared with the GEMM packing (gemm_simd.hpp)

#ifdef __AVX512F__
using LaneMask = __mmask16;
/// Lanes [0, valid) of one vector; valid may be <= 0 or >= 16.
TC_INLINE LaneMask lane_mask(index_t valid) {
  return valid >= kLanes ? LaneMask(0xFFFF) : valid <= 0 ? LaneMask(0) : LaneMask((1u << valid) - 1);
}
TC_INLINE reg masked_load(LaneMask mask, const float* p) { return _mm512_maskz_loadu_ps(mask, p); }
TC_INLINE void masked_store(float* p, LaneMask mask, reg value) { _mm512_mask_storeu_ps(p, mask, value); }
#else
using LaneMask = __m256i;
/// Lanes [0, valid) of one vector (sign bits set); valid may be <= 0 or >= 8.
TC_INLINE LaneMask lane_mask(index_t valid) {
  const int clamped = valid <= 0 ? 0 : valid >= kLanes ? kLanes : static_cast<int>(valid);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(clamped), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
TC_INLINE reg masked_load(LaneMask mask, const float* p) { return _mm256_maskload_ps(p, mask); }
TC_INLINE void masked_store(float* p, LaneMask mask, reg value) { _mm256_maskstore_ps(p, mask, value); }
#endif

/// Writes rows [0, rows) and columns [0, cols) of the tile to c (leading
/// dimension ldc), adding to what is there when `accumulate`. Whole vectors go through plain
/// loads and stores, the last partial one through masked ones.
template <int MR, int NV>
TC_INLINE void tile_store(const Tile<MR, NV>& tile, float* c, index_t ldc, index_t rows,
                          index_t cols, bool accumulate) {
  LaneMask masks[NV];
  bool whole[NV];
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) {
    masks[j] = lane_mask(cols - j * kLanes);
    whole[j] = cols - j * kLanes >= kLanes;
  }
#pragma GCC unroll 64
  for (int i = 0; i < MR; ++i) {
    if (i >= rows) break;
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      float* dst = c + i * ldc + j * kLanes;
      reg value = tile.acc[i][j];
      if (whole[j]) {
        if (accumulate) value = Vec::add(value, Vec::load(dst));
        Vec::store(dst, value);
      } else if (cols > j * kLanes) {
        if (accumulate) value = Vec::add(value, masked_load(masks[j], dst));
        masked_store(dst, masks[j], value);
      }
    }
  }
}

}  // namespace tc::gconv
