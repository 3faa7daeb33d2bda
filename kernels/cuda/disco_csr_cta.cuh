// One CTA of either direction (Forward, Transpose) on either executor: stage a chunk of the
// row's entries, barrier, accumulate, barrier, ...; then store.
//
// A Cta has `staged` (the StagedEntries in shared memory, or a host copy), each_thread(f),
// which calls f(tid, that thread's Accumulators<BT>) for the CTA's thread (device) or for
// every thread in turn (host), and sync(), the CTA's barrier.
#pragma once

#include "disco_csr.cuh"

namespace tc::disco_cuda {

/// Work item `item` (CSR row or line) for channel tile `tile` and longitude run `chunk`.
#pragma nv_exec_check_disable
template <typename Direction, int BT, typename Elem, typename Cta>
TC_HD void run_item(Cta& cta, const Operands<Elem>& a, index_t item, index_t tile, index_t chunk) {
  const index_t bc0 = tile * BT, valid = min_index(BT, a.d.bc - bc0);
  const index_t lon0 = chunk * kLonsPerCta;
  const ChannelPlanes<BT, Elem> planes(a.src, bc0, valid, Direction::src_plane(a.d));
  const Span span = row_span(a.offsets, item, a.nnz);
  cta.each_thread([&](int, Accumulators<BT>& acc) {
#pragma unroll
    for (int c = 0; c < BT; ++c)
#pragma unroll
      for (int t = 0; t < kLonsPerThread; ++t) acc.sum[c][t] = 0.0f;
  });
  for (index_t first = span.begin; first < span.end; first += kChunk) {
    const int count = static_cast<int>(min_index(kChunk, span.end - first));
    cta.each_thread([&](int tid, Accumulators<BT>&) {
      Direction::stage(a, first, count, tid, cta.staged);
    });
    cta.sync();
    cta.each_thread([&](int tid, Accumulators<BT>& acc) {
      Direction::template accumulate<BT>(a, cta.staged, count, planes, lon0, tid, acc);
    });
    cta.sync();  // the next chunk overwrites the staged entries
  }
  cta.each_thread([&](int tid, Accumulators<BT>& acc) {
    Direction::template store<BT>(a, acc, item, bc0, valid, lon0, tid);
  });
}

/// CTA `block` of `grid`.
#pragma nv_exec_check_disable
template <typename Direction, int BT, typename Elem, typename Cta>
TC_HD void run_cta(Cta& cta, const Operands<Elem>& a, const Grid& grid, index_t block) {
  const Work work = work_of(grid, block);
  run_item<Direction, BT>(cta, a, Direction::item_at(work.rank, a.d), work.tile, work.chunk);
}

}  // namespace tc::disco_cuda
