// The gvec pipeline's tiled path (grouped_conv_gvec.hpp): forward and bwd_data over the
// source's zero-padded copy, blocks of pixels x column blocks dealt out to the threads,
// each tile MR pixels x NV rows reduced over (tap, source channel) in registers.
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "grouped_conv_gvec_conv.hpp"

namespace tc::gconv {

template <int Dir>
template <int Gv, int SB, int NV>
inline void GroupVectorConv<Dir>::run_gather(float* out) const {
  constexpr int MR = gvec::rows_for(NV);
  const index_t per_block = std::max<index_t>(1, kBN / (NV * L));
  const index_t blocks = ceil_div(col_blocks_, per_block);
  const float* src = relaid_.get();
  const std::vector<Phase> no_phases;
#pragma omp parallel num_threads(threads_)
  {
    pack_weight();
    if (!in_place_) relayout<Gv>();
    if (in_place_ && Gv == 1) pad_along_w();
    std::vector<index_t> scratch(in_place_ ? 5 * s_.taps() : 0);  // in_place_block's tap lists
#pragma omp barrier
    auto run_block = [&](index_t b, const Phase& phase, index_t m_begin, index_t m_end) {
      const index_t cb_begin = b * per_block, cb_end = std::min(col_blocks_, (b + 1) * per_block);
      if constexpr ((Gv == L && gvec::kDepthwiseRows > 0) || (Gv == 1 && gvec::kChannelRows > 0))
        if (in_place_)
          return in_place_block<Gv == 1>(out, phase, cb_begin, cb_end, m_begin, m_end, scratch.data());
      block<Gv, SB, NV, MR>(out, src, cb_begin, cb_end, phase, m_begin, m_end);
    };
    if (in_place_ && !phases_.front().whole) {
      // in place at a stride: din's lines in order, each through its phases (one a residue
      // of w), so the dout rows they read are still in cache for the next line's
      const index_t lines = s_.n * dst_dims_[0] * dst_dims_[1], image = dst_dims_[0] * dst_dims_[1];
      auto din_lines = [&](index_t b, index_t l_begin, index_t l_end) {
        for (index_t l = l_begin; l < l_end; ++l) {
          const index_t dh = l % dst_dims_[1], dd = l / dst_dims_[1] % dst_dims_[0], n = l / image;
          const index_t rd = dd % s_.stride[0], rh = dh % s_.stride[1];
          for (index_t rw = 0; rw < residues_[2]; ++rw) {
            const Phase& phase = phases_[(rd * residues_[1] + rh) * residues_[2] + rw];
            const index_t m = ((n * phase.dims[0] + dd / s_.stride[0]) * phase.dims[1] + dh / s_.stride[1]) *
                              phase.dims[2];
            run_block(b, phase, m, m + phase.dims[2]);
          }
        }
      };
      if constexpr (!kInterWave) {
        // the (column block, line block) grid as the phases' below
        const index_t per = ceil_div(kBM, dst_dims_[2]), line_blocks = ceil_div(lines, per);
        const index_t units = blocks * line_blocks, run = std::max<index_t>(1, units / (2 * threads_));
#pragma omp for schedule(dynamic, run) nowait
        for (index_t unit = 0; unit < units; ++unit) {
          const index_t lb = unit % line_blocks;
          din_lines(unit / line_blocks, lb * per, std::min(lines, (lb + 1) * per));
        }
      } else {
#pragma omp for schedule(dynamic, 1) nowait
        for (index_t unit = 0; unit < blocks * s_.n; ++unit)
          din_lines(unit / s_.n, unit % s_.n * image, (unit % s_.n + 1) * image);
      }
    }
    // phases write disjoint destination pixels: no barrier between them (in place at a
    // stride, they ran above, line by line)
    for (const Phase& phase : in_place_ && !phases_.front().whole ? no_phases : phases_) {
      const index_t image = phase.dims[0] * phase.dims[1] * phase.dims[2], rows = s_.n * image;
      if constexpr (!kInterWave) {
        // the (column block, pixel block) grid, pixel blocks inner, in runs of neighbouring
        // blocks (their source rows overlap) half a thread's share long, dealt out as threads
        // come free: a layer of few blocks, or a thread slowed by the shared machine, no
        // longer waits on the slowest share (one loop a column block, each statically
        // shared, gave a layer of one pixel block all to the first thread)
        const index_t m_blocks = ceil_div(rows, kBM), units = blocks * m_blocks;
        const index_t run = std::max<index_t>(1, units / (2 * threads_));
#pragma omp for schedule(dynamic, run) nowait
        for (index_t unit = 0; unit < units; ++unit) {
          const index_t mb = unit % m_blocks;
          run_block(unit / m_blocks, phase, mb * kBM, std::min(rows, (mb + 1) * kBM));
        }
      } else {
#pragma omp for schedule(dynamic, 1) nowait
        for (index_t unit = 0; unit < blocks * s_.n; ++unit)
          run_block(unit / s_.n, phase, unit % s_.n * image, (unit % s_.n + 1) * image);
      }
    }
  }
}

/// Column blocks [cb_begin, cb_end) x the phase's destination rows [m_begin, m_end): each
/// pixel tile runs all of the block's column blocks while its source rows are in cache. A
/// phase of no taps still takes one pass, which writes its zeros.
template <int Dir>
template <int Gv, int SB, int NV, int MR>
inline void GroupVectorConv<Dir>::block(float* out, const float* src, index_t cb_begin, index_t cb_end, const Phase& phase,
           index_t m_begin, index_t m_end) const {
  const index_t taps = index_t(phase.taps.size());
  for (index_t k0 = 0; k0 == 0 || k0 < taps; k0 += kBK) {
    Pixel first = split_pixel(m_begin, phase.dims);
    for (index_t m0 = m_begin; m0 < m_end; m0 += MR) {
      for (index_t cb = cb_begin; cb < cb_end; ++cb)
        tile<Gv, SB, NV, MR>(out, src, cb, phase, m0, first, std::min<index_t>(MR, m_end - m0), k0,
                             std::min(taps, k0 + kBK));
      advance(first, MR, phase.dims);
    }
  }
}

template <int Dir>
template <int Gv, int SB, int NV, int MR>
TC_INLINE void GroupVectorConv<Dir>::tile(float* out, const float* src, index_t cb, const Phase& phase, index_t m0,
                    Pixel first, index_t rows, index_t k_begin, index_t k_end) const {
  // one row a pixel: kChains accumulators, the source channels dealt out among them (one
  // chain of taps x S dependent FMAs a row would hold 8 rows to the FMA latency); NV rows
  // a pixel are independent chains already
  constexpr int kChains = NV == 1 ? gvec::kChains : 1;
  constexpr int lanes = NV * L;
  const index_t S = src_ch_;
  const index_t column = Gv > 1 ? cb * S * Gv : cb / channel_blocks_ * S;
  const float* origin[MR];   // the source pixel under tap 0 (past the last row: the last's)
  index_t dst[MR];           // the destination pixel
  Pixel p = first;
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    origin[i] = src + padded_pixel(p, 1) * src_row_ + column;
    dst[i] = phase.whole ? m0 + i  // the phase's pixels are the destination's, in order
                         : ((p.n * dst_dims_[0] + phase.first[0] + p.d * phase.step[0]) * dst_dims_[1] +
                            phase.first[1] + p.h * phase.step[1]) * dst_dims_[2] + phase.first[2] +
                               p.w * phase.step[2];
    if (i + 1 < rows) advance(p, 1, phase.dims);
  }
  Row acc[kChains][MR][NV];
  gvec::zero_all(acc);
  // SB source channels of one tap: their weight rows, then each row's broadcasts
  auto channels = [&](const float* const (&row)[MR], const float* w, index_t s0)
                      __attribute__((always_inline)) {
    Row weights[SB][NV];
#pragma GCC unroll 8
    for (int j = 0; j < SB; ++j)
#pragma GCC unroll 4
      for (int r = 0; r < NV; ++r) weights[j][r] = Row::load(w + (s0 + j) * lanes + r * L);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < SB; ++j) {
        const Row source = Row::template broadcast<Gv>(row[i] + (s0 + j) * Gv);
#pragma GCC unroll 4
        for (int r = 0; r < NV; ++r) acc[j % kChains][i][r].fma(source, weights[j][r]);
      }
  };
  // one tap: a single step when S == SB (depthwise's one channel: nothing else to loop over)
  const index_t* offsets = phase.offsets.data();
  const index_t* taps = phase.taps.data();
  const float* weights = packed_.get() + cb * s_.taps() * S * lanes;
  for (index_t k = k_begin; k < k_end; ++k) {
    const float* row[MR];
    const index_t offset = offsets[k];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) row[i] = origin[i] + offset;
    const float* w = weights + taps[k] * S * lanes;
    if (S == SB) {
      channels(row, w, 0);
    } else {
      for (index_t s0 = 0; s0 < S; s0 += SB) channels(row, w, s0);
    }
  }
  if constexpr (kChains == 2)
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) acc[0][i][0].add(acc[1][i][0]);
  store<Gv, NV, MR>(acc[0], out, cb, dst, rows, k_begin > 0);
}

/// Rows [0, rows) of the tile to the destination. Gv > 1: dst[pixel i][cb * Gv + gi][d], lanes
/// back in [gi][d] order (output lane j = gi * D + d holds tile lane d * Gv + gi), only groups
/// below G. Gv = 1: row r to channels c0 + 16 r.. of group cb / channel blocks, only those
/// below D.
template <int Dir>
template <int Gv, int NV, int MR>
TC_INLINE void GroupVectorConv<Dir>::store(const Row (*acc)[NV], float* out, index_t cb, const index_t* dst_pixel, index_t rows,
                     bool accumulate) const {
  const index_t D = dst_ch_, ld = s_.g * D;
  if constexpr (Gv == 1) {
    const index_t g = cb / channel_blocks_, c0 = cb % channel_blocks_ * NV * L;
    for (index_t i = 0; i < rows; ++i)
#pragma GCC unroll 4
      for (int r = 0; r < NV; ++r) {
        const index_t first = c0 + r * L;
        if (first >= D) break;
        acc[i][r].store_first(out + dst_pixel[i] * ld + g * D + first, D - first, accumulate);
      }
  } else {
    constexpr int Dv = L / Gv;
    const index_t valid = std::min<index_t>(Gv, s_.g - cb * Gv) * Dv;
#ifdef __AVX512F__
    alignas(64) int order[L];
    for (int j = 0; j < L; ++j) order[j] = (j % Dv) * Gv + j / Dv;
    const __m512i permutation = _mm512_load_si512(order);
    for (index_t i = 0; i < rows; ++i) {
      const Row value{_mm512_permutexvar_ps(permutation, acc[i][0].v)};
      value.store_first(out + dst_pixel[i] * ld + cb * Gv * Dv, valid, accumulate);
    }
#else
    int order[L];
    for (int j = 0; j < L; ++j) order[j] = (j % Dv) * Gv + j / Dv;
    for (index_t i = 0; i < rows; ++i) {
      const Row value = Dv == 1 ? acc[i][0] : acc[i][0].permuted(order);
      value.store_first(out + dst_pixel[i] * ld + cb * Gv * Dv, valid, accumulate);
    }
#endif
  }
}

}  // namespace tc::gconv
