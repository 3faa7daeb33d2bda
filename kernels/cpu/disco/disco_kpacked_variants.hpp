// The (KREG, NV) register tiles of the kpacked forward the CPU DISCO library instantiates, per
// ISA: the one C++ table of them. The runtime (disco_kpacked.cpp) picks from it per call or
// runs a named entry; the benchmark harness (disco_bench.cpp) refuses to compile a tile
// missing here. tilecast/families/disco.py holds the same rows (TILES, variant kpacked), and
// tests/test_disco_family.py checks the two agree (tc_disco_kpacked_variant_tiles).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "disco_kpacked.hpp"

namespace tc::disco {

template <typename Elem>
using PackedFn = void (*)(const Elem*, Elem*, const Dims&, index_t, index_t, const std::int64_t*,
                          const std::int32_t*, const std::int32_t*, const float*, index_t, int,
                          index_t);

/// One instantiation: basis functions held in registers per pass (KREG; K > KREG takes
/// ceil(K / KREG) passes), vectors of output longitudes per tile, entry point.
template <typename Fn>
struct PackedVariant {
  int kernels;
  int vectors;
  Fn run;
};

// KREG x NV accumulators fit the register file beside the NV slices and a broadcast; the
// widest NV for each KREG, so that each loaded slice feeds as many FMAs as fit.
// In an unnamed namespace: a class template's static table is otherwise one symbol in the
// whole process (STB_GNU_UNIQUE), so a process that loads two builds of this library (an
// A/B benchmark) would run the first build's kernels through both.
namespace {
template <typename Elem>
struct PackedVariants {
#ifdef __AVX512F__
  static constexpr PackedVariant<PackedFn<Elem>> tiles[] = {
      {16, 1, kpacked_forward_blocked<16, 1, Elem>}, {12, 2, kpacked_forward_blocked<12, 2, Elem>},
      {9, 3, kpacked_forward_blocked<9, 3, Elem>},   {6, 4, kpacked_forward_blocked<6, 4, Elem>},
      {4, 6, kpacked_forward_blocked<4, 6, Elem>},   {3, 8, kpacked_forward_blocked<3, 8, Elem>},
      {1, 8, kpacked_forward_blocked<1, 8, Elem>}};
#else
  static constexpr PackedVariant<PackedFn<Elem>> tiles[] = {
      {16, 1, kpacked_forward_blocked<16, 1, Elem>}, {12, 1, kpacked_forward_blocked<12, 1, Elem>},
      {6, 2, kpacked_forward_blocked<6, 2, Elem>},   {5, 2, kpacked_forward_blocked<5, 2, Elem>},
      {4, 3, kpacked_forward_blocked<4, 3, Elem>},   {3, 3, kpacked_forward_blocked<3, 3, Elem>},
      {3, 4, kpacked_forward_blocked<3, 4, Elem>},   {1, 8, kpacked_forward_blocked<1, 8, Elem>}};
#endif
};
}  // namespace

/// Whether the table holds the tile (kernels, vectors): usable in a static_assert.
template <typename Fn, std::size_t N>
constexpr bool has_packed(const PackedVariant<Fn> (&variants)[N], int kernels, int vectors) {
  for (std::size_t i = 0; i < N; ++i)
    if (variants[i].kernels == kernels && variants[i].vectors == vectors) return true;
  return false;
}

/// The variant with tile (kernels, vectors), or nullptr when the table has none.
template <typename Fn, std::size_t N>
const PackedVariant<Fn>* find_packed(const PackedVariant<Fn> (&variants)[N], int kernels,
                                     int vectors) {
  for (const PackedVariant<Fn>& variant : variants)
    if (variant.kernels == kernels && variant.vectors == vectors) return &variant;
  return nullptr;
}

/// The tile the library runs for k basis functions when told none: among tiles of at least
/// two vectors (with one, each FMA waits on its own broadcast: 9 x 1 ran well behind 5 x 2
/// on AVX2), the fewest passes over the neighbours,
/// then the fewest idle register rows in the last pass, then the fewest accumulators;
/// nullptr if the table has none (k < 1).
template <typename Fn, std::size_t N>
const PackedVariant<Fn>* choose_packed(const PackedVariant<Fn> (&variants)[N], index_t k) {
  const PackedVariant<Fn>* best = nullptr;
  auto rank = [k](const PackedVariant<Fn>& v) {
    const index_t passes = (k + v.kernels - 1) / v.kernels;
    return std::array<index_t, 3>{passes, passes * v.kernels - k,
                                  static_cast<index_t>(v.kernels) * v.vectors};
  };
  if (k < 1) return nullptr;
  for (const PackedVariant<Fn>& variant : variants)
    if (variant.vectors >= 2 && (best == nullptr || rank(variant) < rank(*best))) best = &variant;
  return best;
}

}  // namespace tc::disco
