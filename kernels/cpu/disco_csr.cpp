// CPU DISCO contraction with psi in CSR: OpenMP, extern "C" entry points for ctypes. Computes
// in float32; x, y, gy and gx are stored as float32, bfloat16 or float16 (Storage).
//
//   forward    y[bc, k, ho, wo]     = sum_{e in row k*Ho+ho}  val_e * x[bc, hi_e, (wi_e + s*wo) mod Wi]
//   transpose  gx[bc, hi, p + s*j]  = sum_{e in line hi*s+p} val_e * gy[bc, row_e, (j - q_e) mod Wo]
//
// s = Wi / Wo is the longitude stride. Writing an input longitude as wi = p + s*q (phase p,
// quotient q) makes both directions contiguous in the output longitude: x's phase line
// (hi, p) is read at (q + wo) mod Wo. The forward copies the input latitudes a work item
// needs into a band of phase lines padded with their own start, so every slice is
// contiguous whatever the stride; the transpose reads gy in place.
//
// Both directions gather: a work item owns its outputs, so there are no atomics. The
// transpose reads the transposed CSR (rows = input lines hi*s+p, columns (k*Ho+ho)*Wo + q,
// built once by the caller) and processes BT channels per work item so that every decoded
// entry feeds BT * NV FMAs (BT = 8 if BC >= 8, 4 if BC >= 4, else 1). NV, the vectors per
// tile, is picked per call from a short table to waste the fewest padded longitudes.
//
// Files: disco_csr_simd.hpp (registers, storage types), disco_csr_tile.hpp (the register
// tiles), disco_csr_forward.hpp / disco_csr_transpose.hpp (the loops around them), this file
// (checks, entry decoding, variant tables, entry points).
//
// Return value: 0 ok, else a Status; nothing is written past the outputs on error.
#include <omp.h>
#include <sys/mman.h>

#include <cstdint>
#include <vector>

#include "disco_csr_forward.hpp"
#include "disco_csr_transpose.hpp"

namespace tc::disco {
namespace {

enum Status : int { kOk = 0, kBadShape = 1, kBadOffsets = 2, kEntryOutOfRange = 3, kBadStorage = 4 };

/// The storage type codes the entry points take (tilecast/disco/native.py holds the same).
enum Storage : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

Status check_dims(const Dims& d) {
  const bool positive = d.bc > 0 && d.hi > 0 && d.wi > 0 && d.k > 0 && d.ho > 0 && d.wo > 0;
  return positive && d.wi % d.wo == 0 ? kOk : kBadShape;
}

/// roff must start at 0, never decrease and end at nnz.
Status check_offsets(const std::int64_t* roff, index_t rows, index_t nnz) {
  if (roff[0] != 0 || roff[rows] != nnz) return kBadOffsets;
  for (index_t r = 0; r < rows; ++r)
    if (roff[r + 1] < roff[r]) return kBadOffsets;
  return kOk;
}

template <typename Elem>
using ForwardFn = void (*)(const Elem*, Elem*, const Dims&, const std::int64_t*,
                           const std::int32_t*, const std::int32_t*, const float*, int);
template <typename Elem>
using TransposeFn = void (*)(const Elem*, Elem*, const Dims&, const std::int64_t*,
                             const std::int64_t*, const std::int32_t*, const float*, int);

/// One instantiation of a kernel: its channel tile BT, vectors per tile NV, entry point.
template <typename Fn>
struct Variant {
  int channels;
  int vectors;
  Fn run;
};

// Per storage type, direction and channel tile, the tile widths to choose from: BT * NV
// accumulators fit the register file with room for the operands, and NV >= 4 when BT = 1
// so that enough independent FMA chains are in flight.
template <typename Elem>
struct Variants {
#ifdef __AVX512F__
  static constexpr Variant<ForwardFn<Elem>> forward_tiles[] = {
      {1, 8, forward<8, Elem>}, {1, 6, forward<6, Elem>}, {1, 5, forward<5, Elem>},
      {1, 4, forward<4, Elem>}};
  static constexpr Variant<TransposeFn<Elem>> transpose_tiles[] = {
      {8, 2, transpose<8, 2, Elem>}, {8, 1, transpose<8, 1, Elem>}, {4, 4, transpose<4, 4, Elem>},
      {4, 3, transpose<4, 3, Elem>}, {4, 2, transpose<4, 2, Elem>}, {1, 8, transpose<1, 8, Elem>},
      {1, 6, transpose<1, 6, Elem>}, {1, 5, transpose<1, 5, Elem>}, {1, 4, transpose<1, 4, Elem>}};
#else
  static constexpr Variant<ForwardFn<Elem>> forward_tiles[] = {
      {1, 12, forward<12, Elem>}, {1, 10, forward<10, Elem>}, {1, 8, forward<8, Elem>},
      {1, 6, forward<6, Elem>}};
  static constexpr Variant<TransposeFn<Elem>> transpose_tiles[] = {
      {8, 1, transpose<8, 1, Elem>}, {4, 3, transpose<4, 3, Elem>}, {4, 2, transpose<4, 2, Elem>},
      {1, 12, transpose<1, 12, Elem>}, {1, 10, transpose<1, 10, Elem>}, {1, 8, transpose<1, 8, Elem>},
      {1, 6, transpose<1, 6, Elem>}};
#endif
};

/// Among the variants with `channels`, the one computing the fewest padded longitudes for
/// wo; the first listed (the widest) on a tie.
template <typename Fn, std::size_t N>
const Variant<Fn>& choose(const Variant<Fn> (&variants)[N], int channels, index_t wo) {
  const Variant<Fn>* best = nullptr;
  index_t best_padded = 0;
  for (const Variant<Fn>& variant : variants) {
    if (variant.channels != channels) continue;
    const index_t width = variant.vectors * kLanes;
    const index_t padded = ceil_div(wo, width) * width;
    if (best == nullptr || padded < best_padded) best = &variant, best_padded = padded;
  }
  return *best;
}

/// The transpose's channel tile: 8 channels per work item if there are 8, else 4, else 1.
int channel_tile_for(index_t bc) { return bc >= 8 ? 8 : bc >= 4 ? 4 : 1; }

int resolve_threads(int threads) { return threads > 0 ? threads : omp_get_max_threads(); }

/// Asks Linux to back an output with 2 MB pages. A fresh output is first touched by the
/// kernel, and faulting it in 4 KB pages took as long as computing it (360 x 720, K = 9).
void advise_huge_pages(void* data, std::size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t begin = (first + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t end = (first + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data, (void)bytes;
#endif
}

/// Decodes each forward entry's phase line (hi * s + p) and quotient q; false if a column
/// lies outside the input grid.
bool decode_forward(const std::int64_t* col, index_t nnz, const Dims& d, int threads,
                    std::int32_t* line, std::int32_t* quot) {
  const index_t s = d.stride();
  bool out_of_range = false;
#pragma omp parallel for num_threads(threads) reduction(|| : out_of_range)
  for (index_t e = 0; e < nnz; ++e) {
    const index_t c = col[e];
    if (c < 0 || c >= d.hi * d.wi) {
      out_of_range = true;
      continue;
    }
    const index_t h = c / d.wi, w = c % d.wi;
    line[e] = static_cast<std::int32_t>(h * s + w % s);
    quot[e] = static_cast<std::int32_t>(w / s);
  }
  return !out_of_range;
}

/// Decodes each transposed entry's quotient q = col mod Wo; false if a column lies outside gy.
bool decode_transpose(const std::int64_t* tcol, index_t nnz, const Dims& d, int threads,
                      std::int32_t* quot) {
  bool out_of_range = false;
#pragma omp parallel for num_threads(threads) reduction(|| : out_of_range)
  for (index_t e = 0; e < nnz; ++e) {
    const index_t c = tcol[e];
    if (c < 0 || c >= d.k * d.ho * d.wo) {
      out_of_range = true;
      continue;
    }
    quot[e] = static_cast<std::int32_t>(c % d.wo);
  }
  return !out_of_range;
}

template <typename Elem>
void run_forward(const void* x, void* y, const Dims& d, const std::int64_t* roff,
                 const std::int32_t* line, const std::int32_t* quot, const float* vals, int threads) {
  advise_huge_pages(y, sizeof(Elem) * d.bc * d.k * d.ho * d.wo);
  choose(Variants<Elem>::forward_tiles, 1, d.wo)
      .run(static_cast<const Elem*>(x), static_cast<Elem*>(y), d, roff, line, quot, vals, threads);
}

template <typename Elem>
void run_transpose(const void* gy, void* gx, const Dims& d, const std::int64_t* troff,
                   const std::int64_t* tcol, const std::int32_t* quot, const float* tvals,
                   int threads) {
  advise_huge_pages(gx, sizeof(Elem) * d.bc * d.hi * d.wi);
  choose(Variants<Elem>::transpose_tiles, channel_tile_for(d.bc), d.wo)
      .run(static_cast<const Elem*>(gy), static_cast<Elem*>(gx), d, troff, tcol, quot, tvals,
           threads);
}

}  // namespace
}  // namespace tc::disco

extern "C" {

using tc::disco::Dims;
using tc::disco::index_t;

/// y (bc, k, ho, wo) = psi contracted with x (bc, hi, wi), both of `storage` type; psi rows
/// k*ho_n+ho in CSR (roff [k*ho_n + 1], col = hi*wi_n + wi, vals), each row sorted by column.
int tc_disco_contraction(const void* x, void* y, index_t bc, index_t hi, index_t wi, index_t k,
                         index_t ho, index_t wo, const std::int64_t* roff,
                         const std::int64_t* col, const float* vals, index_t nnz, int storage,
                         int threads) {
  using namespace tc::disco;
  const Dims d{bc, hi, wi, k, ho, wo};
  if (check_dims(d) != kOk) return kBadShape;
  if (storage != kFloat32 && storage != kBFloat16 && storage != kFloat16) return kBadStorage;
  if (check_offsets(roff, k * ho, nnz) != kOk) return kBadOffsets;
  threads = resolve_threads(threads);
  std::vector<std::int32_t> line(nnz), quot(nnz);
  if (!decode_forward(col, nnz, d, threads, line.data(), quot.data())) return kEntryOutOfRange;
  if (storage == kFloat32) run_forward<float>(x, y, d, roff, line.data(), quot.data(), vals, threads);
  if (storage == kBFloat16) run_forward<BFloat16>(x, y, d, roff, line.data(), quot.data(), vals, threads);
  if (storage == kFloat16) run_forward<Float16>(x, y, d, roff, line.data(), quot.data(), vals, threads);
  return kOk;
}

/// gx (bc, hi, wi) = the adjoint of tc_disco_contraction applied to gy (bc, k, ho, wo), both
/// of `storage` type, with psi transposed: rows hi*s + p (s = wi / wo),
/// col = (k*ho_n + ho)*wo_n + q, vals.
int tc_disco_transpose_contraction(const void* gy, void* gx, index_t bc, index_t hi, index_t wi,
                                   index_t k, index_t ho, index_t wo, const std::int64_t* troff,
                                   const std::int64_t* tcol, const float* tvals, index_t nnz,
                                   int storage, int threads) {
  using namespace tc::disco;
  const Dims d{bc, hi, wi, k, ho, wo};
  if (check_dims(d) != kOk) return kBadShape;
  if (storage != kFloat32 && storage != kBFloat16 && storage != kFloat16) return kBadStorage;
  if (check_offsets(troff, hi * d.stride(), nnz) != kOk) return kBadOffsets;
  threads = resolve_threads(threads);
  std::vector<std::int32_t> quot(nnz);
  if (!decode_transpose(tcol, nnz, d, threads, quot.data())) return kEntryOutOfRange;
  if (storage == kFloat32) run_transpose<float>(gy, gx, d, troff, tcol, quot.data(), tvals, threads);
  if (storage == kBFloat16) run_transpose<BFloat16>(gy, gx, d, troff, tcol, quot.data(), tvals, threads);
  if (storage == kFloat16) run_transpose<Float16>(gy, gx, d, troff, tcol, quot.data(), tvals, threads);
  return kOk;
}

/// Output longitudes per forward tile for this Wo (for benchmarks and tests).
int tc_disco_forward_tile_width(index_t wo) {
  using namespace tc::disco;
  return choose(Variants<float>::forward_tiles, 1, wo).vectors * kLanes;
}

/// (channels << 16) | longitudes of the transpose's tile for bc channels and this Wo.
int tc_disco_transpose_tile(index_t bc, index_t wo) {
  using namespace tc::disco;
  const auto& variant = choose(Variants<float>::transpose_tiles, channel_tile_for(bc), wo);
  return (variant.channels << 16) | (variant.vectors * kLanes);
}

}  // extern "C"
