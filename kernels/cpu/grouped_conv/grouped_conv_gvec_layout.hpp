// The gvec pipeline's copies and phases (grouped_conv_gvec.hpp): the weights packed per
// column block, the source relaid into its zero-padded image, and bwd_data's phases at a
// stride; where a pixel lies in the padded image.
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "grouped_conv_gvec_conv.hpp"

namespace tc::gconv {

/// packed[cb][t][s][lane]: the weight of each lane's (group, destination channel) (see
/// lane_channel_), zero past G or D.
template <int Dir>
inline void GroupVectorConv<Dir>::pack_weight() const {
  const index_t taps = s_.taps(), S = src_ch_, lanes = nv_ * L;
#pragma omp for schedule(static) nowait
  for (index_t unit = 0; unit < col_blocks_ * taps; ++unit) {
    const index_t cb = unit / taps, t = unit % taps;
    float* dst = packed_.get() + unit * S * lanes;
    for (index_t lane = 0; lane < lanes; ++lane) {
      const index_t channel = lane_channel_[cb * lanes + lane];
      if (channel < 0) {
        for (index_t s = 0; s < S; ++s) dst[s * lanes + lane] = 0.0f;
        continue;
      }
      const index_t g = channel / dst_ch_, d = channel % dst_ch_;
      // w[g][k][t][c]: forward (k = d, c = s) reads along c, bwd_data (k = s, c = d) along k
      const float* from = weight_ + (g * s_.k * taps + t) * s_.c +
                          (Dir == kForward ? d * taps * s_.c : d);
      const index_t step = Dir == kForward ? 1 : taps * s_.c;
      for (index_t s = 0; s < S; ++s) dst[s * lanes + lane] = from[s * step];
    }
  }
}

/// relaid[pixel][gb][s][gi] = src[pixel][g = gb * Gv + gi][s], zero past G. A block of
/// Gv groups x S channels is a transpose: one permutation of a vector when it fills one.
template <int Dir>
template <int Gv>
inline void GroupVectorConv<Dir>::relayout() const {
  const index_t S = src_ch_, G = s_.g, full_blocks = G / Gv;
#ifdef __AVX512F__
  const bool one_vector = Gv * S == L;
  alignas(64) int order[L];
  for (int j = 0; j < L; ++j) order[j] = one_vector ? (j % Gv) * int(S) + j / Gv : 0;
  const __m512i permutation = _mm512_load_si512(order);
#else
  const bool one_vector = false;
#endif
  // a line at a time (one (n, d, h) of the source): its pixels are consecutive on both
  // sides, so nothing is divided per pixel, and a same-layout line is one copy
  const index_t width = src_dims_[2], lines = s_.n * src_pixels_ / width;
  const bool same_layout = Gv == 1 || S == 1;
#pragma omp for schedule(static)
  for (index_t line = 0; line < lines; ++line) {
    const float* line_src = src_ + line * width * G * S;
    float* line_dst = relaid_.get() + padded_pixel(split_pixel(line * width, src_dims_), 0) * src_row_;
    if (same_layout && src_row_ == G * S) {  // zeros past G: none
      std::copy(line_src, line_src + width * G * S, line_dst);
      continue;
    }
    for (index_t w = 0; w < width; ++w) {
      const float* row = line_src + w * G * S;
      float* dst = line_dst + w * src_row_;
      index_t gb = 0;
      if (same_layout) {  // a copy, zeros past G
        std::copy(row, row + G * S, dst);
        std::fill(dst + G * S, dst + src_row_, 0.0f);
        continue;
      }
#ifdef __AVX512F__
      if (one_vector)
        for (; gb < full_blocks; ++gb)
          _mm512_storeu_ps(dst + gb * L, _mm512_permutexvar_ps(permutation, _mm512_loadu_ps(row + gb * L)));
#endif
      for (; gb < group_blocks_; ++gb)
        for (index_t s = 0; s < S; ++s)
          for (int gi = 0; gi < Gv; ++gi) {
            const index_t g = gb * Gv + gi;
            dst[(gb * S + s) * Gv + gi] = g < G ? row[g * S + s] : 0.0f;
          }
    }
  }
}

/// bwd_data's phases (see Phase), and the padding of dout that keeps every tap of every
/// pixel inside the copy: below, the most any tap reaches before row 0; above, past the end.
template <int Dir>
inline void GroupVectorConv<Dir>::plan_phases() {
  index_t below[3] = {0, 0, 0}, above[3] = {0, 0, 0}, residues[3];
  auto reach = [&](int dim, index_t r, index_t f, index_t& a) {  // whether tap f reads, and where
    const index_t num = r + s_.pad[dim] - f * s_.dil[dim], stride = s_.stride[dim];
    if (((num % stride) + stride) % stride != 0) return false;
    a = num / stride;
    return true;
  };
  for (int dim = 0; dim < 3; ++dim) {
    residues[dim] = residues_[dim] = std::min(s_.stride[dim], dst_dims_[dim]);
    for (index_t r = 0; r < residues[dim]; ++r) {
      const index_t last = ceil_div(dst_dims_[dim] - r, s_.stride[dim]) - 1;
      for (index_t f = 0, a = 0; f < s_.filt[dim]; ++f)
        if (reach(dim, r, f, a)) {
          below[dim] = std::max(below[dim], -a);
          above[dim] = std::max(above[dim], last + a - (src_dims_[dim] - 1));
        }
    }
    lead_[dim] = below[dim];
    padded_[dim] = src_dims_[dim] + below[dim] + above[dim];
  }
  for (index_t rd = 0; rd < residues[0]; ++rd)
    for (index_t rh = 0; rh < residues[1]; ++rh)
      for (index_t rw = 0; rw < residues[2]; ++rw) {
        const index_t r[3] = {rd, rh, rw};
        Phase phase{false, {rd, rh, rw}, {s_.stride[0], s_.stride[1], s_.stride[2]}, {}, {}, {}, {}};
        for (int dim = 0; dim < 3; ++dim) phase.dims[dim] = ceil_div(dst_dims_[dim] - r[dim], s_.stride[dim]);
        for (index_t t = 0; t < s_.taps(); ++t) {
          const Pixel f = split_tap(t, s_.filt);
          const index_t fs[3] = {f.d, f.h, f.w};
          index_t a[3];
          bool reads = true;
          for (int dim = 0; dim < 3; ++dim) reads = reads && reach(dim, r[dim], fs[dim], a[dim]);
          if (!reads) continue;
          phase.taps.push_back(t);
          for (int dim = 0; dim < 3; ++dim) phase.at[dim].push_back(a[dim]);
          phase.offsets.push_back((((a[0] + lead_[0]) * padded_[1] + a[1] + lead_[1]) * padded_[2] +
                                   a[2] + lead_[2]) * src_row_);
        }
        phases_.push_back(std::move(phase));
      }
}

/// The index of a pixel in the padded source: at `scale` 0 source pixel p's place, at
/// scale 1 the place tap offsets count from for destination pixel p (bwd_data: p's index
/// within its phase).
template <int Dir>
inline index_t GroupVectorConv<Dir>::padded_pixel(const Pixel& p, int scale) const {
  index_t at[3] = {p.d, p.h, p.w};
  for (int dim = 0; dim < 3; ++dim)
    at[dim] = scale ? at[dim] * (Dir != kBwdData ? s_.stride[dim] : 1) : at[dim] + lead_[dim];
  return ((p.n * padded_[0] + at[0]) * padded_[1] + at[1]) * padded_[2] + at[2];
}

/// The pixel `count` past p along the (n, d, h, w) order of an image of `dims`.
template <int Dir>
TC_INLINE void GroupVectorConv<Dir>::advance(Pixel& p, index_t count, const index_t (&dims)[3]) {
  p.w += count;
  while (p.w >= dims[2]) {
    p.w -= dims[2];
    if (++p.h < dims[1]) continue;
    p.h = 0;
    if (kNdim == 3 && ++p.d < dims[0]) continue;
    p.d = 0;
    ++p.n;
  }
}

}  // namespace tc::gconv
