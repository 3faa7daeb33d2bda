// The kpacked forward contraction: psi in the blocked layout of tilecast/disco/kpacked.py,
// one entry per (output latitude, neighbour) carrying the K_PAD basis values of that
// neighbour contiguously.
//
//   y[bc, k, ho, wo] = sum_{n in ho's neighbours} vals[n, k] * x[bc, lat_n, (lon_n + s*wo) mod Wi]
//
// Because every basis function shares the neighbour, one input slice feeds all K of them:
// the register tile is KREG x NV vectors (KREG basis functions x NV * kLanes output
// longitudes), and each neighbour costs NV loads and KREG broadcasts for KREG * NV FMAs, where the
// CSR forward (one row per basis function) pays one load per FMA. A tile with KREG < K runs
// the basis functions in passes of KREG (ceil(K / KREG) passes over the neighbours): with
// AVX2's 16 registers, K = 9 fits only as 9 x 1, whose single slice per neighbour leaves the
// FMA units waiting on the broadcasts, while 3 x 3 or 4 x 3 passes keep them busy. Rows
// k >= K are skipped, so the padding to K_PAD costs no arithmetic. The input comes from a
// float32 band of phase lines (fill_periodic_band), so every slice is contiguous whatever the
// stride, and each line runs on past its end with its own values again, so a neighbour's
// slice is one pointer and an offset, with no wrap to test in the inner loop; whole tiles
// are stored straight into y. On AVX2 these two made the contraction much faster.
//
//   template <int KREG, int NV, typename Elem>
//   void kpacked_forward_blocked(const Elem* x, Elem* y, const Dims& d, index_t ho_begin,
//                                index_t ho_count, const std::int64_t* offset,
//                                const std::int32_t* line, const std::int32_t* quot,
//                                const float* vals, index_t kpad, int threads,
//                                index_t lat_block)
//
// vals holds K_PAD (kpad) values per neighbour. lat_block output latitudes form
// one OpenMP work item (the automatic entry uses kKpackedBlock).
//
// d.ho is psi's full output latitude count; the call computes output latitudes
// [ho_begin, ho_begin + ho_count) into y (bc, k, ho_count, wo). line / quot are the phase
// line (lat * s + lon mod s) and quotient (lon div s) of the neighbours of those latitudes,
// decoded by the caller (decode_neighbours): entry i belongs to neighbour offset[ho_begin] + i.
// The instantiated (KREG, NV) tiles are listed in disco_kpacked_variants.hpp.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "disco_csr_forward.hpp"

namespace tc::disco {

constexpr index_t kKpackedBlock = 8;  // default output latitudes per work item

/// out[k * out_stride : + T] for k < kernels (<= KREG): the sum over the `count` neighbours of
/// vals[e * kpad + k0 + k] * src[e][w0 : w0 + T], T = NV * kLanes. Each src[e] points at its
/// neighbour's first longitude in a band line long enough that w0 + T never wraps.
template <int KREG, int NV>
TC_INLINE void packed_tile(const float* const* __restrict src, index_t count,
                           const float* __restrict vals, index_t kpad, int kernels, int k0,
                           index_t w0, float* __restrict out, index_t out_stride) {
  reg acc[KREG][NV];
#pragma GCC unroll 16
  for (int k = 0; k < KREG; ++k)
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) acc[k][u] = Vec::zero();
  vals += k0;
  for (index_t e = 0; e < count; ++e, vals += kpad) {
    const float* from = src[e] + w0;
    reg slice[NV];
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) slice[u] = Vec::load(from + u * kLanes);
#pragma GCC unroll 16
    for (int k = 0; k < KREG; ++k) {
      if (k < kernels) {
        const reg val = Vec::broadcast(vals + k);
#pragma GCC unroll 16
        for (int u = 0; u < NV; ++u) acc[k][u] = Vec::fma(val, slice[u], acc[k][u]);
      }
    }
  }
#pragma GCC unroll 16
  for (int k = 0; k < KREG; ++k)
    if (k < kernels)
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) Vec::store(out + k * out_stride + u * kLanes, acc[k][u]);
}

/// The phase line (lat * s + lon mod s) and quotient (lon div s) of neighbours [first, last)
/// of idx ([nbr, 2] = (lat, lon)), stored from index 0; false if one lies outside the grid.
inline bool decode_neighbours(const std::int64_t* idx, index_t first, index_t last,
                              const Dims& d, int threads, std::int32_t* line,
                              std::int32_t* quot) {
  const index_t s = d.stride();
  bool out_of_range = false;
#pragma omp parallel for num_threads(threads) reduction(|| : out_of_range)
  for (index_t n = first; n < last; ++n) {
    const index_t lat = idx[2 * n], lon = idx[2 * n + 1];
    if (lat < 0 || lat >= d.hi || lon < 0 || lon >= d.wi) {
      out_of_range = true;
      continue;
    }
    line[n - first] = static_cast<std::int32_t>(lat * s + lon % s);
    quot[n - first] = static_cast<std::int32_t>(lon / s);
  }
  return !out_of_range;
}

/// fill_band with lines of `rowlen` >= wo floats: line (h, p) holds x[h, p + s*j] for j < Wo,
/// then its values again from the first, periodically, to the end of the line.
template <typename Elem>
void fill_periodic_band(const Elem* plane, const Dims& d, index_t hi_lo, index_t hi_hi,
                        index_t rowlen, float* band) {
  fill_band(plane, d, hi_lo, hi_hi, 0, rowlen, band);
  const index_t lines = (hi_hi - hi_lo + 1) * d.stride();
  for (index_t l = 0; l < lines; ++l) {
    float* dst = band + l * rowlen;
    // dst[0 : wo + done) is periodic already, so its next chunk (at most wo) copies on
    for (index_t done = 0; d.wo + done < rowlen;) {
      const index_t chunk = std::min(d.wo, rowlen - d.wo - done);
      std::memcpy(dst + d.wo + done, dst + done, sizeof(float) * chunk);
      done += chunk;
    }
  }
}

/// The kpacked forward with `lat_block` (> 0) output latitudes per work item: more items
/// balance the threads better, fewer share each band of input latitudes across more rows.
template <int KREG, int NV, typename Elem>
void kpacked_forward_blocked(const Elem* x, Elem* y, const Dims& d, index_t ho_begin,
                             index_t ho_count, const std::int64_t* offset,
                             const std::int32_t* line, const std::int32_t* quot,
                             const float* vals, index_t kpad, int threads, index_t lat_block) {
  constexpr index_t T = NV * kLanes;
  const index_t s = d.stride();
  const int kernels = static_cast<int>(d.k);
  // a line holds its wo longitudes and then the first ones again, far enough that a tile
  // starting at any neighbour's shift (< wo) plus any w0 (< wo) reads on without wrapping
  const index_t rowlen = ceil_div(2 * d.wo + T, kLanes) * kLanes;
  const index_t blocks = ceil_div(ho_count, lat_block);
  const index_t first = offset[ho_begin];
  const index_t plane = ho_count * d.wo;  // floats between basis functions in y
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> band;
    std::vector<const float*> src;
    alignas(64) float tile[KREG * T];
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (index_t bc = 0; bc < d.bc; ++bc) {
      for (index_t blk = 0; blk < blocks; ++blk) {
        const index_t ho0 = ho_begin + blk * lat_block;
        const index_t ho1 = std::min(ho_begin + ho_count, ho0 + lat_block);
        // neighbours are sorted by (latitude, longitude): first and last bound the band
        index_t hi_lo = d.hi, hi_hi = -1;
        for (index_t ho = ho0; ho < ho1; ++ho) {
          if (offset[ho] == offset[ho + 1]) continue;
          hi_lo = std::min<index_t>(hi_lo, line[offset[ho] - first] / s);
          hi_hi = std::max<index_t>(hi_hi, line[offset[ho + 1] - 1 - first] / s);
        }
        if (hi_hi >= hi_lo) {
          band.resize((hi_hi - hi_lo + 1) * s * rowlen);
          fill_periodic_band(x + bc * d.hi * d.wi, d, hi_lo, hi_hi, rowlen, band.data());
        }
        for (index_t ho = ho0; ho < ho1; ++ho) {
          src.clear();
          for (index_t n = offset[ho]; n < offset[ho + 1]; ++n)
            src.push_back(band.data() + (line[n - first] - hi_lo * s) * rowlen + quot[n - first]);
          const index_t count = static_cast<index_t>(src.size());
          const float* ho_vals = vals + offset[ho] * kpad;
          Elem* y_row = y + (bc * d.k * ho_count + (ho - ho_begin)) * d.wo;
          for (index_t w0 = 0; w0 < d.wo; w0 += T) {
            const index_t width = std::min(T, d.wo - w0);
            for (int k0 = 0; k0 < kernels; k0 += KREG) {
              const int pass = std::min(KREG, kernels - k0);
              Elem* dst = y_row + k0 * plane + w0;
              if (std::is_same_v<Elem, float> && width == T) {
                // a whole tile goes straight to y
                packed_tile<KREG, NV>(src.data(), count, ho_vals, kpad, pass, k0, w0,
                                      reinterpret_cast<float*>(dst), plane);
              } else {
                packed_tile<KREG, NV>(src.data(), count, ho_vals, kpad, pass, k0, w0, tile, T);
                for (int k = 0; k < pass; ++k) store_floats(dst + k * plane, tile + k * T, width);
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace tc::disco
