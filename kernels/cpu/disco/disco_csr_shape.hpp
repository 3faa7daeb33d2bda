// The problem a DISCO kernel call solves: BC channels of Hi x Wi input longitudes and K
// basis functions at Ho x Wo output points (Wi a multiple of Wo).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>

#include "disco_csr_simd.hpp"

namespace tc::disco {

struct Dims {
  index_t bc, hi, wi, k, ho, wo;
  index_t stride() const { return wi / wo; }
};

inline index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }

/// Asks Linux to back an output with 2 MB pages. A fresh output is first touched by the
/// kernel, and faulting it in 4 KB pages took about as long as computing it.
inline void advise_huge_pages(void* data, std::size_t bytes) {
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

}  // namespace tc::disco
