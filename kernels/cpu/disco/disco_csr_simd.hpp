// Registers and storage types of the CPU DISCO kernels. The kernels compute in float32; the
// activations they read and write may be stored as float32, bfloat16 or float16, converted
// on the way into and out of registers (round to nearest even on the way out, as torch does).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../gemm/gemm_simd.hpp"

namespace tc::disco {

using index_t = std::int64_t;

#ifdef __AVX512F__
using Vec = tc::gemm::VecAvx512;
#else
using Vec = tc::gemm::VecAvx2;
#endif
using reg = Vec::reg;
constexpr int kLanes = Vec::width;

/// 16-bit storage types, as raw bits.
struct BFloat16 {
  std::uint16_t bits;
};
struct Float16 {
  std::uint16_t bits;
};

// ------------------------------------------------------------------ scalar conversions

TC_INLINE float to_float(float value) { return value; }

TC_INLINE float to_float(BFloat16 value) {
  const std::uint32_t bits = std::uint32_t{value.bits} << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

TC_INLINE float to_float(Float16 value) { return _cvtsh_ss(value.bits); }

template <typename T>
TC_INLINE T from_float(float value);

template <>
TC_INLINE float from_float<float>(float value) {
  return value;
}

template <>
TC_INLINE BFloat16 from_float<BFloat16>(float value) {
  if (value != value) return {0x7FC0};  // a quiet NaN, whatever the payload
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return {static_cast<std::uint16_t>(bits >> 16)};
}

template <>
TC_INLINE Float16 from_float<Float16>(float value) {
  return {static_cast<std::uint16_t>(_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT))};
}

// ------------------------------------------------------------------ kLanes at a time

TC_INLINE reg load_float(const float* p) { return Vec::load(p); }
TC_INLINE void store_float(float* p, reg value) { Vec::store(p, value); }

#ifdef __AVX512F__
TC_INLINE reg widen(__m256i bits, const BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
TC_INLINE reg widen(__m256i bits, const Float16*) { return _mm512_cvtph_ps(bits); }

TC_INLINE reg load_float(const BFloat16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), p);
}
TC_INLINE reg load_float(const Float16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), p);
}

TC_INLINE void store_float(BFloat16* p, reg value) {
#ifdef __AVX512BF16__
  const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(value));
#else
  const __m512i raw = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(raw, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(raw, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
}

TC_INLINE void store_float(Float16* p, reg value) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
TC_INLINE reg load_float(const BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

TC_INLINE reg load_float(const Float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

TC_INLINE void store_float(BFloat16* p, reg value) {
  const __m256i raw = _mm256_castps_si256(value);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(raw, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(raw, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(value, value, _CMP_UNORD_Q);
  rounded = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                                 _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
  const __m256i halves = _mm256_srli_epi32(rounded, 16);
  // packus works within 128-bit lanes: gather the two lanes' results into the low half
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

TC_INLINE void store_float(Float16* p, reg value) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// ------------------------------------------------------------------ loads across the wrap

/// Lanes of a vector starting at row[first] that lie before the row's end at wo.
TC_INLINE index_t lanes_in_row(index_t first, index_t wo) {
  return std::min<index_t>(std::max<index_t>(wo - first, 0), kLanes);
}

/// The kLanes values row[(start + lane0 + i) mod wo], i < kLanes, as floats, for start < wo
/// and a slice that wraps at most once: lanes before the row's end load from start, the
/// others from the row's beginning. Masked-off lanes touch no memory.
TC_INLINE reg load_wrapped(const float* row, index_t start, index_t wo, int lane0) {
  const index_t first = start + lane0, in_row = lanes_in_row(first, wo);
#ifdef __AVX512F__
  const __mmask16 head = static_cast<__mmask16>((1u << in_row) - 1u);
  const reg front = _mm512_maskz_loadu_ps(head, row + first);
  return _mm512_mask_loadu_ps(front, static_cast<__mmask16>(~head), row + first - wo);
#else
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i head = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(in_row)), lanes);
  const reg front = _mm256_maskload_ps(row + first, head);
  const reg back = _mm256_maskload_ps(row + first - wo, _mm256_xor_si256(head, _mm256_set1_epi32(-1)));
  return _mm256_add_ps(front, back);
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/// load_wrapped for 16-bit storage: masked 16-bit loads, then widened.
template <typename Elem>
TC_INLINE reg load_wrapped(const Elem* row, index_t start, index_t wo, int lane0) {
  const index_t first = start + lane0, in_row = lanes_in_row(first, wo);
  const __mmask16 head = static_cast<__mmask16>((1u << in_row) - 1u);
  const __m256i front = _mm256_maskz_loadu_epi16(head, row + first);
  return widen(_mm256_mask_loadu_epi16(front, static_cast<__mmask16>(~head), row + first - wo), row);
}
constexpr bool kWrappedLoads16 = true;
#else
constexpr bool kWrappedLoads16 = false;  // 16-bit storage wraps through a copy instead
#endif

/// Whether load_wrapped serves storage type Elem.
template <typename Elem>
constexpr bool kWrappedLoads = std::is_same_v<Elem, float> || kWrappedLoads16;

/// dst[0:n] = src[0:n] converted to T; kLanes at a time, the rest one by one.
template <typename T>
TC_INLINE void store_floats(T* dst, const float* src, index_t n) {
  index_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_float(dst + i, Vec::load(src + i));
  for (; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

}  // namespace tc::disco
