// Compile-time parameters of the GEMM variant, validated once, here.
//
// Each variant is one binary built with -D macros; an invalid combination
// must fail at compile time (the tuner records it as a build failure) rather
// than produce a binary that silently computes garbage.
//
//   TC_DTYPE     0 fp32 inputs, 1 bf16 inputs (raw uint16 bits), fp32 accumulation
//   TC_ISA       0 AVX2 (8-float ymm, 16 regs), 1 AVX-512 (16-float zmm, 32 regs)
//   TC_MR TC_NR  register micro-tile; NR % vector width == 0 and the tile's
//                accumulators + NR/width B vectors + 1 A broadcast fit the registers
//   TC_MC TC_NC TC_KC  cache blocks; MC % MR == 0, NC % NR == 0
//   TC_PACK_A    1 pack A into MR-row micro-panels, 0 read A in place (fp32 only)
//   TC_PAR       0 "m", 1 "n", 2 "k" (split-K) OpenMP scheme
//   TC_PREFETCH  0/1 software prefetch in the micro-kernel
#pragma once

#include <cstdint>
#include <vector>

#include "gemm_simd.hpp"
#include "../common/harness.hpp"

#ifdef TC_SKINNY_UNIT
// gemm_skinny.cpp, the GEMV-class path shared by the variants of one dtype, ISA, scheme and
// prefetch: it is given those four alone, and the tile and cache-block constants below do not
// exist in it, so no code it compiles can depend on them
#if !defined(TC_DTYPE) || !defined(TC_ISA) || !defined(TC_PAR) || !defined(TC_PREFETCH)
#error "missing -D parameter: the GEMV-class unit needs TC_DTYPE TC_ISA TC_PAR TC_PREFETCH"
#endif
#elif !defined(TC_DTYPE) || !defined(TC_ISA) || !defined(TC_MR) || !defined(TC_NR) ||  \
    !defined(TC_MC) || !defined(TC_NC) || !defined(TC_KC) || !defined(TC_PACK_A) || \
    !defined(TC_PAR) || !defined(TC_PREFETCH)
#error "missing -D parameter: all of TC_DTYPE TC_ISA TC_MR TC_NR TC_MC TC_NC TC_KC TC_PACK_A TC_PAR TC_PREFETCH are required"
#endif

#if TC_DTYPE != 0 && TC_DTYPE != 1
#error "TC_DTYPE must be 0 (fp32) or 1 (bf16)"
#endif
#if TC_ISA != 0 && TC_ISA != 1
#error "TC_ISA must be 0 (AVX2) or 1 (AVX-512)"
#endif
#if TC_ISA == 1 && !defined(__AVX512F__)
#error "TC_ISA=1 needs AVX-512F: compile with -march=native on an AVX-512 machine"
#endif
#if TC_ISA == 0 && (!defined(__AVX2__) || !defined(__FMA__))
#error "TC_ISA=0 needs AVX2 and FMA: compile with -march=native (or -mavx2 -mfma)"
#endif
#ifndef TC_SKINNY_UNIT  // the tile's parameters
#if TC_PACK_A != 0 && TC_PACK_A != 1
#error "TC_PACK_A must be 0 or 1"
#endif
#if TC_DTYPE == 1 && TC_PACK_A == 0
#error "TC_DTYPE=1 (bf16) is repacked (widened to fp32, or paired for vdpbf16ps), so it needs TC_PACK_A=1"
#endif
#endif  // TC_SKINNY_UNIT
#if TC_PAR != 0 && TC_PAR != 1 && TC_PAR != 2
#error "TC_PAR must be 0 (m), 1 (n) or 2 (k, split-K)"
#endif
#if TC_PREFETCH != 0 && TC_PREFETCH != 1
#error "TC_PREFETCH must be 0 or 1"
#endif

// Vector width in floats and architectural vector registers per ISA.
#if TC_ISA == 1
#define TC_VEC_WIDTH 16
#define TC_VEC_REGS 32
#else
#define TC_VEC_WIDTH 8
#define TC_VEC_REGS 16
#endif

#ifndef TC_SKINNY_UNIT  // the tile's parameters
#if TC_MR < 1 || TC_NR < 1
#error "TC_MR and TC_NR must be positive"
#endif
#if TC_NR % TC_VEC_WIDTH != 0
#error "TC_NR must be a multiple of the vector width (8 for TC_ISA=0, 16 for TC_ISA=1)"
#endif
// Accumulators + one row of B vectors + one A broadcast must fit, otherwise
// the micro-kernel spills accumulators and runs at a fraction of peak.
#if TC_MR * (TC_NR / TC_VEC_WIDTH) + TC_NR / TC_VEC_WIDTH + 1 > TC_VEC_REGS
#error "micro-tile too large: need MR*(NR/width) + NR/width + 1 <= vector registers (16 AVX2, 32 AVX-512)"
#endif
#if TC_MC < 1 || TC_NC < 1 || TC_KC < 1
#error "TC_MC, TC_NC and TC_KC must be positive"
#endif
#if TC_MC % TC_MR != 0
#error "TC_MC must be a multiple of TC_MR"
#endif
#if TC_NC % TC_NR != 0
#error "TC_NC must be a multiple of TC_NR"
#endif
#endif  // TC_SKINNY_UNIT

namespace tc::gemm {

using index_t = std::ptrdiff_t;

/// Element type stored in the A/B files: fp32, or bf16 as raw bits.
#if TC_DTYPE == 1
using InputT = std::uint16_t;
#else
using InputT = float;
#endif

/// The variant's vectors: zmm in an AVX-512 variant, ymm otherwise.
#if TC_ISA == 1
using Vec = VecAvx512;
#else
using Vec = VecAvx2;
#endif

/// bf16 on a CPU with AVX-512 BF16 keeps its operands bf16 in the packed panels, two k
/// steps to a 32-bit word, and the micro-kernel multiplies them with vdpbf16ps; elsewhere
/// bf16 is widened to fp32 while packing (the GEMV-class path, gemm_skinny.hpp, widens its
/// large operand as it loads it and multiplies in fp32 on every CPU).
#if TC_DTYPE == 1 && TC_ISA == 1 && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kBf16Dot = true;
using MicroVec = VecAvx512Bf16Dot;
#else
constexpr bool kBf16Dot = false;
using MicroVec = Vec;
#endif

/// The steps a packed panel holds for a kc-deep block: k pairs for the bf16 dot, else kc.
constexpr index_t packed_steps(index_t kc) { return kBf16Dot ? (kc + 1) / 2 : kc; }

/// The largest M, N or K a job or an in-process call takes: beyond it the int-sized counts
/// of OpenMP loops and the harness's file sizes overflow long before they would fit in memory.
constexpr long long kMaxDim = 1LL << 31;

#ifndef TC_SKINNY_UNIT  // the tile and cache blocks
constexpr int kMR = TC_MR;
constexpr int kNR = TC_NR;
constexpr index_t kMC = TC_MC;
constexpr index_t kNC = TC_NC;
constexpr index_t kKC = TC_KC;
constexpr bool kPackA = TC_PACK_A == 1;
#endif  // TC_SKINNY_UNIT
constexpr int kParScheme = TC_PAR;
constexpr bool kPrefetch = TC_PREFETCH == 1;

#ifndef TC_SKINNY_UNIT
/// The one table `--describe` prints.
inline std::vector<Param> describe_params() {
  return {{"DTYPE", TC_DTYPE}, {"ISA", TC_ISA},         {"MR", TC_MR},
          {"NR", TC_NR},       {"MC", TC_MC},           {"NC", TC_NC},
          {"KC", TC_KC},       {"PACK_A", TC_PACK_A},   {"PAR", TC_PAR},
          {"PREFETCH", TC_PREFETCH}};
}
#endif  // TC_SKINNY_UNIT

}  // namespace tc::gemm
