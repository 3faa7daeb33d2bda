// A rowsum variant as an in-process kernel (the tilecast-rowsum plugin): a shared library whose
// C entries run rowsum_kernel.hpp on caller-owned memory, for tilecast's interleaved protocol
// (the family's `timer`). Each returns a tc::entry::Status, the reason in `message`.
#include <chrono>
#include <string>

#include "inprocess_entry.hpp"
#include "rowsum_kernel.hpp"

extern "C" {

/// The row sums `reps` times (at least once); *seconds = seconds per call.
int tilecast_rowsum_time(const float* x, long long m, long long n, long long ld, float* y,
                         int threads, int reps, double* seconds, char* message,
                         long long message_capacity) {
  return tc::entry::guarded(message, message_capacity, [&]() -> tc::entry::Outcome {
    if (x == nullptr || y == nullptr) return {tc::entry::kBadArgument, "a null operand pointer"};
    if (m < 1 || n < 1 || ld < n)
      return {tc::entry::kBadArgument, "need m, n >= 1 and ld >= n, got m=" + std::to_string(m) +
                                           " n=" + std::to_string(n) + " ld=" + std::to_string(ld)};
    const int calls = reps > 1 ? reps : 1;
    const int team = threads > 0 ? threads : omp_get_max_threads();
    const auto start = std::chrono::steady_clock::now();
    for (int call = 0; call < calls; ++call) rowsum::rowsum(x, m, n, ld, y, team);
    if (seconds != nullptr)
      *seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls;
    return {};
  });
}

/// harness.hpp's synchronization probe of this library's OpenMP team (the interleaved
/// protocol's record of the machine's state in each window).
double tilecast_sync_probe_us() { return tc::sync_probe_us(); }

int tilecast_kernel_param(const char* name, long long* value) {
  return tc::entry::find_param(rowsum::describe_params(), name, value);
}

}  // extern "C"
