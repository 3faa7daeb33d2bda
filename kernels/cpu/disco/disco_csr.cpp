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
// tiles), disco_csr_forward.hpp / disco_csr_transpose.hpp (the loops around them),
// disco_csr_decode.hpp (checks, entry decoding), disco_csr_variants.hpp (the table of
// instantiated tiles), this file (the entry points). The *_variant entries run a named tile
// and latitude block (what tilecast's disco families benchmark; tilecast.disco.selector
// picks one), the others choose per call.
//
// Return value: 0 ok, else a Status; nothing is written past the outputs on error.
#include <cstdint>
#include <vector>

#include "disco_csr_decode.hpp"
#include "disco_csr_variants.hpp"
#include "disco_lines_transpose.hpp"

namespace tc::disco {
namespace {

bool valid_storage(int storage) {
  return storage == kFloat32 || storage == kBFloat16 || storage == kFloat16;
}

template <typename Elem>
void run_forward(const Variant<ForwardFn<Elem>>& variant, index_t lat_block, const void* x,
                 void* y, const Dims& d, const std::int64_t* roff, const std::int32_t* line,
                 const std::int32_t* quot, const float* vals, int threads) {
  advise_huge_pages(y, sizeof(Elem) * d.bc * d.k * d.ho * d.wo);
  variant.run(static_cast<const Elem*>(x), static_cast<Elem*>(y), d, roff, line, quot, vals,
              threads, lat_block);
}

template <typename Elem>
void run_transpose(const Variant<TransposeFn<Elem>>& variant, index_t lat_block, const void* gy,
                   void* gx, const Dims& d, const std::int64_t* troff, const std::int64_t* tcol,
                   const std::int32_t* quot, const float* tvals, int threads) {
  advise_huge_pages(gx, sizeof(Elem) * d.bc * d.hi * d.wi);
  variant.run(static_cast<const Elem*>(gy), static_cast<Elem*>(gx), d, troff, tcol, quot, tvals,
              threads, lat_block);
}

/// The forward tile for one storage type: (1, nv), or the per-call choice when nv == 0.
template <typename Elem>
const Variant<ForwardFn<Elem>>* forward_tile(int nv, index_t wo) {
  return nv == 0 ? &choose(Variants<Elem>::forward_tiles, 1, wo)
                 : find_tile(Variants<Elem>::forward_tiles, 1, nv);
}

/// The transpose tile for one storage type: (bt, nv), or the per-call choice when bt == 0.
template <typename Elem>
const Variant<TransposeFn<Elem>>* transpose_tile(int bt, int nv, index_t bc, index_t wo) {
  return bt == 0 ? &choose(Variants<Elem>::transpose_tiles, channel_tile_for(bc), wo)
                 : find_tile(Variants<Elem>::transpose_tiles, bt, nv);
}

template <typename Elem>
int forward_entry(const void* x, void* y, const Dims& d, const std::int64_t* roff,
                  const std::int32_t* line, const std::int32_t* quot, const float* vals,
                  int threads, int nv, index_t lat_block) {
  const auto* variant = forward_tile<Elem>(nv, d.wo);
  if (variant == nullptr) return kBadVariant;
  run_forward<Elem>(*variant, lat_block, x, y, d, roff, line, quot, vals, threads);
  return kOk;
}

template <typename Elem>
int transpose_entry(const void* gy, void* gx, const Dims& d, const std::int64_t* troff,
                    const std::int64_t* tcol, const std::int32_t* quot, const float* tvals,
                    int threads, int bt, int nv, index_t lat_block) {
  const auto* variant = transpose_tile<Elem>(bt, nv, d.bc, d.wo);
  if (variant == nullptr) return kBadVariant;
  run_transpose<Elem>(*variant, lat_block, gy, gx, d, troff, tcol, quot, tvals, threads);
  return kOk;
}

/// The forward contraction with tile nv (0: chosen per call) and lat_block output latitudes
/// per work item.
int contraction(const void* x, void* y, const Dims& d, const std::int64_t* roff,
                const std::int64_t* col, const float* vals, index_t nnz, int storage,
                int threads, int nv, index_t lat_block) {
  if (check_dims(d) != kOk) return kBadShape;
  if (!valid_storage(storage)) return kBadStorage;
  if (lat_block < 1 || forward_tile<float>(nv, d.wo) == nullptr) return kBadVariant;
  if (check_offsets(roff, d.k * d.ho, nnz) != kOk) return kBadOffsets;
  threads = resolve_threads(threads);
  std::vector<std::int32_t> line(nnz), quot(nnz);
  if (!decode_forward(col, nnz, d, threads, line.data(), quot.data())) return kEntryOutOfRange;
  const std::int32_t* l = line.data();
  const std::int32_t* q = quot.data();
  if (storage == kBFloat16) return forward_entry<BFloat16>(x, y, d, roff, l, q, vals, threads, nv, lat_block);
  if (storage == kFloat16) return forward_entry<Float16>(x, y, d, roff, l, q, vals, threads, nv, lat_block);
  return forward_entry<float>(x, y, d, roff, l, q, vals, threads, nv, lat_block);
}

/// The transpose contraction with tile (bt, nv) (bt = 0: chosen per call) and lat_block
/// input latitudes per work item.
int transpose_contraction(const void* gy, void* gx, const Dims& d, const std::int64_t* troff,
                          const std::int64_t* tcol, const float* tvals, index_t nnz, int storage,
                          int threads, int bt, int nv, index_t lat_block) {
  if (check_dims(d) != kOk) return kBadShape;
  if (!valid_storage(storage)) return kBadStorage;
  if (lat_block < 1 || transpose_tile<float>(bt, nv, d.bc, d.wo) == nullptr) return kBadVariant;
  if (check_offsets(troff, d.hi * d.stride(), nnz) != kOk) return kBadOffsets;
  threads = resolve_threads(threads);
  std::vector<std::int32_t> quot(nnz);
  if (!decode_transpose(tcol, nnz, d, threads, quot.data())) return kEntryOutOfRange;
  const std::int32_t* q = quot.data();
  if (storage == kBFloat16)
    return transpose_entry<BFloat16>(gy, gx, d, troff, tcol, q, tvals, threads, bt, nv, lat_block);
  if (storage == kFloat16)
    return transpose_entry<Float16>(gy, gx, d, troff, tcol, q, tvals, threads, bt, nv, lat_block);
  return transpose_entry<float>(gy, gx, d, troff, tcol, q, tvals, threads, bt, nv, lat_block);
}

template <typename Elem>
void run_lines(const void* gy, void* gx, const Dims& d, const std::int64_t* boff,
               const std::int64_t* bcol, const float* bvals, int threads) {
  advise_huge_pages(gx, sizeof(Elem) * d.bc * d.hi * d.wi);
  transpose_lines(static_cast<const Elem*>(gy), static_cast<Elem*>(gx), d, boff, bcol, bvals,
                  threads);
}

/// The line-blocked transpose (disco_lines_transpose.hpp): boff over the blocks of
/// kLineBlock input lines must start at 0, never decrease and end at keys; every bcol must
/// address gy.
int transpose_lines_contraction(const void* gy, void* gx, const Dims& d,
                                const std::int64_t* boff, const std::int64_t* bcol,
                                const float* bvals, index_t keys, int storage, int threads) {
  if (check_dims(d) != kOk) return kBadShape;
  if (!valid_storage(storage)) return kBadStorage;
  if (check_offsets(boff, ceil_div(d.hi * d.stride(), kLineBlock), keys) != kOk)
    return kBadOffsets;
  const index_t columns = d.k * d.ho * d.wo;
  for (index_t e = 0; e < keys; ++e)
    if (bcol[e] < 0 || bcol[e] >= columns) return kEntryOutOfRange;
  threads = resolve_threads(threads);
  if (storage == kBFloat16) run_lines<BFloat16>(gy, gx, d, boff, bcol, bvals, threads);
  else if (storage == kFloat16) run_lines<Float16>(gy, gx, d, boff, bcol, bvals, threads);
  else run_lines<float>(gy, gx, d, boff, bcol, bvals, threads);
  return kOk;
}

/// Copies a tile table's (BT, NV) pairs into bt / nv (at most capacity); returns its length.
template <typename Fn, std::size_t N>
int list_tiles(const Variant<Fn> (&variants)[N], int* bt, int* nv, int capacity) {
  for (std::size_t i = 0; i < N && static_cast<int>(i) < capacity; ++i)
    bt[i] = variants[i].channels, nv[i] = variants[i].vectors;
  return static_cast<int>(N);
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
  return tc::disco::contraction(x, y, Dims{bc, hi, wi, k, ho, wo}, roff, col, vals, nnz, storage,
                                threads, 0, tc::disco::kForwardBlock);
}

/// tc_disco_contraction with the register tile (1, nv) and lat_block output latitudes per
/// work item; kBadVariant (5) when the library has no such tile or lat_block < 1.
int tc_disco_contraction_variant(const void* x, void* y, index_t bc, index_t hi, index_t wi,
                                 index_t k, index_t ho, index_t wo, const std::int64_t* roff,
                                 const std::int64_t* col, const float* vals, index_t nnz,
                                 int storage, int threads, int nv, index_t lat_block) {
  if (nv < 1) return tc::disco::kBadVariant;
  return tc::disco::contraction(x, y, Dims{bc, hi, wi, k, ho, wo}, roff, col, vals, nnz, storage,
                                threads, nv, lat_block);
}

/// gx (bc, hi, wi) = the adjoint of tc_disco_contraction applied to gy (bc, k, ho, wo), both
/// of `storage` type, with psi transposed: rows hi*s + p (s = wi / wo),
/// col = (k*ho_n + ho)*wo_n + q, vals.
int tc_disco_transpose_contraction(const void* gy, void* gx, index_t bc, index_t hi, index_t wi,
                                   index_t k, index_t ho, index_t wo, const std::int64_t* troff,
                                   const std::int64_t* tcol, const float* tvals, index_t nnz,
                                   int storage, int threads) {
  return tc::disco::transpose_contraction(gy, gx, Dims{bc, hi, wi, k, ho, wo}, troff, tcol, tvals,
                                          nnz, storage, threads, 0, 0, tc::disco::kTransposeBlock);
}

/// tc_disco_transpose_contraction with the register tile (bt, nv) and lat_block input
/// latitudes per work item; kBadVariant (5) when the library has no such tile or lat_block < 1.
int tc_disco_transpose_contraction_variant(const void* gy, void* gx, index_t bc, index_t hi,
                                           index_t wi, index_t k, index_t ho, index_t wo,
                                           const std::int64_t* troff, const std::int64_t* tcol,
                                           const float* tvals, index_t nnz, int storage,
                                           int threads, int bt, int nv, index_t lat_block) {
  if (bt < 1 || nv < 1) return tc::disco::kBadVariant;
  return tc::disco::transpose_contraction(gy, gx, Dims{bc, hi, wi, k, ho, wo}, troff, tcol, tvals,
                                          nnz, storage, threads, bt, nv, lat_block);
}

/// gx (bc, hi, wi) = tc_disco_transpose_contraction's result, computed from psi's transpose
/// regrouped by blocks of tc_disco_line_block() input lines (boff [blocks + 1], bcol
/// [keys] = (k*ho_n + ho)*wo_n + q, bvals [keys, line block]; tilecast/disco/lines.py).
int tc_disco_transpose_lines(const void* gy, void* gx, index_t bc, index_t hi, index_t wi,
                             index_t k, index_t ho, index_t wo, const std::int64_t* boff,
                             const std::int64_t* bcol, const float* bvals, index_t keys,
                             int storage, int threads) {
  return tc::disco::transpose_lines_contraction(gy, gx, Dims{bc, hi, wi, k, ho, wo}, boff, bcol,
                                                bvals, keys, storage, threads);
}

/// Input lines per block of the line-blocked layout.
int tc_disco_line_block() { return tc::disco::kLineBlock; }

/// The (BT, NV) tiles instantiated for direction 0 (forward) or 1 (transpose), in table
/// order, copied into bt / nv up to capacity; returns the table's length (-1: bad direction).
int tc_disco_variant_tiles(int direction, int* bt, int* nv, int capacity) {
  using namespace tc::disco;
  if (direction == 0) return list_tiles(Variants<float>::forward_tiles, bt, nv, capacity);
  if (direction == 1) return list_tiles(Variants<float>::transpose_tiles, bt, nv, capacity);
  return -1;
}

/// Vector lanes (float32) of the ISA the library was compiled for: 16 AVX-512, 8 AVX2.
int tc_disco_lanes() { return tc::disco::kLanes; }

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
