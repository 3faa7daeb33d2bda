// The compiled direction and pipeline's kernel over caller-owned tensors: the one place that
// picks it, shared by the benchmark binary (grouped_conv.cpp, which times it) and the
// in-process library (grouped_conv_lib.cpp, which runs it once).
#pragma once

#include <algorithm>

#include "grouped_conv_config.hpp"
#include "grouped_conv_dw.hpp"
#include "grouped_conv_gather.hpp"
#include "grouped_conv_parallel.hpp"
#include "grouped_conv_shape.hpp"
#include "grouped_conv_wgrad.hpp"
#if TC_PIPELINE == 3
#include "grouped_conv_gemm.hpp"
#elif TC_PIPELINE == 4
#include "grouped_conv_winograd.hpp"
#elif TC_PIPELINE == 5
#include "grouped_conv_gvec.hpp"
#endif

namespace tc::gconv {

/// Builds the compiled kernel over (in1, in2) -> out with its scratch, then returns
/// body(run), where run() computes `out` once on `threads` threads. The scratch is
/// allocated before body runs and lives until it returns, so a timed body times the kernel
/// alone. A template on Dir so that the branches of the other directions are never
/// instantiated.
template <int Dir, class Body>
decltype(auto) with_kernel(const ConvShape& shape, const float* in1, const float* in2, float* out,
                           int threads, Body&& body) {
#if TC_PIPELINE == 3
  const GemmConv<Dir> kernel(shape, in1, in2, threads);
  return body([&] { kernel.run(out); });
#elif TC_PIPELINE == 4
  const WinogradConv<Dir> kernel(shape, in1, in2, threads);
  return body([&] { kernel.run(out); });
#elif TC_PIPELINE == 5
  const GroupVectorConv<Dir> kernel(shape, in1, in2, threads);
  return body([&] { kernel.run(out); });
#else
  const FloatBuffer zeros(std::max({shape.c, shape.k, shape.g}) + 2 * kNR);
  if constexpr (kPipeline == kDw) {
    if constexpr (Dir == kBwdWeight) {
      const DepthwiseWeightGrad kernel(shape, in1, in2, threads);
      return body([&] { kernel.run(out, threads); });
    } else {
      FloatBuffer packed(DepthwiseGather<Dir>::packed_weight_elems(shape));
      const DepthwiseGather<Dir> kernel(shape, in1, in2, packed.get(), zeros.get());
      return body([&] { kernel.run(out, threads); });
    }
  } else if constexpr (Dir == kBwdWeight) {
    const WeightGradPolicy policy(shape, in1, in2);
    const Workspace workspace(threads, policy.rows(), policy.depth(), policy.out_elems(), true);
    return body([&] { run_conv(policy, out, workspace); });
  } else {
    FloatBuffer packed(GatherPolicy<Dir>::packed_weight_elems(shape));
    const GatherPolicy<Dir> policy(shape, in1, in2, packed.get(), zeros.get());
    const Workspace workspace(threads, policy.rows(), policy.depth(), policy.out_elems(), false);
    return body([&] { run_conv(policy, out, workspace); });
  }
#endif
}

}  // namespace tc::gconv
