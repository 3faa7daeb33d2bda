// Paired timing of two builds of one kernel in one process: each pair runs both builds
// back to back in a random order, so a shared machine's slow phases hit both alike; the
// median of the per-pair time ratios is the figure (quartiles beside it). GEMM mode also
// reads this machine's FMA peak (all threads, independent FMA chains) after every pair.
//
//   paired gemm M N K [pairs]        paired conv G C K H W [pairs]
//
// Built by pair.sh from gemm_variant.cpp or conv_variant.cpp (two source trees).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

extern "C" {
#ifdef PAIRED_GEMM
void* va_make(long, long, long, float*, float*, float*, int);
void* vb_make(long, long, long, float*, float*, float*, int);
#else
void* va_make(long, long, long, long, long, int);
void* vb_make(long, long, long, long, long, int);
#endif
void va_run(void*);
void vb_run(void*);
}

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The widest vectors of this build, for the FMA peak.
#ifdef __AVX512F__
struct PeakVec {
  using reg = __m512;
  static constexpr int lanes = 16, chains = 24;  // 24 of the 32 zmm: enough to hide latency
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static float sum(reg v) { return _mm512_reduce_add_ps(v); }
};
#else
struct PeakVec {
  using reg = __m256;
  static constexpr int lanes = 8, chains = 12;  // 12 of the 16 ymm
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static float sum(reg v) {
    float lanes_out[8];
    _mm256_storeu_ps(lanes_out, v);
    float total = 0.0f;
    for (float lane : lanes_out) total += lane;
    return total;
  }
};
#endif

/// GFLOP/s of independent FMA chains on every thread (the machine's ceiling right now).
double fma_peak(long reps) {
  using V = PeakVec;
  const double t0 = now();
  float sink = 0.0f;
#pragma omp parallel reduction(+ : sink)
  {
    V::reg acc[V::chains];
    for (int i = 0; i < V::chains; ++i) acc[i] = V::set1(float(i));
    const V::reg x = V::set1(1.0000001f), y = V::set1(0.999999f);
    for (long r = 0; r < reps; ++r)
#pragma GCC unroll 24
      for (int i = 0; i < V::chains; ++i) acc[i] = V::fma(acc[i], x, y);
    for (int i = 1; i < V::chains; ++i) acc[0] = V::add(acc[0], acc[i]);
    sink += V::sum(acc[0]);
  }
  const double seconds = now() - t0;
  if (sink == 1234.5f) std::printf(" ");  // keeps the chains live
  return 2.0 * V::lanes * V::chains * reps * omp_get_max_threads() / seconds / 1e9;
}

double median(std::vector<double> v, double q = 0.5) {
  std::sort(v.begin(), v.end());
  return v[std::size_t(q * double(v.size() - 1) + 0.5)];
}
}  // namespace

int main(int argc, char** argv) {
#ifdef PAIRED_GEMM
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s M N K [pairs]\n", argv[0]);
    return 2;
  }
  const long m = std::atol(argv[1]), n = std::atol(argv[2]), k = std::atol(argv[3]);
  const int pairs = argc > 4 ? std::atoi(argv[4]) : 30;
  std::vector<float> a(m * k), b(k * n), ca(m * n), cb(m * n);
  for (long i = 0; i < m * k; ++i) a[i] = float(i % 7) * 0.1f;
  for (long i = 0; i < k * n; ++i) b[i] = float(i % 5) * 0.1f;
  void* ha = va_make(m, n, k, a.data(), b.data(), ca.data(), omp_get_max_threads());
  void* hb = vb_make(m, n, k, a.data(), b.data(), cb.data(), omp_get_max_threads());
  const double flops = 2.0 * m * n * k;
  char label[128];
  std::snprintf(label, sizeof label, "%ldx%ldx%ld", m, n, k);
#else
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s G C K H W [pairs]\n", argv[0]);
    return 2;
  }
  const long g = std::atol(argv[1]), c = std::atol(argv[2]), k = std::atol(argv[3]);
  const long h = std::atol(argv[4]), w = std::atol(argv[5]);
  const int pairs = argc > 6 ? std::atoi(argv[6]) : 100;
  void* ha = va_make(g, c, k, h, w, omp_get_max_threads());
  void* hb = vb_make(g, c, k, h, w, omp_get_max_threads());
  const long n = std::getenv("N") ? std::atol(std::getenv("N")) : 1;
  const long pad = std::getenv("PAD") ? std::atol(std::getenv("PAD")) : 1;
  const long dil = std::getenv("DIL") ? std::atol(std::getenv("DIL")) : 1;
  const long stride = std::getenv("STRIDE") ? std::atol(std::getenv("STRIDE")) : 1;
  const long f = std::getenv("FILT") ? std::atol(std::getenv("FILT")) : 3;
  const long di = std::getenv("DI") ? std::atol(std::getenv("DI")) : 1;  // > 1: 3D, a cube filter
  auto out = [&](long size) { return (size + 2 * pad - dil * (f - 1) - 1) / stride + 1; };
  const long oh = out(h), ow = out(w), od = di > 1 ? out(di) : 1, fd = di > 1 ? f : 1;
  const double flops = 2.0 * n * g * c * k * fd * f * f * od * oh * ow;
  char label[160];
  std::snprintf(label, sizeof label, "N%ld G%ld C%ld K%ld %ldx%ldx%ld %ldx%ldx%ld stride %ld pad %ld dil %ld",
                n, g, c, k, di, h, w, fd, f, f, stride, pad, dil);
#endif
  for (int i = 0; i < 3; ++i) va_run(ha), vb_run(hb);  // warm up both
  std::vector<double> ta, tb, ratio, peak;
  std::mt19937 rng(1);
  for (int it = 0; it < pairs; ++it) {
    const bool a_first = rng() & 1;
    double t[2];
    for (int s = 0; s < 2; ++s) {
      const bool run_a = (s == 0) == a_first;
      const double t0 = now();
      run_a ? va_run(ha) : vb_run(hb);
      t[run_a ? 0 : 1] = now() - t0;
    }
    ta.push_back(t[0]), tb.push_back(t[1]), ratio.push_back(t[0] / t[1]);
#ifdef PAIRED_GEMM
    peak.push_back(fma_peak(200000));
#endif
  }
  std::printf("%s, %d threads: A %.1f GFLOP/s, B %.1f GFLOP/s (medians)", label, omp_get_max_threads(),
              flops / median(ta) / 1e9, flops / median(tb) / 1e9);
  if (!peak.empty()) {
    const double p = median(peak);
    std::printf("; FMA peak %.0f: A %.0f %%, B %.0f %%", p, 100 * flops / median(ta) / 1e9 / p,
                100 * flops / median(tb) / 1e9 / p);
  }
  std::printf("; A time / B time %.3f [quartiles %.3f %.3f], %d pairs\n", median(ratio),
              median(ratio, 0.25), median(ratio, 0.75), pairs);
  return 0;
}
