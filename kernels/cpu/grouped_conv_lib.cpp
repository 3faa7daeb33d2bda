// A grouped-convolution variant as an in-process kernel: a shared library whose C entry runs
// the kernel of the benchmark binary (grouped_conv_kernel.hpp, same -D parameters; see
// grouped_conv.cpp) once on caller-owned memory. tilecast.build compiles it in shared mode;
// tilecast.ops calls it.
//
// shape: the 19 integers of a job line (N G C K Di Hi Wi Z Y X stride_d stride_h stride_w
// pad_d pad_h pad_w dil_d dil_h dil_w); (in1, in2, out) and their layouts as in
// grouped_conv.cpp. Each of in1, in2 and out must have tilecast_grouped_conv_slack() readable
// floats past its end (the micro-kernels may read a vector there; those lanes never reach the
// result). Returns an entry::Status; the reason lands in `message`.
#include <omp.h>

#include <chrono>

#include <stdexcept>
#include <string>
#include <vector>

#include "grouped_conv_config.hpp"
#include "grouped_conv_kernel.hpp"
#include "grouped_conv_shape.hpp"
#include "inprocess_entry.hpp"

namespace tc::gconv {
namespace {

/// The shape integers of a job line: every token but the id and the three paths.
constexpr std::size_t kShapeFields = kJobTokens - 4;

/// Runs the kernel `reps` times (at least once) on one set of scratch buffers; *seconds (when
/// not null) receives the seconds per call of those runs.
entry::Outcome run(const long long* dims, const float* in1, const float* in2, float* out,
                   int threads, int reps = 1, double* seconds = nullptr) {
  if (dims == nullptr || in1 == nullptr || in2 == nullptr || out == nullptr)
    return {entry::kBadArgument, "a null shape or tensor pointer"};
  // Through the job line's parser, so an in-process shape obeys the benchmark's rules exactly.
  std::vector<std::string> tokens(kJobTokens);
  for (std::size_t field = 0; field < kShapeFields; ++field) tokens[1 + field] = std::to_string(dims[field]);
  ConvShape shape;
  try {
    shape = parse_shape(tokens);
  } catch (const std::invalid_argument& bad_field) {
    return {entry::kBadArgument, bad_field.what()};
  }
  const std::string why_not = check_supported(shape);
  if (!why_not.empty()) return {entry::kUnsupported, why_not};
  const int calls = reps > 1 ? reps : 1;
  with_kernel<kDir>(shape, in1, in2, out, threads > 0 ? threads : omp_get_max_threads(),
                    [&](auto&& run_once) {
                      const auto start = std::chrono::steady_clock::now();
                      for (int call = 0; call < calls; ++call) run_once();
                      const std::chrono::duration<double> elapsed =
                          std::chrono::steady_clock::now() - start;
                      if (seconds != nullptr) *seconds = elapsed.count() / calls;
                    });
  return {};
}

}  // namespace
}  // namespace tc::gconv

extern "C" {

long long tilecast_grouped_conv_slack() { return tc::gconv::FloatBuffer::kSlack; }

int tilecast_grouped_conv_run(const long long* shape, const float* in1, const float* in2,
                              float* out, int threads, char* message, long long message_capacity) {
  return tc::entry::guarded(message, message_capacity,
                            [&] { return tc::gconv::run(shape, in1, in2, out, threads); });
}

/// tilecast_grouped_conv_run `reps` times on one set of scratch buffers, *seconds = seconds
/// per call: the in-process timing entry (tilecast.interleave).
int tilecast_grouped_conv_time(const long long* shape, const float* in1, const float* in2,
                               float* out, int threads, int reps, double* seconds, char* message,
                               long long message_capacity) {
  return tc::entry::guarded(message, message_capacity, [&] {
    return tc::gconv::run(shape, in1, in2, out, threads, reps, seconds);
  });
}

/// Wall time (microseconds) of 200 barriers of this library's OpenMP team (harness.hpp
/// sync_probe_us): the interleaved protocol's record of the machine's state in each window.
double tilecast_sync_probe_us() { return tc::sync_probe_us(); }

int tilecast_kernel_param(const char* name, long long* value) {
  return tc::entry::find_param(tc::gconv::describe_params(), name, value);
}

}  // extern "C"
