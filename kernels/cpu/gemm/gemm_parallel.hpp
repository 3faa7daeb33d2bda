// Loops 5, 4 and 3 (jc over NC, pc over KC, ic over MC) and the three OpenMP
// schemes that share them out, selected by TC_PAR through one table.
//
//   m  B block packed cooperatively; each thread starts on its own contiguous
//      range of MR-row panels of M (balanced to MR granularity, not whole MC
//      blocks, so e.g. M=512 does not split 3:2 blocks), claims it an A block at a
//      time and packs its own A blocks; one done early takes the rest of another's.
//   n  A and B blocks packed cooperatively; threads claim the NR panels of
//      each block a few at a time, so a core that runs slower (a busy sibling on
//      a shared VM) takes fewer of them. Suits small M (skinny GEMMs) with wide N.
//   k  split-K: each thread runs the whole blocked GEMM on its own K range
//      into its own partial C (thread 0 writes C itself), then a parallel
//      reduction. Suits small M*N with large K.
//
// Whether A is packed is the workspace's: TC_PACK_A by default (a GEMM variant's parameter),
// or the caller's choice (the convolution's gemm pipeline reads a forward im2col in place
// when it has few columns to spread the packing over).
#pragma once

#include <omp.h>

#include <atomic>
#include <map>
#include <memory>
#include <tuple>
#include <type_traits>

#include "gemm_buffers.hpp"
#include "gemm_config.hpp"
#include "gemm_macrokernel.hpp"
#include "gemm_pack.hpp"
#include "gemm_skinny.hpp"

namespace tc::gemm {

/// One GEMM problem: C (m x n, row-major, leading dimension ldc) = A * B.
struct Problem {
  index_t m, n, k;
  StridedView<InputT> a;
  StridedView<InputT> b;
  float* c;
  index_t ldc;
};

/// All scratch memory of one job, allocated once before timing.
struct Workspace {
  int threads;
  bool pack_a;             // A packed into MR-row panels, or read in place (fp32 only)
  SlicedBuffer b_pack;     // kc x round_up(nc, NR); one per thread for "k", else shared
  SlicedBuffer a_pack;     // round_up(mc, MR) x kc; shared for "n", else one per thread
  SlicedBuffer a_tail;     // MR x kc per thread (A in place: its edge rows)
  SlicedBuffer c_partial;  // m x n per thread but the first ("k" only)
  skinny::Scratch skinny;  // GEMV-class problems (gemm_skinny.hpp) need only this
  // Claim counters, zeroed by each call, one per block and owning thread: "m" the row
  // panels claimed in each (jc, pc) block, "n" the B panels claimed in each (jc, pc, ic).
  std::unique_ptr<std::atomic<index_t>[]> claims;
  index_t claim_blocks = 0;

  Workspace(const Problem& problem, int thread_count, bool pack_a_blocks = kPackA)
      : threads(thread_count), pack_a(pack_a_blocks || !std::is_same_v<InputT, float>) {
    skinny::Task task;
    if (skinny::task_of(problem, task)) {
      skinny = skinny::Scratch(task, threads);
      return;
    }
    const index_t kc = std::min(problem.k, kKC);
    const index_t nc = round_up(std::min(problem.n, kNC), kNR);
    const index_t mc = round_up(std::min(problem.m, kMC), kMR);
    b_pack = SlicedBuffer(kParScheme == 2 ? threads : 1, kc * nc);
    if (pack_a) a_pack = SlicedBuffer(kParScheme == 1 ? 1 : threads, mc * kc);
    if (!pack_a) a_tail = SlicedBuffer(threads, kMR * kc);
    if (kParScheme == 2 && threads > 1) c_partial = SlicedBuffer(threads - 1, problem.m * problem.n);
    if (kParScheme != 2) {
      claim_blocks = ceil_div(problem.n, kNC) * ceil_div(problem.k, kKC) *
                     (kParScheme == 1 ? ceil_div(problem.m, kMC) : 1);
      claims.reset(new std::atomic<index_t>[claim_blocks * threads]);
    }
  }

  /// Every claim counter back to zero, before a call's parallel region.
  void reset_claims() {
    for (index_t i = 0; i < claim_blocks * threads; ++i) claims[i].store(0, std::memory_order_relaxed);
  }
};

/// Workspaces for a product taken `chunk` rows at a time out of `total`: one per distinct
/// chunk size (the last chunk may be smaller), keyed by rows; problem(rows) gives its shape.
template <class MakeProblem>
std::map<index_t, std::unique_ptr<Workspace>> chunk_workspaces(index_t chunk, index_t total,
                                                               int threads, MakeProblem problem,
                                                               bool pack_a = kPackA) {
  std::map<index_t, std::unique_ptr<Workspace>> by_rows;
  for (index_t rows : {chunk, total % chunk})
    if (rows > 0 && !by_rows.count(rows))
      by_rows.emplace(rows, std::make_unique<Workspace>(problem(rows), threads, pack_a));
  return by_rows;
}

/// The A block (ic, pc) of `mc` x `kc` as the macro-kernel reads it. With
/// packing, panels [panel_begin, panel_end) are packed by this caller.
template <bool PackA>
inline ABlock a_block(const Problem& p, index_t ic, index_t pc, index_t mc, index_t kc,
                      float* packed, float* tail, index_t panel_begin, index_t panel_end) {
  if constexpr (PackA) {
    const StridedView<InputT> a{p.a.at(ic, pc), p.a.row_stride, p.a.col_stride};
    for (index_t panel = panel_begin; panel < panel_end; ++panel) pack_a_panel<kMR>(a, mc, kc, panel, packed);
    return {packed, 0, 0, nullptr};
  } else {
    (void)mc, (void)kc, (void)packed, (void)panel_begin, (void)panel_end;
    return {reinterpret_cast<const float*>(p.a.at(ic, pc)), p.a.row_stride, p.a.col_stride, tail};
  }
}

/// This thread's share of the NR panels of a shared B block, packed; returns once every
/// thread's share is in place.
inline void pack_b_share(const StridedView<InputT>& b, index_t kc, index_t nc, int nt, int tid,
                         float* b_packed) {
  index_t panel_begin, panel_end;
  split_range(ceil_div(nc, kNR), nt, tid, panel_begin, panel_end);
  pack_b_panels<kNR>(b, kc, nc, panel_begin, panel_end, b_packed);
#pragma omp barrier
}

/// Claims up to `most` of the `count` units counted by `next` (guided: a fair share of what
/// is left, so the last claims are small); returns the first unit, or `count` when none is left.
inline index_t claim_guided(std::atomic<index_t>& next, index_t count, index_t most, int threads,
                            index_t& claimed) {
  index_t first = next.load(std::memory_order_relaxed);
  do {
    if (first >= count) return count;
    claimed = std::min(most, std::max<index_t>(1, ceil_div(count - first, threads)));
  } while (!next.compare_exchange_weak(first, first + claimed, std::memory_order_relaxed));
  return first;
}

/// "m": threads split the rows of C. Each starts on its own range of MR-row panels, in
/// A blocks of up to MC rows that shrink towards the range's end; a thread that finishes
/// early takes the rest of another's range, so a slower core does not hold up the block.
struct ParallelM {
  template <bool PackA>
  static void run(const Problem& p, Workspace& ws) {
    ws.reset_claims();
#pragma omp parallel num_threads(ws.threads)
    {
      const int tid = omp_get_thread_num();
      const int nt = omp_get_num_threads();
      const index_t panels = ceil_div(p.m, kMR);
      float* b_packed = ws.b_pack.slice(0);
      index_t block = 0;
      for (index_t jc = 0; jc < p.n; jc += kNC) {
        const index_t nc = std::min(kNC, p.n - jc);
        for (index_t pc = 0; pc < p.k; pc += kKC, ++block) {
          const index_t kc = std::min(kKC, p.k - pc);
          const StridedView<InputT> b{p.b.at(pc, jc), p.b.row_stride, p.b.col_stride};
          pack_b_share(b, kc, nc, nt, tid, b_packed);
          for (int step = 0; step < nt; ++step) {
            const int owner = (tid + step) % nt;
            index_t own_begin, own_end, claimed = 0;
            split_range(panels, nt, owner, own_begin, own_end);
            std::atomic<index_t>& next = ws.claims[block * nt + owner];
            for (index_t first; (first = claim_guided(next, own_end - own_begin, kMC / kMR, nt, claimed)) <
                                own_end - own_begin;) {
              const index_t ic = (own_begin + first) * kMR;
              const index_t mc = std::min(claimed * kMR, p.m - ic);
              const ABlock a = a_block<PackA>(p, ic, pc, mc, kc, PackA ? ws.a_pack.slice(tid) : nullptr,
                                              PackA ? nullptr : ws.a_tail.slice(tid), 0, ceil_div(mc, kMR));
              macrokernel<PackA>(mc, nc, kc, a, b_packed, p.c + ic * p.ldc + jc, p.ldc, pc > 0, 0,
                                 ceil_div(nc, kNR));
            }
          }
          // The B block is repacked next iteration: wait until all threads are done with it.
#pragma omp barrier
        }
      }
    }
  }
};

/// "n": threads share each A and B block and claim its NR panels in groups.
struct ParallelN {
  template <bool PackA>
  static void run(const Problem& p, Workspace& ws) {
    ws.reset_claims();
#pragma omp parallel num_threads(ws.threads)
    {
      const int tid = omp_get_thread_num();
      const int nt = omp_get_num_threads();
      float* b_packed = ws.b_pack.slice(0);
      index_t block = 0;
      for (index_t jc = 0; jc < p.n; jc += kNC) {
        const index_t nc = std::min(kNC, p.n - jc);
        const index_t panels = ceil_div(nc, kNR);
        // About eight claims a thread: a slow core's shortfall is at most one group.
        const index_t group = std::max<index_t>(1, panels / (8 * nt));
        for (index_t pc = 0; pc < p.k; pc += kKC) {
          const index_t kc = std::min(kKC, p.k - pc);
          const StridedView<InputT> b{p.b.at(pc, jc), p.b.row_stride, p.b.col_stride};
          pack_b_share(b, kc, nc, nt, tid, b_packed);
          for (index_t ic = 0; ic < p.m; ic += kMC, ++block) {
            const index_t mc = std::min(kMC, p.m - ic);
            index_t a_begin = 0, a_end = 0;
            if constexpr (PackA) split_range(ceil_div(mc, kMR), nt, tid, a_begin, a_end);
            const ABlock a = a_block<PackA>(p, ic, pc, mc, kc, PackA ? ws.a_pack.slice(0) : nullptr,
                                            PackA ? nullptr : ws.a_tail.slice(tid), a_begin, a_end);
            // Everyone's share of the shared A block must be packed before use.
            if constexpr (PackA) {
#pragma omp barrier
            }
            // Each thread first takes the panels it packed (they are in its L2), then helps
            // the others with theirs.
            for (int step = 0; step < nt; ++step) {
              const int owner = (tid + step) % nt;
              index_t own_begin, own_end;
              split_range(panels, nt, owner, own_begin, own_end);
              std::atomic<index_t>& claim = ws.claims[block * nt + owner];
              for (index_t first = own_begin + claim.fetch_add(group); first < own_end;
                   first = own_begin + claim.fetch_add(group))
                macrokernel<PackA>(mc, nc, kc, a, b_packed, p.c + ic * p.ldc + jc, p.ldc, pc > 0,
                                   first, std::min(first + group, own_end));
            }
            // The shared A block (or B block, after the last ic) is overwritten next.
#pragma omp barrier
          }
        }
      }
    }
  }
};

/// "k": split-K into per-thread partial C, then a parallel reduction.
struct ParallelK {
  template <bool PackA>
  static void run(const Problem& p, Workspace& ws) {
#pragma omp parallel num_threads(ws.threads)
    {
      const int tid = omp_get_thread_num();
      const int nt = omp_get_num_threads();
      index_t k_begin, k_end;
      split_range(p.k, nt, tid, k_begin, k_end);
      float* c = tid == 0 ? p.c : ws.c_partial.slice(tid - 1);
      const index_t ldc = tid == 0 ? p.ldc : p.n;
      float* b_packed = ws.b_pack.slice(tid);
      if (k_begin == k_end)  // more threads than K: contribute zeros
        for (index_t i = 0; i < p.m; ++i) std::fill(c + i * ldc, c + i * ldc + p.n, 0.0f);
      for (index_t jc = 0; jc < p.n; jc += kNC) {
        const index_t nc = std::min(kNC, p.n - jc);
        for (index_t pc = k_begin; pc < k_end; pc += kKC) {
          const index_t kc = std::min(kKC, k_end - pc);
          const StridedView<InputT> b{p.b.at(pc, jc), p.b.row_stride, p.b.col_stride};
          pack_b_panels<kNR>(b, kc, nc, 0, ceil_div(nc, kNR), b_packed);
          for (index_t ic = 0; ic < p.m; ic += kMC) {
            const index_t mc = std::min(kMC, p.m - ic);
            const ABlock a = a_block<PackA>(p, ic, pc, mc, kc, PackA ? ws.a_pack.slice(tid) : nullptr,
                                            PackA ? nullptr : ws.a_tail.slice(tid), 0, ceil_div(mc, kMR));
            macrokernel<PackA>(mc, nc, kc, a, b_packed, c + ic * ldc + jc, ldc, pc > k_begin, 0,
                               ceil_div(nc, kNR));
          }
        }
      }
#pragma omp barrier
      if (nt > 1) {
#pragma omp for schedule(static)
        for (index_t i = 0; i < p.m; ++i) {
          float* c_row = p.c + i * p.ldc;
          for (int t = 1; t < nt; ++t) {
            const float* partial_row = ws.c_partial.slice(t - 1) + i * p.n;
            for (index_t j = 0; j < p.n; ++j) c_row[j] += partial_row[j];
          }
        }
      }
    }
  }
};

/// TC_PAR -> scheme: the single table of parallel schemes.
using Schemes = std::tuple<ParallelM, ParallelN, ParallelK>;
using Scheme = std::tuple_element_t<kParScheme, Schemes>;

/// C = A * B for one problem with the scratch allocated for it: GEMV-class problems
/// stream their large operand in place (gemm_skinny.hpp), the rest take the blocked path.
inline void gemm(const Problem& problem, Workspace& workspace) {
  skinny::Task task;
  if (skinny::task_of(problem, task))
    skinny::run(task, workspace.skinny, workspace.threads);
  else if (workspace.pack_a)
    Scheme::template run<true>(problem, workspace);
  else if constexpr (std::is_same_v<InputT, float>)   // bf16 is widened while packing
    Scheme::template run<false>(problem, workspace);
}

}  // namespace tc::gemm
