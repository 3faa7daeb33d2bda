// Packing of A and B blocks into the micro-panel layouts the micro-kernel reads.
//
// A strided source element (r, c) lives at src[r*row_stride + c*col_stride],
// which covers both row- and column-major operands. Packing converts to fp32
// (bf16 -> fp32 is a 16-bit shift), or for the bf16 dot product (kBf16Dot) keeps
// bf16 two k steps to a word, and zero-pads partial panels, so the micro-kernel
// never needs a tail case on its k, MR or NR dimension.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "gemm_config.hpp"
#include "gemm_simd.hpp"

namespace tc::gemm {

/// A read-only strided matrix view over the file's elements.
template <class T>
struct StridedView {
  const T* data;
  index_t row_stride;
  index_t col_stride;
  const T* at(index_t row, index_t col) const { return data + row * row_stride + col * col_stride; }
};

inline float to_float(float value) { return value; }
/// bf16 is the top half of an fp32 bit pattern.
inline float to_float(std::uint16_t bits) {
  const std::uint32_t widened = std::uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

/// 8 source elements as fp32 (bf16 widened by a 16-bit shift).
inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8(const std::uint16_t* src) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}


/// Lanes contiguous in the source (row-major B, column-major A): each step
/// is a short contiguous copy; full panels use a constant trip count so the
/// copy (and bf16 widening) is vectorised.
template <int W, class T>
inline void pack_lanes_contiguous(index_t len, index_t width, const T* src, index_t step_stride,
                                  float* __restrict dst) {
  for (index_t step = 0; step < len; ++step) {
    const T* line = src + step * step_stride;
    float* out = dst + step * W;
    if (width == W && W % 8 == 0) {
      for (int lane = 0; lane < W; lane += 8) _mm256_storeu_ps(out + lane, load8(line + lane));
    } else if (width == W) {
      for (int lane = 0; lane < W; ++lane) out[lane] = to_float(line[lane]);
    } else {
      for (index_t lane = 0; lane < width; ++lane) out[lane] = to_float(line[lane]);
      for (index_t lane = width; lane < W; ++lane) out[lane] = 0.0f;
    }
  }
}

/// Steps contiguous in the source (row-major A, column-major B): a
/// transpose, done in 8x8 register blocks so both reads and writes stay
/// vector-wide; leftover steps go element by element.
///
/// The last 1-7 lanes (an MR of 6, or 14 on AVX-512) go first, with whole-vector stores:
/// each spills past its step's row into the next steps' first lanes, which later stores
/// write (the next steps', or the full 8-lane blocks after). Stores that would reach past
/// the panel are masked to their own row, so nothing lands outside it. (A masked store
/// costs an AMD core several cycles: masked stores everywhere took a large share of the
/// A-packing time on AVX2.)
template <int W, class T>
inline void pack_steps_contiguous(index_t len, index_t width, const T* src, index_t lane_stride,
                                  float* __restrict dst) {
  const index_t full_lanes = width / 8 * 8;
  if (full_lanes < width) {
    const index_t lane = full_lanes, rest = width - lane;
    const float* panel_end = dst + len * W;
    const __m256i last_mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(W - lane)),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    index_t step = 0;
    for (; step + 8 <= len; step += 8) {
      __m256 rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = r < rest ? load8(src + (lane + r) * lane_stride + step) : _mm256_setzero_ps();
      transpose8x8(rows);
      for (int r = 0; r < 8; ++r) {
        float* out = dst + (step + r) * W + lane;
        if (out + 8 <= panel_end) _mm256_storeu_ps(out, rows[r]);
        else _mm256_maskstore_ps(out, last_mask, rows[r]);
      }
    }
    for (; step < len; ++step)
      for (index_t l = lane; l < W; ++l) dst[step * W + l] = l < width ? to_float(src[l * lane_stride + step]) : 0.0f;
  }
  for (index_t lane = 0; lane < full_lanes; lane += 8) {
    index_t step = 0;
    for (; step + 8 <= len; step += 8) {
      __m256 rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = load8(src + (lane + r) * lane_stride + step);
      transpose8x8(rows);
      for (int r = 0; r < 8; ++r) _mm256_storeu_ps(dst + (step + r) * W + lane, rows[r]);
    }
    for (; step < len; ++step)
      for (index_t l = lane; l < lane + 8; ++l) dst[step * W + l] = to_float(src[l * lane_stride + step]);
  }
  // Lanes no store above reached (a partial panel wider than the vector blocks): zeros.
  for (index_t lane = full_lanes < width ? std::min<index_t>(W, full_lanes + 8) : width; lane < W; ++lane)
    for (index_t step = 0; step < len; ++step) dst[step * W + lane] = 0.0f;
}

/// Packs `width` (<= W) lines of `len` elements into dst[step*W + lane]:
/// lane < width from src[lane*lane_stride + step*step_stride], the rest zero.
template <int W, class T>
inline void pack_panel(index_t len, index_t width, const T* src, index_t lane_stride,
                       index_t step_stride, float* __restrict dst) {
  if (lane_stride == 1) {
    pack_lanes_contiguous<W>(len, width, src, step_stride, dst);
  } else if (step_stride == 1) {
    pack_steps_contiguous<W>(len, width, src, lane_stride, dst);
  } else {  // only for a 1-element dimension; keep a plain loop
    for (index_t step = 0; step < len; ++step)
      for (index_t lane = 0; lane < W; ++lane)
        dst[step * W + lane] = lane < width ? to_float(src[lane * lane_stride + step * step_stride]) : 0.0f;
  }
}

/// bf16 pairs for vdpbf16ps (kBf16Dot): word [p * W + lane] of dst holds the source elements
/// (lane, 2p) in its lower half and (lane, 2p + 1) in its upper half; the upper half is zero
/// past `len` steps and lanes past `width` are zero, so a zero pair meets whatever the other
/// operand holds there. Words are written as 32-bit integers into the float buffers the
/// micro-kernel reads with vector loads (which may alias any type).
inline std::uint32_t pair_at(const std::uint16_t* src, index_t step_stride, index_t step, index_t len) {
  const std::uint32_t low = src[step * step_stride];
  const std::uint32_t high = step + 1 < len ? src[(step + 1) * step_stride] : 0u;
  return low | high << 16;
}
inline void put_word(float* dst, std::uint32_t word) { std::memcpy(dst, &word, sizeof(word)); }

/// Pairs [pair_begin, pair_end) of a pair panel whose lanes are contiguous in the source
/// (row-major B, column-major A): each pair interleaves two source lines, 16 lanes a vector.
template <int W>
inline void pack_pairs_lanes_contiguous(index_t len, index_t width, const std::uint16_t* src,
                                        index_t step_stride, index_t pair_begin, index_t pair_end,
                                        float* __restrict dst) {
  for (index_t pair = pair_begin; pair < pair_end; ++pair) {
    const std::uint16_t* low = src + 2 * pair * step_stride;
    const bool has_high = 2 * pair + 1 < len;
    float* out = dst + pair * W;
    for (int lane = 0; lane < W; lane += 16) {
      const int valid = int(std::clamp<index_t>(width - lane, 0, 16));
      const int room = std::min(16, W - lane);
      const __mmask16 read = __mmask16((1u << valid) - 1);
      __m512i words = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(read, low + lane));
      if (has_high)
        words = _mm512_or_si512(words, _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(read, low + step_stride + lane)), 16));
      if (room == 16) _mm512_storeu_si512(out + lane, words);
      else _mm512_mask_storeu_epi32(out + lane, __mmask16((1u << room) - 1), words);
    }
  }
}

/// A pair panel whose steps are contiguous in the source (row-major A, column-major B): a
/// pair is one 32-bit word of the source, so 8 lanes x 8 pairs go through an 8x8 transpose
/// of words; the lanes of a partial block past `width` come from zero rows, and the pairs
/// that reach the last 16 steps go one by one.
template <int W>
inline void pack_pairs_steps_contiguous(index_t len, index_t width, const std::uint16_t* src,
                                        index_t lane_stride, float* __restrict dst) {
  const index_t pairs = (len + 1) / 2;
  const index_t whole = len / 16 * 8;  // pairs in blocks of 8 whose 16 steps all exist
  index_t lane = 0;
  for (; lane < width; lane += 8) {
    const int rows = int(std::min<index_t>(8, width - lane));
    const int room = int(std::min<index_t>(8, W - lane));
    for (index_t pair = 0; pair < whole; pair += 8) {
      __m256 block[8];
      for (int r = 0; r < 8; ++r)
        block[r] = r < rows ? _mm256_castsi256_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(src + (lane + r) * lane_stride + 2 * pair)))
                            : _mm256_setzero_ps();
      transpose8x8(block);
      for (int r = 0; r < 8; ++r) {
        float* out = dst + (pair + r) * W + lane;
        if (room == 8) _mm256_storeu_ps(out, block[r]);
        else _mm256_mask_storeu_epi32(out, __mmask8((1u << room) - 1), _mm256_castps_si256(block[r]));
      }
    }
    for (index_t pair = whole; pair < pairs; ++pair)
      for (int l = 0; l < room; ++l)
        put_word(dst + pair * W + lane + l, l < rows ? pair_at(src + (lane + l) * lane_stride, 1, 2 * pair, len) : 0u);
  }
  // lanes no block above reached: zeros
  for (; lane < W; ++lane)
    for (index_t pair = 0; pair < pairs; ++pair) put_word(dst + pair * W + lane, 0u);
}

/// Packs `width` (<= W) lines of `len` bf16 steps into a pair panel (see pair_at).
template <int W>
inline void pack_pair_panel(index_t len, index_t width, const std::uint16_t* src, index_t lane_stride,
                            index_t step_stride, float* __restrict dst) {
  if (lane_stride == 1) {
    pack_pairs_lanes_contiguous<W>(len, width, src, step_stride, 0, (len + 1) / 2, dst);
  } else if (step_stride == 1) {
    pack_pairs_steps_contiguous<W>(len, width, src, lane_stride, dst);
  } else {  // only for a 1-element dimension
    for (index_t pair = 0; pair < (len + 1) / 2; ++pair)
      for (index_t lane = 0; lane < W; ++lane)
        put_word(dst + pair * W + lane, lane < width ? pair_at(src + lane * lane_stride, step_stride, 2 * pair, len) : 0u);
  }
}

/// Packs NR-column micro-panel `panel` of the kc x nc block of B at `b`:
/// dst holds packed_steps(kc) rows of NR floats (or words of bf16 pairs).
template <int NR, class T>
inline void pack_b_panel(StridedView<T> b, index_t kc, index_t nc, index_t panel, float* dst) {
  const index_t col = panel * NR;
  const index_t width = nc - col < NR ? nc - col : NR;
  if constexpr (kBf16Dot)
    pack_pair_panel<NR>(kc, width, b.at(0, col), b.col_stride, b.row_stride, dst + panel * NR * packed_steps(kc));
  else
    pack_panel<NR>(kc, width, b.at(0, col), b.col_stride, b.row_stride, dst + panel * NR * kc);
}

/// Packs NR-column micro-panels [panel_begin, panel_end) of the kc x nc block of B at `b`.
/// Row-major B is read kPackBRows rows at a time across the panels: a few sequential streams
/// instead of kc short reads per panel, a page apart, and each panel gets kPackBRows * NR
/// contiguous floats a visit. (One row at a time, every panel's 64-byte write fell in the
/// same L1 set, the panels being kc * NR * 4 bytes apart; in paired runs on AVX2, where
/// packing B from memory is a large share of a skinny split-K GEMM, 2 to 8 rows were faster
/// than one and 16 no faster.)
/// Other layouts go a panel at a time.
constexpr index_t kPackBRows = 4;

template <int NR, class T>
inline void pack_b_panels(StridedView<T> b, index_t kc, index_t nc, index_t panel_begin,
                          index_t panel_end, float* dst) {
  static_assert(NR % 8 == 0, "a B micro-panel row is whole 8-float vectors");
  if (b.col_stride != 1) {
    for (index_t panel = panel_begin; panel < panel_end; ++panel) pack_b_panel<NR>(b, kc, nc, panel, dst);
    return;
  }
  if constexpr (kBf16Dot) {  // kPackBRows / 2 pairs of every panel a visit
    const index_t pairs = packed_steps(kc);
    for (index_t pair = 0; pair < pairs; pair += kPackBRows / 2)
      for (index_t panel = panel_begin; panel < panel_end; ++panel) {
        const index_t col = panel * NR;
        pack_pairs_lanes_contiguous<NR>(kc, std::min<index_t>(NR, nc - col), b.at(0, col), b.row_stride, pair,
                                        std::min(pairs, pair + kPackBRows / 2), dst + panel * NR * pairs);
      }
    return;
  }
  // rows [step, step + Rows) of every panel; Rows a compile-time count, so the copies unroll
  auto rows_of_panels = [&](index_t step, auto rows) {
    constexpr index_t Rows = decltype(rows)::value;
    for (index_t panel = panel_begin; panel < panel_end; ++panel) {
      const index_t col = panel * NR;
      const index_t width = nc - col < NR ? nc - col : NR;
      float* out = dst + panel * NR * kc + step * NR;
      const T* line = b.at(step, col);
      if (width == NR) {
        for (index_t row = 0; row < Rows; ++row)
          for (int lane = 0; lane < NR; lane += 8)
            _mm256_storeu_ps(out + row * NR + lane, load8(line + row * b.row_stride + lane));
      } else {
        for (index_t row = 0; row < Rows; ++row) {
          for (index_t lane = 0; lane < width; ++lane) out[row * NR + lane] = to_float(line[row * b.row_stride + lane]);
          for (index_t lane = width; lane < NR; ++lane) out[row * NR + lane] = 0.0f;
        }
      }
    }
  };
  index_t step = 0;
  for (; step + kPackBRows <= kc; step += kPackBRows)
    rows_of_panels(step, std::integral_constant<index_t, kPackBRows>{});
  for (; step < kc; ++step) rows_of_panels(step, std::integral_constant<index_t, 1>{});
}

/// Packs MR-row micro-panel `panel` of the mc x kc block of A at `a`:
/// dst holds packed_steps(kc) columns of MR floats (or words of bf16 pairs).
template <int MR, class T>
inline void pack_a_panel(StridedView<T> a, index_t mc, index_t kc, index_t panel, float* dst) {
  const index_t row = panel * MR;
  const index_t width = mc - row < MR ? mc - row : MR;
  if constexpr (kBf16Dot)
    pack_pair_panel<MR>(kc, width, a.at(row, 0), a.row_stride, a.col_stride, dst + panel * MR * packed_steps(kc));
  else
    pack_panel<MR>(kc, width, a.at(row, 0), a.row_stride, a.col_stride, dst + panel * MR * kc);
}

inline index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }
inline index_t round_up(index_t a, index_t b) { return ceil_div(a, b) * b; }

}  // namespace tc::gemm
