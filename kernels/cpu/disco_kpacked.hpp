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
// k >= K are skipped, so the padding to K_PAD costs no arithmetic. The input comes from the CSR forward's
// float32 band of phase lines (fill_band), so every slice is contiguous whatever the stride.
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
#include <type_traits>
#include <vector>

#include "disco_csr_forward.hpp"

namespace tc::disco {

constexpr index_t kKpackedBlock = 8;  // default output latitudes per work item

/// A neighbour decoded for one work item: its slice starts at band offset off, shifted by q.
struct PackedEntry {
  index_t off;
  std::int32_t q;
  const float* vals;  // K_PAD values
};

/// out[k][0:T] for k < kernels (<= KREG): sum over the entries of vals_e[k0 + k] * band slice
/// e, T = NV * kLanes.
template <int KREG, int NV>
TC_INLINE void packed_tile(const PackedEntry* __restrict entries, index_t count, int kernels,
                           int k0, const float* band, index_t w0, index_t wo,
                           float* __restrict out) {
  reg acc[KREG][NV];
#pragma GCC unroll 16
  for (int k = 0; k < KREG; ++k)
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) acc[k][u] = Vec::zero();
  for (index_t e = 0; e < count; ++e) {
    index_t start = entries[e].q + w0;
    start -= start >= wo ? wo : 0;
    const float* src = band + entries[e].off + start;
    reg slice[NV];
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) slice[u] = Vec::load(src + u * kLanes);
    const float* vals = entries[e].vals + k0;
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
      for (int u = 0; u < NV; ++u) Vec::store(out + (k * NV + u) * kLanes, acc[k][u]);
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
  const index_t rowlen = ceil_div(d.wo + T, kLanes) * kLanes;
  const index_t blocks = ceil_div(ho_count, lat_block);
  const index_t first = offset[ho_begin];
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> band;
    std::vector<PackedEntry> entries;
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
          fill_band(x + bc * d.hi * d.wi, d, hi_lo, hi_hi, T, rowlen, band.data());
        }
        for (index_t ho = ho0; ho < ho1; ++ho) {
          entries.clear();
          for (index_t n = offset[ho]; n < offset[ho + 1]; ++n)
            entries.push_back({(line[n - first] - hi_lo * s) * rowlen, quot[n - first], vals + n * kpad});
          const index_t count = static_cast<index_t>(entries.size());
          for (index_t w0 = 0; w0 < d.wo; w0 += T) {
            const index_t width = std::min(T, d.wo - w0);
            for (int k0 = 0; k0 < kernels; k0 += KREG) {
              const int pass = std::min(KREG, kernels - k0);
              packed_tile<KREG, NV>(entries.data(), count, pass, k0, band.data(), w0, d.wo, tile);
              for (int k = 0; k < pass; ++k) {
                Elem* dst = y + ((bc * d.k + k0 + k) * ho_count + (ho - ho_begin)) * d.wo + w0;
                store_floats(dst, tile + k * T, width);
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace tc::disco
