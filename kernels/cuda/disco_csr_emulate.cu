// The CTAs of disco_csr.cu run on the CPU: every thread of a CTA in turn, phase by phase
// between the barriers, over host memory. Same entry points, checks and results as the GPU
// library (the sums run in the same order with the same fused multiply-adds), so tests check
// the kernels' index arithmetic, channel tiles and conversions on machines without a GPU.
// Slow by design; for tests only (tilecast/disco/cuda.py builds it as EMULATOR).
#include <cstdint>
#include <memory>
#include <vector>

#include "disco_csr_cta.cuh"
#include "disco_csr_forward.cuh"
#include "disco_csr_transpose.cuh"

namespace tc::disco_cuda {
namespace {

/// The CTA body for all kThreads threads, one after another; the barrier is the phase boundary.
template <int BT>
struct HostCta {
  StagedEntries& staged;
  std::vector<Accumulators<BT>> acc;

  template <typename F>
  void each_thread(F&& f) {
    for (int tid = 0; tid < kThreads; ++tid) f(tid, acc[tid]);
  }
  void sync() {}
};

/// Every CTA of the launch that disco_csr.cu would make, in turn.
template <typename Direction, int BT, typename Elem>
void emulate_grid(const Operands<Elem>& a) {
  const Grid grid = grid_for(Direction::items(a.d), a.d, BT);
  const auto staged = std::make_unique<StagedEntries>();
  HostCta<BT> cta{*staged, std::vector<Accumulators<BT>>(kThreads)};
  for (index_t block = 0; block < grid.ctas(); ++block) run_cta<Direction, BT>(cta, a, grid, block);
}

template <typename Elem>
struct TileEmulator {
  int channels;
  void (*run)(const Operands<Elem>&);
};

template <typename Direction, typename Elem>
int emulate(const void* src, void* dst, const Dims& d, const index_t* offsets,
            const index_t* columns, const float* vals, index_t nnz) {
  static constexpr TileEmulator<Elem> variants[] = {{1, emulate_grid<Direction, 1, Elem>},
                                                    {4, emulate_grid<Direction, 4, Elem>},
                                                    {8, emulate_grid<Direction, 8, Elem>}};
  const Operands<Elem> a{static_cast<const Elem*>(src), static_cast<Elem*>(dst), d, offsets,
                         columns, vals, nnz};
  for (const TileEmulator<Elem>& variant : variants)
    if (variant.channels == channel_tile_for(d.bc)) variant.run(a);
  return kOk;
}

using Emulator = int (*)(const void*, void*, const Dims&, const index_t*, const index_t*,
                         const float*, index_t);

template <typename Direction>
int run(const void* src, void* dst, const Dims& d, const index_t* offsets,
        const index_t* columns, const float* vals, index_t nnz, int storage) {
  static constexpr Emulator emulators[] = {emulate<Direction, float>,
                                           emulate<Direction, __nv_bfloat16>,
                                           emulate<Direction, __half>};
  const Status shape = check_dims(d);
  if (shape != kOk) return shape;
  if (storage < kFloat32 || storage > kFloat16) return kBadStorage;
  if (nnz < 0) return kBadShape;
  return emulators[storage](src, dst, d, offsets, columns, vals, nnz);
}

}  // namespace
}  // namespace tc::disco_cuda

extern "C" {

using tc::disco_cuda::Dims;
using tc::disco_cuda::index_t;

/// tc_disco_cuda_contraction of disco_csr.cu over host pointers; device and stream unused.
int tc_disco_cuda_contraction(const void* x, void* y, index_t bc, index_t hi, index_t wi,
                              index_t k, index_t ho, index_t wo, const std::int64_t* roff,
                              const std::int64_t* col, const float* vals, index_t nnz,
                              int storage, int /*device*/, void* /*stream*/) {
  return tc::disco_cuda::run<tc::disco_cuda::Forward>(x, y, Dims{bc, hi, wi, k, ho, wo}, roff,
                                                      col, vals, nnz, storage);
}

/// tc_disco_cuda_transpose_contraction of disco_csr.cu over host pointers.
int tc_disco_cuda_transpose_contraction(const void* gy, void* gx, index_t bc, index_t hi,
                                        index_t wi, index_t k, index_t ho, index_t wo,
                                        const std::int64_t* troff, const std::int64_t* tcol,
                                        const float* tvals, index_t nnz, int storage,
                                        int /*device*/, void* /*stream*/) {
  return tc::disco_cuda::run<tc::disco_cuda::Transpose>(gy, gx, Dims{bc, hi, wi, k, ho, wo},
                                                        troff, tcol, tvals, nnz, storage);
}

int tc_disco_cuda_channel_tile(index_t bc) { return tc::disco_cuda::channel_tile_for(bc); }

const char* tc_disco_cuda_error_string(int /*status*/) { return nullptr; }

}  // extern "C"
