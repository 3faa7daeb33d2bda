// The line-blocked transpose contraction: gx[bc, line, :] for kLineBlock consecutive input
// lines (hi * s + p) at a time, from psi's transpose regrouped by line block.
//
//   layout (tilecast/disco/lines.py): per block b of kLineBlock lines, keys boff[b]:boff[b+1],
//   each a column (k * Ho + ho) * Wo + q of gy that some line of the block reads, with
//   kLineBlock values (zero for the lines that do not read it).
//
// The CSR transpose (channel_tile) pays one loaded gy slice per FMA. Here a slice
// gy[bc, k, ho, (j0 - q) mod Wo ..] is loaded once per key and feeds every line of the block
// that reads it: the register tile is kLineBlock lines x NV vectors, kLineBlock broadcasts
// and NV loads for kLineBlock * NV FMAs, a zero value where a line lacks the key. That pays
// where the lines of a block share most keys (a filter several input lines tall: the
// downsampling convolutions; tilecast.disco.lines decides from the share). Each line's sum
// runs over its keys in column order, as the CSR transpose's does, and a zero value adds
// nothing, so the result is the CSR kernel's bit for bit (unless gy holds inf or NaN, which
// then also reaches the lines that do not read it). A work item (channel, line block) owns
// its output lines: a gather, no atomics.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "disco_csr_shape.hpp"
#include "disco_csr_simd.hpp"

namespace tc::disco {

constexpr int kLineBlock = 4;  // input lines per block of the layout and the register tile
#ifdef __AVX512F__
constexpr int kLineVectors = 6;  // 4 x 6 accumulators + 6 slices + a broadcast of 32 registers
#else
constexpr int kLineVectors = 3;  // 4 x 3 + 3 + 1 of AVX2's 16
#endif

/// A key decoded for one work item: its gy row starts at off, shifted by q longitudes.
struct LineEntry {
  index_t off;
  std::int32_t q;
  const float* vals;  // kLineBlock values
};

/// out[i * stride + 0:T] = sum over the keys of vals_e[i] * gy[off_e + ((j0 - q_e) mod wo) + t]
/// for the block's lines i, T = NV * kLanes, gy stored as Elem; slices wrapping past the row's
/// end as
/// in channel_tile (masked loads, or a float32 copy in `wrap`, T floats).
template <int LB, int NV, typename Elem>
TC_INLINE void line_tile(const LineEntry* __restrict entries, index_t count, const Elem* gy,
                         index_t j0, index_t wo, float* __restrict wrap, float* __restrict out,
                         index_t stride) {
  constexpr int T = NV * kLanes;
  reg acc[LB][NV];
#pragma GCC unroll 16
  for (int i = 0; i < LB; ++i)
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) acc[i][u] = Vec::zero();
  for (index_t e = 0; e < count; ++e) {
    index_t start = j0 - entries[e].q;
    start += start < 0 ? wo : 0;
    const Elem* row = gy + entries[e].off;
    reg slice[NV];
    if (start + T <= wo) {
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) slice[u] = load_float(row + start + u * kLanes);
    } else if (kWrappedLoads<Elem> && wo >= T) {
      if constexpr (kWrappedLoads<Elem>) {
#pragma GCC unroll 16
        for (int u = 0; u < NV; ++u) slice[u] = load_wrapped(row, start, wo, u * kLanes);
      }
    } else {
      index_t lon = start;
      for (int t = 0; t < T; ++t) {
        wrap[t] = to_float(row[lon]);
        lon = lon + 1 == wo ? 0 : lon + 1;
      }
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) slice[u] = Vec::load(wrap + u * kLanes);
    }
    const float* vals = entries[e].vals;
#pragma GCC unroll 16
    for (int i = 0; i < LB; ++i) {
      const reg val = Vec::broadcast(vals + i);
#pragma GCC unroll 16
      for (int u = 0; u < NV; ++u) acc[i][u] = Vec::fma(val, slice[u], acc[i][u]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < LB; ++i)
#pragma GCC unroll 16
    for (int u = 0; u < NV; ++u) Vec::store(out + i * stride + u * kLanes, acc[i][u]);
}

/// line_tile with the fewest vectors (at most NV) that cover n longitudes: a grid's last tile
/// (720 longitudes are 7.5 tiles of 96 on AVX-512) computes no more than it keeps.
template <int LB, int NV, typename Elem>
TC_INLINE void line_tile_upto(index_t n, const LineEntry* __restrict entries, index_t count,
                              const Elem* gy, index_t j0, index_t wo, float* __restrict wrap,
                              float* __restrict out, index_t stride) {
  if constexpr (NV > 1) {
    if (n <= (NV - 1) * kLanes) {
      line_tile_upto<LB, NV - 1, Elem>(n, entries, count, gy, j0, wo, wrap, out, stride);
      return;
    }
  }
  line_tile<LB, NV, Elem>(entries, count, gy, j0, wo, wrap, out, stride);
}

/// gx (bc, hi, wi) from gy (bc, k, ho, wo) with the line-blocked layout (boff over
/// ceil(hi * s / kLineBlock) blocks, bcol, bvals [keys, kLineBlock]); columns already checked.
/// The keys are decoded once a call (a division each, which per channel had cost about a
/// tenth of the multiply-adds), then every (channel, block) reads its run of them.
template <typename Elem>
void transpose_lines(const Elem* gy, Elem* gx, const Dims& d, const std::int64_t* boff,
                     const std::int64_t* bcol, const float* bvals, int threads) {
  constexpr int LB = kLineBlock, NV = kLineVectors;
  constexpr index_t T = NV * kLanes;
  const index_t s = d.stride(), plane = d.k * d.ho * d.wo, lines = d.hi * s;
  const index_t blocks = ceil_div(lines, LB), keys = boff[blocks];
  std::vector<LineEntry> decoded(static_cast<std::size_t>(keys));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (index_t e = 0; e < keys; ++e) {
      const index_t row = bcol[e] / d.wo;
      decoded[e] = {row * d.wo, static_cast<std::int32_t>(bcol[e] - row * d.wo), bvals + e * LB};
    }
    alignas(64) float wrap[T];
    alignas(64) float out[LB * T];
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (index_t bc = 0; bc < d.bc; ++bc) {
      for (index_t b = 0; b < blocks; ++b) {
        const LineEntry* entries = decoded.data() + boff[b];
        const index_t count = boff[b + 1] - boff[b];
        const Elem* channel = gy + bc * plane;
        for (index_t j0 = 0; j0 < d.wo; j0 += T) {
          const index_t n = std::min(T, d.wo - j0);
          line_tile_upto<LB, NV, Elem>(n, entries, count, channel, j0, d.wo, wrap, out, T);
          for (int i = 0; i < LB && b * LB + i < lines; ++i) {
            const index_t l = b * LB + i, h = l / s, p = l % s;
            Elem* dst = gx + (bc * d.hi + h) * d.wi + p + s * j0;
            if (s == 1) {
              store_floats(dst, out + i * T, n);
            } else {
              for (index_t t = 0; t < n; ++t) dst[s * t] = from_float<Elem>(out[i * T + t]);
            }
          }
        }
      }
    }
  }
}

}  // namespace tc::disco
