// The forward contraction's loops around row_tile: y[bc, k, ho, :] for a work item of
// (channel, lat_block output latitudes; kForwardBlock by default), from a float32 band of the
// input latitudes the item's psi rows read.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "disco_csr_shape.hpp"
#include "disco_csr_tile.hpp"

namespace tc::disco {

constexpr index_t kForwardBlock = 8;  // default output latitudes per forward work item

/// Copies input latitudes [hi_lo, hi_hi] of one channel into float32 phase lines of `rowlen`
/// floats: line (h, p) holds x[h, p + s*j] for j < Wo, then its own first T values again.
template <typename Elem>
void fill_band(const Elem* plane, const Dims& d, index_t hi_lo, index_t hi_hi, index_t tile,
               index_t rowlen, float* band) {
  const index_t s = d.stride();
  for (index_t h = hi_lo; h <= hi_hi; ++h) {
    const Elem* src = plane + h * d.wi;
    for (index_t p = 0; p < s; ++p) {
      float* dst = band + ((h - hi_lo) * s + p) * rowlen;
      if constexpr (std::is_same_v<Elem, float>) {
        if (s == 1) {
          std::memcpy(dst, src, sizeof(float) * d.wo);
        } else {
          for (index_t j = 0; j < d.wo; ++j) dst[j] = src[p + s * j];
        }
      } else {
        for (index_t j = 0; j < d.wo; ++j) dst[j] = to_float(src[p + s * j]);
      }
      for (index_t t = 0; t < tile; ++t) dst[d.wo + t] = dst[t % d.wo];
    }
  }
}

/// The forward with `lat_block` output latitudes per work item (> 0): more items balance the
/// threads better, fewer share each band of input latitudes across more output rows.
template <int NV, typename Elem>
void forward_blocked(const Elem* x, Elem* y, const Dims& d, const std::int64_t* roff,
                     const std::int32_t* line, const std::int32_t* quot, const float* vals,
                     int threads, index_t lat_block) {
  constexpr index_t T = NV * kLanes;
  const index_t s = d.stride();
  const index_t rowlen = ceil_div(d.wo + T, kLanes) * kLanes;
  const index_t blocks = ceil_div(d.ho, lat_block);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> band;
    std::vector<SliceEntry> entries;
    std::vector<index_t> row_begin;
    alignas(64) float tail[T];
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (index_t bc = 0; bc < d.bc; ++bc) {
      for (index_t blk = 0; blk < blocks; ++blk) {
        const index_t ho0 = blk * lat_block, ho1 = std::min(d.ho, ho0 + lat_block);
        // a row's entries are sorted by column, so its first and last bound its latitudes
        index_t hi_lo = d.hi, hi_hi = -1;
        for (index_t k = 0; k < d.k; ++k) {
          for (index_t ho = ho0; ho < ho1; ++ho) {
            const index_t r = k * d.ho + ho;
            if (roff[r] == roff[r + 1]) continue;
            hi_lo = std::min<index_t>(hi_lo, line[roff[r]] / s);
            hi_hi = std::max<index_t>(hi_hi, line[roff[r + 1] - 1] / s);
          }
        }
        if (hi_hi >= hi_lo) {
          band.resize((hi_hi - hi_lo + 1) * s * rowlen);
          fill_band(x + bc * d.hi * d.wi, d, hi_lo, hi_hi, T, rowlen, band.data());
        }
        entries.clear();
        row_begin.clear();
        for (index_t ho = ho0; ho < ho1; ++ho) {
          for (index_t k = 0; k < d.k; ++k) {
            const index_t r = k * d.ho + ho;
            row_begin.push_back(static_cast<index_t>(entries.size()));
            for (index_t e = roff[r]; e < roff[r + 1]; ++e)
              entries.push_back({(line[e] - hi_lo * s) * rowlen, quot[e], vals[e]});
          }
        }
        row_begin.push_back(static_cast<index_t>(entries.size()));

        for (index_t i = 0; i + 1 < static_cast<index_t>(row_begin.size()); ++i) {
          const index_t ho = ho0 + i / d.k, k = i % d.k;
          for (index_t w0 = 0; w0 < d.wo; w0 += T) {
            Elem* dst = y + ((bc * d.k + k) * d.ho + ho) * d.wo + w0;
            const SliceEntry* row = entries.data() + row_begin[i];
            const index_t count = row_begin[i + 1] - row_begin[i];
            if (std::is_same_v<Elem, float> && w0 + T <= d.wo) {
              row_tile<NV>(row, count, band.data(), w0, d.wo, reinterpret_cast<float*>(dst));
            } else {
              row_tile<NV>(row, count, band.data(), w0, d.wo, tail);
              store_floats(dst, tail, std::min(T, d.wo - w0));
            }
          }
        }
      }
    }
  }
}

/// The forward with the default latitude block.
template <int NV, typename Elem>
void forward(const Elem* x, Elem* y, const Dims& d, const std::int64_t* roff,
             const std::int32_t* line, const std::int32_t* quot, const float* vals, int threads) {
  forward_blocked<NV, Elem>(x, y, d, roff, line, quot, vals, threads, kForwardBlock);
}

}  // namespace tc::disco
