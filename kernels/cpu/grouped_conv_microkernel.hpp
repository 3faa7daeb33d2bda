// The register tile shared by every pipeline: MR x NR fp32 accumulators
// (NV = NR/16 zmm per row) and the three ways of feeding it.
//
//   tile_packed   A packed as kc x MR, B packed as kc x NR (im2col pipeline)
//   tile_rows     A gathered in place: row i reads rows[i][0:len] (direct fwd/bwd_data)
//   tile_strided  A row i at a[p*a_step + i], B row at b[p*b_step] (direct bwd_weight)
//
// All are force-inlined into callers with compile-time MR/NV, so the
// accumulators stay in registers (8 x 2 zmm + 2 B vectors + 1 broadcast).
#pragma once

#include <immintrin.h>

#include "gemm_simd.hpp"
#include "grouped_conv_config.hpp"

namespace tc::gconv {

using Vec = tc::gemm::VecAvx512;
using reg = Vec::reg;
constexpr int kLanes = Vec::width;

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

/// Lanes [0, valid) of one vector; valid may be <= 0 or >= 16.
TC_INLINE __mmask16 lane_mask(index_t valid) {
  return valid >= kLanes ? __mmask16(0xFFFF) : valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1);
}

/// Writes rows [0, rows) and columns [0, cols) of the tile to c (leading
/// dimension ldc), adding to what is there when `accumulate`.
template <int MR, int NV>
TC_INLINE void tile_store(const Tile<MR, NV>& tile, float* c, index_t ldc, index_t rows,
                          index_t cols, bool accumulate) {
  __mmask16 masks[NV];
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) masks[j] = lane_mask(cols - j * kLanes);
#pragma GCC unroll 64
  for (int i = 0; i < MR; ++i) {
    if (i >= rows) break;
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      float* dst = c + i * ldc + j * kLanes;
      reg value = tile.acc[i][j];
      if (accumulate) value = Vec::add(value, _mm512_maskz_loadu_ps(masks[j], dst));
      _mm512_mask_storeu_ps(dst, masks[j], value);
    }
  }
}

}  // namespace tc::gconv
