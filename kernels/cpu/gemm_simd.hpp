// Thin vector-register wrappers so the micro-kernel is written once.
//
// Each wrapper exposes the handful of operations the micro-kernel needs; all
// are force-inlined so the generated code is the same as hand-written
// intrinsics.
#pragma once

#include <immintrin.h>

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
  static TC_INLINE reg broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static TC_INLINE reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static TC_INLINE reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
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
  static TC_INLINE reg broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static TC_INLINE reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static TC_INLINE reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
};
#endif

}  // namespace tc::gemm
