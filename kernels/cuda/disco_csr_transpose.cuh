// The transpose contraction's part of a CTA: gx[bc0 : bc0+BT, hi, p + s*j] for the
// kLonsPerCta longitudes j from lon0, on transposed-CSR line l = hi*s + p.
//
// Entry e (column row_e*Wo + q_e) reads gy[c, row_e, (j - q_e) mod Wo]. It is staged as
// offset = row_e*Wo and shift = q_e, so that a thread reads offset + j - q_e, plus Wo while
// j < q_e.
#pragma once

#include "disco_csr.cuh"

namespace tc::disco_cuda {

struct Transpose {
  /// Work items: the input lines hi*s + p.
  static index_t items(const Dims& d) { return d.hi * d.stride(); }

  /// The line of item `rank`: latitudes pole first, the s phases of one latitude adjacent.
  static TC_HD index_t item_at(index_t rank, const Dims& d) {
    return pole_first(rank / d.stride(), d.hi) * d.stride() + rank % d.stride();
  }

  /// Elements per channel of the input it reads (gy).
  static TC_HD index_t src_plane(const Dims& d) { return d.out_plane(); }

  /// Thread tid's share of staging entries [first, first + count).
  template <typename Elem>
  static TC_HD void stage(const Operands<Elem>& a, index_t first, int count, int tid,
                          StagedEntries& staged) {
    const index_t plane = a.d.out_plane();
    for (int i = tid; i < count; i += kThreads) {
      const index_t col = a.columns[first + i];
      // a column outside gy becomes a zero entry that reads the plane's first row
      const bool inside = col >= 0 && col < plane;
      const index_t q = inside ? col % a.d.wo : 0;
      staged.offset[i] = static_cast<std::int32_t>(inside ? col - q : 0);
      staged.shift[i] = static_cast<std::int32_t>(q);
      staged.val[i] = inside ? a.vals[first + i] : 0.0f;
    }
  }

  /// Adds the staged entries' contributions to thread tid's sums.
  template <int BT, typename Elem>
  static TC_HD void accumulate(const Operands<Elem>& a, const StagedEntries& staged, int count,
                               const ChannelPlanes<BT, Elem>& planes, index_t lon0, int tid,
                               Accumulators<BT>& acc) {
    const std::int32_t wo = static_cast<std::int32_t>(a.d.wo);
    std::int32_t lon[kLonsPerThread];  // j; slots past Wo read Wo - 1's, dropped later
#pragma unroll
    for (int t = 0; t < kLonsPerThread; ++t)
      lon[t] = static_cast<std::int32_t>(min_index(thread_lon(lon0, tid, t), a.d.wo - 1));
    for (int i = 0; i < count; ++i) {
      const std::int32_t offset = staged.offset[i], q = staged.shift[i];
      const float val = staged.val[i];
      std::int32_t index[kLonsPerThread];
#pragma unroll
      for (int t = 0; t < kLonsPerThread; ++t) index[t] = offset + lon[t] - q + (lon[t] < q ? wo : 0);
#pragma unroll
      for (int c = 0; c < BT; ++c)
#pragma unroll
        for (int t = 0; t < kLonsPerThread; ++t)
          acc.sum[c][t] = fmaf(val, load_float(planes.plane[c] + index[t]), acc.sum[c][t]);
    }
  }

  /// Writes thread tid's sums of the `valid` channels from bc0 to gx.
  template <int BT, typename Elem>
  static TC_HD void store(const Operands<Elem>& a, const Accumulators<BT>& acc, index_t line,
                          index_t bc0, index_t valid, index_t lon0, int tid) {
    const index_t s = a.d.stride(), hi = line / s, phase = line % s;
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      if (c >= valid) break;
      Elem* out = a.dst + ((bc0 + c) * a.d.hi + hi) * a.d.wi + phase;
#pragma unroll
      for (int t = 0; t < kLonsPerThread; ++t) {
        const index_t j = thread_lon(lon0, tid, t);
        if (j < a.d.wo) out[s * j] = from_float<Elem>(acc.sum[c][t]);
      }
    }
  }
};

}  // namespace tc::disco_cuda
