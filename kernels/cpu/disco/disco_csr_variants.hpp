// The register tiles the CPU DISCO library instantiates, per direction and ISA: the one C++
// table of them. The runtime (disco_csr.cpp) picks from it per call or runs a named entry; the
// benchmark harness (disco_bench.cpp) refuses to compile a tile missing here, so every
// benchmarked candidate is one the runtime can run. tilecast/families/disco.py holds the same
// rows (TILES), and tests/test_disco_family.py checks the two agree (tc_disco_variant_tiles).
#pragma once

#include <cstddef>
#include <cstdint>

#include "disco_csr_forward.hpp"
#include "disco_csr_transpose.hpp"

namespace tc::disco {

template <typename Elem>
using ForwardFn = void (*)(const Elem*, Elem*, const Dims&, const std::int64_t*,
                           const std::int32_t*, const std::int32_t*, const float*, int, index_t);
template <typename Elem>
using TransposeFn = void (*)(const Elem*, Elem*, const Dims&, const std::int64_t*,
                             const std::int64_t*, const std::int32_t*, const float*, int, index_t);

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
// In an unnamed namespace: a class template's static table is otherwise one symbol in the
// whole process (STB_GNU_UNIQUE), so a process that loads two builds of this library (an
// A/B benchmark) would run the first build's kernels through both.
namespace {
template <typename Elem>
struct Variants {
#ifdef __AVX512F__
  static constexpr Variant<ForwardFn<Elem>> forward_tiles[] = {
      {1, 8, forward_blocked<8, Elem>}, {1, 6, forward_blocked<6, Elem>},
      {1, 5, forward_blocked<5, Elem>}, {1, 4, forward_blocked<4, Elem>}};
  static constexpr Variant<TransposeFn<Elem>> transpose_tiles[] = {
      {8, 2, transpose_blocked<8, 2, Elem>}, {8, 1, transpose_blocked<8, 1, Elem>},
      {4, 4, transpose_blocked<4, 4, Elem>}, {4, 3, transpose_blocked<4, 3, Elem>},
      {4, 2, transpose_blocked<4, 2, Elem>}, {1, 8, transpose_blocked<1, 8, Elem>},
      {1, 6, transpose_blocked<1, 6, Elem>}, {1, 5, transpose_blocked<1, 5, Elem>},
      {1, 4, transpose_blocked<1, 4, Elem>}};
#else
  static constexpr Variant<ForwardFn<Elem>> forward_tiles[] = {
      {1, 12, forward_blocked<12, Elem>}, {1, 10, forward_blocked<10, Elem>},
      {1, 8, forward_blocked<8, Elem>}, {1, 6, forward_blocked<6, Elem>}};
  static constexpr Variant<TransposeFn<Elem>> transpose_tiles[] = {
      {8, 1, transpose_blocked<8, 1, Elem>}, {4, 3, transpose_blocked<4, 3, Elem>},
      {4, 2, transpose_blocked<4, 2, Elem>}, {1, 12, transpose_blocked<1, 12, Elem>},
      {1, 10, transpose_blocked<1, 10, Elem>}, {1, 8, transpose_blocked<1, 8, Elem>},
      {1, 6, transpose_blocked<1, 6, Elem>}};
#endif
};
}  // namespace

/// Whether the table holds the tile (channels, vectors): usable in a static_assert.
template <typename Fn, std::size_t N>
constexpr bool has_tile(const Variant<Fn> (&variants)[N], int channels, int vectors) {
  for (std::size_t i = 0; i < N; ++i)
    if (variants[i].channels == channels && variants[i].vectors == vectors) return true;
  return false;
}

/// The variant with tile (channels, vectors), or nullptr when the table has none.
template <typename Fn, std::size_t N>
const Variant<Fn>* find_tile(const Variant<Fn> (&variants)[N], int channels, int vectors) {
  for (const Variant<Fn>& variant : variants)
    if (variant.channels == channels && variant.vectors == vectors) return &variant;
  return nullptr;
}

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

/// The transpose's channel tile (BC_TILE): 8 channels per work item if there are 8, else 4,
/// else 1 (the seed's rule). On AVX2 a 1 x 10 tile ran full-size float32 problems faster
/// than 8 x 1, but 8 x 1 ran the same problems at a quarter of the size (where wide tiles
/// wrap often) faster, and 16-bit storage (whose wrapped slices go through a copy) much
/// faster; a published selector picks per problem (tilecast.disco.selector).
inline int channel_tile_for(index_t bc) { return bc >= 8 ? 8 : bc >= 4 ? 4 : 1; }

}  // namespace tc::disco
