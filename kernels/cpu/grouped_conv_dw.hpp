// Depthwise pipeline (C == K == 1 per group) for all three directions.
//
// With C = K = 1 the NDHWGC layout puts the group index at unit stride, so the
// vectors run over groups (16 per zmm) and each output pixel is a row: the
// per-group GEMM has a single column and would waste 15/16 of every vector.
// Vectorising over width instead would need stride-G gathers.
//
//   forward / bwd_data  tile = MR pixels x NR groups, reduced over taps;
//                       BM pixels x BN groups per block, BK taps per pass
//   bwd_weight          4 pixel lanes x NR groups per tap, reduced over pixels;
//                       BM taps x BN groups per block, BK pixels per pass
//
// Waves: intra splits one group block's pixel blocks (bwd_weight: the
// (tap block, group block) grid); inter takes whole (group block, image) units
// (bwd_weight: whole group blocks).
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "grouped_conv_microkernel.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

/// Forward (Dir 0) or bwd_data (Dir 1): dst[m, g] = sum_t src[source(m, t), g] * w[g, t].
template <int Dir>
class DepthwiseGather {
 public:
  DepthwiseGather(const ConvShape& shape, const float* src, const float* weight, float* packed,
                  const float* zeros)
      : s_(shape), src_(src), weight_(weight), packed_(packed), zeros_(zeros) {
    for (int dim = 0; dim < 3; ++dim) {
      dst_dims_[dim] = Dir == kForward ? s_.out[dim] : s_.in[dim];
      src_dims_[dim] = Dir == kForward ? s_.in[dim] : s_.out[dim];
    }
    dst_pixels_ = dst_dims_[0] * dst_dims_[1] * dst_dims_[2];
    groups_padded_ = round_up(s_.g, kNR);
    // each (destination coordinate, filter offset)'s source coordinate, looked up in the
    // tile instead of computed there: bwd_data's is a division by the stride
    for (int dim = 0; dim < 3; ++dim) {
      sources_[dim].resize(dst_dims_[dim] * s_.filt[dim]);
      for (index_t d = 0; d < dst_dims_[dim]; ++d)
        for (index_t f = 0; f < s_.filt[dim]; ++f)
          sources_[dim][d * s_.filt[dim] + f] = gather_source<Dir>(s_, dim, d, f);
    }
  }

  static index_t packed_weight_elems(const ConvShape& s) { return s.taps() * round_up(s.g, kNR); }

  void run(float* out, int threads) const {
    const index_t taps = s_.taps(), rows = s_.n * dst_pixels_;
    const index_t group_blocks = ceil_div(s_.g, kBN), m_blocks = ceil_div(rows, kBM);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
      for (index_t t = 0; t < taps; ++t)  // transposed weight: w[t][g], groups contiguous
        for (index_t g = 0; g < groups_padded_; ++g)
          packed_[t * groups_padded_ + g] = g < s_.g ? weight_[g * taps + t] : 0.0f;
      if constexpr (!kInterWave) {
        for (index_t gb = 0; gb < group_blocks; ++gb) {
#pragma omp for schedule(static) nowait
          for (index_t mb = 0; mb < m_blocks; ++mb)
            block(out, gb * kBN, mb * kBM, std::min(rows, (mb + 1) * kBM));
        }
      } else {
#pragma omp for schedule(dynamic, 1)
        for (index_t unit = 0; unit < group_blocks * s_.n; ++unit) {
          const index_t gb = unit / s_.n, n = unit % s_.n;
          for (index_t m = n * dst_pixels_; m < (n + 1) * dst_pixels_; m += kBM)
            block(out, gb * kBN, m, std::min((n + 1) * dst_pixels_, m + kBM));
        }
      }
    }
  }

 private:
  /// Groups [g_begin, g_begin + BN) x rows [m_begin, m_end).
  void block(float* out, index_t g_begin, index_t m_begin, index_t m_end) const {
    const index_t taps = s_.taps();
    const index_t g_end = std::min(g_begin + kBN, s_.g);
    for (index_t g0 = g_begin; g0 < g_end; g0 += kNR)
      for (index_t t0 = 0; t0 < taps; t0 += kBK)
        for (index_t m0 = m_begin; m0 < m_end; m0 += kMR)
          tile(out, g0, m0, std::min<index_t>(kMR, m_end - m0), t0, std::min(taps, t0 + kBK));
  }

  TC_INLINE void tile(float* out, index_t g0, index_t m0, index_t rows, index_t t_begin,
                      index_t t_end) const {
    Pixel dst[kMR];
    for (int i = 0; i < kMR; ++i) dst[i] = split_pixel(i < rows ? m0 + i : m0, dst_dims_);
    MicroTile acc;
    acc.zero();
    for (index_t t = t_begin; t < t_end; ++t) {
      const Pixel f = split_tap(t, s_.filt);
      reg w[kNV];
      for (int v = 0; v < kNV; ++v) w[v] = Vec::load(packed_ + t * groups_padded_ + g0 + v * kLanes);
#pragma GCC unroll 8
      for (int i = 0; i < kMR; ++i) {
        const float* row = zeros_;
        const index_t sd = kNdim == 3 ? source(0, dst[i].d, f.d) : 0;
        const index_t sh = source(1, dst[i].h, f.h), sw = source(2, dst[i].w, f.w);
        if (i < rows && (sd | sh | sw) >= 0)
          row = src_ + (((dst[i].n * src_dims_[0] + sd) * src_dims_[1] + sh) * src_dims_[2] + sw) * s_.g + g0;
#pragma GCC unroll 8
        for (int v = 0; v < kNV; ++v)
          acc.acc[i][v] = Vec::fma(Vec::load(row + v * kLanes), w[v], acc.acc[i][v]);
      }
    }
    tile_store(acc, out + m0 * s_.g + g0, s_.g, rows, s_.g - g0, t_begin > 0);
  }

  TC_INLINE index_t source(int dim, index_t dst, index_t f) const {
    return sources_[dim][dst * s_.filt[dim] + f];
  }

  ConvShape s_;
  const float* src_;
  const float* weight_;
  float* packed_;
  const float* zeros_;
  index_t dst_dims_[3], src_dims_[3], dst_pixels_, groups_padded_;
  std::vector<index_t> sources_[3];
};

/// bwd_weight: dwei[g, t] = sum_p in[forward_source(p, t), g] * dout[p, g].
class DepthwiseWeightGrad {
 public:
  DepthwiseWeightGrad(const ConvShape& shape, const float* input, const float* dout)
      : s_(shape), in_(input), dout_(dout) {}

  void run(float* out, int threads) const {
    const index_t taps = s_.taps();
    const index_t tap_blocks = ceil_div(taps, kBM), group_blocks = ceil_div(s_.g, kBN);
#pragma omp parallel num_threads(threads)
    {
      if constexpr (!kInterWave) {
#pragma omp for schedule(dynamic, 1)
        for (index_t block = 0; block < tap_blocks * group_blocks; ++block) {
          const index_t tb = block % tap_blocks, gb = block / tap_blocks;
          run_block(out, tb * kBM, std::min(taps, (tb + 1) * kBM), gb * kBN);
        }
      } else {
#pragma omp for schedule(dynamic, 1)
        for (index_t gb = 0; gb < group_blocks; ++gb) run_block(out, 0, taps, gb * kBN);
      }
    }
  }

 private:
  static constexpr int kLanesP = 4;  // independent pixel accumulators: hides FMA latency

  void run_block(float* out, index_t t_begin, index_t t_end, index_t g_begin) const {
    const index_t pixels = s_.n * s_.out_pixels();
    const index_t g_end = std::min(g_begin + kBN, s_.g);
    for (index_t p0 = 0; p0 < pixels; p0 += kBK)
      for (index_t t = t_begin; t < t_end; ++t)
        for (index_t g0 = g_begin; g0 < g_end; g0 += kNR)
          tap_panel(out, t, g0, p0, std::min(pixels, p0 + kBK));
  }

  /// dwei[g0 : g0+NR, t] (+)= the sum over pixels [p_begin, p_end).
  void tap_panel(float* out, index_t t, index_t g0, index_t p_begin, index_t p_end) const {
    const Pixel f = split_tap(t, s_.filt);
    index_t w_lo, w_hi;
    forward_valid_range(s_, 2, f.w, w_lo, w_hi);
    const index_t G = s_.g, wo = s_.out[2];
    Tile<kLanesP, kNV> acc;
    acc.zero();
    for (index_t p = p_begin; p < p_end;) {
      const Pixel o = split_pixel(p, s_.out);
      const index_t row_end = std::min(p_end, p + (wo - o.w));
      const index_t id = kNdim == 3 ? forward_source(s_, 0, o.d, f.d) : 0;
      const index_t ih = forward_source(s_, 1, o.h, f.h);
      const index_t first = std::max(o.w, w_lo), last = std::min(o.w + (row_end - p), w_hi);
      if ((id | ih) >= 0 && first < last) {
        const index_t iw = first * s_.stride[2] - s_.pad[2] + f.w * s_.dil[2];
        const float* a = in_ + (((o.n * s_.in[0] + id) * s_.in[1] + ih) * s_.in[2] + iw) * G + g0;
        const float* b = dout_ + (p + (first - o.w)) * G + g0;
        const index_t a_step = s_.stride[2] * G, count = last - first;
        index_t q = 0;
        for (; q + kLanesP <= count; q += kLanesP)
#pragma GCC unroll 8
          for (int l = 0; l < kLanesP; ++l)
#pragma GCC unroll 8
            for (int v = 0; v < kNV; ++v)
              acc.acc[l][v] = Vec::fma(Vec::load(a + (q + l) * a_step + v * kLanes),
                                       Vec::load(b + (q + l) * G + v * kLanes), acc.acc[l][v]);
        for (; q < count; ++q)
#pragma GCC unroll 8
          for (int v = 0; v < kNV; ++v)
            acc.acc[0][v] = Vec::fma(Vec::load(a + q * a_step + v * kLanes),
                                     Vec::load(b + q * G + v * kLanes), acc.acc[0][v]);
      }
      p = row_end;
    }
    alignas(64) float sums[kNR];
    for (int v = 0; v < kNV; ++v) {
      reg total = acc.acc[0][v];
      for (int l = 1; l < kLanesP; ++l) total = Vec::add(total, acc.acc[l][v]);
      Vec::store(sums + v * kLanes, total);
    }
    const index_t taps = s_.taps(), valid = std::min<index_t>(kNR, G - g0);
    for (index_t lane = 0; lane < valid; ++lane) {
      float& dst = out[(g0 + lane) * taps + t];
      dst = p_begin > 0 ? dst + sums[lane] : sums[lane];
    }
  }

  ConvShape s_;
  const float* in_;
  const float* dout_;
};

}  // namespace tc::gconv
