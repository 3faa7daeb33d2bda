// GEMV-class problems: C = A * B with M <= kSkinnyMax or N <= kSkinnyMax (fp32 or bf16), and the
// few-row products the cols form below runs as dot products (M or N up to kDotsMax).
//
// Such a product does 2 flops per element of its large operand, so it runs at the rate
// that operand streams from memory: packing it first (the blocked path) reads it twice
// and writes it once. Here the large operand is read once, in place, and the small one
// stays in registers or L1.
//
// bf16 takes the same path: T is widened to fp32 as it is loaded (TLoad), S once a call.
//
// Both cases are one task, out (R x N) = S (R x K) * T (K x N) with R <= kSkinnyMax and
// every operand strided: small M takes S = A, T = B, out = C; small N takes the transpose,
// S = B^T, T = A^T, out = C^T. T is read one of two ways:
//   rows  T's rows contiguous (t_cs == 1): a group of T's rows (rows_depth: 8, 16 for 8 rows
//         in ymm when T fits the LLC, fewer where their lines would share an L1 set; 32 in
//         zmm from kDeepRows rows of S) stream
//         side by side along a chunk of columns, each step one broadcast of S(r, p) per row of
//         S (axpys) in the variant's vectors (zmm or ymm), the chunk's sums kept in L1-L2
//         between sweeps; 8 rows in ymm transposed: a broadcast of T(p, c) per column against
//         S's column;
//   cols  T's columns contiguous (t_rs == 1): R x CB dot products down CB columns at once,
//         S's rows read as vectors (packed first when they are strided), in ymm (zmm dots
//         from kDotsMinDepth steps on AVX-512, as past kSkinnyMax rows). Up to kDotsMax rows
//         (R > kSkinnyMax: dots_range) when the dots are at least kDotsMinDepth long: a few
//         columns of T at a time against S a few rows at a time, in the variant's vectors,
//         the columns staying in L1-L2 while S's row blocks pass, so T is still read once.
//         A product of 9-24 rows, a column-major B (the forward convolution's weight) or a
//         row-major A seen from C^T, then streams its large operand once instead of
//         transposing it into packed panels, and wastes no lanes of a register tile on a
//         short edge (n = 20 fills 20 of a 32-wide tile).
// The variant's parallel scheme shares the work: "k" splits K (per-thread partial outputs,
// then a reduction over columns), "m" and "n" split the N columns; TC_PREFETCH adds
// software prefetches: kPrefetchBytes ahead in the cols form's streams, the next group of
// rows into L2 in the rows form.
#pragma once

#include <immintrin.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <type_traits>

#include "gemm_buffers.hpp"
#include "gemm_config.hpp"
#include "gemm_pack.hpp"
#include "gemm_simd.hpp"

namespace tc::gemm::skinny {

/// The small dimension's limit: up to 8 rows of S fit the registers with a column block.
constexpr index_t kSkinnyMax = 8;
/// Below this many multiply-adds (a few microseconds of work at memory speed) a parallel
/// region costs more than it saves (a barrier of the team, the recorded window_probes_us / 200,
/// and a fork-join more): the calling thread does it alone.
constexpr index_t kSerialWork = index_t(1) << 16;
constexpr index_t kPrefetchBytes = 512;
/// rows form: the sums of one pass over columns (R x 16384/R floats, 64 KiB, in L1-L2), so
/// each row of T is read in runs of 8-64 KiB (a quarter of that, 2 KiB runs at R = 8, streamed
/// well below the read probe; 64 KiB of sums came close to it), and the number of rows of T
/// read side by side.
constexpr index_t kRowsSums = 16384;
constexpr index_t kRowsDepth = 8;  // 4 and 16 streamed slower; on AVX2, 16 and 32 were slower
                                   // still past the LLC
/// 8 rows transposed, when T fits the last-level cache: its rows come from the LLC, no stream
/// to keep, and longer runs of FMAs between loads and stores of the sums pay (measured in
/// paired runs on AVX2; not for 5 rows untransposed, nor past the LLC, nor at 24 and 32 rows).
constexpr index_t kRowsDepthInCache = 16;
/// In zmm, from kDeepRows rows of S on, a group reads kRowsDepthDeep of T's rows, whatever
/// L1 sets their lines share: a column block's sums (R x NV zmm) go to L1 and back once a
/// group, and with groups of 8 of T's rows that round trip held 8 rows of S well short of a
/// core's FMA peak with T in L2. Groups of 32 rows were faster in the LLC and level past it;
/// fewer rows of S lose by it: their FMAs are few beside the streams, and 32 streams a core
/// outrun the prefetchers.
constexpr int kDeepRows = 6;
constexpr index_t kRowsDepthDeep = 32;
/// The cols form's reach: up to kDotsMax rows of S, for dots of kDotsMinDepth or more (the
/// reduction of each dot's vector, a few adds, is then small beside its multiply-adds).
/// Against the blocked path in paired runs (AVX-512) it won up to 25 rows and lost on some
/// shapes of 28-32: hence the limit.
constexpr index_t kDotsMax = 24;
constexpr index_t kDotsMinDepth = 256;

struct Task {
  index_t rows, cols, depth;  // R, N, K
  const float* s;             // S in fp32: the operand itself, or (bf16) run's widened copy
  index_t s_rs, s_cs;
  const InputT* t;            // T as stored: fp32, or bf16 widened as it is loaded
  index_t t_rs, t_cs;
  float* out;
  index_t o_rs, o_cs;
  const InputT* s_in;         // S as stored (what run widens for bf16)
};

/// Vectors of T's elements as fp32: fp32 loaded as is, bf16 (the upper half of an fp32's
/// bits) widened by a 16-bit shift as it is loaded, so a bf16 T streams half the bytes.
template <class V>
struct TLoad;
template <>
struct TLoad<VecAvx2> {
  static TC_INLINE __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static TC_INLINE __m256 load(const std::uint16_t* p) { return load8(p); }
  static TC_INLINE __m256 load_first(const float* p, int n) { return VecAvx2::load_first(p, n); }
  static TC_INLINE __m256 load_first(const std::uint16_t* p, int n) {
    alignas(16) std::uint16_t lanes[8] = {};
    for (int i = 0; i < n; ++i) lanes[i] = p[i];
    return load8(lanes);
  }
  static TC_INLINE __m256 broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static TC_INLINE __m256 broadcast(const std::uint16_t* p) { return _mm256_set1_ps(to_float(*p)); }
};
#ifdef __AVX512F__
template <>
struct TLoad<VecAvx512> {
  static TC_INLINE __m512 widen(__m256i bits) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static TC_INLINE __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static TC_INLINE __m512 load(const std::uint16_t* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static TC_INLINE __m512 load_first(const float* p, int n) { return VecAvx512::load_first(p, n); }
  static TC_INLINE __m512 load_first(const std::uint16_t* p, int n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return widen(_mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p));
#else  // AVX-512 F alone has no 16-bit masked load
    alignas(32) std::uint16_t lanes[16] = {};
    for (int i = 0; i < n; ++i) lanes[i] = p[i];
    return load(lanes);
#endif
  }
};
#endif

/// The caches rows_depth sizes a group by, read once from the C library (sysconf); an
/// unknown figure takes the common one (8 ways, 64 sets of 64 bytes) or, for the LLC, none.
struct CacheShape {
  index_t l1_ways = 8, l1_sets = 64, line = 64, llc_bytes = 0;
  static const CacheShape& here() {
    static const CacheShape shape = [] {
      CacheShape c;
      const long ways = sysconf(_SC_LEVEL1_DCACHE_ASSOC), size = sysconf(_SC_LEVEL1_DCACHE_SIZE),
                 line = sysconf(_SC_LEVEL1_DCACHE_LINESIZE), llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
      if (ways > 1 && line > 0 && size > ways * line)
        c.l1_ways = ways, c.line = line, c.l1_sets = size / (ways * line);
      if (llc > 0) c.llc_bytes = llc;
      return c;
    }();
    return shape;
  }
  /// The L1 set of the line `bytes` past a line's start.
  index_t set_of(index_t bytes) const { return bytes / line % l1_sets; }
};

/// The rows of T a rows-form group reads side by side, T's rows `row_bytes` apart: the first
/// `wanted` (at most kRowsDepthInCache), cut before the row whose line would be the L1's
/// ways-th in one set. A column block touches one line of each row; T's rows a multiple of
/// 4 KiB apart (n = 1024, 3072, 6144 floats) put all of them in one set, and 8 fill an 8-way
/// set, so the block's other data (its sums, S's column) evicts them between steps (cutting
/// the group there was faster, in the LLC and past it).
inline index_t group_depth(index_t row_bytes, index_t wanted, const CacheShape& cache) {
  index_t sets[kRowsDepthInCache];
  index_t depth = std::min(wanted, kRowsDepthInCache);
  for (index_t q = 0; q < depth; ++q) {
    sets[q] = cache.set_of(q * row_bytes);
    index_t sharing = 1;  // rows [0, q] whose line falls in row q's set
    for (index_t o = 0; o < q; ++o) sharing += sets[o] == sets[q];
    if (sharing >= cache.l1_ways) depth = q;
  }
  return depth;
}

/// group_depth for T on this machine's L1, the last answer kept per thread (working it out on
/// every call slowed tiny products).
inline index_t rows_depth(const Task& t, index_t wanted) {
  thread_local index_t last_rs = -1, last_wanted = 0, last_depth = 0;
  if (t.t_rs != last_rs || wanted != last_wanted) {
    last_depth = group_depth(t.t_rs * index_t(sizeof(InputT)), wanted, CacheShape::here());
    last_rs = t.t_rs, last_wanted = wanted;
  }
  return last_depth;
}

/// Whether T (depth x cols floats) fits this machine's last-level cache.
inline bool fits_llc(const Task& t) {
  return t.depth * t.cols * index_t(sizeof(InputT)) <= CacheShape::here().llc_bytes;
}

/// S's fp32 pointer: the operand itself (fp32), or none until run widens it (bf16).
template <class T>
inline const float* as_float(const T* data) {
  if constexpr (std::is_same_v<T, float>) return data;
  else return (void)data, nullptr;
}

/// Whether `problem` takes this path, and its task; false for odd strides.
template <class P>
inline bool task_of(const P& p, Task& task) {
  const Task by_rows{p.m, p.n, p.k, as_float(p.a.data), p.a.row_stride, p.a.col_stride,
                     p.b.data, p.b.row_stride, p.b.col_stride, p.c, p.ldc, 1, p.a.data};
  const Task by_cols{p.n, p.m, p.k, as_float(p.b.data), p.b.col_stride, p.b.row_stride,
                     p.a.data, p.a.col_stride, p.a.row_stride, p.c, 1, p.ldc, p.b.data};
  if (p.m <= kSkinnyMax && p.m <= p.n) {
    task = by_rows;
  } else if (p.n <= kSkinnyMax) {
    task = by_cols;
  } else if (p.k >= kDotsMinDepth && p.m <= kDotsMax && p.m <= p.n && by_rows.t_rs == 1) {
    task = by_rows;   // few rows of C, B's columns contiguous: dots
  } else if (p.k >= kDotsMinDepth && p.n <= kDotsMax && by_cols.t_rs == 1) {
    task = by_cols;   // few columns of C, A's rows contiguous: dots of C^T
  } else {
    return false;
  }
  return task.t_cs == 1 || task.t_rs == 1;  // the family's layouts always give one
}

/// Scratch of the skinny path, sized before timing: S's rows packed contiguous (cols form
/// with strided S; bf16's S widened to fp32, either form), and the split-K partial outputs
/// of all threads but the first.
struct Scratch {
  AlignedBuffer s_rows;
  SlicedBuffer partial;
  Scratch() = default;
  Scratch(const Task& t, int threads) {
    if (!std::is_same_v<InputT, float> || (t.t_cs != 1 && t.s_cs != 1))
      s_rows = AlignedBuffer(t.rows * t.depth);
    if (kParScheme == 2 && threads > 1) partial = SlicedBuffer(threads - 1, t.rows * t.cols);
  }
};

/// out = S * T for one task, on `threads` threads by the variant's scheme.
inline void run(const Task& given, Scratch& scratch, int threads);

/// `run` as gemm_skinny.cpp's object holds it, for one dtype, ISA, scheme and prefetch: a unit
/// linked with an object of other parameters fails to link rather than run another's code.
template <int Dtype, int Isa, int Par, int Prefetch>
void run_compiled(const Task& given, Scratch& scratch, int threads);

#ifdef TC_SKINNY_SEPARATE
// The variant's unit (gemm_variant.cpp; the gemm and winograd grouped-conv pipelines') takes
// `run` from gemm_skinny.cpp's object, compiled once for every variant of one dtype, ISA,
// scheme and prefetch: the code below depends on nothing else of a variant.
inline void run(const Task& given, Scratch& scratch, int threads) {
  run_compiled<TC_DTYPE, TC_ISA, TC_PAR, TC_PREFETCH>(given, scratch, threads);
}
#else

inline float hsum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

inline void put(float* out, index_t o_rs, index_t o_cs, index_t r, index_t c, float value) {
  out[r * o_rs + c * o_cs] = value;
}

/// The rows form's vector width: the variant's vectors (zmm or ymm).
constexpr int kRowW = Vec::width;

/// rows form, one column block: sums[0:R, c:c+W*NV] += S[:, p0:p1] * T[p0:p1, cb+c : ...],
/// the last vector holding `tail` lanes when kMasked. T's rows in [p0, p1) are read side by
/// side, each contiguously along the block: sequential streams the prefetchers follow. With
/// TC_PREFETCH, each line is also fetched into L2 for a later group of rows (the same
/// columns kAhead * `depth` rows down), whose streams start a page the hardware has not seen.
template <int R, int NV, bool kMasked, index_t kChunk, int kAhead>
TC_INLINE void rows_block(const Task& t, float (*sums)[kChunk], index_t cb, index_t c,
                          index_t p0, index_t p1, int tail, index_t depth) {
  using V = Vec;
  typename V::reg acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = V::load_aligned(&sums[r][c + kRowW * j]);
  const InputT* tp = t.t + p0 * t.t_rs + cb + c;
  const float* sp = t.s + p0 * t.s_cs;
  for (index_t p = p0; p < p1; ++p, tp += t.t_rs, sp += t.s_cs) {
    if constexpr (kPrefetch)
      for (int j = 0; j < NV; j += 64 / (4 * kRowW))  // one prefetch per 64-byte line
        _mm_prefetch(reinterpret_cast<const char*>(tp + kAhead * depth * t.t_rs + kRowW * j),
                     _MM_HINT_T1);
    typename V::reg row[NV];
    for (int j = 0; j < NV; ++j)
      row[j] = kMasked && j == NV - 1 ? TLoad<V>::load_first(tp + kRowW * j, tail)
                                      : TLoad<V>::load(tp + kRowW * j);
    for (int r = 0; r < R; ++r) {
      const typename V::reg s = V::broadcast(sp + r * t.s_rs);
      for (int j = 0; j < NV; ++j) acc[r][j] = V::fma(s, row[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) V::store_aligned(&sums[r][c + kRowW * j], acc[r][j]);
}

/// rows form of 8 rows in ymm, transposed, one block of NC columns: sums[c:c+NC][0:8] +=
/// (S[:, p0:p1] * T[p0:p1, cb+c : cb+c+NC])^T, a column's 8 rows in one ymm of sums. Each
/// step broadcasts NC elements of T's row against S's column (st[p - p0]): NC chains of
/// FMAs, where the rows form's two bands (6 rows, then 2) left the second band 4 chains and
/// re-read T. No prefetch: fetching the next group of rows into L2 was slower past the LLC.
template <int NC>
TC_INLINE void rows_block_t(const Task& t, float (*sums)[8], const float (*st)[8], index_t cb, index_t c,
                            index_t p0, index_t p1) {
  __m256 acc[NC];
  for (int j = 0; j < NC; ++j) acc[j] = _mm256_load_ps(sums[c + j]);
  const InputT* tp = t.t + p0 * t.t_rs + cb + c;
  for (index_t p = p0; p < p1; ++p, tp += t.t_rs) {
    const __m256 column = _mm256_load_ps(st[p - p0]);
    for (int j = 0; j < NC; ++j) acc[j] = _mm256_fmadd_ps(TLoad<VecAvx2>::broadcast(tp + j), column, acc[j]);
  }
  for (int j = 0; j < NC; ++j) _mm256_store_ps(sums[c + j], acc[j]);
}

/// rows_block_t over `cols` < NC + 1 columns, one block.
template <int NC>
TC_INLINE void rows_rest_t(index_t cols, const Task& t, float (*sums)[8], const float (*st)[8], index_t cb,
                           index_t c, index_t p0, index_t p1) {
  if constexpr (NC > 1)
    if (cols < NC) return rows_rest_t<NC - 1>(cols, t, sums, st, cb, c, p0, p1);
  rows_block_t<NC>(t, sums, st, cb, c, p0, p1);
}

/// rows form of 8 rows in ymm (see rows_block_t): out[0:8, c0:c1] over K steps [p0, p1), as
/// rows_range, with the chunk's sums [column][row] and each group's 8 columns of S copied to
/// st first: faster than the two bands on AVX2, split-K and m-split, in the LLC and past it.
template <int R>
void rows_range_t(const Task& t, index_t c0, index_t c1, index_t p0, index_t p1, float* out, index_t o_rs,
                  index_t o_cs) {
  static_assert(R == 8);
  constexpr int NC = 14;  // 14 accumulators + S's column + a broadcast: the 16 ymm
  constexpr index_t kChunk = kRowsSums / R;
  alignas(64) float sums[kChunk][R];
  alignas(64) float st[kRowsDepthInCache][R];
  const bool in_llc = fits_llc(t);
  const index_t depth = rows_depth(t, in_llc ? kRowsDepthInCache : kRowsDepth);
  for (index_t cb = c0; cb < c1; cb += kChunk) {
    const index_t width = std::min(kChunk, c1 - cb);
    const index_t whole = width / NC * NC;
    std::fill(sums[0], sums[0] + width * R, 0.0f);
    for (index_t p = p0; p < p1; p += depth) {
      const index_t pe = std::min(p + depth, p1);
      for (index_t q = p; q < pe; ++q)
        for (int r = 0; r < R; ++r) st[q - p][r] = t.s[r * t.s_rs + q * t.s_cs];
      for (index_t c = 0; c < whole; c += NC) rows_block_t<NC>(t, sums, st, cb, c, p, pe);
      if (whole < width) rows_rest_t<NC - 1>(width - whole, t, sums, st, cb, whole, p, pe);
    }
    for (index_t c = 0; c < width; ++c)
      for (int r = 0; r < R; ++r) out[r * o_rs + (cb + c) * o_cs] = sums[c][r];
  }
}

/// rows form: out[0:R, c0:c1] over K steps [p0, p1), a chunk of columns at a time (whole
/// 4 KiB pages of a row, kRowsSums / R floats), its sums in L1-L2 while kRowsDepth rows of T
/// at a time stream through; TC_PREFETCH fetches kAhead groups ahead (rows_range).
template <int R, int kAhead>
void rows_range_ahead(const Task& t, index_t c0, index_t c1, index_t p0, index_t p1, float* out,
                      index_t o_rs, index_t o_cs) {
  // R*NV accumulators + NV row vectors + 1 broadcast within the registers (32 zmm, 16 ymm).
  // In ymm, 7 rows would leave one vector a column block: 7 accumulator chains, under the
  // FMA's latency times its throughput, so any late load stalls them all. They go in two
  // bands instead, 6 rows then 1, two vectors each; the second band re-reads the group of
  // T's rows from L2 (faster for 8 rows, which now go transposed, rows_range_t; 7 that way
  // were slower in the LLC, 1 lane of 8 idle).
  constexpr int kBand = kRowW == 8 && R > 6 ? 6 : R;
  constexpr int NV = kRowW == 16 ? (R <= 6 ? 4 : 2) : 2;
  constexpr index_t kStep = kRowW * NV;
  constexpr index_t kChunk = kRowsSums / R / 1024 * 1024;
  static_assert(kChunk >= 1024 && kChunk % kStep == 0);
  alignas(64) float sums[R][kChunk];
  const index_t depth = kRowW == 16 && R >= kDeepRows ? kRowsDepthDeep : rows_depth(t, kRowsDepth);
  for (index_t cb = c0; cb < c1; cb += kChunk) {
    const index_t width = std::min(kChunk, c1 - cb);
    const index_t whole = width / kStep * kStep;
    for (int r = 0; r < R; ++r) std::fill(sums[r], sums[r] + round_up(width, kRowW), 0.0f);
    for (index_t p = p0; p < p1; p += depth) {
      const index_t pe = std::min(p + depth, p1);
      for (index_t c = 0; c < whole; c += kStep)
        rows_block<kBand, NV, false, kChunk, kAhead>(t, sums, cb, c, p, pe, kRowW, depth);
      if constexpr (kBand < R) {
        Task band = t;
        band.s = t.s + kBand * t.s_rs;
        for (index_t c = 0; c < whole; c += kStep)
          rows_block<R - kBand, NV, false, kChunk, kAhead>(band, sums + kBand, cb, c, p, pe, kRowW,
                                                           depth);
      }
      for (index_t c = whole; c < width; c += kRowW)
        rows_block<R, 1, true, kChunk, kAhead>(t, sums, cb, c, p, pe,
                                               int(std::min<index_t>(kRowW, width - c)), depth);
    }
    for (int r = 0; r < R; ++r) {
      float* row = out + r * o_rs + cb * o_cs;
      if (o_cs == 1)
        std::copy(sums[r], sums[r] + width, row);
      else
        for (index_t c = 0; c < width; ++c) row[c * o_cs] = sums[r][c];
    }
  }
}

/// rows_range_ahead with TC_PREFETCH's distance: the next group, or in zmm past the LLC the
/// one after it, where memory's latency wants the lines asked for earlier (paired runs on
/// Zen 4: faster past the LLC, a little slower in it; not measured on AVX2, which keeps one).
template <int R>
void rows_range(const Task& t, index_t c0, index_t c1, index_t p0, index_t p1, float* out,
                index_t o_rs, index_t o_cs) {
  const bool in_llc = fits_llc(t);
  if (kPrefetch && kRowW == 16 && !in_llc)
    rows_range_ahead<R, 2>(t, c0, c1, p0, p1, out, o_rs, o_cs);
  else
    rows_range_ahead<R, 1>(t, c0, c1, p0, p1, out, o_rs, o_cs);
}

/// cols form: out[0:R, c:c+CB] over K steps [p0, p1); S rows contiguous (s_cs == 1).
template <int R, int CB>
TC_INLINE void cols_block(const Task& t, const float* s, index_t s_rs, index_t c, index_t p0,
                          index_t p1, float* out, index_t o_rs, index_t o_cs) {
  __m256 acc[R][CB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < CB; ++j) acc[r][j] = _mm256_setzero_ps();
  const InputT* col[CB];
  for (int j = 0; j < CB; ++j) col[j] = t.t + (c + j) * t.t_cs;
  index_t p = p0;
  for (; p + 8 <= p1; p += 8) {
    if constexpr (kPrefetch)
      for (int j = 0; j < CB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(col[j] + p) + kPrefetchBytes, _MM_HINT_T0);
    __m256 tv[CB];
    for (int j = 0; j < CB; ++j) tv[j] = TLoad<VecAvx2>::load(col[j] + p);
    for (int r = 0; r < R; ++r) {
      const __m256 sv = _mm256_loadu_ps(s + r * s_rs + p);
      for (int j = 0; j < CB; ++j) acc[r][j] = _mm256_fmadd_ps(sv, tv[j], acc[r][j]);
    }
  }
  if (p < p1) {
    const int rest = int(p1 - p);
    __m256 tv[CB];
    for (int j = 0; j < CB; ++j) tv[j] = TLoad<VecAvx2>::load_first(col[j] + p, rest);
    for (int r = 0; r < R; ++r) {
      const __m256 sv = VecAvx2::load_first(s + r * s_rs + p, rest);
      for (int j = 0; j < CB; ++j) acc[r][j] = _mm256_fmadd_ps(sv, tv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < CB; ++j) put(out, o_rs, o_cs, r, c + j, hsum(acc[r][j]));
}

template <int R>
void cols_range(const Task& t, const float* s, index_t s_rs, index_t c0, index_t c1, index_t p0,
                index_t p1, float* out, index_t o_rs, index_t o_cs) {
  constexpr int CB = R <= 2 ? 4 : R <= 4 ? 2 : 1;  // R*CB accumulators + CB columns + 1 S row
  index_t c = c0;
  for (; c + CB <= c1; c += CB) cols_block<R, CB>(t, s, s_rs, c, p0, p1, out, o_rs, o_cs);
  for (; c < c1; ++c) cols_block<R, 1>(t, s, s_rs, c, p0, p1, out, o_rs, o_cs);
}

/// cols form past kSkinnyMax rows: out[r0:r0+RB, c:c+CB] over K steps [p0, p1), in the
/// variant's vectors; S rows contiguous (s_rs apart).
template <int RB, int CB>
TC_INLINE void dots_block(const Task& t, const float* s, index_t s_rs, index_t r0, index_t c,
                          index_t p0, index_t p1, float* out, index_t o_rs, index_t o_cs) {
  using V = Vec;
  constexpr int W = V::width;
  typename V::reg acc[RB][CB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < CB; ++j) acc[r][j] = V::zero();
  const InputT* col[CB];
  for (int j = 0; j < CB; ++j) col[j] = t.t + (c + j) * t.t_cs;
  const float* row[RB];
  for (int r = 0; r < RB; ++r) row[r] = s + (r0 + r) * s_rs;
  index_t p = p0;
  for (; p + W <= p1; p += W) {
    if constexpr (kPrefetch)
      for (int j = 0; j < CB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(col[j] + p) + kPrefetchBytes, _MM_HINT_T0);
    typename V::reg tv[CB];
    for (int j = 0; j < CB; ++j) tv[j] = TLoad<V>::load(col[j] + p);
    for (int r = 0; r < RB; ++r) {
      const typename V::reg sv = V::load(row[r] + p);
      for (int j = 0; j < CB; ++j) acc[r][j] = V::fma(sv, tv[j], acc[r][j]);
    }
  }
  if (p < p1) {
    const int rest = int(p1 - p);
    typename V::reg tv[CB];
    for (int j = 0; j < CB; ++j) tv[j] = TLoad<V>::load_first(col[j] + p, rest);
    for (int r = 0; r < RB; ++r) {
      const typename V::reg sv = V::load_first(row[r] + p, rest);
      for (int j = 0; j < CB; ++j) acc[r][j] = V::fma(sv, tv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < CB; ++j) put(out, o_rs, o_cs, r0 + r, c + j, V::sum(acc[r][j]));
}

/// The register block of dots_range: RB rows of S x CB columns of T, RB * CB accumulators
/// beside CB column vectors and one row vector (AVX-512: 6 x 4 of 32 zmm; AVX2: 3 x 3 of 16).
constexpr int kDotsRows = Vec::width == 16 ? 6 : 3;
constexpr int kDotsCols = Vec::width == 16 ? 4 : 3;

/// The rows [r0, r0 + rb) of S (rb <= kDotsRows) against CB columns of T.
template <int CB, int RB = kDotsRows>
TC_INLINE void dots_rows(const Task& t, const float* s, index_t s_rs, index_t r0, index_t rb,
                         index_t c, index_t p0, index_t p1, float* out, index_t o_rs, index_t o_cs) {
  if constexpr (RB > 1) {
    if (rb < RB) return dots_rows<CB, RB - 1>(t, s, s_rs, r0, rb, c, p0, p1, out, o_rs, o_cs);
  }
  dots_block<RB, CB>(t, s, s_rs, r0, c, p0, p1, out, o_rs, o_cs);
}

/// cols form for kSkinnyMax < R <= kDotsMax: kDotsCols columns of T at a time, each block
/// against S kDotsRows rows at a time; the block's columns are read from memory once and
/// from L1-L2 for the later row blocks.
inline void dots_range(const Task& t, const float* s, index_t s_rs, index_t c0, index_t c1, index_t p0,
                       index_t p1, float* out, index_t o_rs, index_t o_cs) {
  constexpr index_t CB = kDotsCols, RB = kDotsRows;
  index_t c = c0;
  for (; c + CB <= c1; c += CB)
    for (index_t r0 = 0; r0 < t.rows; r0 += RB)
      dots_rows<CB>(t, s, s_rs, r0, std::min(RB, t.rows - r0), c, p0, p1, out, o_rs, o_cs);
  for (; c < c1; ++c)
    for (index_t r0 = 0; r0 < t.rows; r0 += RB)
      dots_rows<1>(t, s, s_rs, r0, std::min(RB, t.rows - r0), c, p0, p1, out, o_rs, o_cs);
}

/// out[0:R, c0:c1] of the K steps [p0, p1), written at (o_rs, o_cs); `s_rows` is S with
/// contiguous rows (s_rs apart) when the cols form needs them.
template <int R>
void range(const Task& t, const float* s_rows, index_t s_rs, index_t c0, index_t c1, index_t p0,
           index_t p1, float* out, index_t o_rs, index_t o_cs) {
  if (t.t_cs == 1) {
    if constexpr (kRowW == 8 && R == 8) rows_range_t<R>(t, c0, c1, p0, p1, out, o_rs, o_cs);
    else rows_range<R>(t, c0, c1, p0, p1, out, o_rs, o_cs);
  } else {
    // in zmm, dots of kDotsMinDepth steps or more go in dots_range's blocks whatever R (faster
    // than the ymm blocks below in paired runs on Zen 4, fp32 and bf16; one row or column
    // level: memory holds it)
    if constexpr (kRowW == 16)
      if (p1 - p0 >= kDotsMinDepth) return dots_range(t, s_rows, s_rs, c0, c1, p0, p1, out, o_rs, o_cs);
    cols_range<R>(t, s_rows, s_rs, c0, c1, p0, p1, out, o_rs, o_cs);
  }
}

using RangeFn = void (*)(const Task&, const float*, index_t, index_t, index_t, index_t, index_t,
                         float*, index_t, index_t);
constexpr RangeFn kRanges[kSkinnyMax] = {range<1>, range<2>, range<3>, range<4>,
                                         range<5>, range<6>, range<7>, range<8>};

inline void run(const Task& given, Scratch& scratch, int threads) {
  Task t = given;
  const RangeFn fn = t.rows <= kSkinnyMax ? kRanges[t.rows - 1] : dots_range;
  if constexpr (!std::is_same_v<InputT, float>) {  // bf16: S widened to fp32 rows, once a call
    float* widened = scratch.s_rows.get();
    for (index_t r = 0; r < t.rows; ++r)
      for (index_t p = 0; p < t.depth; ++p) widened[r * t.depth + p] = to_float(t.s_in[r * t.s_rs + p * t.s_cs]);
    t.s = widened, t.s_rs = t.depth, t.s_cs = 1;
  }
  const float* s_rows = t.s;
  index_t s_rs = t.s_rs;
  if (t.t_cs != 1 && t.s_cs != 1) {  // cols form reads S's rows as vectors: make them contiguous
    float* packed = scratch.s_rows.get();
    for (index_t r = 0; r < t.rows; ++r)
      for (index_t p = 0; p < t.depth; ++p) packed[r * t.depth + p] = t.s[r * t.s_rs + p * t.s_cs];
    s_rows = packed, s_rs = t.depth;
  }
  const int nt = t.rows * t.cols * t.depth < kSerialWork ? 1 : threads;
  if (nt == 1) {
    fn(t, s_rows, s_rs, 0, t.cols, 0, t.depth, t.out, t.o_rs, t.o_cs);
    return;
  }
  if constexpr (kParScheme == 2) {
#pragma omp parallel num_threads(nt)
    {
      const int tid = omp_get_thread_num();
      const int team = omp_get_num_threads();
      index_t p0, p1;
      split_range(t.depth, team, tid, p0, p1);
      float* out = tid == 0 ? t.out : scratch.partial.slice(tid - 1);
      const index_t o_rs = tid == 0 ? t.o_rs : t.cols, o_cs = tid == 0 ? t.o_cs : 1;
      if (p0 < p1) {
        fn(t, s_rows, s_rs, 0, t.cols, p0, p1, out, o_rs, o_cs);
      } else {
        for (index_t r = 0; r < t.rows; ++r)
          for (index_t c = 0; c < t.cols; ++c) out[r * o_rs + c * o_cs] = 0.0f;
      }
#pragma omp barrier
      index_t c0, c1;
      split_range(t.cols, team, tid, c0, c1);
      for (int other = 1; other < team; ++other) {
        const float* part = scratch.partial.slice(other - 1);
        for (index_t r = 0; r < t.rows; ++r)
          for (index_t c = c0; c < c1; ++c) t.out[r * t.o_rs + c * t.o_cs] += part[r * t.cols + c];
      }
    }
  } else {
#pragma omp parallel num_threads(nt)
    {
      const int tid = omp_get_thread_num();
      const int team = omp_get_num_threads();
      // whole 16-column blocks per thread, so no thread gets a masked block in the middle
      const index_t blocks = ceil_div(t.cols, 16);
      index_t b0, b1;
      split_range(blocks, team, tid, b0, b1);
      const index_t c0 = std::min(b0 * 16, t.cols), c1 = std::min(b1 * 16, t.cols);
      if (c0 < c1) fn(t, s_rows, s_rs, c0, c1, 0, t.depth, t.out, t.o_rs, t.o_cs);
    }
  }
}

#endif  // TC_SKINNY_SEPARATE

}  // namespace tc::gemm::skinny
