// One GEMM build as a C entry point for the paired driver (paired.cpp): compiled twice, from
// two source trees, with -Dtc=<namespace> and -DNAME=<prefix> so both live in one binary.
// BCOL=1 in the environment makes B column-major (the forward convolution's weight); a TC_DTYPE=1
// build reads the operands' values cut to bf16.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm_parallel.hpp"

#define PAIRED_CAT2(a, b) a##b
#define PAIRED_CAT(a, b) PAIRED_CAT2(a, b)

namespace {
using Input = tc::gemm::InputT;

/// The operand as this build reads it: fp32 as given, or (TC_DTYPE=1) its values cut to bf16.
std::vector<Input> operand(const float* values, long count) {
  std::vector<Input> out(count);
  for (long i = 0; i < count; ++i) {
    if constexpr (std::is_same_v<Input, float>) {
      out[i] = values[i];
    } else {
      std::uint32_t bits;
      std::memcpy(&bits, values + i, sizeof(bits));
      out[i] = Input(bits >> 16);
    }
  }
  return out;
}

struct Handle {
  std::vector<Input> a, b;
  tc::gemm::Problem problem;
  tc::gemm::Workspace workspace;
};
}  // namespace

extern "C" void* PAIRED_CAT(NAME, _make)(long m, long n, long k, float* a, float* b, float* c,
                                         int threads) {
  const bool b_col = std::getenv("BCOL") && std::atoi(std::getenv("BCOL")) == 1;
  std::vector<Input> a_in = operand(a, m * k), b_in = operand(b, k * n);
  const tc::gemm::StridedView<Input> b_view = b_col ? tc::gemm::StridedView<Input>{b_in.data(), 1, k}
                                                    : tc::gemm::StridedView<Input>{b_in.data(), n, 1};
  const tc::gemm::Problem problem{m, n, k, {a_in.data(), k, 1}, b_view, c, n};
  // the vectors' buffers move into the handle unchanged, so the views stay valid
  return new Handle{std::move(a_in), std::move(b_in), problem, tc::gemm::Workspace(problem, threads)};
}

extern "C" void PAIRED_CAT(NAME, _run)(void* handle) {
  auto* h = static_cast<Handle*>(handle);
  tc::gemm::gemm(h->problem, h->workspace);
}
