// The problem a DISCO kernel call solves: BC channels of Hi x Wi input longitudes and K
// basis functions at Ho x Wo output points (Wi a multiple of Wo).
#pragma once

#include "disco_csr_simd.hpp"

namespace tc::disco {

struct Dims {
  index_t bc, hi, wi, k, ho, wo;
  index_t stride() const { return wi / wo; }
};

inline index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }

}  // namespace tc::disco
