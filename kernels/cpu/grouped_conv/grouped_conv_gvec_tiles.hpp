// The gvec pipeline's vectors and tiles (grouped_conv_gvec.hpp): a 16-lane Row (one zmm, or
// two ymm with AVX2), each ISA's tile sizes, and the tile of the in-place path, which reads
// the source where it lies (GroupVectorConv::in_place_block).
#pragma once

#include <immintrin.h>

#include <cstring>

#include "grouped_conv_microkernel.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

namespace gvec {

constexpr int kRowLanes = 16;

/// Sixteen lanes: one zmm, or two ymm with AVX2.
#ifdef __AVX512F__
// A tile's pixels: 2 x 8 accumulators + up to 4 weight rows + a broadcast, and the rows'
// pointers stay in registers (12 pixels were no faster).
constexpr int kMR = 8;
// Source channels a step: 4, or 1 when they do not divide by 4 (steps of 8 and 2 were no
// faster and doubled the build time).
constexpr int kMaxSB = 4;
constexpr int kChains = 2;
constexpr int kMaxNV = 4;
/// Pixels a tile for NV rows a pixel: NV x MR accumulators + NV weight rows + a broadcast fit.
constexpr int rows_for(int nv) { return nv == 4 ? 6 : kMR; }
// Depthwise reads its source in place (see GroupVectorConv::in_place_): pixels a tile, one
// zmm accumulator each, a weight row and a source row (on Zen 4 much faster than the padded
// copy, forward and bwd_data at a stride; 8 pixels a tile only a little faster on wide
// images and slower on narrow ones, 20 slower). One group's channels a row (Gv = 1) keep the
// copy: in place, 12 pixels a tile, they were slower (a 7x7 stem most)
constexpr int kDepthwiseRows = 14;
constexpr int kChannelRows = 0;
/// bwd_weight's (tap, channel) pairs a unit: pairs x NV (x 2 pixel chains at NV = 1)
/// accumulators + NV dout rows + a broadcast fit.
constexpr int pairs_for(int nv) { return nv == 1 ? 8 : nv == 2 ? 6 : 4; }
struct Row {
  __m512 v;
  /// Lanes [0, n) (all when n >= 16) to p, added to what is there when `accumulate`.
  TC_INLINE void store_first(float* p, index_t n, bool accumulate) const {
    const __mmask16 mask = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m512 value = accumulate ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p)) : v;
    _mm512_mask_storeu_ps(p, mask, value);
  }
  TC_INLINE void add(Row other) { v = _mm512_add_ps(v, other.v); }
  static TC_INLINE Row zero() { return {_mm512_setzero_ps()}; }
  static TC_INLINE Row load(const float* p) { return {_mm512_loadu_ps(p)}; }
  /// Lanes [0, n) from p (all when n >= 16), zeros past them; nothing past them is read.
  static TC_INLINE Row load_first(const float* p, index_t n) {
    return {_mm512_maskz_loadu_ps(n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1), p)};
  }
  TC_INLINE void fma(Row a, Row b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  TC_INLINE void store(float* p) const { _mm512_storeu_ps(p, v); }
  /// Gv consecutive floats at p, repeated over the 16 lanes.
  template <int Gv>
  static TC_INLINE Row broadcast(const float* p) {
    if constexpr (Gv == 16) return {_mm512_loadu_ps(p)};
    else if constexpr (Gv == 8) return {_mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p))))};
    else if constexpr (Gv == 4) return {_mm512_broadcast_f32x4(_mm_loadu_ps(p))};
    else if constexpr (Gv == 2) {
      double pair;
      std::memcpy(&pair, p, sizeof(pair));
      return {_mm512_castpd_ps(_mm512_set1_pd(pair))};
    } else {
      return {_mm512_set1_ps(*p)};
    }
  }
};
#else
constexpr int kMR = 4;      // 4 x 2 accumulators + 2 x 2 weight rows + a broadcast of 16 ymm
constexpr int kMaxSB = 2;
constexpr int kChains = 1;  // 16 ymm hold no second set
constexpr int kMaxNV = 2;
// 6 pixels (12 accumulators) for one source channel a step were slower: kMR for all
constexpr int rows_for(int nv) { return nv == 1 ? kMR : 2; }
// Depthwise in place (GroupVectorConv::in_place_): pixels a tile, 2 x 7 accumulators and a
// tap's weight row (2 ymm); 6 and 4 were slower
constexpr int kDepthwiseRows = 7;
// One group's channels in place (Gv = 1): 6 pixels x 2 ymm accumulators, a
// weight row (2 ymm) and a broadcast of the source
constexpr int kChannelRows = 6;
constexpr int pairs_for(int nv) { return nv == 1 ? 4 : 2; }
struct Row {
  __m256 lo, hi;
  TC_INLINE void store_first(float* p, index_t n, bool accumulate) const {
    if (n >= 16) {
      store_half(p, lo, accumulate);
      store_half(p + 8, hi, accumulate);
      return;
    }
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    store_half_masked(p, lo, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lanes), accumulate);
    store_half_masked(p + 8, hi, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n) - 8), lanes), accumulate);
  }
  static TC_INLINE void store_half(float* p, __m256 v, bool accumulate) {
    _mm256_storeu_ps(p, accumulate ? _mm256_add_ps(v, _mm256_loadu_ps(p)) : v);
  }
  static TC_INLINE void store_half_masked(float* p, __m256 v, __m256i mask, bool accumulate) {
    _mm256_maskstore_ps(p, mask, accumulate ? _mm256_add_ps(v, _mm256_maskload_ps(p, mask)) : v);
  }
  /// Lane j of the result is lane order[j] of this row (order[j] in [0, 16)).
  TC_INLINE Row permuted(const int (&order)[16]) const {
    Row out;
    __m256* halves[2] = {&out.lo, &out.hi};
    for (int half = 0; half < 2; ++half) {
      const __m256i index = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order + 8 * half));
      const __m256i from_hi = _mm256_cmpgt_epi32(index, _mm256_set1_epi32(7));
      const __m256i within = _mm256_and_si256(index, _mm256_set1_epi32(7));
      *halves[half] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, within),
                                       _mm256_permutevar8x32_ps(hi, within), _mm256_castsi256_ps(from_hi));
    }
    return out;
  }
  TC_INLINE void add(Row other) {
    lo = _mm256_add_ps(lo, other.lo);
    hi = _mm256_add_ps(hi, other.hi);
  }
  static TC_INLINE Row zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static TC_INLINE Row load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  /// Lanes [0, n) from p (all when n >= 16), zeros past them; nothing past them is read.
  static TC_INLINE Row load_first(const float* p, index_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return {_mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lanes)),
            _mm256_maskload_ps(p + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n) - 8), lanes))};
  }
  TC_INLINE void fma(Row a, Row b) {
    lo = _mm256_fmadd_ps(a.lo, b.lo, lo);
    hi = _mm256_fmadd_ps(a.hi, b.hi, hi);
  }
  TC_INLINE void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  template <int Gv>
  static TC_INLINE Row broadcast(const float* p) {
    if constexpr (Gv == 16) {
      return load(p);
    } else {
      __m256 half;
      if constexpr (Gv == 8) half = _mm256_loadu_ps(p);
      else if constexpr (Gv == 4) half = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
      else if constexpr (Gv == 2) half = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p)));
      else half = _mm256_broadcast_ss(p);
      return {half, half};
    }
  }
};
#endif

/// Every accumulator of a tile, [chains][rows][vectors], to zero.
template <int A, int B, int C>
TC_INLINE void zero_all(Row (&acc)[A][B][C]) {
#pragma GCC unroll 2
  for (int a = 0; a < A; ++a)
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[a][b][c] = Row::zero();
}

/// Weights a pass of in_place_line (Channels) reads, in floats: 16 KiB, half of L1.
constexpr index_t kInPlaceWeights = 4096;

/// One line of one row of destination lanes for in_place_block.
struct InPlaceLine {
  const float* origin;   // the source of the line's pixel 0 (where its tap offsets count from)
  index_t step;          // floats between the sources of neighbouring pixels
  const float* weights;  // the row's weights for tap 0, source channel 0
  index_t tap_step;      // floats between a tap's weights and the next tap's
  index_t channel_step;  // floats between a source channel's weights and the next's (Channels)
  index_t channels;      // source channels (Channels; depthwise 1)
  float* dst;            // the line's pixel 0 in the destination
  index_t dst_step;      // floats between destination pixels
  index_t lanes;         // of 16 written (the rest past G or D: their source not read, Depthwise)
};

/// Pixels [w, w + R) of a line: the sum over `count` taps (and, Channels, the source
/// channels) of the source at off[k] times tap tap[k]'s weight row, added to the
/// destination when `accumulate`.
template <int R, bool Partial, bool Channels>
TC_INLINE void in_place_tile(const InPlaceLine& line, index_t w, const index_t* off,
                             const index_t* tap, index_t count, bool accumulate) {
  const float* at = line.origin + w * line.step;
  const index_t step = line.step, lanes = line.lanes;
  Row acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = Row::zero();
  for (index_t k = 0; k < count; ++k) {
    const float* from = at + off[k];
    const float* weights = line.weights + tap[k] * line.tap_step;
    if constexpr (Channels) {
      for (index_t c = 0; c < line.channels; ++c) {
        const Row weight = Row::load(weights + c * line.channel_step);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) acc[i].fma(Row::template broadcast<1>(from + i * step + c), weight);
      }
    } else {
      const Row weight = Row::load(weights);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i)
        acc[i].fma(Partial ? Row::load_first(from + i * step, lanes) : Row::load(from + i * step), weight);
    }
  }
  float* dst = line.dst + w * line.dst_step;
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i].store_first(dst + i * line.dst_step, Partial ? lanes : kRowLanes, accumulate);
}

/// in_place_tile of `rows` (1 to R) pixels.
template <int R, bool Partial, bool Channels>
TC_INLINE void in_place_rest(index_t rows, const InPlaceLine& line, index_t w, const index_t* off,
                             const index_t* tap, index_t count, bool accumulate) {
  if constexpr (R > 1)
    if (rows < R) return in_place_rest<R - 1, Partial, Channels>(rows, line, w, off, tap, count, accumulate);
  in_place_tile<R, Partial, Channels>(line, w, off, tap, count, accumulate);
}

}  // namespace gvec

}  // namespace tc::gconv
