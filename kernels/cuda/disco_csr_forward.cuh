// The forward contraction's part of a CTA: y[bc0 : bc0+BT, r, lon0 : lon0+kLonsPerCta] for
// CSR row r = k*Ho + ho.
//
// Entry e (column hi*Wi + wi) reads x[c, hi, (wi + s*wo) mod Wi]. It is staged as
// offset = its column and shift = Wi - wi, the longitudes left before the wrap, so that a
// thread reads offset + s*wo, less Wi once s*wo >= shift.
#pragma once

#include "disco_csr.cuh"

namespace tc::disco_cuda {

struct Forward {
  /// Work items: the CSR rows k*Ho + ho.
  static index_t items(const Dims& d) { return d.k * d.ho; }

  /// The row of item `rank`: latitudes pole first, the K rows of one latitude adjacent
  /// (they read the same input latitudes).
  static TC_HD index_t item_at(index_t rank, const Dims& d) {
    return rank % d.k * d.ho + pole_first(rank / d.k, d.ho);
  }

  /// Elements per channel of the input it reads (x).
  static TC_HD index_t src_plane(const Dims& d) { return d.in_plane(); }

  /// Thread tid's share of staging entries [first, first + count).
  template <typename Elem>
  static TC_HD void stage(const Operands<Elem>& a, index_t first, int count, int tid,
                          StagedEntries& staged) {
    const index_t plane = a.d.in_plane();
    for (int i = tid; i < count; i += kThreads) {
      const index_t col = a.columns[first + i];
      // a column outside the grid becomes a zero entry that reads the plane's first row
      const bool inside = col >= 0 && col < plane;
      staged.offset[i] = static_cast<std::int32_t>(inside ? col : 0);
      staged.shift[i] = static_cast<std::int32_t>(a.d.wi - (inside ? col % a.d.wi : 0));
      staged.val[i] = inside ? a.vals[first + i] : 0.0f;
    }
  }

  /// Adds the staged entries' contributions to thread tid's sums.
  template <int BT, typename Elem>
  static TC_HD void accumulate(const Operands<Elem>& a, const StagedEntries& staged, int count,
                               const ChannelPlanes<BT, Elem>& planes, index_t lon0, int tid,
                               Accumulators<BT>& acc) {
    const std::int32_t wi = static_cast<std::int32_t>(a.d.wi);
    std::int32_t lon_in[kLonsPerThread];  // s * wo; slots past Wo read Wo - 1's, dropped later
#pragma unroll
    for (int t = 0; t < kLonsPerThread; ++t)
      lon_in[t] = static_cast<std::int32_t>(
          a.d.stride() * min_index(thread_lon(lon0, tid, t), a.d.wo - 1));
    for (int i = 0; i < count; ++i) {
      const std::int32_t offset = staged.offset[i], shift = staged.shift[i];
      const float val = staged.val[i];
      std::int32_t index[kLonsPerThread];
#pragma unroll
      for (int t = 0; t < kLonsPerThread; ++t)
        index[t] = offset + lon_in[t] - (lon_in[t] >= shift ? wi : 0);
#pragma unroll
      for (int c = 0; c < BT; ++c)
#pragma unroll
        for (int t = 0; t < kLonsPerThread; ++t)
          acc.sum[c][t] = fmaf(val, load_float(planes.plane[c] + index[t]), acc.sum[c][t]);
    }
  }

  /// Writes thread tid's sums of the `valid` channels from bc0 to y.
  template <int BT, typename Elem>
  static TC_HD void store(const Operands<Elem>& a, const Accumulators<BT>& acc, index_t row,
                          index_t bc0, index_t valid, index_t lon0, int tid) {
    const index_t rows = a.d.k * a.d.ho;
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      if (c >= valid) break;
      Elem* out = a.dst + ((bc0 + c) * rows + row) * a.d.wo;
#pragma unroll
      for (int t = 0; t < kLonsPerThread; ++t) {
        const index_t wo = thread_lon(lon0, tid, t);
        if (wo < a.d.wo) out[wo] = from_float<Elem>(acc.sum[c][t]);
      }
    }
  }
};

}  // namespace tc::disco_cuda
