// Entry points of the kpacked forward contraction (disco_kpacked.hpp): checks, neighbour
// decoding, the (KREG, NV) variant table (disco_kpacked_variants.hpp), extern "C" for ctypes.
// Computes in float32; x and y are stored as float32, bfloat16 or float16 (Storage, as in
// disco_csr.cpp). tc_disco_kpacked_contraction picks the tile per call;
// tc_disco_kpacked_contraction_variant runs a named tile and latitude block (what tilecast's
// disco_forward family benchmarks; tilecast.disco.selector picks one).
// tc_disco_kpacked_mix runs the contraction and the channel mix as one kernel
// (disco_kpacked_mix.hpp), float32 only.
//
// Return value: 0 ok, else a Status (the codes of disco_csr.cpp, plus kBadKPad and
// kBadVariant); nothing is written past the output on error.
#include <omp.h>

#include <cstdint>
#include <vector>

#include "disco_kpacked_mix.hpp"
#include "disco_kpacked_variants.hpp"

namespace tc::disco {
namespace {

enum Status : int {
  kOk = 0, kBadShape = 1, kBadOffsets = 2, kEntryOutOfRange = 3, kBadStorage = 4, kBadKPad = 5,
  kBadVariant = 6   // a (KREG, NV) tile the library lacks, or lat_block < 1
};
enum Storage : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

/// The tile for one storage type: (kreg, nv), or the per-call choice when kreg == 0; nullptr
/// when the table has no such tile.
template <typename Elem>
const PackedVariant<PackedFn<Elem>>* select_packed(int kreg, int nv, index_t k) {
  if (kreg == 0) return choose_packed(PackedVariants<Elem>::tiles, k);
  return find_packed(PackedVariants<Elem>::tiles, kreg, nv);
}

/// offset must start at 0, never decrease and end at nbr.
bool offsets_ok(const std::int64_t* offset, index_t rows, index_t nbr) {
  if (offset[0] != 0 || offset[rows] != nbr) return false;
  for (index_t r = 0; r < rows; ++r)
    if (offset[r + 1] < offset[r]) return false;
  return true;
}

/// The phase lines and quotients of the neighbours of output latitudes [ho_begin, ho_begin +
/// ho_count) only (decode_neighbours; the fused path asks block by block), from neighbour
/// offset[ho_begin] on; false if one lies outside the grid.
struct Decoded {
  std::vector<std::int32_t> line, quot;
};

bool decode_rows(const std::int64_t* offset, const std::int64_t* idx, index_t ho_begin,
                 index_t ho_count, const Dims& d, int threads, Decoded& decoded) {
  const index_t first = offset[ho_begin], last = offset[ho_begin + ho_count];
  decoded.line.resize(last - first);
  decoded.quot.resize(last - first);
  return decode_neighbours(idx, first, last, d, threads, decoded.line.data(), decoded.quot.data());
}

template <typename Elem>
int run(const void* x, void* y, const Dims& d, index_t ho_begin, index_t ho_count, int kpad,
        const std::int64_t* offset, const std::int32_t* line, const std::int32_t* quot,
        const float* vals, int threads, int kreg, int nv, index_t lat_block) {
  const auto* variant = select_packed<Elem>(kreg, nv, d.k);
  if (variant == nullptr) return kreg == 0 ? kBadKPad : kBadVariant;
  advise_huge_pages(y, sizeof(Elem) * d.bc * d.k * ho_count * d.wo);
  variant->run(static_cast<const Elem*>(x), static_cast<Elem*>(y), d, ho_begin, ho_count, offset,
               line, quot, vals, kpad, threads, lat_block);
  return kOk;
}

/// Output latitudes [ho_begin, ho_begin + ho_count) with tile (kreg, nv) (kreg = 0: chosen
/// per call) and lat_block output latitudes per work item.
int contraction(const void* x, void* y, const Dims& d, index_t ho_begin, index_t ho_count,
                const std::int64_t* offset, const std::int64_t* idx, const float* vals,
                index_t nbr, int kpad, int storage, int threads, int kreg, int nv,
                index_t lat_block) {
  const bool positive = d.bc > 0 && d.hi > 0 && d.wi > 0 && d.k > 0 && d.ho > 0 && d.wo > 0;
  if (!positive || d.wi % d.wo != 0 || ho_begin < 0 || ho_count < 1 || ho_begin + ho_count > d.ho)
    return kBadShape;
  if ((kpad != 8 && kpad != 16) || d.k > kpad) return kBadKPad;
  if (storage != kFloat32 && storage != kBFloat16 && storage != kFloat16) return kBadStorage;
  if (kreg != 0 && (lat_block < 1 || select_packed<float>(kreg, nv, d.k) == nullptr))
    return kBadVariant;
  if (!offsets_ok(offset, d.ho, nbr)) return kBadOffsets;
  threads = threads > 0 ? threads : omp_get_max_threads();
  Decoded decoded;
  if (!decode_rows(offset, idx, ho_begin, ho_count, d, threads, decoded)) return kEntryOutOfRange;
  const std::int32_t* l = decoded.line.data();
  const std::int32_t* q = decoded.quot.data();
  if (storage == kFloat32)
    return run<float>(x, y, d, ho_begin, ho_count, kpad, offset, l, q, vals, threads, kreg, nv, lat_block);
  if (storage == kBFloat16)
    return run<BFloat16>(x, y, d, ho_begin, ho_count, kpad, offset, l, q, vals, threads, kreg, nv, lat_block);
  return run<Float16>(x, y, d, ho_begin, ho_count, kpad, offset, l, q, vals, threads, kreg, nv, lat_block);
}

/// The fused contraction and mix: output latitudes [ho_begin, ho_begin + ho_count) of out
/// (batch, m, ho, wo) from x (batch, channels, hi, wi) and w (m, channels * k), all float32.
int kpacked_mix(const float* x, const float* w, float* out, index_t batch, index_t channels,
                const Dims& d, index_t ho_begin, index_t ho_count, index_t m,
                const std::int64_t* offset, const std::int64_t* idx, const float* vals,
                index_t nbr, int kpad, int threads) {
  const bool positive = batch > 0 && channels > 0 && m > 0 && d.hi > 0 && d.wi > 0 && d.k > 0 &&
                        d.ho > 0 && d.wo > 0;
  if (!positive || d.wi % d.wo != 0 || ho_begin < 0 || ho_count < 1 || ho_begin + ho_count > d.ho)
    return kBadShape;
  if ((kpad != 8 && kpad != 16) || d.k > kpad) return kBadKPad;
  if (!offsets_ok(offset, d.ho, nbr)) return kBadOffsets;
  threads = threads > 0 ? threads : omp_get_max_threads();
  Decoded decoded;
  if (!decode_rows(offset, idx, ho_begin, ho_count, d, threads, decoded)) return kEntryOutOfRange;
  advise_huge_pages(out, sizeof(float) * batch * m * d.ho * d.wo);  // the whole of out
  Dims items = d;
  items.bc = batch;
  kpacked_mix_forward(x, w, out, items, ho_begin, ho_count, channels, m, offset,
                      decoded.line.data(), decoded.quot.data(), vals, kpad, threads);
  return kOk;
}

}  // namespace
}  // namespace tc::disco

extern "C" {

using tc::disco::Dims;
using tc::disco::index_t;

/// y (bc, k, ho_count, wo) = output latitudes [ho_begin, ho_begin + ho_count) of psi, in the
/// kpacked layout (offset [ho + 1], idx [nbr, 2] = (lat, lon), vals [nbr, kpad]), contracted
/// with x (bc, hi, wi); x and y of `storage` type. kpad must be 8 or 16 and at least k.
int tc_disco_kpacked_contraction(const void* x, void* y, index_t bc, index_t hi, index_t wi,
                                 index_t k, index_t ho, index_t wo, index_t ho_begin,
                                 index_t ho_count, const std::int64_t* offset,
                                 const std::int64_t* idx, const float* vals, index_t nbr,
                                 int kpad, int storage, int threads) {
  return tc::disco::contraction(x, y, Dims{bc, hi, wi, k, ho, wo}, ho_begin, ho_count, offset,
                                idx, vals, nbr, kpad, storage, threads, 0, 0,
                                tc::disco::kKpackedBlock);
}

/// tc_disco_kpacked_contraction with the register tile (kreg, nv) and lat_block output
/// latitudes per work item (KREG < K runs ceil(K / KREG) passes); kBadVariant (6) when the
/// library has no such tile or lat_block < 1.
int tc_disco_kpacked_contraction_variant(const void* x, void* y, index_t bc, index_t hi,
                                         index_t wi, index_t k, index_t ho, index_t wo,
                                         index_t ho_begin, index_t ho_count,
                                         const std::int64_t* offset, const std::int64_t* idx,
                                         const float* vals, index_t nbr, int kpad, int storage,
                                         int threads, int kreg, int nv, index_t lat_block) {
  if (kreg < 1 || nv < 1) return tc::disco::kBadVariant;
  return tc::disco::contraction(x, y, Dims{bc, hi, wi, k, ho, wo}, ho_begin, ho_count, offset,
                                idx, vals, nbr, kpad, storage, threads, kreg, nv, lat_block);
}

/// The (KREG, NV) tiles instantiated, in table order, copied into kreg / nv up to capacity;
/// returns the table's length.
int tc_disco_kpacked_variant_tiles(int* kreg, int* nv, int capacity) {
  using namespace tc::disco;
  constexpr auto& tiles = PackedVariants<float>::tiles;
  const int count = static_cast<int>(sizeof(tiles) / sizeof(tiles[0]));
  for (int i = 0; i < count && i < capacity; ++i) kreg[i] = tiles[i].kernels, nv[i] = tiles[i].vectors;
  return count;
}

/// (basis functions in registers per pass << 16) | longitudes of the kpacked tile the library
/// runs for k basis functions; 0 if none.
int tc_disco_kpacked_tile(index_t k) {
  using namespace tc::disco;
  const auto* variant = choose_packed(PackedVariants<float>::tiles, k);
  return variant == nullptr ? 0 : (variant->kernels << 16) | (variant->vectors * kLanes);
}

/// Output latitudes [ho_begin, ho_begin + ho_count) of out (batch, m, ho, wo) = the kpacked
/// contraction of x (batch, channels, hi, wi) mixed by w (m, channels * k): DiscoConvS2's
/// forward without bias on one group, float32, in one kernel (disco_kpacked_mix.hpp); the
/// other latitudes of out are not touched.
int tc_disco_kpacked_mix(const float* x, const float* w, float* out, index_t batch,
                         index_t channels, index_t hi, index_t wi, index_t k, index_t ho,
                         index_t wo, index_t ho_begin, index_t ho_count, index_t m,
                         const std::int64_t* offset, const std::int64_t* idx, const float* vals,
                         index_t nbr, int kpad, int threads) {
  return tc::disco::kpacked_mix(x, w, out, batch, channels, Dims{batch * channels, hi, wi, k, ho, wo},
                                ho_begin, ho_count, m, offset, idx, vals, nbr, kpad, threads);
}

}  // extern "C"
