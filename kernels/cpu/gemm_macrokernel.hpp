// Loops 2 and 1 around the micro-kernel (jr over NR panels of B, ir over MR
// panels of A) for one mc x nc x kc block, plus the edge-tile handling.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

#include <immintrin.h>

#include "gemm_config.hpp"
#include "gemm_microkernel.hpp"
#include "gemm_pack.hpp"

namespace tc::gemm {

/// The A operand of one block as the micro-kernel sees it: packed MR-row
/// micro-panels, or (TC_PACK_A=0) the original strided matrix, in which case
/// partial MR-row tails are packed into `tail` so no row past M is read.
struct ABlock {
  const float* base;   // packed block, or A(ic, pc) of the strided matrix
  index_t row_stride;  // strided only
  index_t col_stride;  // strided only
  float* tail;         // strided only: MR x kc scratch
};

/// A partial tile (at the M or N edge) is computed into a full MR x NR
/// buffer and only its valid part reaches C: the micro-kernel stays branch-free.
inline void store_edge_tile(const float* tile, index_t mr, index_t nr, float* c, index_t ldc,
                            bool accumulate) {
  for (index_t i = 0; i < mr; ++i)
    for (index_t j = 0; j < nr; ++j)
      c[i * ldc + j] = accumulate ? c[i * ldc + j] + tile[i * kNR + j] : tile[i * kNR + j];
}

/// The L2 stream of one call: call `call` of a panel's `calls` takes its share of `region`
/// (`lines` lines in all), one line every 4 k steps, or every 2 or every step where the
/// panel has too few calls for that.
inline L2Stream stream_share(L2Stream region, index_t lines, index_t call, index_t calls, index_t kc) {
  if (!kPrefetch || region.base == nullptr || lines <= 0) return {};
  int shift = 2;
  while (shift > 0 && calls * (kc >> shift) < lines) --shift;
  const index_t window = ceil_div(lines, calls);
  region.first = call * window;
  region.count = std::max<index_t>(0, std::min({window, lines - region.first, ceil_div(kc, index_t(1) << shift)}));
  region.shift = shift;
  return region;
}

/// A packed B panel as an L2 stream region (contiguous), with its line count.
inline L2Stream packed_region(const float* panel, index_t kc, index_t& lines) {
  lines = ceil_div(kc * kNR * index_t(sizeof(float)), 64);
  return {reinterpret_cast<const char*>(panel), 0, lines};
}

/// The source of B panel `panel` (before packing) as an L2 stream region, with its line
/// count: kc rows of NR elements for row-major B, NR columns of kc for column-major B.
template <class T>
inline L2Stream source_region(const StridedView<T>& b, index_t kc, index_t nc, index_t panel,
                              index_t& lines) {
  const index_t col = panel * kNR;
  const index_t width = std::min<index_t>(kNR, nc - col);
  index_t runs, run_length, stride;
  if (b.col_stride == 1) {
    runs = kc, run_length = width, stride = b.row_stride;
  } else if (b.row_stride == 1) {
    runs = width, run_length = kc, stride = b.col_stride;
  } else {
    lines = 0;
    return {};
  }
  // A run that does not start on a line boundary spans one line more.
  const index_t run_lines = ceil_div(run_length * index_t(sizeof(T)), 64) + 1;
  lines = runs * run_lines;
  return {reinterpret_cast<const char*>(b.at(0, col)), stride * index_t(sizeof(T)), run_lines};
}

/// The tiles of one NR panel of the C block: C[:, jr:jr+nr] (+)= A block * B panel. `b_after`
/// is what the call after the last one reads; `region` (`lines` lines) is fetched into L2
/// across the panel's calls.
inline void panel_tiles(index_t mc, index_t kc, const ABlock& a, const float* b_panel, index_t nr,
                        float* c, index_t ldc, bool accumulate, const float* b_after,
                        L2Stream region, index_t lines) {
  alignas(64) float edge_tile[kMR * kNR];
  const index_t calls = ceil_div(mc, kMR);
  for (index_t ir = 0; ir < mc; ir += kMR) {
    const index_t mr = mc - ir < kMR ? mc - ir : kMR;
    // Next call reads the next A panel, or the first one with the next B panel.
    const bool last_row = ir + kMR >= mc;
    const float* b_next = last_row ? b_after : b_panel;
    const bool full = mr == kMR && nr == kNR;
    float* c_tile = full ? c + ir * ldc : edge_tile;
    const index_t c_ld = full ? ldc : kNR;
    const bool c_accumulate = full && accumulate;
    const L2Stream stream = stream_share(region, lines, ir / kMR, calls, kc);

    if constexpr (kPackA) {
      const float* a_panel = a.base + ir * kc;
      const float* a_next = last_row ? a.base : a_panel + kMR * kc;
      microkernel<Vec, kMR, kNR, true, kPrefetch>(kc, {a_panel, 1, kMR}, b_panel, c_tile, c_ld,
                                                  c_accumulate, a_next, b_next, stream);
    } else if (mr == kMR) {
      const float* a_rows = a.base + ir * a.row_stride;
      const float* a_next = last_row ? a.base : a_rows + kMR * a.row_stride;
      microkernel<Vec, kMR, kNR, false, kPrefetch>(kc, {a_rows, a.row_stride, a.col_stride},
                                                   b_panel, c_tile, c_ld, c_accumulate, a_next,
                                                   b_next, stream);
    } else {
      pack_a_panel<kMR>(StridedView<float>{a.base + ir * a.row_stride, a.row_stride, a.col_stride},
                        mr, kc, 0, a.tail);
      microkernel<Vec, kMR, kNR, true, kPrefetch>(kc, {a.tail, 1, kMR}, b_panel, c_tile, c_ld,
                                                  c_accumulate, a.base, b_next, stream);
    }
    if (!full) store_edge_tile(edge_tile, mr, nr, c + ir * ldc, ldc, accumulate);
  }
}

/// C block (mc x nc, leading dimension ldc) (+)= A block * B block, for the
/// NR panels [panel_begin, panel_end) of the packed B block. Each panel's calls fetch the
/// next panel into L2: a packed block is larger than L2, so its panels come from L3.
inline void macrokernel(index_t mc, index_t nc, index_t kc, const ABlock& a,
                        const float* b_packed, float* c, index_t ldc, bool accumulate,
                        index_t panel_begin, index_t panel_end) {
  for (index_t panel = panel_begin; panel < panel_end; ++panel) {
    const index_t jr = panel * kNR;
    const float* b_panel = b_packed + jr * kc;
    const float* b_after = b_panel + kNR * kc;
    index_t lines = 0;
    const L2Stream region = panel + 1 < panel_end ? packed_region(b_after, kc, lines) : L2Stream{};
    panel_tiles(mc, kc, a, b_panel, std::min<index_t>(kNR, nc - jr), c + jr, ldc, accumulate,
                b_after, region, lines);
  }
}

/// Spins until `flag` reads `value` (acquire), yielding the core after a while: with more
/// threads than cores, the thread being waited for may need it.
inline void wait_until(const std::atomic<std::int64_t>& flag, std::int64_t value) {
  for (int spins = 0; flag.load(std::memory_order_acquire) != value; ++spins) {
    if (spins < 4096)
      _mm_pause();
    else
      std::this_thread::yield();
  }
}

/// The first A block of a B block, with the B block's packing folded in: this thread's panels
/// [own_begin, own_end) are packed one at a time, each just before its tiles, while the
/// previous panel's calls fetch its source into L2. Packing then reads from L2 and writes a
/// panel that the next calls read from L1-L2, instead of a pass of its own through L3.
///
/// Without `ready`, only the thread's own panels are computed (the panels are split between
/// threads, or it packs them all). With `ready`, every panel is computed: after its own, in
/// turn, those other threads pack, each once its flag reads `generation` (release/acquire).
template <class T>
inline void packing_block(index_t mc, index_t nc, index_t kc, const ABlock& a,
                          const StridedView<T>& b, float* b_packed, float* c, index_t ldc,
                          bool accumulate, index_t own_begin, index_t own_end,
                          std::atomic<std::int64_t>* ready, std::int64_t generation) {
  const index_t panels = ceil_div(nc, kNR);
  const index_t own = own_end - own_begin;
  const index_t count = ready ? panels : own;
  const auto panel_at = [&](index_t i) { return (own_begin + i) % panels; };
  for (index_t i = 0; i < count; ++i) {
    const index_t panel = panel_at(i);
    if (i < own) {
      pack_b_panel<kNR>(b, kc, nc, panel, b_packed);
      if (ready) ready[panel].store(generation, std::memory_order_release);
    } else {
      wait_until(ready[panel], generation);
    }
    // The next panel: its source to pack, or the packed panel another thread made.
    index_t lines = 0;
    L2Stream region;
    const float* b_after = a.base;
    if (i + 1 < count) {
      const index_t next = panel_at(i + 1);
      b_after = b_packed + next * kNR * kc;
      region = i + 1 < own ? source_region(b, kc, nc, next, lines) : packed_region(b_after, kc, lines);
    }
    const index_t jr = panel * kNR;
    panel_tiles(mc, kc, a, b_packed + jr * kc, std::min<index_t>(kNR, nc - jr), c + jr, ldc,
                accumulate, b_after, region, lines);
  }
}

}  // namespace tc::gemm
