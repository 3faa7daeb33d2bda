// One grouped-convolution pipeline build as a C entry point for the paired driver: compiled
// twice, from two source trees (see gemm_variant.cpp). The layer is 2D, N images, a square
// FILT x FILT filter, with pad, dilation and stride from the environment (N, FILT, PAD, DIL,
// STRIDE; defaults 1, 3, 1, 1, 1); with DI > 1 (a build with TC_NDIM 3) it is 3D, DI deep,
// the filter a FILT cube, the same pad, dilation and stride along the depth;
// TC_PIPELINE picks the pipeline's class (3 gemm, 5 gvec; 2 dw for bwd_weight).
#include <cstdlib>
#include <type_traits>

#include "grouped_conv_config.hpp"
#if TC_PIPELINE == 3
#include "grouped_conv_gemm.hpp"
template <int Dir>
using Pipeline = tc::gconv::GemmConv<Dir>;
#elif TC_PIPELINE == 5
#include "grouped_conv_gvec.hpp"
template <int Dir>
using Pipeline = tc::gconv::GroupVectorConv<Dir>;
#elif TC_PIPELINE == 2 && TC_DIR == 2
#include "grouped_conv_dw.hpp"
/// The dw pipeline's bwd_weight with run(out), as the others (its constructor took no thread
/// count before 2026-12-05).
template <int Dir>
struct Pipeline {
  using Kernel = tc::gconv::DepthwiseWeightGrad;
  static Kernel make(const tc::gconv::ConvShape& s, const float* a, const float* b, int threads) {
    if constexpr (std::is_constructible_v<Kernel, const tc::gconv::ConvShape&, const float*, const float*, int>)
      return Kernel(s, a, b, threads);
    else
      return Kernel(s, a, b);
  }
  Pipeline(const tc::gconv::ConvShape& s, const float* a, const float* b, int threads)
      : kernel(make(s, a, b, threads)), threads(threads) {}
  void run(float* out) const { kernel.run(out, threads); }
  Kernel kernel;
  int threads;
};
#else
#error "conv_variant.cpp times the gemm (3) and gvec (5) pipelines, and dw (2) bwd_weight"
#endif

#define PAIRED_CAT2(a, b) a##b
#define PAIRED_CAT(a, b) PAIRED_CAT2(a, b)

namespace {
long env_or(const char* name, long fallback) {
  const char* value = std::getenv(name);
  return value ? std::atol(value) : fallback;
}

struct Handle {
  tc::gconv::ConvShape shape;
  tc::gconv::FloatBuffer in1, in2, out;
  Pipeline<TC_DIR>* kernel = nullptr;
};
}  // namespace

extern "C" void* PAIRED_CAT(NAME, _make)(long g, long c, long k, long h, long w, int threads) {
  using tc::gconv::index_t;
  auto* hd = new Handle;
  tc::gconv::ConvShape& s = hd->shape;
  s.n = env_or("N", 1), s.g = g, s.c = c, s.k = k;
  const long pad = env_or("PAD", 1), dil = env_or("DIL", 1), stride = env_or("STRIDE", 1);
  const long filt = env_or("FILT", 3), depth = env_or("DI", 1);
  const long in[3] = {depth, h, w};
  const bool flat = depth == 1;  // 2D: a depth of 1, a filter of 1 along it
  for (int d = 0; d < 3; ++d) {
    s.in[d] = in[d];
    s.filt[d] = d == 0 && flat ? 1 : filt;
    s.stride[d] = d == 0 && flat ? 1 : stride;
    s.pad[d] = d == 0 && flat ? 0 : pad;
    s.dil[d] = d == 0 && flat ? 1 : dil;
    s.out[d] = (s.in[d] + 2 * s.pad[d] - s.dil[d] * (s.filt[d] - 1) - 1) / s.stride[d] + 1;
  }
  // forward: x, w -> y; bwd_data: dy, w -> dx; bwd_weight: x, dy -> dw
  const index_t in1 = TC_DIR == 1 ? s.output_elems() : s.input_elems();
  const index_t in2 = TC_DIR == 2 ? s.output_elems() : s.weight_elems();
  const index_t out = TC_DIR == 0 ? s.output_elems() : TC_DIR == 1 ? s.input_elems() : s.weight_elems();
  hd->in1 = tc::gconv::FloatBuffer(in1), hd->in2 = tc::gconv::FloatBuffer(in2), hd->out = tc::gconv::FloatBuffer(out);
  for (index_t i = 0; i < in1; ++i) hd->in1.get()[i] = float(i % 7) * 0.1f;
  for (index_t i = 0; i < in2; ++i) hd->in2.get()[i] = float(i % 5) * 0.1f;
  hd->kernel = new Pipeline<TC_DIR>(s, hd->in1.get(), hd->in2.get(), threads);
  return hd;
}

extern "C" void PAIRED_CAT(NAME, _run)(void* handle) {
  auto* hd = static_cast<Handle*>(handle);
  hd->kernel->run(hd->out.get());
}
