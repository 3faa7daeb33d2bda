// The gvec pipeline's bwd_weight (grouped_conv_gvec.hpp): the input and dout read as forward
// reads the input and writes dout; a unit is R (tap, channel) pairs of one column block.
#pragma once

#include <omp.h>

#include <algorithm>

#include "grouped_conv_gvec_conv.hpp"

namespace tc::gconv {

/// bwd_weight: dwei[g, k, t, c] = sum over output pixels p of dout[p, g, k] * in[source(p, t),
/// g, c], lanes as forward's with K the destination. A unit is R (tap, channel) pairs of one
/// column block, each an accumulator row reduced over every output pixel: dout's row (read
/// once a pixel from its packed copy) times a broadcast of the input under the pair's tap.
/// intrawave deals out (column block, pair chunk) units, interwave whole blocks of BN lanes.
template <int Dir>
template <int Gv, int NV>
inline void GroupVectorConv<Dir>::run_weight_grad(float* out) const {
  constexpr int R = gvec::pairs_for(NV);
  const index_t chunks = ceil_div(s_.taps() * src_ch_, R);
#pragma omp parallel num_threads(threads_)
  {
    pack_dout<NV>();
    relayout<Gv>();
#pragma omp barrier
    if constexpr (!kInterWave) {
#pragma omp for schedule(dynamic, 1)
      for (index_t unit = 0; unit < col_blocks_ * chunks; ++unit)
        weight_grad_pairs<Gv, NV, R>(out, unit / chunks, unit % chunks * R);
    } else {
      const index_t per_block = std::max<index_t>(1, kBN / (NV * L));
#pragma omp for schedule(dynamic, 1)
      for (index_t block = 0; block < ceil_div(col_blocks_, per_block); ++block)
        for (index_t chunk = 0; chunk < chunks; ++chunk)
          for (index_t cb = block * per_block; cb < std::min(col_blocks_, (block + 1) * per_block); ++cb)
            weight_grad_pairs<Gv, NV, R>(out, cb, chunk * R);
    }
  }
}

/// packed[pixel][cb][lane] = dout[pixel][the lane's group and channel], zero past G or K.
template <int Dir>
template <int NV>
inline void GroupVectorConv<Dir>::pack_dout() const {
  const index_t row = col_blocks_ * NV * L, ld = s_.g * dst_ch_;
#pragma omp for schedule(static) nowait
  for (index_t pixel = 0; pixel < s_.n * dst_pixels_; ++pixel) {
    const float* from = weight_ + pixel * ld;
    float* to = packed_.get() + pixel * row;
    for (index_t i = 0; i < row; ++i) to[i] = lane_channel_[i] >= 0 ? from[lane_channel_[i]] : 0.0f;
  }
}

/// Pairs [pair_begin, pair_begin + R) of column block cb (those past taps x C ignored).
template <int Dir>
template <int Gv, int NV, int R>
inline void GroupVectorConv<Dir>::weight_grad_pairs(float* out, index_t cb, index_t pair_begin) const {
  constexpr int kPixels = NV == 1 ? gvec::kChains : 1;   // pixels a step, each its own chain
  constexpr int lanes = NV * L;
  const index_t S = src_ch_, pairs = s_.taps() * S, row = col_blocks_ * lanes;
  const index_t column = Gv > 1 ? cb * S * Gv : cb / channel_blocks_ * S;
  index_t offset[R];
#pragma GCC unroll 16
  for (int j = 0; j < R; ++j) {
    const index_t pair = std::min(pair_begin + j, pairs - 1);
    offset[j] = phases_.front().offsets[pair / S] + pair % S * Gv + column;  // forward-like: one phase
  }
  Row acc[kPixels][R][NV];
  gvec::zero_all(acc);
  const float* src = relaid_.get();
  const index_t step = s_.stride[2] * src_row_, width = dst_dims_[2];
  for (index_t line = 0; line < s_.n * dst_pixels_ / width; ++line) {   // (n, d, h) rows
    const Pixel first = split_pixel(line * width, dst_dims_);
    const float* base = src + padded_pixel(first, 1) * src_row_;
    const float* dout = packed_.get() + line * width * row + cb * lanes;
    // one pixel's dout row times the input under each pair's tap, into chain q
    auto pixel = [&](int q, index_t w) __attribute__((always_inline)) {
      Row d[NV];
#pragma GCC unroll 4
      for (int r = 0; r < NV; ++r) d[r] = Row::load(dout + w * row + r * L);
      const float* at = base + w * step;
#pragma GCC unroll 16
      for (int j = 0; j < R; ++j) {
        const Row source = Row::template broadcast<Gv>(at + offset[j]);
#pragma GCC unroll 4
        for (int r = 0; r < NV; ++r) acc[q][j][r].fma(source, d[r]);
      }
    };
    index_t w = 0;
    for (; w + kPixels <= width; w += kPixels)
#pragma GCC unroll 2
      for (int q = 0; q < kPixels; ++q) pixel(q, w + q);
    for (; w < width; ++w) pixel(0, w);
  }
  alignas(64) float sums[lanes];
  for (int j = 0; j < R && pair_begin + j < pairs; ++j) {
    const index_t t = (pair_begin + j) / S, c = (pair_begin + j) % S;
    for (int r = 0; r < NV; ++r) {
      if constexpr (kPixels == 2) acc[0][j][r].add(acc[1][j][r]);
      acc[0][j][r].store(sums + r * L);
    }
    // lane -> (g, k): dwei[(g K + k) taps + t][c]
    const index_t* channel = lane_channel_.data() + cb * lanes;
    for (int lane = 0; lane < lanes; ++lane)
      if (channel[lane] >= 0) out[(channel[lane] * s_.taps() + t) * s_.c + c] = sums[lane];
  }
}

}  // namespace tc::gconv
