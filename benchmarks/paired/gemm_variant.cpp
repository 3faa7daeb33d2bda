// One GEMM build as a C entry point for the paired driver (paired.cpp): compiled twice, from
// two source trees, with -Dtc=<namespace> and -DNAME=<prefix> so both live in one binary.
// BCOL=1 in the environment makes B column-major (the forward convolution's weight).
#include <cstdlib>

#include "gemm_parallel.hpp"

#define PAIRED_CAT2(a, b) a##b
#define PAIRED_CAT(a, b) PAIRED_CAT2(a, b)

namespace {
struct Handle {
  tc::gemm::Problem problem;
  tc::gemm::Workspace workspace;
};
}  // namespace

extern "C" void* PAIRED_CAT(NAME, _make)(long m, long n, long k, float* a, float* b, float* c,
                                         int threads) {
  const bool b_col = std::getenv("BCOL") && std::atoi(std::getenv("BCOL")) == 1;
  const tc::gemm::StridedView<float> b_view = b_col ? tc::gemm::StridedView<float>{b, 1, k}
                                                    : tc::gemm::StridedView<float>{b, n, 1};
  const tc::gemm::Problem problem{m, n, k, {a, k, 1}, b_view, c, n};
  return new Handle{problem, tc::gemm::Workspace(problem, threads)};
}

extern "C" void PAIRED_CAT(NAME, _run)(void* handle) {
  auto* h = static_cast<Handle*>(handle);
  tc::gemm::gemm(h->problem, h->workspace);
}
