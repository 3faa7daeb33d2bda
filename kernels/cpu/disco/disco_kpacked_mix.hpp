// The kpacked contraction and the channel mix in one kernel: the forward of DiscoConvS2 on
// one group (fp32), written as a GEMM whose B operand the contraction produces already packed.
//
//   out[b, o, ho, wo] = sum_{c, k} w[o, c * K + k] * y[b, c, k, ho, wo]
//   y[b, c, k, ho, wo] = sum_{n in ho's neighbours} vals[n, k] * x[b, c, lat_n, (lon_n + s*wo) mod Wi]
//
// The fused path of tilecast/disco/fused.py writes y for a block of output latitudes (a
// 24 MB slab) and hands it to torch's sgemm, which reads it back and packs it into NR-column
// panels. Here y never exists: for one output latitude at a time (a work item), the
// contraction tile of packed_tile (disco_kpacked.hpp) is exactly one row segment of a GEMM
// B panel when its width is the micro-kernel's NR (16 floats on AVX2, 32 on AVX-512), so it
// stores its K basis rows straight into the panel, and the GEMM micro-kernel
// (gemm_microkernel.hpp) runs on the panel while it is in cache. Where wo is not a whole
// number of panels (720 longitudes on AVX-512: 22 panels and 16), the last panel is
// contracted whole from the band (whose lines run on periodically past wo) and only its
// first wo % NR columns reach the output.
//
// Loops, per work item (batch element b, output latitude ho, or part of its panels where
// the call has fewer latitudes than twice the threads; a thread owns whole items, so no two
// threads write the same output and none waits for another):
//   for each chunk of channels (kc = channels * K rows of the GEMM's k, about kKcTarget):
//     contract the chunk into the item's B block: wo / NR panels of kc x NR
//     for each block of mc output channels, each panel, each MR rows: C tile (+)= A * panel
// A, the weight, is packed once per call into MR-row micro-panels per chunk (zero rows
// past C_out). The output row is written in place: out[b, o, ho, :] is one row of C with
// leading dimension Ho * Wo.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "disco_kpacked.hpp"

// The GEMM headers take their variant from -D macros; this kernel needs only the
// micro-kernel, whose tile it names itself, so any consistent set will do.
#ifndef TC_DTYPE
#define TC_DTYPE 0
#ifdef __AVX512F__
#define TC_ISA 1
#define TC_MR 14
#define TC_NR 32
#else
#define TC_ISA 0
#define TC_MR 6
#define TC_NR 16
#endif
#define TC_MC (12 * TC_MR)
#define TC_NC 2048
#define TC_KC 256
#define TC_PACK_A 1
#define TC_PAR 0
#define TC_PREFETCH 0
#endif
#include "../gemm/gemm_microkernel.hpp"

namespace tc::disco {

#ifdef __AVX512F__
constexpr int kMixMR = 14;           // 28 zmm accumulators
constexpr int kMixKreg = 12;         // contraction tile 12 x 2 zmm: 32 longitudes
#else
constexpr int kMixMR = 6;            // 12 ymm accumulators
constexpr int kMixKreg = 5;          // contraction tile 5 x 2 ymm: 16 longitudes
#endif
constexpr int kMixNV = 2;
constexpr index_t kMixNR = kMixNV * kLanes;  // GEMM panel width = contraction tile width
constexpr index_t kKcTarget = 256;   // GEMM k rows per channel chunk (a B panel: 16 KB, L1)
constexpr index_t kMcTarget = 192;   // output channels per A block (mc x kc: L2)

/// Channels per chunk for K basis functions: kc = channels * K close to kKcTarget.
inline index_t mix_chunk_channels(index_t k) { return std::max<index_t>(1, kKcTarget / k); }

/// w (m x channels*k, row-major) packed per channel chunk and MR-row panel: chunk q's panels
/// start at chunk_offset[q]; panel i holds w[i*MR + r, rows of the chunk] step by step,
/// MR floats a step, rows past m zero.
struct PackedWeight {
  std::vector<float> data;
  std::vector<index_t> chunk_offset;
  index_t m_padded;
};

inline PackedWeight pack_weight(const float* w, index_t m, index_t channels, index_t k,
                                index_t chunk) {
  PackedWeight packed;
  const index_t width = channels * k;
  packed.m_padded = ceil_div(m, kMixMR) * kMixMR;
  packed.data.assign(packed.m_padded * width, 0.0f);
  for (index_t c0 = 0; c0 < channels; c0 += chunk) {
    const index_t r0 = c0 * k, kc = std::min(chunk, channels - c0) * k;
    const index_t base = packed.m_padded * r0;
    packed.chunk_offset.push_back(base);
    for (index_t i = 0; i < m; ++i) {
      float* panel = packed.data.data() + base + (i / kMixMR) * kMixMR * kc + i % kMixMR;
      const float* row = w + i * width + r0;
      for (index_t step = 0; step < kc; ++step) panel[step * kMixMR] = row[step];
    }
  }
  return packed;
}

/// The fused forward (module comment) of output latitudes [ho_begin, ho_begin + ho_count);
/// d.bc is the batch, `channels` the input channels (x is (batch, channels, hi, wi)), m the
/// output channels (out is (batch, m, ho, wo), only those latitudes written). offset / line /
/// quot / vals: the kpacked psi as kpacked_forward_blocked takes it (line and quot decoded
/// from neighbour offset[ho_begin] on).
inline void kpacked_mix_forward(const float* x, const float* w, float* out, const Dims& d,
                                index_t ho_begin, index_t ho_count, index_t channels, index_t m,
                                const std::int64_t* offset, const std::int32_t* line,
                                const std::int32_t* quot, const float* vals, index_t kpad,
                                int threads) {
  constexpr index_t NR = kMixNR;
  const index_t s = d.stride();
  const int kernels = static_cast<int>(d.k);
  const index_t chunk = mix_chunk_channels(d.k);
  const PackedWeight a = pack_weight(w, m, channels, d.k, chunk);
  const index_t mc = std::max<index_t>(kMixMR, kMcTarget / kMixMR * kMixMR);
  const index_t rowlen = ceil_div(2 * d.wo + NR, kLanes) * kLanes;
  const index_t panels = ceil_div(d.wo, NR);  // the last one partial where NR does not divide wo
  const index_t ldc = d.ho * d.wo;
  // a work item is one output latitude's panels [p0, p1): a latitude is cut in parts only
  // where there are too few of them for the threads (a block of one or two rows)
  const index_t row_items = d.bc * ho_count;
  const index_t parts = std::min(panels, std::max<index_t>(1, ceil_div(2 * threads, row_items)));
  const index_t items = row_items * parts;
  const index_t first = offset[ho_begin];
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> band;
    std::vector<const float*> src;
    std::vector<float> b_storage;  // the item's panels for one chunk: panels x kc x NR
    alignas(64) float edge[kMixMR * NR];
    tc::gemm::Ahead none{nullptr, nullptr, nullptr, nullptr, 0};
#pragma omp for schedule(dynamic, 1)
    for (index_t item = 0; item < items; ++item) {
      const index_t row = item / parts, part = item % parts;
      const index_t b = row / ho_count, ho = ho_begin + row % ho_count;
      const index_t p0 = part * panels / parts, p1 = (part + 1) * panels / parts;
      float* c_row = out + b * m * ldc + ho * d.wo;
      const index_t count = offset[ho + 1] - offset[ho];
      if (count == 0) {  // no neighbours: the row is zero
        for (index_t o = 0; o < m; ++o)
          std::fill(c_row + o * ldc + p0 * NR, c_row + o * ldc + std::min(p1 * NR, d.wo), 0.0f);
        continue;
      }
      const index_t hi_lo = line[offset[ho] - first] / s;
      const index_t hi_hi = line[offset[ho + 1] - 1 - first] / s;
      band.resize((hi_hi - hi_lo + 1) * s * rowlen);
      src.clear();
      for (index_t n = offset[ho]; n < offset[ho + 1]; ++n)
        src.push_back(band.data() + (line[n - first] - hi_lo * s) * rowlen + quot[n - first]);
      const float* ho_vals = vals + offset[ho] * kpad;
      b_storage.resize((p1 - p0) * chunk * d.k * NR + 16);
      // the micro-kernel loads B panels aligned: 64 bytes
      float* b_block = b_storage.data() +
                       (16 - reinterpret_cast<std::uintptr_t>(b_storage.data()) / 4 % 16) % 16;
      for (index_t c0 = 0, q = 0; c0 < channels; c0 += chunk, ++q) {
        const index_t cc = std::min(chunk, channels - c0), kc = cc * d.k;
        // the chunk's B panels: row (c - c0) * K + k of panel p is y[b, c, k, ho, p*NR : +NR]
        for (index_t c = c0; c < c0 + cc; ++c) {
          fill_periodic_band(x + (b * channels + c) * d.hi * d.wi, d, hi_lo, hi_hi, rowlen,
                             band.data());
          for (index_t p = p0; p < p1; ++p) {
            float* rows = b_block + (p - p0) * kc * NR + (c - c0) * d.k * NR;
            for (int k0 = 0; k0 < kernels; k0 += kMixKreg)
              packed_tile<kMixKreg, kMixNV>(src.data(), count, ho_vals, kpad,
                                            std::min(kMixKreg, kernels - k0), k0, p * NR,
                                            rows + k0 * NR, NR);
          }
        }
        const bool accumulate = c0 > 0;
        const float* a_chunk = a.data.data() + a.chunk_offset[q];
        for (index_t ic = 0; ic < m; ic += mc) {
          const index_t mb = std::min(mc, m - ic);
          for (index_t p = p0; p < p1; ++p) {
            const float* panel = b_block + (p - p0) * kc * NR;
            const index_t cols = std::min(NR, d.wo - p * NR);
            for (index_t ir = ic; ir < ic + mb; ir += kMixMR) {
              const float* a_panel = a_chunk + ir * kc;
              float* c_tile = c_row + ir * ldc + p * NR;
              if (ir + kMixMR <= m && cols == NR) {
                tc::gemm::microkernel<Vec, kMixMR, NR, true, false>(kc, {a_panel, 1, kMixMR}, panel,
                                                                   c_tile, ldc, accumulate, none);
              } else {  // the last rows or columns: through a whole tile, then only the valid ones
                tc::gemm::microkernel<Vec, kMixMR, NR, true, false>(kc, {a_panel, 1, kMixMR}, panel,
                                                                   edge, NR, false, none);
                for (index_t i = 0; i < std::min<index_t>(kMixMR, m - ir); ++i)
                  for (index_t j = 0; j < cols; ++j)
                    c_tile[i * ldc + j] = (accumulate ? c_tile[i * ldc + j] : 0.0f) + edge[i * NR + j];
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace tc::disco
