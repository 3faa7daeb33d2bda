// Compile-time parameters of one grouped-convolution variant, validated here.
//
// A variant is one binary built with -D macros; an invalid combination fails
// at compile time (the tuner records a build failure) instead of producing a
// binary that computes garbage.
//
//   TC_DIR       0 forward, 1 bwd_data, 2 bwd_weight
//   TC_NDIM      2 or 3 (2 drops the depth loops; the depth of every shape must be trivial)
//   TC_BM TC_BN TC_BK  implicit-GEMM blocks; BM % 8 == 0 (MR = 8), BN % 16 == 0
//                (NR = 32 when BN % 32 == 0, else 16, with AVX-512; 8 with AVX2),
//                1 <= BK <= 4096, BM, BN <= 4096.
//                dw pipeline: BM = output pixels (bwd_weight: taps) per block,
//                BN = groups per block, BK = taps (bwd_weight: pixels) per block.
//   TC_PIPELINE  0 direct, 1 im2col, 2 dw (depthwise: C == K == 1 per group), 3 gemm (one
//                GEMM per group on tilecast's GEMM library, grouped_conv_gemm.hpp: BM, BN, BK
//                are its cache blocks MC, NC, KC; the register tile is the ISA's, 8 x 32 with
//                AVX-512 (8 x 16 when BN % 32 != 0), 6 x 16 with AVX2), 4 winograd
//                (F(2x2, 3x3) for 3x3 stride-1 2D layers, forward and bwd_data, its 16
//                GEMMs on the GEMM library as gemm's: grouped_conv_winograd.hpp), 5 gvec
//                (direct convolution, whole groups side by side in each 16-lane vector when
//                they have few channels, grouped_conv_gvec.hpp; forward and bwd_data: BM =
//                pixels per block, BN = lanes per block, BK = taps per pass; bwd_weight: BN
//                only, as its interwave block)
//   TC_WAVE      0 intra (threads share one group's GEMM), 1 inter (threads take whole
//                (group, image) GEMMs; bwd_weight: whole groups; winograd: whole GEMMs of
//                its 16; dw and gvec: whole (group block, image) units)
//   TC_DSB       1: pack the next im2col block while computing the current one (im2col only)
//   TC_SI        1: split the K_gemm reduction over threads into partial outputs, then reduce
//
// Valid (pipeline, wave, dsb, si): direct {dsb 0} x wave x si (4), im2col all 8,
// dw {dsb 0, si 0} x wave (2), gemm {intra, dsb 0} x si and {inter, dsb 0, si 0} (3),
// winograd {dsb 0, si 0} x wave (2), gvec {dsb 0, si 0} x wave (2): 21 in all. The Python family holds the same table.
#pragma once

#include <cstddef>
#include <vector>

#include "../common/harness.hpp"

#if !defined(TC_DIR) || !defined(TC_NDIM) || !defined(TC_BM) || !defined(TC_BN) || \
    !defined(TC_BK) || !defined(TC_PIPELINE) || !defined(TC_WAVE) || !defined(TC_DSB) || \
    !defined(TC_SI)
#error "missing -D parameter: all of TC_DIR TC_NDIM TC_BM TC_BN TC_BK TC_PIPELINE TC_WAVE TC_DSB TC_SI are required"
#endif

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "grouped_conv needs AVX-512F, or AVX2 with FMA: compile with -march=native"
#endif

#if TC_DIR != 0 && TC_DIR != 1 && TC_DIR != 2
#error "TC_DIR must be 0 (forward), 1 (bwd_data) or 2 (bwd_weight)"
#endif
#if TC_NDIM != 2 && TC_NDIM != 3
#error "TC_NDIM must be 2 or 3"
#endif
#if TC_BM < 8 || TC_BM > 4096 || TC_BM % 8 != 0
#error "TC_BM must be a multiple of 8 (the micro-tile MR) in [8, 4096]"
#endif
#if TC_BN < 16 || TC_BN > 4096 || TC_BN % 16 != 0
#error "TC_BN must be a multiple of 16 (the micro-tile NR) in [16, 4096]"
#endif
#if TC_BK < 1 || TC_BK > 4096
#error "TC_BK must be in [1, 4096]"
#endif
#if TC_PIPELINE < 0 || TC_PIPELINE > 5
#error "TC_PIPELINE must be 0 (direct), 1 (im2col), 2 (dw), 3 (gemm), 4 (winograd) or 5 (gvec)"
#endif
#if TC_WAVE != 0 && TC_WAVE != 1
#error "TC_WAVE must be 0 (intra) or 1 (inter)"
#endif
#if TC_DSB != 0 && TC_DSB != 1
#error "TC_DSB must be 0 or 1"
#endif
#if TC_SI != 0 && TC_SI != 1
#error "TC_SI must be 0 or 1"
#endif
#if TC_DSB == 1 && TC_PIPELINE != 1
#error "TC_DSB=1 packs the next im2col block ahead, so it needs TC_PIPELINE=1 (im2col)"
#endif
#if TC_SI == 1 && TC_PIPELINE == 2
#error "TC_SI=1 is not implemented for TC_PIPELINE=2 (dw); valid dw variants have TC_DSB=0 TC_SI=0"
#endif
#if TC_PIPELINE == 3 && TC_SI == 1 && TC_WAVE == 1
#error "TC_PIPELINE=3 (gemm) with TC_WAVE=1 runs each group's GEMM on one thread: no split-K (TC_SI=1)"
#endif
#if TC_PIPELINE == 4 && TC_SI == 1
#error "TC_SI=1 is not implemented for TC_PIPELINE=4 (winograd)"
#endif
#if TC_PIPELINE == 4 && TC_DIR == 2
#error "TC_PIPELINE=4 (winograd) runs forward and bwd_data only"
#endif
#if TC_PIPELINE == 5 && TC_SI == 1
#error "TC_SI=1 is not implemented for TC_PIPELINE=5 (gvec)"
#endif

// The gemm and winograd pipelines' GEMM parameters (kernels/cpu/gemm/gemm_config.hpp), from this
// variant's.
#if TC_PIPELINE == 3 || TC_PIPELINE == 4
#define TC_DTYPE 0
#ifdef __AVX512F__
#define TC_ISA 1
#define TC_MR 8
#define TC_NR (TC_BN % 32 == 0 ? 32 : 16)
#else
#define TC_ISA 0
#define TC_MR 6
#define TC_NR 16
#endif
#define TC_MC ((TC_BM + TC_MR - 1) / TC_MR * TC_MR)
#define TC_NC TC_BN
#define TC_KC TC_BK
#define TC_PACK_A 1
#define TC_PAR (TC_SI == 1 ? 2 : 0)
#define TC_PREFETCH 1
#endif

namespace tc::gconv {

using index_t = std::ptrdiff_t;

enum Direction { kForward = 0, kBwdData = 1, kBwdWeight = 2 };
enum Pipeline { kDirect = 0, kIm2col = 1, kDw = 2, kGemm = 3, kWinograd = 4, kGvec = 5 };

constexpr int kDir = TC_DIR;
constexpr int kNdim = TC_NDIM;
constexpr index_t kBM = TC_BM;
constexpr index_t kBN = TC_BN;
constexpr index_t kBK = TC_BK;
constexpr int kPipeline = TC_PIPELINE;
constexpr bool kInterWave = TC_WAVE == 1;
constexpr bool kDoubleBuffer = TC_DSB == 1;
constexpr bool kSplitInput = TC_SI == 1;

/// Register micro-tile: MR rows x NR columns of fp32 accumulators: 8 x 2 or 8 x 1 zmm with
/// AVX-512; 8 x 1 ymm with AVX2, whose 16 registers hold the 8 accumulators beside a B vector
/// and a broadcast (8 x 2 would spill).
constexpr int kMR = 8;
#ifdef __AVX512F__
constexpr int kSimdLanes = 16;
constexpr int kNR = TC_BN % 32 == 0 ? 32 : 16;
#else
constexpr int kSimdLanes = 8;
constexpr int kNR = 8;
#endif
constexpr int kNV = kNR / kSimdLanes;
constexpr index_t kPanelsPerBlock = kBN / kNR;

/// The one table `--describe` prints.
inline std::vector<Param> describe_params() {
  return {{"DIR", TC_DIR},           {"NDIM", TC_NDIM}, {"BM", TC_BM},  {"BN", TC_BN},
          {"BK", TC_BK},             {"PIPELINE", TC_PIPELINE}, {"WAVE", TC_WAVE},
          {"DSB", TC_DSB},           {"SI", TC_SI}};
}

}  // namespace tc::gconv
