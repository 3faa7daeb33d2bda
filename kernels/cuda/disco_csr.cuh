// What the CUDA DISCO kernels share: sizes, status and storage codes, launch geometry, the
// 16-bit conversions and the staged psi entries. Same math, CSR layouts and codes as
// kernels/cpu/disco/disco_csr.cpp:
//
//   forward    y[bc, k, ho, wo]     = sum_{e in row k*Ho+ho}  val_e * x[bc, hi_e, (wi_e + s*wo) mod Wi]
//   transpose  gx[bc, hi, p + s*j]  = sum_{e in line hi*s+p} val_e * gy[bc, row_e, (j - q_e) mod Wo]
//
// s = Wi / Wo; the transposed CSR's rows are input lines hi*s + p and its columns
// row_e*Wo + q_e (tilecast/disco/csr.py builds both layouts).
//
// Both directions gather, so no output is written by two CTAs and there are no atomics. A
// CTA owns one work item: a CSR row (forward) or line (transpose), BT channels and
// kLonsPerCta output longitudes. Its threads stage the row's entries in shared memory,
// kChunk at a time and decoded once, then every thread accumulates BT x kLonsPerThread
// outputs in registers: each staged entry feeds BT * kLonsPerThread FMAs, and the lanes of a
// warp read consecutive longitudes of one entry (coalesced; stride s in the forward). Sums
// run in float32 over the entries in CSR order with FMAs, as the CPU kernels do, so both
// give the same bits. The launch is a 1-D grid, work items slowest in pole-first order
// (Grid, pole_first).
//
// The CTA body (disco_csr_cta.cuh, over the per-direction parts in disco_csr_forward.cuh and
// disco_csr_transpose.cuh) is written once against a `Cta` executor: DeviceCta
// (disco_csr.cu) runs it as one thread of a real CTA, HostCta (disco_csr_emulate.cu) runs
// every thread of a CTA in turn on the CPU, so the index arithmetic is tested on machines
// without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#define TC_HD __host__ __device__ __forceinline__

namespace tc::disco_cuda {

using index_t = std::int64_t;

/// Return codes of the entry points; 1 and 4 mean what they mean in disco_csr.cpp.
enum Status : int {
  kOk = 0,
  kBadShape = 1,
  kBadStorage = 4,
  kTooLarge = 5,           // a plane or the grid exceeds 32-bit offsets or CUDA's grid
  kCudaErrorBase = 1000,   // + the cudaError_t of a failed launch
};

/// Storage type codes, as in disco_csr.cpp (tilecast/disco/native.py holds the same).
enum Storage : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr int kThreads = 128;        // threads per CTA
constexpr int kLonsPerThread = 2;    // output longitudes per thread, kThreads apart
constexpr int kLonsPerCta = kThreads * kLonsPerThread;
constexpr int kChunk = 512;          // psi entries staged in shared memory at a time
constexpr index_t kMaxGridX = 2147483647;
constexpr index_t kMaxOffset = 2147483647;

/// bc channels of Hi x Wi input longitudes and K basis functions at Ho x Wo output points.
struct Dims {
  index_t bc, hi, wi, k, ho, wo;
  TC_HD index_t stride() const { return wi / wo; }
  TC_HD index_t in_plane() const { return hi * wi; }
  TC_HD index_t out_plane() const { return k * ho * wo; }
};

TC_HD index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }
TC_HD index_t min_index(index_t a, index_t b) { return a < b ? a : b; }
TC_HD index_t max_index(index_t a, index_t b) { return a > b ? a : b; }

/// Channels per CTA: 8 if there are 8, else 4, else 1 (the seed's BC_TILE rule).
inline int channel_tile_for(index_t bc) { return bc >= 8 ? 8 : bc >= 4 ? 4 : 1; }

/// The latitude at position `rank` of an order running from the poles inwards (0, n-1, 1,
/// n-2, ...). Rows and lines near the poles hold the most psi entries (26 times the mean at
/// 360 x 720), so their CTAs start first rather than trail the launch.
TC_HD index_t pole_first(index_t rank, index_t n) {
  return rank % 2 == 0 ? rank / 2 : n - 1 - rank / 2;
}

/// One launch, a 1-D grid of items x tiles x chunks CTAs: work items (CSR rows or lines,
/// in pole-first order) slowest, so that the heavy ones start first and the CTAs in flight
/// share a few latitudes' data in L2; then channel tiles; runs of kLonsPerCta output
/// longitudes fastest.
struct Grid {
  index_t items, tiles, chunks;

  index_t ctas() const { return items * tiles * chunks; }
};

/// What CTA `block` of a Grid computes: item rank (before the pole-first order), channel
/// tile and longitude run.
struct Work {
  index_t rank, tile, chunk;
};

TC_HD Work work_of(const Grid& grid, index_t block) {
  const index_t per_item = grid.tiles * grid.chunks;
  return {block / per_item, block % per_item / grid.chunks, block % grid.chunks};
}

inline Grid grid_for(index_t items, const Dims& d, int channels) {
  return {items, ceil_div(d.bc, channels), ceil_div(d.wo, kLonsPerCta)};
}

/// kBadShape unless every size is positive and Wo divides Wi; kTooLarge when a plane's
/// offsets do not fit the kernels' 32-bit offsets or the CTAs CUDA's 1-D grid (1 channel
/// per CTA bounds both directions' counts).
inline Status check_dims(const Dims& d) {
  const bool positive = d.bc > 0 && d.hi > 0 && d.wi > 0 && d.k > 0 && d.ho > 0 && d.wo > 0;
  if (!positive || d.wi % d.wo != 0) return kBadShape;
  // a thread's int32 index may pass its plane by up to one row before the wrap folds it back
  if (d.in_plane() + d.wi > kMaxOffset || d.out_plane() + d.wo > kMaxOffset) return kTooLarge;
  // items x channels x chunks, with care not to overflow the product itself
  const index_t items = max_index(d.k * d.ho, d.hi * d.stride());
  const index_t per_item = d.bc * ceil_div(d.wo, kLonsPerCta);
  return per_item <= kMaxGridX / items ? kOk : kTooLarge;
}

// ------------------------------------------------------------------ storage types

TC_HD float load_float(const float* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

TC_HD float load_float(const __nv_bfloat16* p) {
#ifdef __CUDA_ARCH__
  return __bfloat162float(__ldg(p));
#else
  return __bfloat162float(*p);
#endif
}

TC_HD float load_float(const __half* p) {
#ifdef __CUDA_ARCH__
  return __half2float(__ldg(p));
#else
  return __half2float(*p);
#endif
}

/// float32 to the storage type, rounding to nearest even as torch does.
template <typename Elem>
TC_HD Elem from_float(float value);

template <>
TC_HD float from_float<float>(float value) {
  return value;
}

template <>
TC_HD __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

template <>
TC_HD __half from_float<__half>(float value) {
  return __float2half_rn(value);
}

// ------------------------------------------------------------------ staged entries

/// Up to kChunk psi entries of one row, decoded for the CTA's loads: entry i reads the
/// channel plane at offset[i] plus a longitude that wraps at shift[i] (see each direction).
/// 6 KB for every channel tile: the entries are shared by the BT channels, so BT = 8 stays
/// far below the 48 KB of static shared memory a kernel may use without opting in with
/// cudaFuncAttributeMaxDynamicSharedMemorySize (the seed's note on BC_TILE = 8).
struct StagedEntries {
  std::int32_t offset[kChunk];
  std::int32_t shift[kChunk];
  float val[kChunk];
};
static_assert(sizeof(StagedEntries) <= 48 * 1024, "staged entries must fit static shared memory");

/// The entries [begin, end) of CSR row r, clamped to [0, nnz] so that offsets that are not
/// monotone or overrun psi read no memory outside it (tilecast/disco/cuda.py rejects them).
struct Span {
  index_t begin, end;
};

TC_HD Span row_span(const index_t* offsets, index_t r, index_t nnz) {
  const index_t begin = min_index(max_index(offsets[r], 0), nnz);
  const index_t end = min_index(max_index(offsets[r + 1], begin), nnz);
  return {begin, end};
}

/// What a CTA reads and writes: src (x or gy) and dst (y or gx) of storage type Elem, and
/// one CSR of psi (forward: roff, col, vals; transpose: troff, tcol, tvals).
template <typename Elem>
struct Operands {
  const Elem* src;
  Elem* dst;
  Dims d;
  const index_t* offsets;
  const index_t* columns;
  const float* vals;
  index_t nnz;
};

/// One thread's sums: BT channels x kLonsPerThread longitudes.
template <int BT>
struct Accumulators {
  float sum[BT][kLonsPerThread];
};

/// The output longitude of a thread's slot t in the CTA's run starting at lon0.
TC_HD index_t thread_lon(index_t lon0, int tid, int t) { return lon0 + tid + t * kThreads; }

/// Pointers to the planes of channels bc0 .. bc0+BT-1 of `base`; slots past the last
/// channel re-read the last valid one, and their sums are dropped (no branch in the FMAs).
template <int BT, typename Elem>
struct ChannelPlanes {
  const Elem* plane[BT];

  TC_HD ChannelPlanes(const Elem* base, index_t bc0, index_t valid, index_t plane_size) {
#pragma unroll
    for (int c = 0; c < BT; ++c) plane[c] = base + (bc0 + min_index(c, valid - 1)) * plane_size;
  }
};

}  // namespace tc::disco_cuda
