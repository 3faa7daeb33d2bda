// How the GEMM-form directions (direct / im2col pipelines) share out their
// tasks over OpenMP threads: TC_WAVE x TC_SI, four schedules.
//
//   intra        per group in turn, threads split its (BM block, BN block) grid
//   inter        threads take whole (group, image) GEMMs (bwd_weight: whole groups)
//   intra + si   per group in turn, threads split its K_gemm into partial outputs,
//                then reduce the group's slice
//   inter + si   every thread runs all units over its K_gemm share, one reduction at the end
//
// Thread 0's partial is the output itself; the others are preallocated buffers.
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "grouped_conv_blocked.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

/// All scratch of one job, allocated once before timing.
class Workspace {
 public:
  Workspace(int threads, index_t rows, index_t depth, index_t out_elems, bool packs_b)
      : threads_(threads) {
    a_slice_ = round_up(std::min(kBM, round_up(rows, kMR)) * std::min(kBK, depth), 16);
    b_slice_ = packs_b ? round_up(kBN * std::min(kBK, depth), 16) : 0;
    if (kPipeline == kIm2col) packs_ = FloatBuffer(threads * (2 * a_slice_ + b_slice_));
    if (kSplitInput && threads > 1) partials_ = FloatBuffer((threads - 1) * round_up(out_elems, 16));
    out_slice_ = round_up(out_elems, 16);
  }
  int threads() const { return threads_; }
  TaskScratch scratch(int tid) const {
    if (!packs_.get()) return {{nullptr, nullptr}, nullptr};
    float* base = packs_.get() + tid * (2 * a_slice_ + b_slice_);
    return {{base, base + a_slice_}, base + 2 * a_slice_};
  }
  /// Where thread `tid` writes its split-input partial; thread 0 writes `out`.
  float* partial(int tid, float* out) const {
    return tid == 0 ? out : partials_.get() + (tid - 1) * out_slice_;
  }

 private:
  int threads_;
  index_t a_slice_ = 0, b_slice_ = 0, out_slice_ = 0;
  FloatBuffer packs_, partials_;
};

namespace detail {

/// out[offset + i] += the other threads' partials, i < length.
inline void add_partials(const Workspace& ws, int threads, float* out, index_t offset, index_t length) {
  for (int t = 1; t < threads; ++t) {
    const float* partial = ws.partial(t, out) + offset;
    for (index_t i = 0; i < length; ++i) out[offset + i] += partial[i];
  }
}

}  // namespace detail

/// Runs the whole convolution of `policy` into `out` (every element written).
template <class Policy>
void run_conv(const Policy& policy, float* out, const Workspace& ws) {
  const int groups = policy.groups();
  const index_t rows = policy.rows(), panels = policy.panels(), depth = policy.depth();
  const index_t units_per_group = rows / policy.unit_rows();
#pragma omp parallel num_threads(ws.threads())
  {
    const int tid = omp_get_thread_num();
    const int threads = omp_get_num_threads();
    const TaskScratch scratch = ws.scratch(tid);
#pragma omp for schedule(static)
    for (index_t unit = 0; unit < policy.prepare_units(); ++unit) policy.prepare(unit);

    if constexpr (!kSplitInput && !kInterWave) {
      const index_t m_blocks = ceil_div(rows, kBM), j_blocks = ceil_div(panels, kPanelsPerBlock);
      for (int g = 0; g < groups; ++g) {
        // Groups write disjoint outputs: no barrier between them.
#pragma omp for schedule(static) nowait
        for (index_t block = 0; block < m_blocks * j_blocks; ++block) {
          const index_t mb = block % m_blocks, jb = block / m_blocks;
          const TaskRange range{g, mb * kBM, std::min(rows, (mb + 1) * kBM), jb * kPanelsPerBlock,
                                std::min(panels, (jb + 1) * kPanelsPerBlock), 0, depth};
          run_task(policy, range, out, scratch);
        }
      }
    } else if constexpr (!kSplitInput && kInterWave) {
#pragma omp for schedule(dynamic, 1)
      for (index_t unit = 0; unit < groups * units_per_group; ++unit) {
        const int g = int(unit / units_per_group);
        const index_t u = unit % units_per_group;
        const index_t unit_rows = policy.unit_rows();
        run_task(policy, {g, u * unit_rows, (u + 1) * unit_rows, 0, panels, 0, depth}, out, scratch);
      }
    } else {
      index_t p_begin, p_end;
      split_range(depth, threads, tid, p_begin, p_end);
      float* partial = ws.partial(tid, out);
      const index_t run_length = policy.run_length();
      if constexpr (!kInterWave) {
        for (int g = 0; g < groups; ++g) {
          run_task(policy, {g, 0, rows, 0, panels, p_begin, p_end}, partial, scratch);
#pragma omp barrier
          // The implicit barrier of this loop keeps the next group's writes out of the reduction.
#pragma omp for schedule(static)
          for (index_t run = 0; run < policy.run_count(); ++run)
            detail::add_partials(ws, threads, out, policy.run_offset(g, run), run_length);
        }
      } else {
        for (int g = 0; g < groups; ++g)
          for (index_t u = 0; u < units_per_group; ++u) {
            const index_t unit_rows = policy.unit_rows();
            run_task(policy, {g, u * unit_rows, (u + 1) * unit_rows, 0, panels, p_begin, p_end},
                     partial, scratch);
          }
#pragma omp barrier
        const index_t chunk = 4096, total = policy.out_elems();
#pragma omp for schedule(static)
        for (index_t begin = 0; begin < total; begin += chunk)
          detail::add_partials(ws, threads, out, begin, std::min(chunk, total - begin));
      }
    }
  }
}

}  // namespace tc::gconv
