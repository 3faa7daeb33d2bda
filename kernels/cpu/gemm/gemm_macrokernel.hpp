// Loops 2 and 1 around the micro-kernel (jr over NR panels of B, ir over MR
// panels of A) for one mc x nc x kc block, plus the edge-tile handling.
#pragma once

#include "gemm_config.hpp"
#include "gemm_microkernel.hpp"
#include "gemm_pack.hpp"

namespace tc::gemm {

/// The A operand of one block as the micro-kernel sees it: packed MR-row
/// micro-panels, or (A read in place) the original strided matrix, in which case
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

/// C block (mc x nc, leading dimension ldc) (+)= A block * B block, for the
/// NR panels [panel_begin, panel_end) of the packed B block; `PackA` says which form `a` has.
template <bool PackA>
inline void macrokernel(index_t mc, index_t nc, index_t kc, const ABlock& a,
                        const float* b_packed, float* c, index_t ldc, bool accumulate,
                        index_t panel_begin, index_t panel_end) {
  alignas(64) float edge_tile[kMR * kNR];
  const index_t calls = ceil_div(mc, kMR);  // per B micro-panel
  const index_t steps = packed_steps(kc);   // rows of a packed micro-panel
  // The next B micro-panel reaches L2 in slices, one a call, while this one is in use.
  const index_t panel_lines = kNR * steps / 16;
  const index_t slice_lines = std::min(ceil_div(panel_lines, calls), steps / kAheadStepsB);
  auto full_tile = [&](index_t panel, index_t ir) {
    return panel < panel_end && ir + kMR <= mc && (panel + 1) * kNR <= nc;
  };
  for (index_t panel = panel_begin; panel < panel_end; ++panel) {
    const index_t jr = panel * kNR;
    const index_t nr = nc - jr < kNR ? nc - jr : kNR;
    const float* b_panel = b_packed + jr * steps;
    const bool later_panel = panel + 1 < panel_end;
    for (index_t ir = 0; ir < mc; ir += kMR) {
      const index_t mr = mc - ir < kMR ? mc - ir : kMR;
      // Next call reads the next A panel, or the first one with the next B panel.
      const bool last_row = ir + kMR >= mc;
      const bool full = mr == kMR && nr == kNR;
      float* c_tile = full ? c + ir * ldc + jr : edge_tile;
      const index_t c_ld = full ? ldc : kNR;
      const bool c_accumulate = full && accumulate;
      const index_t slice_begin = ir / kMR * slice_lines;
      Ahead next;
      next.b = last_row ? b_panel + kNR * steps : b_panel;
      next.c = last_row ? (full_tile(panel + 1, 0) ? c + jr + kNR : nullptr)
                        : (full_tile(panel, ir + kMR) ? c + (ir + kMR) * ldc + jr : nullptr);
      next.b_later = b_panel + kNR * steps + slice_begin * 16;
      next.b_lines = later_panel ? int(std::max<index_t>(0, std::min(slice_lines, panel_lines - slice_begin))) : 0;

      if constexpr (PackA) {
        const float* a_panel = a.base + ir * steps;
        next.a = last_row ? a.base : a_panel + kMR * steps;
        microkernel<MicroVec, kMR, kNR, true, kPrefetch>(steps, {a_panel, 1, kMR}, b_panel, c_tile, c_ld,
                                                         c_accumulate, next);
      } else if (mr == kMR) {
        const float* a_rows = a.base + ir * a.row_stride;
        next.a = last_row ? a.base : a_rows + kMR * a.row_stride;
        microkernel<Vec, kMR, kNR, false, kPrefetch>(kc, {a_rows, a.row_stride, a.col_stride},
                                                     b_panel, c_tile, c_ld, c_accumulate, next);
      } else {
        pack_a_panel<kMR>(StridedView<float>{a.base + ir * a.row_stride, a.row_stride, a.col_stride},
                          mr, kc, 0, a.tail);
        next.a = a.base;
        microkernel<Vec, kMR, kNR, true, kPrefetch>(kc, {a.tail, 1, kMR}, b_panel, c_tile, c_ld,
                                                    c_accumulate, next);
      }
      if (!full) store_edge_tile(edge_tile, mr, nr, c + ir * ldc + jr, ldc, accumulate);
    }
  }
}

}  // namespace tc::gemm
