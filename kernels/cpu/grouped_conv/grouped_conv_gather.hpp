// Forward and bwd_data as one implicit GEMM per group, "gather" form:
//
//   dst[m, j] = sum_{tap, l} src[source(m, tap), l] * W[tap, l, j]
//
//               dst (rows m)        src (depth l)     columns j   source()
//   forward     output NDHWGK       input NDHWGC (C)  K           o*s - p + f*d
//   bwd_data    din NDHWGC          dout NDHWGK (K)   C           (i + p - f*d) / s if exact
//
// bwd_data reads, for each input pixel, the output pixels whose window covers
// it: no scatter, no atomics. K_gemm index r = tap * L + l; the weight is
// packed once per call into NR-column panels W[g][panel][r][NR], zero-padded.
#pragma once

#include <algorithm>

#include "grouped_conv_microkernel.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

template <int Dir>
class GatherPolicy {
  static_assert(Dir == kForward || Dir == kBwdData, "GatherPolicy is forward / bwd_data only");

 public:
  /// `src` is the input (forward) or dout (bwd_data); `zeros` holds >= L zeros.
  GatherPolicy(const ConvShape& shape, const float* src, const float* weight, float* weight_packed,
               const float* zeros)
      : s_(shape), src_(src), weight_(weight), packed_(weight_packed), zeros_(zeros) {
    const bool fwd = Dir == kForward;
    for (int dim = 0; dim < 3; ++dim) {
      dst_dims_[dim] = fwd ? s_.out[dim] : s_.in[dim];
      src_dims_[dim] = fwd ? s_.in[dim] : s_.out[dim];
    }
    depth_per_tap_ = fwd ? s_.c : s_.k;
    cols_ = fwd ? s_.k : s_.c;
    dst_pixels_ = fwd ? s_.out_pixels() : s_.in_pixels();
    src_pixels_ = fwd ? s_.in_pixels() : s_.out_pixels();
    panels_ = ceil_div(cols_, kNR);
  }

  /// Size of the packed weight for the whole call.
  static index_t packed_weight_elems(const ConvShape& s) {
    const index_t cols = Dir == kForward ? s.k : s.c;
    return s.g * round_up(cols, kNR) * s.taps() * (Dir == kForward ? s.c : s.k);
  }

  int groups() const { return int(s_.g); }
  index_t rows() const { return s_.n * dst_pixels_; }
  index_t panels() const { return panels_; }
  index_t depth() const { return s_.taps() * depth_per_tap_; }
  index_t unit_rows() const { return dst_pixels_; }
  index_t out_elems() const { return rows() * s_.g * cols_; }
  // A group's slice of dst: one run of `cols` per row.
  index_t run_count() const { return rows(); }
  index_t run_length() const { return cols_; }
  index_t run_offset(int g, index_t row) const { return (row * s_.g + g) * cols_; }

  /// Weight packing work, one unit per (group, panel).
  index_t prepare_units() const { return s_.g * panels_; }
  void prepare(index_t unit) const {
    const index_t g = unit / panels_, panel = unit % panels_;
    const index_t depth = this->depth(), taps = s_.taps(), L = depth_per_tap_;
    float* dst = packed_ + unit * depth * kNR;
    for (index_t lane = 0; lane < kNR; ++lane) {
      const index_t j = panel * kNR + lane;
      for (index_t r = 0; r < depth; ++r) {
        float value = 0.0f;
        if (j < cols_) {
          if constexpr (Dir == kForward) {  // W[r = (tap, c), k] = wei[g, k, tap, c]
            value = weight_[(g * s_.k + j) * depth + r];
          } else {  // W[r = (tap, k), c] = wei[g, k, tap, c]
            const index_t tap = r / L, k = r % L;
            value = weight_[((g * s_.k + k) * taps + tap) * s_.c + j];
          }
        }
        dst[r * kNR + lane] = value;
      }
    }
  }

  /// Packs rows [m0, m0+MR) x depth [p0, p0+kc) as kc x MR (rows past the end = 0).
  void pack_a(int g, index_t m0, index_t p0, index_t kc, float* __restrict dst) const {
    static_assert(kMR == 8, "pack_a transposes 8 x 8 blocks");
    for_each_segment(g, m0, p0, kc, [&](const float* const* rows, index_t len, index_t offset) {
      // Padding rows point at zeros (>= L floats), so every row reads alike.
      float* out = dst + offset * kMR;
      index_t l = 0;
      for (; l + 8 <= len; l += 8) {
        __m256 block[8];
        for (int i = 0; i < 8; ++i) block[i] = _mm256_loadu_ps(rows[i] + l);
        transpose8x8(block);
        for (int r = 0; r < 8; ++r) _mm256_storeu_ps(out + (l + r) * kMR, block[r]);
      }
      for (; l < len; ++l)
        for (int i = 0; i < kMR; ++i) out[l * kMR + i] = rows[i][l];
    });
  }

  /// Panel j of the packed weight, from depth p0 on: already kc x NR.
  const float* b_block(int g, index_t j, index_t p0, index_t, float*) const {
    return packed_ + ((g * panels_ + j) * depth() + p0) * kNR;
  }

  /// Direct pipeline: accumulate rows [m0, m0+MR) x panel j over depth [p0, p0+kc).
  TC_INLINE void direct_tile(MicroTile& tile, int g, index_t m0, index_t j, index_t p0,
                             index_t kc) const {
    const float* b = b_block(g, j, p0, kc, nullptr);
    for_each_segment(g, m0, p0, kc, [&](const float* const* rows, index_t len, index_t offset) {
      tile_rows(tile, len, rows, b + offset * kNR);
    });
  }

  void store(const MicroTile& tile, float* out, int g, index_t m0, index_t j, bool accumulate) const {
    const index_t ldc = s_.g * cols_;
    tile_store(tile, out + m0 * ldc + g * cols_ + j * kNR, ldc, std::min<index_t>(kMR, rows() - m0),
               cols_ - j * kNR, accumulate);
  }

 private:
  /// Calls fn(rows, len, offset) for each run of depth [p0, p0+kc) inside one
  /// tap: rows[i] points at src element l0 of row m0+i's source pixel for that
  /// tap (or at zeros), offset is the run's start relative to p0. Taps where
  /// every row reads padding are skipped: they add nothing.
  template <class Fn>
  TC_INLINE void for_each_segment(int g, index_t m0, index_t p0, index_t kc, Fn&& fn) const {
    const index_t L = depth_per_tap_;
    const index_t pixel_stride = s_.g * L;
    Pixel dst[kMR];
    bool live[kMR];
    for (int i = 0; i < kMR; ++i) {
      live[i] = m0 + i < rows();
      dst[i] = split_pixel(live[i] ? m0 + i : 0, dst_dims_);
    }
    const float* base = src_ + g * L;
    index_t r = p0;
    const index_t end = p0 + kc;
    index_t tap = r / L, l0 = r % L;
    while (r < end) {
      const index_t len = std::min(L - l0, end - r);
      const Pixel f = split_tap(tap, s_.filt);
      const float* rows[kMR];
      bool any = false;
      for (int i = 0; i < kMR; ++i) {
        rows[i] = zeros_;
        if (!live[i]) continue;
        const index_t sd = kNdim == 3 ? source(0, dst[i].d, f.d) : 0;
        const index_t sh = source(1, dst[i].h, f.h);
        const index_t sw = source(2, dst[i].w, f.w);
        if ((sd | sh | sw) < 0) continue;
        const index_t pixel = ((dst[i].n * src_dims_[0] + sd) * src_dims_[1] + sh) * src_dims_[2] + sw;
        rows[i] = base + pixel * pixel_stride + l0;
        any = true;
      }
      if (any) fn(rows, len, r - p0);
      else if constexpr (kPipeline == kIm2col) fn(rows, len, r - p0);  // packing must write zeros
      r += len;
      ++tap;
      l0 = 0;
    }
  }

  TC_INLINE index_t source(int dim, index_t dst, index_t f) const {
    return gather_source<Dir>(s_, dim, dst, f);
  }

  ConvShape s_;
  const float* src_;
  const float* weight_;
  float* packed_;
  const float* zeros_;
  index_t dst_dims_[3], src_dims_[3];
  index_t depth_per_tap_, cols_, dst_pixels_, src_pixels_, panels_;
};

}  // namespace tc::gconv
