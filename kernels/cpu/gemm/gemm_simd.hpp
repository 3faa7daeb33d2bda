// Thin vector-register wrappers so the micro-kernel is written once.
//
// Each wrapper exposes the handful of operations the micro-kernel needs; all
// are force-inlined so the generated code is the same as hand-written
// intrinsics.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define TC_INLINE inline __attribute__((always_inline))

namespace tc::gemm {

/// 8 floats in a ymm register; AVX2 has 16 of them.
struct VecAvx2 {
  using reg = __m256;
  static constexpr int width = 8;
  static TC_INLINE reg zero() { return _mm256_setzero_ps(); }
  static TC_INLINE reg load_aligned(const float* p) { return _mm256_load_ps(p); }
  static TC_INLINE reg load(const float* p) { return _mm256_loadu_ps(p); }
  static TC_INLINE void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static TC_INLINE void store_aligned(float* p, reg v) { _mm256_store_ps(p, v); }
  /// Lanes [0, n) of p, the others zero (0 < n <= width); nothing past them is read.
  static TC_INLINE reg load_first(const float* p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static TC_INLINE reg broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static TC_INLINE reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static TC_INLINE reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  /// The sum of the lanes.
  static TC_INLINE float sum(reg v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
};

#ifdef __AVX512F__
/// 16 floats in a zmm register; AVX-512 has 32 of them.
struct VecAvx512 {
  using reg = __m512;
  static constexpr int width = 16;
  static TC_INLINE reg zero() { return _mm512_setzero_ps(); }
  static TC_INLINE reg load_aligned(const float* p) { return _mm512_load_ps(p); }
  static TC_INLINE reg load(const float* p) { return _mm512_loadu_ps(p); }
  static TC_INLINE void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static TC_INLINE void store_aligned(float* p, reg v) { _mm512_store_ps(p, v); }
  /// Lanes [0, n) of p, the others zero (0 < n <= width); nothing past them is read.
  static TC_INLINE reg load_first(const float* p, int n) {
    return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p);
  }
  static TC_INLINE reg broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static TC_INLINE reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static TC_INLINE reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static TC_INLINE float sum(reg v) { return _mm512_reduce_add_ps(v); }
};
#endif

#ifdef __AVX512BF16__
/// The micro-kernel's view of bf16 operands on AVX-512 BF16: a "float" of a packed panel is
/// two bf16 of consecutive k steps (the lower half the even step), and one `fma` is a
/// vdpbf16ps, two k steps of multiply-adds into fp32 accumulators (products exact, sums
/// rounded to fp32, denormal inputs and results taken as zero, as the instruction defines
/// them). One vdpbf16ps issues at the rate of one fp32 FMA on Zen 4, so the same
/// micro-kernel does twice the flops a cycle. Everything else is VecAvx512's.
struct VecAvx512Bf16Dot : VecAvx512 {
  /// One pair of bf16 broadcast, its bits unchanged.
  static TC_INLINE reg broadcast(const float* p) {
    std::uint32_t bits;
    std::memcpy(&bits, p, sizeof(bits));
    return _mm512_castsi512_ps(_mm512_set1_epi32(int(bits)));
  }
  static TC_INLINE reg fma(reg a, reg b, reg c) {
    return _mm512_dpbf16_ps(c, (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_castps_si512(b));
  }
};
#endif

/// In-register 8x8 transpose: rows[r][c] -> rows[c][r].
TC_INLINE void transpose8x8(__m256 rows[8]) {
  __m256 lo[4], hi[4], quad[8];
  for (int r = 0; r < 4; ++r) {
    lo[r] = _mm256_unpacklo_ps(rows[2 * r], rows[2 * r + 1]);
    hi[r] = _mm256_unpackhi_ps(rows[2 * r], rows[2 * r + 1]);
  }
  for (int r = 0; r < 2; ++r) {
    quad[4 * r + 0] = _mm256_shuffle_ps(lo[2 * r], lo[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0));
    quad[4 * r + 1] = _mm256_shuffle_ps(lo[2 * r], lo[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2));
    quad[4 * r + 2] = _mm256_shuffle_ps(hi[2 * r], hi[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0));
    quad[4 * r + 3] = _mm256_shuffle_ps(hi[2 * r], hi[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    rows[c] = _mm256_permute2f128_ps(quad[c], quad[4 + c], 0x20);
    rows[c + 4] = _mm256_permute2f128_ps(quad[c], quad[4 + c], 0x31);
  }
}

}  // namespace tc::gemm
