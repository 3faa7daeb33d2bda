// A GEMM variant as an in-process kernel: a shared library whose C entry runs the kernel
// code of the benchmark binary (gemm_parallel.hpp, same -D parameters; see gemm.cpp) on
// caller-owned memory. tilecast.build compiles it in shared mode; tilecast.ops calls it.
//
//   C (m x n fp32, row-major, leading dimension ldc) = A (m x k) * B (k x n)
//
// with A's element (i, p) at a[i*a_row_stride + p*a_col_stride] (B alike), stored as the
// variant's input type (fp32, or bf16 as raw bits): row- or column-major operands with any
// leading dimension. Returns an entry::Status; the reason lands in `message`.
#include <omp.h>

#include <chrono>
#include <string>

#include "gemm_config.hpp"
#include "gemm_parallel.hpp"
#include "../common/inprocess_entry.hpp"

namespace tc::gemm {
namespace {

std::string dims_text(long long m, long long n, long long k) {
  return "M=" + std::to_string(m) + " N=" + std::to_string(n) + " K=" + std::to_string(k);
}

/// Runs the GEMM `reps` times (at least once) on one workspace allocated before the clock
/// starts; *seconds (when not null) receives the seconds per call of those runs.
entry::Outcome run(const void* a, long long a_row_stride, long long a_col_stride, const void* b,
                   long long b_row_stride, long long b_col_stride, float* c, long long ldc,
                   long long m, long long n, long long k, int threads, int reps = 1,
                   double* seconds = nullptr) {
  if (m < 1 || n < 1 || k < 1)
    return {entry::kBadArgument, "every dimension must be >= 1, got " + dims_text(m, n, k)};
  if (m > kMaxDim || n > kMaxDim || k > kMaxDim)
    return {entry::kUnsupported, "dimension above 2^31: " + dims_text(m, n, k)};
  if (a == nullptr || b == nullptr || c == nullptr)
    return {entry::kBadArgument, "a null operand pointer"};
  if (a_row_stride < 0 || a_col_stride < 0 || b_row_stride < 0 || b_col_stride < 0 || ldc < n)
    return {entry::kBadArgument, "strides must be >= 0 and ldc >= N, got ldc=" +
                                     std::to_string(ldc) + " with N=" + std::to_string(n)};
  const Problem problem{m, n, k,
                        {static_cast<const InputT*>(a), a_row_stride, a_col_stride},
                        {static_cast<const InputT*>(b), b_row_stride, b_col_stride},
                        c, ldc};
  Workspace workspace(problem, threads > 0 ? threads : omp_get_max_threads());
  const int calls = reps > 1 ? reps : 1;
  const auto start = std::chrono::steady_clock::now();
  for (int call = 0; call < calls; ++call) gemm(problem, workspace);
  if (seconds != nullptr)
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls;
  return {};
}

}  // namespace
}  // namespace tc::gemm

extern "C" {

int tilecast_gemm_run(const void* a, long long a_row_stride, long long a_col_stride,
                      const void* b, long long b_row_stride, long long b_col_stride, float* c,
                      long long ldc, long long m, long long n, long long k, int threads,
                      char* message, long long message_capacity) {
  return tc::entry::guarded(message, message_capacity, [&] {
    return tc::gemm::run(a, a_row_stride, a_col_stride, b, b_row_stride, b_col_stride, c, ldc,
                         m, n, k, threads);
  });
}

/// tilecast_gemm_run `reps` times on one workspace, *seconds = seconds per call: the
/// in-process timing entry (tilecast.interleave times candidates side by side with it).
int tilecast_gemm_time(const void* a, long long a_row_stride, long long a_col_stride,
                       const void* b, long long b_row_stride, long long b_col_stride, float* c,
                       long long ldc, long long m, long long n, long long k, int threads, int reps,
                       double* seconds, char* message, long long message_capacity) {
  return tc::entry::guarded(message, message_capacity, [&] {
    return tc::gemm::run(a, a_row_stride, a_col_stride, b, b_row_stride, b_col_stride, c, ldc,
                         m, n, k, threads, reps, seconds);
  });
}

/// Wall time (microseconds) of 200 barriers of this library's OpenMP team (harness.hpp
/// sync_probe_us): the interleaved protocol's record of the machine's state in each window.
double tilecast_sync_probe_us() { return tc::sync_probe_us(); }

int tilecast_kernel_param(const char* name, long long* value) {
  return tc::entry::find_param(tc::gemm::describe_params(), name, value);
}

}  // extern "C"
