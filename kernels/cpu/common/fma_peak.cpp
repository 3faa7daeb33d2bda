// The machine's two ceilings, measured now: the CPU's fused multiply-add throughput, and
// (tc_read_gbps) the rate memory streams into the cores. The FMA throughput: each thread runs CHAINS independent
// chains of vector FMAs on registers (no memory traffic), enough chains to cover the FMA
// latency on both FMA ports of the cores tilecast runs on (4 cycles x 2 ports = 8 chains on
// Zen 3/4 and Skylake). No GEMM on this machine can run faster than this rate, at that
// moment; tilecast.probe.fma_peak_gflops reads it beside the benchmarks that quote a GEMM bound.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace {

constexpr int CHAINS = 10;

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int LANES = 16;
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec load(const float* p) { return _mm512_load_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float first(Vec v) { return _mm512_cvtss_f32(v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int LANES = 8;
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec load(const float* p) { return _mm256_load_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float first(Vec v) { return _mm256_cvtss_f32(v); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
#else
#error "fma_peak.cpp needs AVX2 with FMA, or AVX-512"
#endif

}  // namespace

extern "C" {

// Vector lanes of one FMA (float32).
int tc_fma_lanes() { return LANES; }

}  // extern "C"

namespace {

// Runs `iterations` rounds of one step on each of CHAINS register chains on each of `threads`
// threads: `start(chain, thread)` gives a chain's first vector, `step(v)` its next, and
// `fold(v)` one float of a vector. Writes the wall seconds of the parallel region to *seconds
// and *sink a value that depends on every chain (so the compiler cannot drop the work);
// returns the rounds done over the threads that ran (the runtime may give fewer than asked).
template <class V, class Start, class Step, class Fold>
double run_chains(int threads, int64_t iterations, Start start, Step step, Fold fold, double* seconds,
                  float* sink) {
  float total = 0.0f;
  int ran = 0;
  const double began = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
#pragma omp single nowait
    ran = omp_get_num_threads();
    V acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = start(i, omp_get_thread_num());
    for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 10
      for (int i = 0; i < CHAINS; ++i) acc[i] = step(acc[i]);
    }
    for (int i = 0; i < CHAINS; ++i) total += fold(acc[i]);
  }
  *seconds = omp_get_wtime() - began;
  *sink = total;
  return static_cast<double>(iterations) * ran;
}

// The read-bandwidth probe's streams a thread reads side by side, and how far ahead its
// prefetching way asks for lines (tc_read_gbps).
constexpr int kStreams = 8;
constexpr int64_t kPrefetchAhead = 4096;

/// One pass over a share: kStreams streams of `length` floats from `base`, summed.
template <bool kFetch>
float read_share(const float* base, int64_t length) {
  Vec acc[kStreams];
  for (int j = 0; j < kStreams; ++j) acc[j] = splat(0.0f);
  for (int64_t i = 0; i < length; i += LANES) {
    if constexpr (kFetch)
      if (i % (64 / sizeof(float)) == 0)  // one request per 64-byte line of each stream
        for (int j = 0; j < kStreams; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(base + j * length + i) + kPrefetchAhead, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int j = 0; j < kStreams; ++j) acc[j] = add(acc[j], load(base + j * length + i));
  }
  for (int j = 1; j < kStreams; ++j) acc[0] = add(acc[0], acc[j]);
  return first(acc[0]);
}

}  // namespace

extern "C" {

// Runs `iterations` rounds of CHAINS FMAs on each of `threads` threads; writes the wall
// seconds of the parallel region to *seconds and returns the float32 flops done (2 per lane
// per FMA, over the threads that ran), or -1 for threads or iterations below 1.
double tc_fma_peak(int threads, int64_t iterations, double* seconds, float* sink) {
  if (threads < 1 || iterations < 1) return -1.0;
  const Vec scale = splat(1.0000001f), shift = splat(-1e-7f);
  const double rounds = run_chains<Vec>(
      threads, iterations, [](int i, int t) { return splat(1.0f + 0.01f * i + 0.001f * t); },
      [&](Vec v) { return fma(v, scale, shift); }, [](Vec v) { return first(v); }, seconds, sink);
  return 2.0 * LANES * CHAINS * rounds;
}

// The bf16 dot-product ceiling (AVX-512 BF16): as tc_fma_peak with vdpbf16ps, which does two
// bf16 multiply-adds a lane into fp32 (4 flops a lane an instruction): the rate no bf16 GEMM
// can pass. Returns -1 where this build has no AVX-512 BF16 or for bad arguments.
double tc_bf16_dot_peak(int threads, int64_t iterations, double* seconds, float* sink) {
#if defined(__AVX512BF16__)
  if (threads < 1 || iterations < 1) return -1.0;
  // (1.0, 1e-3) pairs in bf16 bits: each step adds about 1.001 to a chain
  const __m512bh pair = (__m512bh)_mm512_set1_epi32(0x3a833f80);
  const double rounds = run_chains<__m512>(
      threads, iterations, [](int i, int t) { return _mm512_set1_ps(float(i + t)); },
      [&](__m512 v) { return _mm512_dpbf16_ps(v, pair, pair); },
      [](__m512 v) { return _mm512_cvtss_f32(v); }, seconds, sink);
  return 4.0 * 16 * CHAINS * rounds;
#else
  (void)threads, (void)iterations, (void)seconds, (void)sink;
  return -1.0;
#endif
}

// Read bandwidth: `threads` threads each sum their own contiguous share of a `bytes` buffer
// (first touched by the thread that reads it, so its pages sit near that core), `passes`
// times in each of two ways, and the faster way's rate counts. Each share is read as
// kStreams sequential streams side by side, one vector sum per stream: one stream per core
// leaves the memory system idle between prefetches (one stream read well below what a GEMV
// reading 8 rows at once reached), and a GEMV kernel reads several rows or columns at once
// too. The second way also asks for each line kPrefetchAhead bytes ahead of the loads (into
// L2), as the GEMM library's prefetching variants do: the hardware's prefetchers alone read
// less than this, so without it the GEMV kernels streamed past the "ceiling". Writes the
// wall seconds of the faster way's timed
// passes to *seconds and returns the bytes they read, or -1 for bad arguments or no memory:
// the ceiling of a kernel that streams its operand once.
double tc_read_gbps(int threads, int64_t bytes, int passes, double* seconds, float* sink) {
  const int64_t unit = int64_t(LANES) * kStreams * 64;  // every stream of every share whole
  const int64_t count = bytes / int64_t(sizeof(float)) / unit * unit;
  if (threads < 1 || passes < 1 || count < 1) return -1.0;
  float* data = static_cast<float*>(std::aligned_alloc(64, count * sizeof(float)));
  if (data == nullptr) return -1.0;
  float total = 0.0f;
  int64_t read = 0;           // floats one pass reads, over all threads
  double elapsed[2] = {0, 0};  // seconds of each way's passes
  double start = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total, read)
  {
    const int team = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t share = count / team / unit * unit;
    const int64_t begin = share * tid, end = tid == team - 1 ? count : begin + share;
    const int64_t length = (end - begin) / kStreams / LANES * LANES;  // floats per stream
    read += kStreams * length;
    for (int64_t i = begin; i < end; ++i) data[i] = 1.0f + 1e-6f * float(i & 1023);
    for (int pass = 0; pass < passes; ++pass)
      for (int way = 0; way < 2; ++way) {  // alternated, so the host's moves touch both alike
#pragma omp barrier
#pragma omp single
        start = omp_get_wtime();
        total += way == 0 ? read_share<false>(data + begin, length) : read_share<true>(data + begin, length);
#pragma omp barrier
#pragma omp single
        elapsed[way] += omp_get_wtime() - start;
      }
  }
  std::free(data);
  *sink = total;
  *seconds = std::min(elapsed[0], elapsed[1]);
  return double(read) * sizeof(float) * passes;
}

}  // extern "C"
