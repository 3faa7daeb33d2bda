// The two register tiles of the CPU DISCO contraction: a run of output longitudes held in
// vector registers while the psi entries that feed them stream past.
//
//   row_tile        forward: one psi row (k, ho), T = NV * kLanes output longitudes.
//                   Entry e adds val_e * band[off_e + (q_e + w0) mod Wo .. + T].
//   channel_tile    transpose: one input line (hi, phase), BT channels x T longitudes.
//                   Entry e adds val_e * gy[c][row_e, (j0 - q_e) mod Wo .. + T] for each c.
//
// Each entry is one broadcast and NV (BT * NV) load + FMA pairs over contiguous memory, so
// the accumulators never leave registers. The forward's caller makes every slice contiguous
// (a padded float32 band); the transpose reads gy in its storage type Elem, and a slice
// crossing longitude 0 with masked loads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "disco_csr_simd.hpp"

namespace tc::disco {

/// A psi entry decoded for one work item: the row it reads starts at off (in the forward's
/// band, or in one gy channel), shifted by q longitudes.
struct SliceEntry {
  index_t off;
  std::int32_t q;
  float val;
};

/// out[0:T] = sum_e val_e * band[off_e + ((q_e + w0) mod wo) + t], T = NV * kLanes.
/// The band's lines are padded by T with their own start, so the slice is contiguous.
template <int NV>
TC_INLINE void row_tile(const SliceEntry* __restrict entries, index_t count, const float* band,
                        index_t w0, index_t wo, float* __restrict out) {
  reg acc[NV];
#pragma GCC unroll 16
  for (int u = 0; u < NV; ++u) acc[u] = Vec::zero();
  for (index_t e = 0; e < count; ++e) {
    index_t start = entries[e].q + w0;
    start -= start >= wo ? wo : 0;
    const float* src = band + entries[e].off + start;
    const reg val = Vec::broadcast(&entries[e].val);
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) acc[u] = Vec::fma(val, Vec::load(src + u * kLanes), acc[u]);
  }
#pragma GCC unroll 16
  for (int u = 0; u < NV; ++u) Vec::store(out + u * kLanes, acc[u]);
}

/// out[c][0:T] = sum_e val_e * gy[c * plane + off_e + ((j0 - q_e) mod wo) + t] for the BT
/// channels c, T = NV * kLanes, gy stored as Elem. A slice that runs past the row's end wraps
/// to its start: with masked loads when it wraps once (load_wrapped), else (the row is
/// shorter than the tile, or no masked loads for Elem) through a float32 copy in `wrap`
/// (BT * T floats).
template <int BT, int NV, typename Elem>
TC_INLINE void channel_tile(const SliceEntry* __restrict entries, index_t count, const Elem* gy,
                            const index_t (&channel_off)[BT], index_t j0, index_t wo,
                            float* __restrict wrap, float* __restrict out) {
  constexpr int T = NV * kLanes;
  reg acc[BT][NV];
#pragma GCC unroll 16
  for (int c = 0; c < BT; ++c)
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) acc[c][u] = Vec::zero();
  for (index_t e = 0; e < count; ++e) {
    index_t start = j0 - entries[e].q;
    start += start < 0 ? wo : 0;
    const Elem* row = gy + entries[e].off;
    const reg val = Vec::broadcast(&entries[e].val);
    if (start + T <= wo) {
#pragma GCC unroll 16
      for (int c = 0; c < BT; ++c)
#pragma GCC unroll 16
        for (int u = 0; u < NV; ++u)
          acc[c][u] = Vec::fma(val, load_float(row + channel_off[c] + start + u * kLanes), acc[c][u]);
    } else if (kWrappedLoads<Elem> && wo >= T) {
      if constexpr (kWrappedLoads<Elem>) {
#pragma GCC unroll 16
        for (int c = 0; c < BT; ++c)
#pragma GCC unroll 16
          for (int u = 0; u < NV; ++u)
            acc[c][u] = Vec::fma(val, load_wrapped(row + channel_off[c], start, wo, u * kLanes), acc[c][u]);
      }
    } else {
      for (int c = 0; c < BT; ++c) {
        index_t lon = start;
        for (int t = 0; t < T; ++t) {
          wrap[c * T + t] = to_float(row[channel_off[c] + lon]);
          lon = lon + 1 == wo ? 0 : lon + 1;
        }
      }
#pragma GCC unroll 16
      for (int c = 0; c < BT; ++c)
#pragma GCC unroll 16
        for (int u = 0; u < NV; ++u)
          acc[c][u] = Vec::fma(val, Vec::load(wrap + c * T + u * kLanes), acc[c][u]);
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < BT; ++c)
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) Vec::store(out + c * T + u * kLanes, acc[c][u]);
}

}  // namespace tc::disco
