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
//
// tilecast_grouped_conv_run_torch takes the same arguments with the three tensors in torch's
// contiguous layouts instead (activations N, G*C or G*K, [D,] H, W; the weight G*K, C, [Z,]
// Y, X), and no slack: it copies them into the kernel's channels-last buffers and the result
// back, so that tilecast.ops makes one call where the conversions took a dozen torch ops.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>

#include <stdexcept>
#include <string>
#include <vector>

#include "grouped_conv_config.hpp"
#include "grouped_conv_kernel.hpp"
#include "grouped_conv_shape.hpp"
#include "grouped_conv_transpose.hpp"
#include "../common/inprocess_entry.hpp"

namespace tc::gconv {
namespace {

/// The shape integers of a job line: every token but the id and the three paths.
constexpr std::size_t kShapeFields = kJobTokens - 4;

/// *shape from the shape integers, through the job line's parser (so an in-process shape
/// obeys the benchmark's rules exactly), and whether the variant runs it.
entry::Outcome parse(const long long* dims, ConvShape& shape) {
  std::vector<std::string> tokens(kJobTokens);
  for (std::size_t field = 0; field < kShapeFields; ++field) tokens[1 + field] = std::to_string(dims[field]);
  try {
    shape = parse_shape(tokens);
  } catch (const std::invalid_argument& bad_field) {
    return {entry::kBadArgument, bad_field.what()};
  }
  const std::string why_not = check_supported(shape);
  if (!why_not.empty()) return {entry::kUnsupported, why_not};
  return {};
}

/// Runs the kernel `reps` times (at least once) on one set of scratch buffers; *seconds (when
/// not null) receives the seconds per call of those runs.
entry::Outcome run(const long long* dims, const float* in1, const float* in2, float* out,
                   int threads, int reps = 1, double* seconds = nullptr) {
  if (dims == nullptr || in1 == nullptr || in2 == nullptr || out == nullptr)
    return {entry::kBadArgument, "a null shape or tensor pointer"};
  ConvShape shape;
  if (entry::Outcome parsed = parse(dims, shape); parsed.status != entry::kOk) return parsed;
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

/// One tensor of the convolution as (outer, channels, pixels) in torch's layout, which the
/// kernels hold as (outer, pixels, channels): activations (N, G*C or G*K, D*H*W), the weight
/// (G*K, C, Z*Y*X).
struct Planes {
  index_t outer, channels, pixels;
  index_t elems() const { return outer * channels * pixels; }
};

/// The planes of (in1, in2, out) for the compiled direction (their roles as in grouped_conv.cpp).
std::array<Planes, 3> planes(const ConvShape& s) {
  const Planes input{s.n, s.g * s.c, s.in_pixels()}, weight{s.g * s.k, s.c, s.taps()},
      output{s.n, s.g * s.k, s.out_pixels()};
  if constexpr (kDir == kForward) return {input, weight, output};
  else if constexpr (kDir == kBwdData) return {output, weight, input};
  else return {input, output, weight};
}

/// Below this many floats a relayout runs on the calling thread (a fork costs more).
constexpr index_t kSerialRelayout = index_t(1) << 15;
/// The relayout's blocks: kBlock x kBlock floats of each side stay in L1 (2 x 16 KiB).
constexpr index_t kBlock = 64;

/// dst[c * rows + r] = src[r * cols + c] for r in [r0, r1), c in [c0, c1): 8 x 8 tiles
/// through the AVX registers (scalar where the block's edge cuts a tile).
inline void transpose_block(const float* __restrict src, float* __restrict dst, index_t rows,
                            index_t cols, index_t r0, index_t r1, index_t c0, index_t c1) {
  index_t r = r0;
#ifdef __AVX__
  for (; r + 8 <= r1; r += 8) {
    index_t c = c0;
    for (; c + 8 <= c1; c += 8) {
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(src + (r + i) * cols + c);
      transpose_8x8(a, [&](int i, __m256 column) { _mm256_storeu_ps(dst + (c + i) * rows + r, column); });
    }
    for (; c < c1; ++c)
      for (index_t i = 0; i < 8; ++i) dst[c * rows + r + i] = src[(r + i) * cols + c];
  }
#endif
  for (; r < r1; ++r)
    for (index_t c = c0; c < c1; ++c) dst[c * rows + r] = src[r * cols + c];
}

/// dst (outer, pixels, channels) = src (outer, channels, pixels), or with to_torch the
/// reverse: per outer index a transpose, in kBlock x kBlock blocks shared over the threads.
void relayout(const float* src, float* dst, const Planes& p, bool to_torch, int threads) {
  const index_t rows = to_torch ? p.pixels : p.channels, cols = to_torch ? p.channels : p.pixels;
  const index_t row_blocks = ceil_div(rows, kBlock), col_blocks = ceil_div(cols, kBlock);
  const index_t blocks = row_blocks * col_blocks, items = p.outer * blocks;
  const int team = p.elems() < kSerialRelayout ? 1 : std::max(threads, 1);
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
  for (index_t item = 0; item < items; ++item) {
    const index_t o = item / blocks, block = item % blocks;
    const index_t r0 = block / col_blocks * kBlock, c0 = block % col_blocks * kBlock;
    const index_t base = o * rows * cols;
    transpose_block(src + base, dst + base, rows, cols, r0, std::min(r0 + kBlock, rows), c0,
                    std::min(c0 + kBlock, cols));
  }
}

/// The kernel once on tensors in torch's layouts: in1 and in2 copied into channels-last
/// buffers with the slack, the result copied back into out.
entry::Outcome run_torch_layouts(const long long* dims, const float* in1, const float* in2,
                                 float* out, int threads) {
  if (dims == nullptr || in1 == nullptr || in2 == nullptr || out == nullptr)
    return {entry::kBadArgument, "a null shape or tensor pointer"};
  ConvShape shape;
  if (entry::Outcome parsed = parse(dims, shape); parsed.status != entry::kOk) return parsed;
  const int team = threads > 0 ? threads : omp_get_max_threads();
  const std::array<Planes, 3> p = planes(shape);
  FloatBuffer a(p[0].elems(), false), b(p[1].elems(), false), result(p[2].elems());
  relayout(in1, a.get(), p[0], false, team);
  relayout(in2, b.get(), p[1], false, team);
  with_kernel<kDir>(shape, a.get(), b.get(), result.get(), team,
                    [&](auto&& run_once) { run_once(); });
  relayout(result.get(), out, p[2], true, team);
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

int tilecast_grouped_conv_run_torch(const long long* shape, const float* in1, const float* in2,
                                    float* out, int threads, char* message,
                                    long long message_capacity) {
  return tc::entry::guarded(message, message_capacity, [&] {
    return tc::gconv::run_torch_layouts(shape, in1, in2, out, threads);
  });
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
