// The transpose contraction's loops around channel_tile: gx[bc0:bc0+BT, hi, :] for a work
// item of (BT channels, lat_block input latitudes; kTransposeBlock by default), reading gy in
// place.
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "disco_csr_shape.hpp"
#include "disco_csr_tile.hpp"

namespace tc::disco {

constexpr index_t kTransposeBlock = 4;  // default input latitudes per transpose work item

/// The transpose with `lat_block` input latitudes per work item (> 0).
template <int BT, int NV, typename Elem>
void transpose_blocked(const Elem* gy, Elem* gx, const Dims& d, const std::int64_t* troff,
                       const std::int64_t* tcol, const std::int32_t* quot, const float* tvals,
                       int threads, index_t lat_block) {
  constexpr index_t T = NV * kLanes;
  const index_t s = d.stride();
  const index_t plane = d.k * d.ho * d.wo;
  const index_t channel_tiles = ceil_div(d.bc, BT), blocks = ceil_div(d.hi, lat_block);
#pragma omp parallel num_threads(threads)
  {
    std::vector<SliceEntry> entries;
    std::vector<index_t> line_begin;
    alignas(64) float wrap[BT * T];
    alignas(64) float out[BT * T];
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (index_t tile = 0; tile < channel_tiles; ++tile) {
      for (index_t blk = 0; blk < blocks; ++blk) {
        const index_t bc0 = tile * BT, valid = std::min<index_t>(BT, d.bc - bc0);
        // slots past the last channel re-read the last valid one; their sums are dropped
        index_t channel_off[BT];
        for (int c = 0; c < BT; ++c) channel_off[c] = std::min<index_t>(c, valid - 1) * plane;
        const index_t line0 = blk * lat_block * s;
        const index_t line1 = std::min(d.hi, (blk + 1) * lat_block) * s;
        entries.clear();
        line_begin.clear();
        for (index_t l = line0; l < line1; ++l) {
          line_begin.push_back(static_cast<index_t>(entries.size()));
          for (index_t e = troff[l]; e < troff[l + 1]; ++e)
            entries.push_back({tcol[e] - quot[e], quot[e], tvals[e]});
        }
        line_begin.push_back(static_cast<index_t>(entries.size()));

        for (index_t j0 = 0; j0 < d.wo; j0 += T) {
          const index_t n = std::min(T, d.wo - j0);
          for (index_t l = line0; l < line1; ++l) {
            const index_t i = l - line0;
            channel_tile<BT, NV>(entries.data() + line_begin[i], line_begin[i + 1] - line_begin[i],
                                 gy + bc0 * plane, channel_off, j0, d.wo, wrap, out);
            const index_t h = l / s, p = l % s;
            for (index_t c = 0; c < valid; ++c) {
              Elem* dst = gx + ((bc0 + c) * d.hi + h) * d.wi + p + s * j0;
              const float* sums = out + c * T;
              if (s == 1) {
                store_floats(dst, sums, n);
              } else {
                for (index_t t = 0; t < n; ++t) dst[s * t] = from_float<Elem>(sums[t]);
              }
            }
          }
        }
      }
    }
  }
}

/// The transpose with the default latitude block.
template <int BT, int NV, typename Elem>
void transpose(const Elem* gy, Elem* gx, const Dims& d, const std::int64_t* troff,
               const std::int64_t* tcol, const std::int32_t* quot, const float* tvals,
               int threads) {
  transpose_blocked<BT, NV, Elem>(gy, gx, d, troff, tcol, quot, tvals, threads, kTransposeBlock);
}

}  // namespace tc::disco
