// Grouped convolution family binary, fp32: forward, bwd_data or bwd_weight
// (TC_DIR), one variant per build (see grouped_conv_config.hpp). Job line:
//   <id> <N> <G> <C> <K> <Di> <Hi> <Wi> <Z> <Y> <X> <stride_d> <stride_h> <stride_w>
//   <pad_d> <pad_h> <pad_w> <dil_d> <dil_h> <dil_w> <in1_path> <in2_path> <out_path>
// with (in1, in2, out) = forward (input, weight, output), bwd_data (dout,
// weight, din), bwd_weight (input, dout, dweight). Layouts: input NDHWGC,
// weight GKZYXC, output NDHWGK; C and K per group.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "grouped_conv_config.hpp"
#include "grouped_conv_kernel.hpp"
#include "grouped_conv_shape.hpp"
#include "../common/harness.hpp"

namespace tc::gconv {
namespace {

/// Element counts of (in1, in2, out) for the compiled direction.
struct TensorSizes {
  index_t in1, in2, out;
};

TensorSizes tensor_sizes(const ConvShape& s) {
  if constexpr (kDir == kForward) return {s.input_elems(), s.weight_elems(), s.output_elems()};
  else if constexpr (kDir == kBwdData) return {s.output_elems(), s.weight_elems(), s.input_elems()};
  else return {s.input_elems(), s.output_elems(), s.weight_elems()};
}

/// A file's floats copied into a padded aligned buffer (see FloatBuffer).
FloatBuffer load(const std::string& path, index_t count) {
  const std::vector<float> data = read_binary<float>(path, std::size_t(count));
  FloatBuffer buffer(count);
  std::copy(data.begin(), data.end(), buffer.get());
  return buffer;
}

/// Times the compiled direction/pipeline's kernel (grouped_conv_kernel.hpp builds it).
template <int Dir>
Timing time_conv(const ConvShape& shape, const Protocol& protocol, const float* in1,
                 const float* in2, float* out) {
  return with_kernel<Dir>(shape, in1, in2, out, omp_get_max_threads(),
                          [&](auto&& run) { return measure(protocol, run); });
}

/// Handles one job line: read the two inputs, time the kernel, write the result.
JobResult run_job(const std::vector<std::string>& tokens, const Protocol& protocol) {
  if (tokens.size() != kJobTokens)
    return JobResult::error("expected " + std::to_string(kJobTokens) + " tokens (" + kJobLineHelp +
                            "), got " + std::to_string(tokens.size()));
  ConvShape shape;
  try {
    shape = parse_shape(tokens);
  } catch (const std::invalid_argument& bad_token) {
    return JobResult::error(bad_token.what());
  }
  const std::string why_not = check_supported(shape);
  if (!why_not.empty()) return JobResult::unsupported(why_not);

  const TensorSizes sizes = tensor_sizes(shape);
  const FloatBuffer in1 = load(tokens[20], sizes.in1);
  const FloatBuffer in2 = load(tokens[21], sizes.in2);
  FloatBuffer out(sizes.out);
  // NaN where the kernel has not written: a pipeline that leaves part of its output to the
  // buffer's zeros fails validation instead of passing by luck (every element is the
  // kernel's to write; a caller's buffer need not be zeroed)
  std::fill(out.get(), out.get() + sizes.out, std::numeric_limits<float>::quiet_NaN());
  Timing timing = time_conv<kDir>(shape, protocol, in1.get(), in2.get(), out.get());
  write_binary(tokens[22], out.get(), std::size_t(sizes.out));
  return JobResult::ok(std::move(timing));
}

}  // namespace
}  // namespace tc::gconv

int main(int argc, char** argv) {
  return tc::run_jobs(argc, argv, tc::gconv::run_job, tc::gconv::describe_params());
}
