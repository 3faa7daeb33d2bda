// The blocked loops around the micro-tile for one task of one group:
// output rows [m_begin, m_end) x column panels [j_begin, j_end), reduced
// over depth [p_begin, p_end), written (not accumulated) into `out`.
//
// Loop order jc (BN) -> pc (BK) -> ic (BM) -> panel -> MR tile, as in BLIS.
//   direct  the policy feeds each tile from the tensors in place
//   im2col  the BM x BK block of A is packed into MR panels, B comes packed
//           (weights) or is packed per (jc, pc) (bwd_weight's im2col operand);
//           with TC_DSB the next A block is packed panel by panel between the
//           tiles of the first column panel of the current one (two buffers).
#pragma once

#include <algorithm>
#include <array>

#include "grouped_conv_microkernel.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

/// One thread's packing buffers.
struct TaskScratch {
  float* a_pack[2];  // round_up(BM, MR) x BK each
  float* b_pack;     // BN x BK
};

/// Where the task range sits; the blocked loops walk it.
struct TaskRange {
  int g;
  index_t m_begin, m_end, j_begin, j_end, p_begin, p_end;
};

namespace detail {

/// Zero tiles for a thread whose share of the reduction is empty.
template <class Policy>
void store_zeros(const Policy& policy, const TaskRange& t, float* out) {
  MicroTile tile;
  tile.zero();
  for (index_t j = t.j_begin; j < t.j_end; ++j)
    for (index_t m = t.m_begin; m < t.m_end; m += kMR) policy.store(tile, out, t.g, m, j, false);
}

/// A position (jc, pc, ic) in the task's block order; advance() steps to the next.
struct BlockStep {
  index_t jc, pc, ic;
  bool advance(const TaskRange& t) {
    if ((ic += kBM) < t.m_end) return true;
    ic = t.m_begin;
    if ((pc += kBK) < t.p_end) return true;
    pc = t.p_begin;
    return (jc += kPanelsPerBlock) < t.j_end;
  }
  index_t mc(const TaskRange& t) const { return std::min(kBM, t.m_end - ic); }
  index_t kc(const TaskRange& t) const { return std::min(kBK, t.p_end - pc); }
};

template <class Policy>
void run_direct(const Policy& policy, const TaskRange& t, float* out) {
  for (index_t jc = t.j_begin; jc < t.j_end; jc += kPanelsPerBlock) {
    const index_t jn = std::min(jc + kPanelsPerBlock, t.j_end);
    for (index_t pc = t.p_begin; pc < t.p_end; pc += kBK) {
      const index_t kc = std::min(kBK, t.p_end - pc);
      for (index_t ic = t.m_begin; ic < t.m_end; ic += kBM) {
        const index_t mn = std::min(ic + kBM, t.m_end);
        for (index_t j = jc; j < jn; ++j)
          for (index_t m = ic; m < mn; m += kMR) {
            MicroTile tile;
            tile.zero();
            policy.direct_tile(tile, t.g, m, j, pc, kc);
            policy.store(tile, out, t.g, m, j, pc > t.p_begin);
          }
      }
    }
  }
}

template <class Policy>
void run_im2col(const Policy& policy, const TaskRange& t, float* out, const TaskScratch& scratch) {
  std::array<const float*, kPanelsPerBlock> b_panels{};
  auto pack_a_panel = [&](const BlockStep& step, index_t panel, float* dst) {
    const index_t kc = step.kc(t);
    policy.pack_a(t.g, step.ic + panel * kMR, step.pc, kc, dst + panel * kMR * kc);
  };
  BlockStep step{t.j_begin, t.p_begin, t.m_begin};
  int buffer = 0;
  if constexpr (kDoubleBuffer)
    for (index_t panel = 0; panel < ceil_div(step.mc(t), kMR); ++panel)
      pack_a_panel(step, panel, scratch.a_pack[0]);
  for (bool more = true; more;) {
    const index_t kc = step.kc(t), mc = step.mc(t);
    const index_t a_panels = ceil_div(mc, kMR);
    const index_t jn = std::min(step.jc + kPanelsPerBlock, t.j_end);
    if (step.ic == t.m_begin)  // a new (jc, pc): new B block
      for (index_t j = step.jc; j < jn; ++j)
        b_panels[j - step.jc] = policy.b_block(t.g, j, step.pc, kc,
                                               scratch.b_pack + (j - step.jc) * kc * kNR);
    if constexpr (!kDoubleBuffer)
      for (index_t panel = 0; panel < a_panels; ++panel) pack_a_panel(step, panel, scratch.a_pack[0]);
    BlockStep next = step;
    more = next.advance(t);
    const index_t next_panels = more && kDoubleBuffer ? ceil_div(next.mc(t), kMR) : 0;
    float* next_buffer = scratch.a_pack[buffer ^ 1];
    index_t packed_ahead = 0;

    const float* a_block = scratch.a_pack[buffer];
    for (index_t j = step.jc; j < jn; ++j)
      for (index_t panel = 0; panel < a_panels; ++panel) {
        MicroTile tile;
        tile.zero();
        tile_packed(tile, kc, a_block + panel * kMR * kc, b_panels[j - step.jc]);
        policy.store(tile, out, t.g, step.ic + panel * kMR, j, step.pc > t.p_begin);
        if (kDoubleBuffer && packed_ahead < next_panels) pack_a_panel(next, packed_ahead++, next_buffer);
      }
    if constexpr (kDoubleBuffer) {
      for (; packed_ahead < next_panels; ++packed_ahead) pack_a_panel(next, packed_ahead, next_buffer);
      buffer ^= 1;
    }
    step = next;
  }
}

}  // namespace detail

/// Computes the task's output block with the compiled pipeline.
template <class Policy>
void run_task(const Policy& policy, const TaskRange& t, float* out, const TaskScratch& scratch) {
  if (t.m_begin >= t.m_end || t.j_begin >= t.j_end) return;
  if (t.p_begin >= t.p_end) return detail::store_zeros(policy, t, out);
  if constexpr (kPipeline == kIm2col) detail::run_im2col(policy, t, out, scratch);
  else detail::run_direct(policy, t, out);
}

}  // namespace tc::gconv
