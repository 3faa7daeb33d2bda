// The gvec pipeline's in-place path (grouped_conv_gvec.hpp): depthwise, and one group's
// channels a row on AVX2, read the source where it lies, a destination line at a time.
#pragma once

#include <omp.h>

#include <algorithm>

#include "grouped_conv_gvec_conv.hpp"

namespace tc::gconv {

/// In place (in_place_): destination pixels [m_begin, m_end) of `phase` x column blocks
/// [cb_begin, cb_end), a line (n, d, h) at a time, reading the source where it lies. A
/// line's taps are those whose (d, h) source row is inside the image (a padding row adds
/// nothing); the pixels whose every such tap reads inside along w go a tile of several at a
/// time, the few others (the padding's width at each end) one at a time with the taps they
/// read. Depthwise: 16 groups a row, bwd_data at a stride a phase at a time (its lines every
/// stride-th pixel of din, reading dout at stride 1 through the phase's taps); Channels
/// (Gv = 1, one phase): 16 of one group's destination channels a row, each (tap, source
/// channel) a broadcast of the source, read from the copy padded along w (pad_along_w).
/// `scratch` holds 5 x taps.
template <int Dir>
template <bool Channels>
inline void GroupVectorConv<Dir>::in_place_block(float* out, const Phase& phase, index_t cb_begin, index_t cb_end, index_t m_begin,
                    index_t m_end, index_t* scratch) const {
  const index_t taps = s_.taps(), G = s_.g, S = src_ch_, D = dst_ch_;
  // a phase's source coordinate is its pixel's index plus the tap's: stride 1
  const index_t strides[3] = {phase.whole ? s_.stride[0] : 1, phase.whole ? s_.stride[1] : 1,
                              phase.whole ? s_.stride[2] : 1};
  const index_t stride = strides[2], n_taps = phase.whole ? taps : index_t(phase.taps.size());
  const index_t width = Channels ? width_ : src_dims_[2], pixel = G * S;  // floats a source pixel
  const index_t step = stride * pixel;  // floats between the sources of neighbouring pixels
  index_t* line_off = scratch;          // a kept tap's source from the line's, in floats
  index_t* line_tap = scratch + taps;
  index_t* line_aw = scratch + 4 * taps;  // a kept tap's source column for the line's pixel 0
  Pixel p = split_pixel(m_begin, phase.dims);
  for (index_t m = m_begin; m < m_end;) {
    const index_t begin = p.w, end = p.w + std::min(phase.dims[2] - p.w, m_end - m);
    index_t kept = 0, lo = begin, hi = end;
    for (index_t k = 0; k < n_taps; ++k) {
      const index_t t = phase.whole ? k : phase.taps[k];
      const auto at = [&](int dim) { return phase.whole ? tap_at_[dim][t] : phase.at[dim][k]; };
      const index_t sd = p.d * strides[0] + at(0), sh = p.h * strides[1] + at(1);
      if (sd < 0 || sd >= src_dims_[0] || sh < 0 || sh >= src_dims_[1]) continue;
      const index_t aw = at(2);
      line_off[kept] = ((sd * src_dims_[1] + sh) * width + aw) * pixel;
      line_aw[kept] = aw;
      line_tap[kept++] = t;
      if (aw < 0) lo = std::max(lo, ceil_div(-aw, stride));           // w stride + aw >= 0
      if (aw > width - 1) hi = begin;                                   // never inside
      else hi = std::min(hi, (width - 1 - aw) / stride + 1);            // w stride + aw < width
    }
    lo = std::min(lo, end);
    hi = std::max(hi, lo);
    const float* image = (Channels ? padded_w_.get() : src_) + p.n * src_dims_[0] * src_dims_[1] * width * pixel;
    // the destination line's pixel 0, and the floats between its pixels
    const index_t dst_pixel = ((p.n * dst_dims_[0] + phase.first[0] + phase.step[0] * p.d) * dst_dims_[1] +
                               phase.first[1] + phase.step[1] * p.h) * dst_dims_[2] + phase.first[2];
    float* line_dst = out + dst_pixel * G * D;
    const index_t dst_step = phase.step[2] * G * D;
    for (index_t cb = cb_begin; cb < cb_end; ++cb) {
      if constexpr (Channels) {
        // rows of 16 of group g's destination channels from c0, the last masked past D;
        // the packed weight is [cb][tap][s][row][16]
        const index_t g = cb / channel_blocks_, c0 = cb % channel_blocks_ * nv_ * L, lanes = nv_ * L;
        for (index_t r = 0; r < nv_ && c0 + r * L < D; ++r) {
          const InPlaceLine line{image + g * S, step, packed_.get() + cb * taps * S * lanes + r * L,
                                 S * lanes, lanes, S, line_dst + g * D + c0 + r * L, dst_step,
                                 std::min<index_t>(L, D - c0 - r * L)};
          if (line.lanes == L) in_place_line<gvec::kChannelRows, false, true>(line, begin, lo, hi, end, kept, stride, scratch);
          else in_place_line<gvec::kChannelRows, true, true>(line, begin, lo, hi, end, kept, stride, scratch);
        }
      } else {
        // the last column block of a G that 16 does not divide reads and writes its lanes below G
        const InPlaceLine line{image + cb * L, step, packed_.get() + cb * taps * L, L, 0, 1,
                               line_dst + cb * L, dst_step, std::min<index_t>(L, G - cb * L)};
        if (line.lanes == L) in_place_line<gvec::kDepthwiseRows, false, false>(line, begin, lo, hi, end, kept, stride, scratch);
        else in_place_line<gvec::kDepthwiseRows, true, false>(line, begin, lo, hi, end, kept, stride, scratch);
      }
    }
    advance(p, end - begin, phase.dims);
    m += end - begin;
  }
}

/// Pixels [begin, end) of a line whose kept taps (scratch: offsets, then tap indices) all
/// read inside for pixels [lo, hi): those in tiles of MR, the others (none in Channels'
/// padded copy) with the taps they read. Channels: the taps go in passes whose weights
/// (kInPlaceWeights floats) stay in L1, each pass after the first adding to the destination.
template <int Dir>
template <int MR, bool Partial, bool Channels>
inline void GroupVectorConv<Dir>::in_place_line(const InPlaceLine& line, index_t begin, index_t lo, index_t hi, index_t end,
                   index_t kept, index_t stride, index_t* scratch) const {
  const index_t taps = s_.taps(), width = Channels ? width_ : src_dims_[2];
  const index_t* line_off = scratch;
  const index_t* line_tap = scratch + taps;
  index_t* pixel_off = scratch + 2 * taps;
  index_t* pixel_tap = scratch + 3 * taps;
  const index_t* line_aw = scratch + 4 * taps;
  // (a line of no taps: one pass, writing zeros)
  const index_t pass = Channels ? std::max<index_t>(1, gvec::kInPlaceWeights / (line.channels * L)) : std::max<index_t>(1, kept);
  for (index_t k0 = 0; k0 == 0 || k0 < kept; k0 += pass) {
    const index_t k1 = std::min(kept, k0 + pass);
    const bool accumulate = k0 > 0;
    auto edge = [&](index_t w) {
      index_t count = 0;
      for (index_t k = k0; k < k1; ++k) {
        const index_t sw = w * stride + line_aw[k];
        if (sw < 0 || sw >= width) continue;
        pixel_off[count] = line_off[k];
        pixel_tap[count++] = line_tap[k];
      }
      gvec::in_place_tile<1, Partial, Channels>(line, w, pixel_off, pixel_tap, count, accumulate);
    };
    index_t w = begin;
    for (; w < lo; ++w) edge(w);
    if constexpr (Channels) {
      // tiles as even as MR allows (a line of 14 as 5 + 5 + 4, not 6 + 6 + 2: a tile of 2
      // pixels is 4 chains of FMAs, under the latency)
      const index_t n = hi - lo, tiles = ceil_div(n, MR);
      for (index_t i = 0; i < tiles; ++i) {
        const index_t rows = n / tiles + (i < n % tiles);
        gvec::in_place_rest<MR, Partial, Channels>(rows, line, w, line_off + k0, line_tap + k0, k1 - k0, accumulate);
        w += rows;
      }
    } else {
      // depthwise: MR at a time, then the rest (even tiles were slower)
      for (; w + MR <= hi; w += MR)
        gvec::in_place_tile<MR, Partial, Channels>(line, w, line_off + k0, line_tap + k0, k1 - k0, accumulate);
      if (w < hi)
        gvec::in_place_rest<MR - 1, Partial, Channels>(hi - w, line, w, line_off + k0, line_tap + k0, k1 - k0,
                                                 accumulate);
    }
    for (w = hi; w < end; ++w) edge(w);
  }
}

/// padded_w_[n, d, h, pad_w_ + w] = src[n, d, h, w] (each pixel G x C floats); the pad
/// columns stay the zeros they were allocated as.
template <int Dir>
inline void GroupVectorConv<Dir>::pad_along_w() const {
  const index_t pixel = s_.g * src_ch_, width = src_dims_[2], lines = s_.n * src_dims_[0] * src_dims_[1];
#pragma omp for schedule(static) nowait
  for (index_t line = 0; line < lines; ++line)
    std::copy(src_ + line * width * pixel, src_ + (line + 1) * width * pixel,
              padded_w_.get() + (line * width_ + pad_w_) * pixel);
}

}  // namespace tc::gconv
