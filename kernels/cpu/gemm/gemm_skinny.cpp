// The GEMV-class path (gemm_skinny.hpp) as a translation unit of its own: compiled once for
// every GEMM variant of one dtype, ISA, parallel scheme and prefetch (-D TC_DTYPE TC_ISA
// TC_PAR TC_PREFETCH, nothing else of a variant) and linked into each such variant's
// executable and in-process library (gemm_variant.cpp; the gemm and winograd grouped-conv
// pipelines' units), which call `run_compiled` of their parameters instead of compiling the
// path themselves. gemm_config.hpp defines no tile or cache-block
// constant here, so nothing this object holds can differ between the variants it serves.
#define TC_SKINNY_UNIT
#include "gemm_skinny.hpp"

namespace tc::gemm::skinny {

template <int Dtype, int Isa, int Par, int Prefetch>
void run_compiled(const Task& given, Scratch& scratch, int threads) {
  run(given, scratch, threads);
}

template void run_compiled<TC_DTYPE, TC_ISA, TC_PAR, TC_PREFETCH>(const Task&, Scratch&, int);

}  // namespace tc::gemm::skinny
