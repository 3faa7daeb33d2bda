// bwd_weight as one implicit GEMM per group:
//
//   dwei[g, k, tap, c] = sum_p dout[p, g, k] * in[forward_source(p, tap), g, c]
//
// M = K (rows), K_gemm = p over N*Do*Ho*Wo output pixels, columns = (tap, c).
// Columns are tiled per tap: each tap's C channels are padded to NR, so a
// column panel j is (tap = j / cpanels, c0 = NR * (j % cpanels)) and its B row
// for pixel p is one contiguous run of the input (or padding: skipped).
#pragma once

#include <algorithm>

#include "grouped_conv_microkernel.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

class WeightGradPolicy {
 public:
  WeightGradPolicy(const ConvShape& shape, const float* input, const float* dout)
      : s_(shape), in_(input), dout_(dout) {
    cpanels_ = ceil_div(s_.c, kNR);
  }

  int groups() const { return int(s_.g); }
  index_t rows() const { return s_.k; }
  index_t panels() const { return s_.taps() * cpanels_; }
  index_t depth() const { return s_.n * s_.out_pixels(); }
  index_t unit_rows() const { return s_.k; }  // the batch is the reduction: units are groups
  index_t out_elems() const { return s_.weight_elems(); }
  index_t run_count() const { return s_.k; }
  index_t run_length() const { return s_.taps() * s_.c; }
  index_t run_offset(int g, index_t row) const { return (g * s_.k + row) * run_length(); }
  index_t prepare_units() const { return 0; }
  void prepare(index_t) const {}

  /// Packs dout rows k in [m0, m0+MR) over pixels [p0, p0+kc) as kc x MR.
  void pack_a(int g, index_t m0, index_t p0, index_t kc, float* __restrict dst) const {
    const index_t valid = std::min<index_t>(kMR, s_.k - m0);
    const float* src = dout_ + p0 * s_.g * s_.k + g * s_.k + m0;
    for (index_t p = 0; p < kc; ++p, src += s_.g * s_.k) {
      for (index_t i = 0; i < valid; ++i) dst[p * kMR + i] = src[i];
      for (index_t i = valid; i < kMR; ++i) dst[p * kMR + i] = 0.0f;
    }
  }

  /// Packs the im2col panel j over pixels [p0, p0+kc) into scratch (kc x NR).
  const float* b_block(int g, index_t j, index_t p0, index_t kc, float* __restrict scratch) const {
    const index_t c0 = (j % cpanels_) * kNR;
    const index_t valid = std::min<index_t>(kNR, s_.c - c0);
    std::fill(scratch, scratch + kc * kNR, 0.0f);
    for_each_run(g, j, p0, kc, [&](index_t offset, index_t count, const float* b, index_t b_step) {
      for (index_t p = 0; p < count; ++p, b += b_step)
        std::copy(b, b + valid, scratch + (offset + p) * kNR);
    });
    return scratch;
  }

  /// Direct pipeline: dout read in place (rows past K read neighbouring data
  /// into discarded accumulators), input rows read in place, padding skipped.
  TC_INLINE void direct_tile(MicroTile& tile, int g, index_t m0, index_t j, index_t p0,
                             index_t kc) const {
    const index_t a_step = s_.g * s_.k;
    const float* a_base = dout_ + g * s_.k + m0;
    for_each_run(g, j, p0, kc, [&](index_t offset, index_t count, const float* b, index_t b_step) {
      tile_strided(tile, count, a_base + (p0 + offset) * a_step, a_step, b, b_step);
    });
  }

  void store(const MicroTile& tile, float* out, int g, index_t m0, index_t j, bool accumulate) const {
    const index_t tap = j / cpanels_, c0 = (j % cpanels_) * kNR;
    const index_t ldc = run_length();
    tile_store(tile, out + (g * s_.k + m0) * ldc + tap * s_.c + c0, ldc,
               std::min<index_t>(kMR, s_.k - m0), s_.c - c0, accumulate);
  }

 private:
  /// Calls fn(offset, count, b, b_step) for each run of pixels [p0, p0+kc)
  /// along one output row whose tap-j source lies inside the input: pixel
  /// p0+offset+q reads its B row at b + q*b_step.
  template <class Fn>
  TC_INLINE void for_each_run(int g, index_t j, index_t p0, index_t kc, Fn&& fn) const {
    const index_t tap = j / cpanels_, c0 = (j % cpanels_) * kNR;
    const Pixel f = split_tap(tap, s_.filt);
    index_t w_lo, w_hi;
    forward_valid_range(s_, 2, f.w, w_lo, w_hi);
    const index_t pixel_stride = s_.g * s_.c;
    const index_t wo = s_.out[2];
    const float* base = in_ + g * s_.c + c0;
    index_t p = p0;
    const index_t end = p0 + kc;
    while (p < end) {
      const Pixel o = split_pixel(p, s_.out);
      const index_t row_end = std::min(end, p + (wo - o.w));
      const index_t id = kNdim == 3 ? forward_source(s_, 0, o.d, f.d) : 0;
      const index_t ih = forward_source(s_, 1, o.h, f.h);
      if ((id | ih) >= 0) {
        const index_t first = std::max(o.w, w_lo), last = std::min(o.w + (row_end - p), w_hi);
        if (first < last) {
          const index_t iw = first * s_.stride[2] - s_.pad[2] + f.w * s_.dil[2];
          const index_t pixel = ((o.n * s_.in[0] + id) * s_.in[1] + ih) * s_.in[2] + iw;
          fn(p - p0 + (first - o.w), last - first, base + pixel * pixel_stride,
             s_.stride[2] * pixel_stride);
        }
      }
      p = row_end;
    }
  }

  ConvShape s_;
  const float* in_;
  const float* dout_;
  index_t cpanels_;
};

}  // namespace tc::gconv
