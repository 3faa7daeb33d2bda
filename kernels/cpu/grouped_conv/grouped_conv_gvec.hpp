// The "gvec" pipeline: a direct convolution, all three directions, whose vectors hold whole
// groups when they have few channels (ResNeXt's 4-16, RegNet's 8-16) and a group's channels
// otherwise (stems of 1-3 input channels and the like). bwd_weight reads the input and dout
// as forward reads the input and writes dout (D = K, S = C; see run_weight_grad).
//
// Per group, a layer of D destination channels (forward K, bwd_data C) and S source channels
// (forward C, bwd_data K) is a GEMM with D columns: a 16-lane vector would hold 4 of them at
// D = 4 and the per-group GEMM wastes the rest, which is why the gemm and direct pipelines
// run such layers at 5-15 % of the machine. When D divides 16, one 16-lane row (a zmm, or two
// ymm) holds Gv = 16 / D whole groups, lanes in channel-major order (lane = d * Gv + gi), so
//
//   dst[m, gi, d] += src[source(m, t), gi, s] * w[gi, d, t, s]
//
// needs, for each (tap, source channel), one weight row and, per pixel, the Gv source values
// of its groups repeated D times: a broadcast of Gv consecutive floats (a 128-bit broadcast at
// Gv = 4), once the source is laid out [pixel][group block][s][gi]. Otherwise (Gv = 1) a pixel
// has NV = ceil(D / 16) rows (up to kMaxNV, more in further column blocks) of one group's
// channels, the last masked, and each broadcast source value feeds all NV rows.
//
// The source layout is a copy taken each call, into a zero-padded image where a destination
// pixel's source under each tap is its pixel's offset plus the tap's. bwd_data at a stride
// goes in phases of destination pixels that share their taps (GroupVectorConv::Phase), so no
// tap it runs reads between dout's pixels. Weights are packed each call to [column
// block][tap][s][lane]; with Gv > 1 lanes go back to [gi][d] order when the tile is stored.
//
// Tile: MR destination pixels x NV 16-lane rows, reduced over (tap, source channel), source
// channels SB at a time with their weight rows in registers. Blocks: BM pixels x BN / (16 NV)
// column blocks, BK taps per pass. Waves as in the dw pipeline: intra splits each block's
// pixel blocks among the threads, inter deals out whole (column block, image) units.
//
// In place (in_place_block): depthwise (16 groups a row) reads the source where it lies
// (bwd_data at a stride a phase at a time, din's lines in order so the dout rows they read
// stay in cache: 2.6-3x at stride 2), and on AVX2 builds one group's channels a row (Gv = 1,
// one phase) reads a copy padded only along w. A destination line runs only the taps whose
// (d, h) source row is inside the image, its pixels in tiles along w (6-7 on AVX2, 14 on
// AVX-512), each tile one row of 16 lanes: a depthwise source vector, or a broadcast of one
// source channel, against the tap's weight row. No relayout, no tap over a padding row, no
// per-pixel pointers (depthwise 112x112 2.2x, a 7x7 stem 2.1x, dense 3x3 at C = K = 64 2.7x
// the tiles above, on the AVX2 EPYC).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "grouped_conv_lanes.hpp"
#include "grouped_conv_microkernel.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

namespace gvec {

constexpr int kRowLanes = 16;

/// Sixteen lanes: one zmm, or two ymm with AVX2.
#ifdef __AVX512F__
// A tile's pixels: 2 x 8 accumulators + up to 4 weight rows + a broadcast, and the rows'
// pointers stay in registers (12 pixels measured 0.89-1.0x).
constexpr int kMR = 8;
// Source channels a step: 4, or 1 when they do not divide by 4 (steps of 8 and 2 measured
// 0.98-1.05x and doubled the build time).
constexpr int kMaxSB = 4;
constexpr int kChains = 2;
constexpr int kMaxNV = 4;
/// Pixels a tile for NV rows a pixel: NV x MR accumulators + NV weight rows + a broadcast fit.
constexpr int rows_for(int nv) { return nv == 4 ? 6 : kMR; }
// Depthwise reads its source in place (see GroupVectorConv::in_place_): pixels a tile, one
// zmm accumulator each, a weight row and a source row (Zen 4 EPYC, against the padded copy:
// 1.67-1.98x forward at stride 1, 2.7-3.3x bwd_data at stride 2; 8 pixels a tile read
// 1.02-1.05x of 14 at 112 and 56 wide but 0.94x at 14, 20 pixels 0.71-0.93x). One group's
// channels a row (Gv = 1) keep the copy: in place, 12 pixels a tile, they read 0.74-0.97x
// (a 7x7 stem 0.74)
constexpr int kDepthwiseRows = 14;
constexpr int kChannelRows = 0;
/// bwd_weight's (tap, channel) pairs a unit: pairs x NV (x 2 pixel chains at NV = 1)
/// accumulators + NV dout rows + a broadcast fit.
constexpr int pairs_for(int nv) { return nv == 1 ? 8 : nv == 2 ? 6 : 4; }
struct Row {
  __m512 v;
  /// Lanes [0, n) (all when n >= 16) to p, added to what is there when `accumulate`.
  TC_INLINE void store_first(float* p, index_t n, bool accumulate) const {
    const __mmask16 mask = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __m512 value = accumulate ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p)) : v;
    _mm512_mask_storeu_ps(p, mask, value);
  }
  TC_INLINE void add(Row other) { v = _mm512_add_ps(v, other.v); }
  static TC_INLINE Row zero() { return {_mm512_setzero_ps()}; }
  static TC_INLINE Row load(const float* p) { return {_mm512_loadu_ps(p)}; }
  /// Lanes [0, n) from p (all when n >= 16), zeros past them; nothing past them is read.
  static TC_INLINE Row load_first(const float* p, index_t n) {
    return {_mm512_maskz_loadu_ps(n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1), p)};
  }
  TC_INLINE void fma(Row a, Row b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  TC_INLINE void store(float* p) const { _mm512_storeu_ps(p, v); }
  /// Gv consecutive floats at p, repeated over the 16 lanes.
  template <int Gv>
  static TC_INLINE Row broadcast(const float* p) {
    if constexpr (Gv == 16) return {_mm512_loadu_ps(p)};
    else if constexpr (Gv == 8) return {_mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(p))))};
    else if constexpr (Gv == 4) return {_mm512_broadcast_f32x4(_mm_loadu_ps(p))};
    else if constexpr (Gv == 2) {
      double pair;
      std::memcpy(&pair, p, sizeof(pair));
      return {_mm512_castpd_ps(_mm512_set1_pd(pair))};
    } else {
      return {_mm512_set1_ps(*p)};
    }
  }
};
#else
constexpr int kMR = 4;      // 4 x 2 accumulators + 2 x 2 weight rows + a broadcast of 16 ymm
constexpr int kMaxSB = 2;
constexpr int kChains = 1;  // 16 ymm hold no second set
constexpr int kMaxNV = 2;
// 6 pixels (12 accumulators) for one source channel a step measured 0.72-0.75x: kMR for all
constexpr int rows_for(int nv) { return nv == 1 ? kMR : 2; }
// Depthwise in place (GroupVectorConv::in_place_): pixels a tile, 2 x 7 accumulators and a
// tap's weight row (2 ymm); 6 measured 0.97-0.99x, 4 0.92-0.94x
constexpr int kDepthwiseRows = 7;
// One group's channels in place (Gv = 1): 6 pixels x 2 ymm accumulators, a
// weight row (2 ymm) and a broadcast of the source
constexpr int kChannelRows = 6;
constexpr int pairs_for(int nv) { return nv == 1 ? 4 : 2; }
struct Row {
  __m256 lo, hi;
  TC_INLINE void store_first(float* p, index_t n, bool accumulate) const {
    if (n >= 16) {
      store_half(p, lo, accumulate);
      store_half(p + 8, hi, accumulate);
      return;
    }
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    store_half_masked(p, lo, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lanes), accumulate);
    store_half_masked(p + 8, hi, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n) - 8), lanes), accumulate);
  }
  static TC_INLINE void store_half(float* p, __m256 v, bool accumulate) {
    _mm256_storeu_ps(p, accumulate ? _mm256_add_ps(v, _mm256_loadu_ps(p)) : v);
  }
  static TC_INLINE void store_half_masked(float* p, __m256 v, __m256i mask, bool accumulate) {
    _mm256_maskstore_ps(p, mask, accumulate ? _mm256_add_ps(v, _mm256_maskload_ps(p, mask)) : v);
  }
  /// Lane j of the result is lane order[j] of this row (order[j] in [0, 16)).
  TC_INLINE Row permuted(const int (&order)[16]) const {
    Row out;
    __m256* halves[2] = {&out.lo, &out.hi};
    for (int half = 0; half < 2; ++half) {
      const __m256i index = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(order + 8 * half));
      const __m256i from_hi = _mm256_cmpgt_epi32(index, _mm256_set1_epi32(7));
      const __m256i within = _mm256_and_si256(index, _mm256_set1_epi32(7));
      *halves[half] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, within),
                                       _mm256_permutevar8x32_ps(hi, within), _mm256_castsi256_ps(from_hi));
    }
    return out;
  }
  TC_INLINE void add(Row other) {
    lo = _mm256_add_ps(lo, other.lo);
    hi = _mm256_add_ps(hi, other.hi);
  }
  static TC_INLINE Row zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static TC_INLINE Row load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  /// Lanes [0, n) from p (all when n >= 16), zeros past them; nothing past them is read.
  static TC_INLINE Row load_first(const float* p, index_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return {_mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lanes)),
            _mm256_maskload_ps(p + 8, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n) - 8), lanes))};
  }
  TC_INLINE void fma(Row a, Row b) {
    lo = _mm256_fmadd_ps(a.lo, b.lo, lo);
    hi = _mm256_fmadd_ps(a.hi, b.hi, hi);
  }
  TC_INLINE void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  template <int Gv>
  static TC_INLINE Row broadcast(const float* p) {
    if constexpr (Gv == 16) {
      return load(p);
    } else {
      __m256 half;
      if constexpr (Gv == 8) half = _mm256_loadu_ps(p);
      else if constexpr (Gv == 4) half = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
      else if constexpr (Gv == 2) half = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p)));
      else half = _mm256_broadcast_ss(p);
      return {half, half};
    }
  }
};
#endif

/// Every accumulator of a tile, [chains][rows][vectors], to zero.
template <int A, int B, int C>
TC_INLINE void zero_all(Row (&acc)[A][B][C]) {
#pragma GCC unroll 2
  for (int a = 0; a < A; ++a)
#pragma GCC unroll 16
    for (int b = 0; b < B; ++b)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[a][b][c] = Row::zero();
}

}  // namespace gvec

/// Forward (Dir 0), bwd_data (Dir 1) or bwd_weight (Dir 2) with whole groups in each vector.
template <int Dir>
class GroupVectorConv {
  using Row = gvec::Row;
  static constexpr int L = gvec::kRowLanes;

  /// Destination pixels that read the source through the same taps at the same offsets:
  /// those at first + step * (d, h, w) for (d, h, w) < dims. One phase, of every pixel and
  /// tap, but for bwd_data at a stride (or padded past its filter): there the pixels with
  /// one residue r modulo the stride along each dim read dout only through the taps f with
  /// r + pad - f dil divisible by the stride, at their index within the phase plus
  /// (r + pad - f dil) / stride. Each phase is a stride-1 problem with no dead taps.
  struct Phase {
    bool whole;  // every destination pixel, in order (first 0, step 1)
    index_t first[3], step[3], dims[3];
    std::vector<index_t> taps;     // indices of the filter's taps (the packed weight's order)
    std::vector<index_t> offsets;  // per tap: floats from the pixel's place in the padded source
    std::vector<index_t> at[3];    // per tap (not whole): dout's coordinate for phase index 0
  };

 public:
  /// `src` is the input (forward, bwd_weight) or dout (bwd_data); `other` the weight,
  /// [G][K][taps][C] (forward, bwd_data), or dout (bwd_weight, which writes the weight's
  /// gradient and reads the input and dout as forward reads the input and writes dout).
  GroupVectorConv(const ConvShape& shape, const float* src, const float* other, int threads)
      : s_(shape), src_(src), weight_(other), threads_(std::max(threads, 1)) {
#ifdef TC_PIXEL_LANES
    // few destination channels at strides 1-2: pixel lanes (grouped_conv_lanes.hpp)
    if (PixelLaneConv<Dir>::applies(s_)) {
      lanes_ = std::make_unique<const PixelLaneConv<Dir>>(s_, src, other, threads_);
      return;
    }
#endif
    const bool fwd = Dir != kBwdData;
    dst_ch_ = fwd ? s_.k : s_.c;
    src_ch_ = fwd ? s_.c : s_.k;
    // D dividing 16: 16 / D groups a row. Otherwise one group's channels, up to kMaxNV rows
    // of them a column block (channel blocks of one group share its broadcasts).
    gv_ = L % dst_ch_ == 0 ? L / dst_ch_ : 1;
    nv_ = gv_ > 1 ? 1 : std::min<index_t>(ceil_div(dst_ch_, L), gvec::kMaxNV);
    channel_blocks_ = gv_ > 1 ? 1 : ceil_div(dst_ch_, nv_ * L);
    group_blocks_ = ceil_div(s_.g, gv_);
    col_blocks_ = group_blocks_ * channel_blocks_;
    for (int dim = 0; dim < 3; ++dim) {
      dst_dims_[dim] = fwd ? s_.out[dim] : s_.in[dim];
      src_dims_[dim] = fwd ? s_.in[dim] : s_.out[dim];
    }
    dst_pixels_ = dst_dims_[0] * dst_dims_[1] * dst_dims_[2];
    src_pixels_ = src_dims_[0] * src_dims_[1] * src_dims_[2];
    src_row_ = group_blocks_ * src_ch_ * gv_;
    // The source is copied into a zero-padded image, where each tap of a destination pixel
    // reads at the pixel's offset plus one offset per tap. Forward (and bwd_weight) pad by
    // pad; bwd_data at stride 1 is the forward convolution of dout with the taps reversed,
    // padded by (filt - 1) * dil - pad. bwd_data otherwise goes in phases (see Phase).
    bool phased = false;
    for (int dim = 0; dim < 3; ++dim) {
      lead_[dim] = fwd ? s_.pad[dim] : (s_.filt[dim] - 1) * s_.dil[dim] - s_.pad[dim];
      phased = phased || (!fwd && (s_.stride[dim] > 1 || lead_[dim] < 0));
    }
    if (!phased) {
      Phase all{true, {0, 0, 0}, {1, 1, 1}, {dst_dims_[0], dst_dims_[1], dst_dims_[2]}, {}, {}, {}};
      for (int dim = 0; dim < 3; ++dim) padded_[dim] = src_dims_[dim] + 2 * lead_[dim];
      for (index_t t = 0; t < s_.taps(); ++t) {
        Pixel f = split_tap(t, s_.filt);
        if (!fwd) f = {0, s_.filt[0] - 1 - f.d, s_.filt[1] - 1 - f.h, s_.filt[2] - 1 - f.w};
        all.offsets.push_back(((f.d * s_.dil[0] * padded_[1] + f.h * s_.dil[1]) * padded_[2] +
                               f.w * s_.dil[2]) * src_row_);
        all.taps.push_back(t);
      }
      phases_.push_back(std::move(all));
    } else {
      plan_phases();
    }
    // Depthwise reads the source in place (see in_place_block), bwd_data at a stride a phase
    // at a time; one group's channels a row at one phase (forward, or bwd_data at stride 1)
    const bool whole = phases_.size() == 1 && phases_.front().whole;
    in_place_ = Dir != kBwdWeight && ((gvec::kDepthwiseRows > 0 && gv_ == L && src_ch_ == 1) ||
                                      (gvec::kChannelRows > 0 && gv_ == 1 && whole));
    if (!in_place_) {
      relaid_ = FloatBuffer(s_.n * padded_[0] * padded_[1] * padded_[2] * src_row_);
    } else {
      // one group's channels a row: a copy of the source padded along w (a cheap copy at
      // these layers' few channels), so every pixel of a line goes in whole tiles (the
      // pixels at its ends alone, with only their taps, held a 3D 7x7x7 stem to 0.8x)
      pad_w_ = gv_ == 1 ? std::max<index_t>(0, lead_[2]) : 0;
      for (index_t t = 0; t < s_.taps(); ++t) {
        Pixel f = split_tap(t, s_.filt);
        if (!fwd) f = {0, s_.filt[0] - 1 - f.d, s_.filt[1] - 1 - f.h, s_.filt[2] - 1 - f.w};
        const index_t fs[3] = {f.d, f.h, f.w};
        for (int dim = 0; dim < 3; ++dim)
          tap_at_[dim].push_back(fs[dim] * s_.dil[dim] - lead_[dim] + (dim == 2 ? pad_w_ : 0));
      }
      if (gv_ == 1) {
        const index_t reach = (dst_dims_[2] - 1) * s_.stride[2] + (s_.filt[2] - 1) * s_.dil[2] - lead_[2];
        width_ = pad_w_ + src_dims_[2] + std::max<index_t>(0, reach - (src_dims_[2] - 1));
        padded_w_ = FloatBuffer(s_.n * src_dims_[0] * src_dims_[1] * width_ * s_.g * src_ch_);
      }
    }
    // forward, bwd_data: the packed weight; bwd_weight: dout, [pixel][column block][lane]
    packed_ = FloatBuffer(Dir == kBwdWeight ? s_.n * dst_pixels_ * col_blocks_ * nv_ * L
                                            : col_blocks_ * s_.taps() * src_ch_ * nv_ * L);
    sb_ = nv_ == 1 && src_ch_ % gvec::kMaxSB == 0 ? gvec::kMaxSB : 1;
    // each lane of each column block: its (group, destination channel)'s offset in a
    // destination pixel, -1 past G or D
    const index_t lanes = nv_ * L;
    for (index_t cb = 0; cb < col_blocks_; ++cb)
      for (index_t lane = 0; lane < lanes; ++lane) {
        const index_t g = gv_ > 1 ? cb * gv_ + lane % gv_ : cb / channel_blocks_;
        const index_t d = gv_ > 1 ? lane / gv_ : cb % channel_blocks_ * lanes + lane;
        lane_channel_.push_back(g < s_.g && d < dst_ch_ ? g * dst_ch_ + d : -1);
      }
  }

  void run(float* out) const {
#ifdef TC_PIXEL_LANES
    if (lanes_) return lanes_->run(out);
#endif
    switch (gv_) {
      case 16: return dispatch_sb<16>(out);
      case 8: return dispatch_sb<8>(out);
      case 4: return dispatch_sb<4>(out);
      case 2: return dispatch_sb<2>(out);
      default: break;
    }
    switch (nv_) {
      case 4: if constexpr (gvec::kMaxNV >= 4) return run_with<1, 1, 4>(out); [[fallthrough]];
      case 3: if constexpr (gvec::kMaxNV >= 3) return run_with<1, 1, 3>(out); [[fallthrough]];
      case 2: return run_with<1, 1, 2>(out);
      default: return dispatch_sb<1>(out);
    }
  }

 private:
  template <int Gv>
  void dispatch_sb(float* out) const {
    if (Dir != kBwdWeight && sb_ == gvec::kMaxSB) return run_with<Gv, gvec::kMaxSB, 1>(out);
    return run_with<Gv, 1, 1>(out);
  }

  template <int Gv, int SB, int NV>
  void run_with(float* out) const {
    if constexpr (Dir == kBwdWeight) {
      return run_weight_grad<Gv, NV>(out);
    } else {
      return run_gather<Gv, SB, NV>(out);
    }
  }

  template <int Gv, int SB, int NV>
  void run_gather(float* out) const {
    constexpr int MR = gvec::rows_for(NV);
    const index_t per_block = std::max<index_t>(1, kBN / (NV * L));
    const index_t blocks = ceil_div(col_blocks_, per_block);
    const float* src = relaid_.get();
    const std::vector<Phase> no_phases;
#pragma omp parallel num_threads(threads_)
    {
      pack_weight();
      if (!in_place_) relayout<Gv>();
      if (in_place_ && Gv == 1) pad_along_w();
      std::vector<index_t> scratch(in_place_ ? 5 * s_.taps() : 0);  // in_place_block's tap lists
#pragma omp barrier
      auto run_block = [&](index_t b, const Phase& phase, index_t m_begin, index_t m_end) {
        const index_t cb_begin = b * per_block, cb_end = std::min(col_blocks_, (b + 1) * per_block);
        if constexpr ((Gv == L && gvec::kDepthwiseRows > 0) || (Gv == 1 && gvec::kChannelRows > 0))
          if (in_place_)
            return in_place_block<Gv == 1>(out, phase, cb_begin, cb_end, m_begin, m_end, scratch.data());
        block<Gv, SB, NV, MR>(out, src, cb_begin, cb_end, phase, m_begin, m_end);
      };
      if (in_place_ && !phases_.front().whole) {
        // in place at a stride: din's lines in order, each through its phases (one a residue
        // of w), so the dout rows they read are still in cache for the next line's
        const index_t lines = s_.n * dst_dims_[0] * dst_dims_[1], image = dst_dims_[0] * dst_dims_[1];
        auto din_lines = [&](index_t b, index_t l_begin, index_t l_end) {
          for (index_t l = l_begin; l < l_end; ++l) {
            const index_t dh = l % dst_dims_[1], dd = l / dst_dims_[1] % dst_dims_[0], n = l / image;
            const index_t rd = dd % s_.stride[0], rh = dh % s_.stride[1];
            for (index_t rw = 0; rw < residues_[2]; ++rw) {
              const Phase& phase = phases_[(rd * residues_[1] + rh) * residues_[2] + rw];
              const index_t m = ((n * phase.dims[0] + dd / s_.stride[0]) * phase.dims[1] + dh / s_.stride[1]) *
                                phase.dims[2];
              run_block(b, phase, m, m + phase.dims[2]);
            }
          }
        };
        if constexpr (!kInterWave) {
          // the (column block, line block) grid as the phases' below
          const index_t per = ceil_div(kBM, dst_dims_[2]), line_blocks = ceil_div(lines, per);
          const index_t units = blocks * line_blocks, run = std::max<index_t>(1, units / (2 * threads_));
#pragma omp for schedule(dynamic, run) nowait
          for (index_t unit = 0; unit < units; ++unit) {
            const index_t lb = unit % line_blocks;
            din_lines(unit / line_blocks, lb * per, std::min(lines, (lb + 1) * per));
          }
        } else {
#pragma omp for schedule(dynamic, 1) nowait
          for (index_t unit = 0; unit < blocks * s_.n; ++unit)
            din_lines(unit / s_.n, unit % s_.n * image, (unit % s_.n + 1) * image);
        }
      }
      // phases write disjoint destination pixels: no barrier between them (in place at a
      // stride, they ran above, line by line)
      for (const Phase& phase : in_place_ && !phases_.front().whole ? no_phases : phases_) {
        const index_t image = phase.dims[0] * phase.dims[1] * phase.dims[2], rows = s_.n * image;
        if constexpr (!kInterWave) {
          // the (column block, pixel block) grid, pixel blocks inner, in runs of neighbouring
          // blocks (their source rows overlap) half a thread's share long, dealt out as threads
          // come free: a layer of few blocks, or a thread slowed by the shared machine, no
          // longer waits on the slowest share (one loop a column block, each statically
          // shared, gave a layer of one pixel block all to the first thread)
          const index_t m_blocks = ceil_div(rows, kBM), units = blocks * m_blocks;
          const index_t run = std::max<index_t>(1, units / (2 * threads_));
#pragma omp for schedule(dynamic, run) nowait
          for (index_t unit = 0; unit < units; ++unit) {
            const index_t mb = unit % m_blocks;
            run_block(unit / m_blocks, phase, mb * kBM, std::min(rows, (mb + 1) * kBM));
          }
        } else {
#pragma omp for schedule(dynamic, 1) nowait
          for (index_t unit = 0; unit < blocks * s_.n; ++unit)
            run_block(unit / s_.n, phase, unit % s_.n * image, (unit % s_.n + 1) * image);
        }
      }
    }
  }

  /// bwd_weight: dwei[g, k, t, c] = sum over output pixels p of dout[p, g, k] * in[source(p, t),
  /// g, c], lanes as forward's with K the destination. A unit is R (tap, channel) pairs of one
  /// column block, each an accumulator row reduced over every output pixel: dout's row (read
  /// once a pixel from its packed copy) times a broadcast of the input under the pair's tap.
  /// intrawave deals out (column block, pair chunk) units, interwave whole blocks of BN lanes.
  template <int Gv, int NV>
  void run_weight_grad(float* out) const {
    constexpr int R = gvec::pairs_for(NV);
    const index_t chunks = ceil_div(s_.taps() * src_ch_, R);
#pragma omp parallel num_threads(threads_)
    {
      pack_dout<NV>();
      relayout<Gv>();
#pragma omp barrier
      if constexpr (!kInterWave) {
#pragma omp for schedule(dynamic, 1)
        for (index_t unit = 0; unit < col_blocks_ * chunks; ++unit)
          weight_grad_pairs<Gv, NV, R>(out, unit / chunks, unit % chunks * R);
      } else {
        const index_t per_block = std::max<index_t>(1, kBN / (NV * L));
#pragma omp for schedule(dynamic, 1)
        for (index_t block = 0; block < ceil_div(col_blocks_, per_block); ++block)
          for (index_t chunk = 0; chunk < chunks; ++chunk)
            for (index_t cb = block * per_block; cb < std::min(col_blocks_, (block + 1) * per_block); ++cb)
              weight_grad_pairs<Gv, NV, R>(out, cb, chunk * R);
      }
    }
  }

  /// packed[pixel][cb][lane] = dout[pixel][the lane's group and channel], zero past G or K.
  template <int NV>
  void pack_dout() const {
    const index_t row = col_blocks_ * NV * L, ld = s_.g * dst_ch_;
#pragma omp for schedule(static) nowait
    for (index_t pixel = 0; pixel < s_.n * dst_pixels_; ++pixel) {
      const float* from = weight_ + pixel * ld;
      float* to = packed_.get() + pixel * row;
      for (index_t i = 0; i < row; ++i) to[i] = lane_channel_[i] >= 0 ? from[lane_channel_[i]] : 0.0f;
    }
  }

  /// Pairs [pair_begin, pair_begin + R) of column block cb (those past taps x C ignored).
  template <int Gv, int NV, int R>
  void weight_grad_pairs(float* out, index_t cb, index_t pair_begin) const {
    constexpr int kPixels = NV == 1 ? gvec::kChains : 1;   // pixels a step, each its own chain
    constexpr int lanes = NV * L;
    const index_t S = src_ch_, pairs = s_.taps() * S, row = col_blocks_ * lanes;
    const index_t column = Gv > 1 ? cb * S * Gv : cb / channel_blocks_ * S;
    index_t offset[R];
#pragma GCC unroll 16
    for (int j = 0; j < R; ++j) {
      const index_t pair = std::min(pair_begin + j, pairs - 1);
      offset[j] = phases_.front().offsets[pair / S] + pair % S * Gv + column;  // forward-like: one phase
    }
    Row acc[kPixels][R][NV];
    gvec::zero_all(acc);
    const float* src = relaid_.get();
    const index_t step = s_.stride[2] * src_row_, width = dst_dims_[2];
    for (index_t line = 0; line < s_.n * dst_pixels_ / width; ++line) {   // (n, d, h) rows
      const Pixel first = split_pixel(line * width, dst_dims_);
      const float* base = src + padded_pixel(first, 1) * src_row_;
      const float* dout = packed_.get() + line * width * row + cb * lanes;
      // one pixel's dout row times the input under each pair's tap, into chain q
      auto pixel = [&](int q, index_t w) __attribute__((always_inline)) {
        Row d[NV];
#pragma GCC unroll 4
        for (int r = 0; r < NV; ++r) d[r] = Row::load(dout + w * row + r * L);
        const float* at = base + w * step;
#pragma GCC unroll 16
        for (int j = 0; j < R; ++j) {
          const Row source = Row::template broadcast<Gv>(at + offset[j]);
#pragma GCC unroll 4
          for (int r = 0; r < NV; ++r) acc[q][j][r].fma(source, d[r]);
        }
      };
      index_t w = 0;
      for (; w + kPixels <= width; w += kPixels)
#pragma GCC unroll 2
        for (int q = 0; q < kPixels; ++q) pixel(q, w + q);
      for (; w < width; ++w) pixel(0, w);
    }
    alignas(64) float sums[lanes];
    for (int j = 0; j < R && pair_begin + j < pairs; ++j) {
      const index_t t = (pair_begin + j) / S, c = (pair_begin + j) % S;
      for (int r = 0; r < NV; ++r) {
        if constexpr (kPixels == 2) acc[0][j][r].add(acc[1][j][r]);
        acc[0][j][r].store(sums + r * L);
      }
      // lane -> (g, k): dwei[(g K + k) taps + t][c]
      const index_t* channel = lane_channel_.data() + cb * lanes;
      for (int lane = 0; lane < lanes; ++lane)
        if (channel[lane] >= 0) out[(channel[lane] * s_.taps() + t) * s_.c + c] = sums[lane];
    }
  }

  /// packed[cb][t][s][lane]: the weight of each lane's (group, destination channel) (see
  /// lane_channel_), zero past G or D.
  void pack_weight() const {
    const index_t taps = s_.taps(), S = src_ch_, lanes = nv_ * L;
#pragma omp for schedule(static) nowait
    for (index_t unit = 0; unit < col_blocks_ * taps; ++unit) {
      const index_t cb = unit / taps, t = unit % taps;
      float* dst = packed_.get() + unit * S * lanes;
      for (index_t lane = 0; lane < lanes; ++lane) {
        const index_t channel = lane_channel_[cb * lanes + lane];
        if (channel < 0) {
          for (index_t s = 0; s < S; ++s) dst[s * lanes + lane] = 0.0f;
          continue;
        }
        const index_t g = channel / dst_ch_, d = channel % dst_ch_;
        // w[g][k][t][c]: forward (k = d, c = s) reads along c, bwd_data (k = s, c = d) along k
        const float* from = weight_ + (g * s_.k * taps + t) * s_.c +
                            (Dir == kForward ? d * taps * s_.c : d);
        const index_t step = Dir == kForward ? 1 : taps * s_.c;
        for (index_t s = 0; s < S; ++s) dst[s * lanes + lane] = from[s * step];
      }
    }
  }

  /// relaid[pixel][gb][s][gi] = src[pixel][g = gb * Gv + gi][s], zero past G. A block of
  /// Gv groups x S channels is a transpose: one permutation of a vector when it fills one.
  template <int Gv>
  void relayout() const {
    const index_t S = src_ch_, G = s_.g, full_blocks = G / Gv;
#ifdef __AVX512F__
    const bool one_vector = Gv * S == L;
    alignas(64) int order[L];
    for (int j = 0; j < L; ++j) order[j] = one_vector ? (j % Gv) * int(S) + j / Gv : 0;
    const __m512i permutation = _mm512_load_si512(order);
#else
    const bool one_vector = false;
#endif
    // a line at a time (one (n, d, h) of the source): its pixels are consecutive on both
    // sides, so nothing is divided per pixel, and a same-layout line is one copy
    const index_t width = src_dims_[2], lines = s_.n * src_pixels_ / width;
    const bool same_layout = Gv == 1 || S == 1;
#pragma omp for schedule(static)
    for (index_t line = 0; line < lines; ++line) {
      const float* line_src = src_ + line * width * G * S;
      float* line_dst = relaid_.get() + padded_pixel(split_pixel(line * width, src_dims_), 0) * src_row_;
      if (same_layout && src_row_ == G * S) {  // zeros past G: none
        std::copy(line_src, line_src + width * G * S, line_dst);
        continue;
      }
      for (index_t w = 0; w < width; ++w) {
        const float* row = line_src + w * G * S;
        float* dst = line_dst + w * src_row_;
        index_t gb = 0;
        if (same_layout) {  // a copy, zeros past G
          std::copy(row, row + G * S, dst);
          std::fill(dst + G * S, dst + src_row_, 0.0f);
          continue;
        }
#ifdef __AVX512F__
        if (one_vector)
          for (; gb < full_blocks; ++gb)
            _mm512_storeu_ps(dst + gb * L, _mm512_permutexvar_ps(permutation, _mm512_loadu_ps(row + gb * L)));
#endif
        for (; gb < group_blocks_; ++gb)
          for (index_t s = 0; s < S; ++s)
            for (int gi = 0; gi < Gv; ++gi) {
              const index_t g = gb * Gv + gi;
              dst[(gb * S + s) * Gv + gi] = g < G ? row[g * S + s] : 0.0f;
            }
      }
    }
  }

  /// Column blocks [cb_begin, cb_end) x the phase's destination rows [m_begin, m_end): each
  /// pixel tile runs all of the block's column blocks while its source rows are in cache. A
  /// phase of no taps still takes one pass, which writes its zeros.
  template <int Gv, int SB, int NV, int MR>
  void block(float* out, const float* src, index_t cb_begin, index_t cb_end, const Phase& phase,
             index_t m_begin, index_t m_end) const {
    const index_t taps = index_t(phase.taps.size());
    for (index_t k0 = 0; k0 == 0 || k0 < taps; k0 += kBK) {
      Pixel first = split_pixel(m_begin, phase.dims);
      for (index_t m0 = m_begin; m0 < m_end; m0 += MR) {
        for (index_t cb = cb_begin; cb < cb_end; ++cb)
          tile<Gv, SB, NV, MR>(out, src, cb, phase, m0, first, std::min<index_t>(MR, m_end - m0), k0,
                               std::min(taps, k0 + kBK));
        advance(first, MR, phase.dims);
      }
    }
  }

  /// In place (in_place_): destination pixels [m_begin, m_end) of `phase` x column blocks
  /// [cb_begin, cb_end), a line (n, d, h) at a time, reading the source where it lies. A
  /// line's taps are those whose (d, h) source row is inside the image (a padding row adds
  /// nothing); the pixels whose every such tap reads inside along w go a tile of several at a
  /// time, the few others (the padding's width at each end) one at a time with the taps they
  /// read. Depthwise: 16 groups a row, bwd_data at a stride a phase at a time (its lines every
  /// stride-th pixel of din, reading dout at stride 1 through the phase's taps); Channels
  /// (Gv = 1, one phase): 16 of one group's destination channels a row, each (tap, source
  /// channel) a broadcast of the source, read from the copy padded along w (pad_along_w).
  /// `scratch` holds 5 x taps.
  template <bool Channels>
  void in_place_block(float* out, const Phase& phase, index_t cb_begin, index_t cb_end, index_t m_begin,
                      index_t m_end, index_t* scratch) const {
    const index_t taps = s_.taps(), G = s_.g, S = src_ch_, D = dst_ch_;
    // a phase's source coordinate is its pixel's index plus the tap's: stride 1
    const index_t strides[3] = {phase.whole ? s_.stride[0] : 1, phase.whole ? s_.stride[1] : 1,
                                phase.whole ? s_.stride[2] : 1};
    const index_t stride = strides[2], n_taps = phase.whole ? taps : index_t(phase.taps.size());
    const index_t width = Channels ? width_ : src_dims_[2], pixel = G * S;  // floats a source pixel
    const index_t step = stride * pixel;  // floats between the sources of neighbouring pixels
    index_t* line_off = scratch;          // a kept tap's source from the line's, in floats
    index_t* line_tap = scratch + taps;
    index_t* line_aw = scratch + 4 * taps;  // a kept tap's source column for the line's pixel 0
    Pixel p = split_pixel(m_begin, phase.dims);
    for (index_t m = m_begin; m < m_end;) {
      const index_t begin = p.w, end = p.w + std::min(phase.dims[2] - p.w, m_end - m);
      index_t kept = 0, lo = begin, hi = end;
      for (index_t k = 0; k < n_taps; ++k) {
        const index_t t = phase.whole ? k : phase.taps[k];
        const auto at = [&](int dim) { return phase.whole ? tap_at_[dim][t] : phase.at[dim][k]; };
        const index_t sd = p.d * strides[0] + at(0), sh = p.h * strides[1] + at(1);
        if (sd < 0 || sd >= src_dims_[0] || sh < 0 || sh >= src_dims_[1]) continue;
        const index_t aw = at(2);
        line_off[kept] = ((sd * src_dims_[1] + sh) * width + aw) * pixel;
        line_aw[kept] = aw;
        line_tap[kept++] = t;
        if (aw < 0) lo = std::max(lo, ceil_div(-aw, stride));           // w stride + aw >= 0
        if (aw > width - 1) hi = begin;                                   // never inside
        else hi = std::min(hi, (width - 1 - aw) / stride + 1);            // w stride + aw < width
      }
      lo = std::min(lo, end);
      hi = std::max(hi, lo);
      const float* image = (Channels ? padded_w_.get() : src_) + p.n * src_dims_[0] * src_dims_[1] * width * pixel;
      // the destination line's pixel 0, and the floats between its pixels
      const index_t dst_pixel = ((p.n * dst_dims_[0] + phase.first[0] + phase.step[0] * p.d) * dst_dims_[1] +
                                 phase.first[1] + phase.step[1] * p.h) * dst_dims_[2] + phase.first[2];
      float* line_dst = out + dst_pixel * G * D;
      const index_t dst_step = phase.step[2] * G * D;
      for (index_t cb = cb_begin; cb < cb_end; ++cb) {
        if constexpr (Channels) {
          // rows of 16 of group g's destination channels from c0, the last masked past D;
          // the packed weight is [cb][tap][s][row][16]
          const index_t g = cb / channel_blocks_, c0 = cb % channel_blocks_ * nv_ * L, lanes = nv_ * L;
          for (index_t r = 0; r < nv_ && c0 + r * L < D; ++r) {
            const InPlaceLine line{image + g * S, step, packed_.get() + cb * taps * S * lanes + r * L,
                                   S * lanes, lanes, S, line_dst + g * D + c0 + r * L, dst_step,
                                   std::min<index_t>(L, D - c0 - r * L)};
            if (line.lanes == L) in_place_line<gvec::kChannelRows, false, true>(line, begin, lo, hi, end, kept, stride, scratch);
            else in_place_line<gvec::kChannelRows, true, true>(line, begin, lo, hi, end, kept, stride, scratch);
          }
        } else {
          // the last column block of a G that 16 does not divide reads and writes its lanes below G
          const InPlaceLine line{image + cb * L, step, packed_.get() + cb * taps * L, L, 0, 1,
                                 line_dst + cb * L, dst_step, std::min<index_t>(L, G - cb * L)};
          if (line.lanes == L) in_place_line<gvec::kDepthwiseRows, false, false>(line, begin, lo, hi, end, kept, stride, scratch);
          else in_place_line<gvec::kDepthwiseRows, true, false>(line, begin, lo, hi, end, kept, stride, scratch);
        }
      }
      advance(p, end - begin, phase.dims);
      m += end - begin;
    }
  }

  /// padded_w_[n, d, h, pad_w_ + w] = src[n, d, h, w] (each pixel G x C floats); the pad
  /// columns stay the zeros they were allocated as.
  void pad_along_w() const {
    const index_t pixel = s_.g * src_ch_, width = src_dims_[2], lines = s_.n * src_dims_[0] * src_dims_[1];
#pragma omp for schedule(static) nowait
    for (index_t line = 0; line < lines; ++line)
      std::copy(src_ + line * width * pixel, src_ + (line + 1) * width * pixel,
                padded_w_.get() + (line * width_ + pad_w_) * pixel);
  }

  /// Weights a pass of in_place_line (Channels) reads, in floats: 16 KiB, half of L1.
  static constexpr index_t kInPlaceWeights = 4096;

  /// One line of one row of destination lanes for in_place_block.
  struct InPlaceLine {
    const float* origin;   // the source of the line's pixel 0 (where its tap offsets count from)
    index_t step;          // floats between the sources of neighbouring pixels
    const float* weights;  // the row's weights for tap 0, source channel 0
    index_t tap_step;      // floats between a tap's weights and the next tap's
    index_t channel_step;  // floats between a source channel's weights and the next's (Channels)
    index_t channels;      // source channels (Channels; depthwise 1)
    float* dst;            // the line's pixel 0 in the destination
    index_t dst_step;      // floats between destination pixels
    index_t lanes;         // of 16 written (the rest past G or D: their source not read, Depthwise)
  };

  /// Pixels [begin, end) of a line whose kept taps (scratch: offsets, then tap indices) all
  /// read inside for pixels [lo, hi): those in tiles of MR, the others (none in Channels'
  /// padded copy) with the taps they read. Channels: the taps go in passes whose weights
  /// (kInPlaceWeights floats) stay in L1, each pass after the first adding to the destination.
  template <int MR, bool Partial, bool Channels>
  void in_place_line(const InPlaceLine& line, index_t begin, index_t lo, index_t hi, index_t end,
                     index_t kept, index_t stride, index_t* scratch) const {
    const index_t taps = s_.taps(), width = Channels ? width_ : src_dims_[2];
    const index_t* line_off = scratch;
    const index_t* line_tap = scratch + taps;
    index_t* pixel_off = scratch + 2 * taps;
    index_t* pixel_tap = scratch + 3 * taps;
    const index_t* line_aw = scratch + 4 * taps;
    // (a line of no taps: one pass, writing zeros)
    const index_t pass = Channels ? std::max<index_t>(1, kInPlaceWeights / (line.channels * L)) : std::max<index_t>(1, kept);
    for (index_t k0 = 0; k0 == 0 || k0 < kept; k0 += pass) {
      const index_t k1 = std::min(kept, k0 + pass);
      const bool accumulate = k0 > 0;
      auto edge = [&](index_t w) {
        index_t count = 0;
        for (index_t k = k0; k < k1; ++k) {
          const index_t sw = w * stride + line_aw[k];
          if (sw < 0 || sw >= width) continue;
          pixel_off[count] = line_off[k];
          pixel_tap[count++] = line_tap[k];
        }
        in_place_tile<1, Partial, Channels>(line, w, pixel_off, pixel_tap, count, accumulate);
      };
      index_t w = begin;
      for (; w < lo; ++w) edge(w);
      if constexpr (Channels) {
        // tiles as even as MR allows (a line of 14 as 5 + 5 + 4, not 6 + 6 + 2: a tile of 2
        // pixels is 4 chains of FMAs, under the latency; a 7x7x7 stem 1.05x)
        const index_t n = hi - lo, tiles = ceil_div(n, MR);
        for (index_t i = 0; i < tiles; ++i) {
          const index_t rows = n / tiles + (i < n % tiles);
          in_place_rest<MR, Partial, Channels>(rows, line, w, line_off + k0, line_tap + k0, k1 - k0, accumulate);
          w += rows;
        }
      } else {
        // depthwise: MR at a time, then the rest (even tiles read 0.90-0.98x at 56 wide)
        for (; w + MR <= hi; w += MR)
          in_place_tile<MR, Partial, Channels>(line, w, line_off + k0, line_tap + k0, k1 - k0, accumulate);
        if (w < hi)
          in_place_rest<MR - 1, Partial, Channels>(hi - w, line, w, line_off + k0, line_tap + k0, k1 - k0,
                                                   accumulate);
      }
      for (w = hi; w < end; ++w) edge(w);
    }
  }

  /// in_place_tile of `rows` (1 to R) pixels.
  template <int R, bool Partial, bool Channels>
  static TC_INLINE void in_place_rest(index_t rows, const InPlaceLine& line, index_t w, const index_t* off,
                                      const index_t* tap, index_t count, bool accumulate) {
    if constexpr (R > 1)
      if (rows < R) return in_place_rest<R - 1, Partial, Channels>(rows, line, w, off, tap, count, accumulate);
    in_place_tile<R, Partial, Channels>(line, w, off, tap, count, accumulate);
  }

  /// Pixels [w, w + R) of a line: the sum over `count` taps (and, Channels, the source
  /// channels) of the source at off[k] times tap tap[k]'s weight row, added to the
  /// destination when `accumulate`.
  template <int R, bool Partial, bool Channels>
  static TC_INLINE void in_place_tile(const InPlaceLine& line, index_t w, const index_t* off,
                                      const index_t* tap, index_t count, bool accumulate) {
    const float* at = line.origin + w * line.step;
    const index_t step = line.step, lanes = line.lanes;
    Row acc[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i] = Row::zero();
    for (index_t k = 0; k < count; ++k) {
      const float* from = at + off[k];
      const float* weights = line.weights + tap[k] * line.tap_step;
      if constexpr (Channels) {
        for (index_t c = 0; c < line.channels; ++c) {
          const Row weight = Row::load(weights + c * line.channel_step);
#pragma GCC unroll 16
          for (int i = 0; i < R; ++i) acc[i].fma(Row::template broadcast<1>(from + i * step + c), weight);
        }
      } else {
        const Row weight = Row::load(weights);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i)
          acc[i].fma(Partial ? Row::load_first(from + i * step, lanes) : Row::load(from + i * step), weight);
      }
    }
    float* dst = line.dst + w * line.dst_step;
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i].store_first(dst + i * line.dst_step, Partial ? lanes : L, accumulate);
  }

  /// bwd_data's phases (see Phase), and the padding of dout that keeps every tap of every
  /// pixel inside the copy: below, the most any tap reaches before row 0; above, past the end.
  void plan_phases() {
    index_t below[3] = {0, 0, 0}, above[3] = {0, 0, 0}, residues[3];
    auto reach = [&](int dim, index_t r, index_t f, index_t& a) {  // whether tap f reads, and where
      const index_t num = r + s_.pad[dim] - f * s_.dil[dim], stride = s_.stride[dim];
      if (((num % stride) + stride) % stride != 0) return false;
      a = num / stride;
      return true;
    };
    for (int dim = 0; dim < 3; ++dim) {
      residues[dim] = residues_[dim] = std::min(s_.stride[dim], dst_dims_[dim]);
      for (index_t r = 0; r < residues[dim]; ++r) {
        const index_t last = ceil_div(dst_dims_[dim] - r, s_.stride[dim]) - 1;
        for (index_t f = 0, a = 0; f < s_.filt[dim]; ++f)
          if (reach(dim, r, f, a)) {
            below[dim] = std::max(below[dim], -a);
            above[dim] = std::max(above[dim], last + a - (src_dims_[dim] - 1));
          }
      }
      lead_[dim] = below[dim];
      padded_[dim] = src_dims_[dim] + below[dim] + above[dim];
    }
    for (index_t rd = 0; rd < residues[0]; ++rd)
      for (index_t rh = 0; rh < residues[1]; ++rh)
        for (index_t rw = 0; rw < residues[2]; ++rw) {
          const index_t r[3] = {rd, rh, rw};
          Phase phase{false, {rd, rh, rw}, {s_.stride[0], s_.stride[1], s_.stride[2]}, {}, {}, {}, {}};
          for (int dim = 0; dim < 3; ++dim) phase.dims[dim] = ceil_div(dst_dims_[dim] - r[dim], s_.stride[dim]);
          for (index_t t = 0; t < s_.taps(); ++t) {
            const Pixel f = split_tap(t, s_.filt);
            const index_t fs[3] = {f.d, f.h, f.w};
            index_t a[3];
            bool reads = true;
            for (int dim = 0; dim < 3; ++dim) reads = reads && reach(dim, r[dim], fs[dim], a[dim]);
            if (!reads) continue;
            phase.taps.push_back(t);
            for (int dim = 0; dim < 3; ++dim) phase.at[dim].push_back(a[dim]);
            phase.offsets.push_back((((a[0] + lead_[0]) * padded_[1] + a[1] + lead_[1]) * padded_[2] +
                                     a[2] + lead_[2]) * src_row_);
          }
          phases_.push_back(std::move(phase));
        }
  }

  /// The index of a pixel in the padded source: at `scale` 0 source pixel p's place, at
  /// scale 1 the place tap offsets count from for destination pixel p (bwd_data: p's index
  /// within its phase).
  index_t padded_pixel(const Pixel& p, int scale) const {
    index_t at[3] = {p.d, p.h, p.w};
    for (int dim = 0; dim < 3; ++dim)
      at[dim] = scale ? at[dim] * (Dir != kBwdData ? s_.stride[dim] : 1) : at[dim] + lead_[dim];
    return ((p.n * padded_[0] + at[0]) * padded_[1] + at[1]) * padded_[2] + at[2];
  }

  /// The pixel `count` past p along the (n, d, h, w) order of an image of `dims`.
  static TC_INLINE void advance(Pixel& p, index_t count, const index_t (&dims)[3]) {
    p.w += count;
    while (p.w >= dims[2]) {
      p.w -= dims[2];
      if (++p.h < dims[1]) continue;
      p.h = 0;
      if (kNdim == 3 && ++p.d < dims[0]) continue;
      p.d = 0;
      ++p.n;
    }
  }

  template <int Gv, int SB, int NV, int MR>
  TC_INLINE void tile(float* out, const float* src, index_t cb, const Phase& phase, index_t m0,
                      Pixel first, index_t rows, index_t k_begin, index_t k_end) const {
    // one row a pixel: kChains accumulators, the source channels dealt out among them (one
    // chain of taps x S dependent FMAs a row would hold 8 rows to the FMA latency); NV rows
    // a pixel are independent chains already
    constexpr int kChains = NV == 1 ? gvec::kChains : 1;
    constexpr int lanes = NV * L;
    const index_t S = src_ch_;
    const index_t column = Gv > 1 ? cb * S * Gv : cb / channel_blocks_ * S;
    const float* origin[MR];   // the source pixel under tap 0 (past the last row: the last's)
    index_t dst[MR];           // the destination pixel
    Pixel p = first;
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      origin[i] = src + padded_pixel(p, 1) * src_row_ + column;
      dst[i] = phase.whole ? m0 + i  // the phase's pixels are the destination's, in order
                           : ((p.n * dst_dims_[0] + phase.first[0] + p.d * phase.step[0]) * dst_dims_[1] +
                              phase.first[1] + p.h * phase.step[1]) * dst_dims_[2] + phase.first[2] +
                                 p.w * phase.step[2];
      if (i + 1 < rows) advance(p, 1, phase.dims);
    }
    Row acc[kChains][MR][NV];
    gvec::zero_all(acc);
    // SB source channels of one tap: their weight rows, then each row's broadcasts
    auto channels = [&](const float* const (&row)[MR], const float* w, index_t s0)
                        __attribute__((always_inline)) {
      Row weights[SB][NV];
#pragma GCC unroll 8
      for (int j = 0; j < SB; ++j)
#pragma GCC unroll 4
        for (int r = 0; r < NV; ++r) weights[j][r] = Row::load(w + (s0 + j) * lanes + r * L);
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < SB; ++j) {
          const Row source = Row::template broadcast<Gv>(row[i] + (s0 + j) * Gv);
#pragma GCC unroll 4
          for (int r = 0; r < NV; ++r) acc[j % kChains][i][r].fma(source, weights[j][r]);
        }
    };
    // one tap: a single step when S == SB (depthwise's one channel: nothing else to loop over)
    const index_t* offsets = phase.offsets.data();
    const index_t* taps = phase.taps.data();
    const float* weights = packed_.get() + cb * s_.taps() * S * lanes;
    for (index_t k = k_begin; k < k_end; ++k) {
      const float* row[MR];
      const index_t offset = offsets[k];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) row[i] = origin[i] + offset;
      const float* w = weights + taps[k] * S * lanes;
      if (S == SB) {
        channels(row, w, 0);
      } else {
        for (index_t s0 = 0; s0 < S; s0 += SB) channels(row, w, s0);
      }
    }
    if constexpr (kChains == 2)
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) acc[0][i][0].add(acc[1][i][0]);
    store<Gv, NV, MR>(acc[0], out, cb, dst, rows, k_begin > 0);
  }

  /// Rows [0, rows) of the tile to the destination. Gv > 1: dst[pixel i][cb * Gv + gi][d], lanes
  /// back in [gi][d] order (output lane j = gi * D + d holds tile lane d * Gv + gi), only groups
  /// below G. Gv = 1: row r to channels c0 + 16 r.. of group cb / channel blocks, only those
  /// below D.
  template <int Gv, int NV, int MR>
  TC_INLINE void store(const Row (*acc)[NV], float* out, index_t cb, const index_t* dst_pixel, index_t rows,
                       bool accumulate) const {
    const index_t D = dst_ch_, ld = s_.g * D;
    if constexpr (Gv == 1) {
      const index_t g = cb / channel_blocks_, c0 = cb % channel_blocks_ * NV * L;
      for (index_t i = 0; i < rows; ++i)
#pragma GCC unroll 4
        for (int r = 0; r < NV; ++r) {
          const index_t first = c0 + r * L;
          if (first >= D) break;
          acc[i][r].store_first(out + dst_pixel[i] * ld + g * D + first, D - first, accumulate);
        }
    } else {
      constexpr int Dv = L / Gv;
      const index_t valid = std::min<index_t>(Gv, s_.g - cb * Gv) * Dv;
#ifdef __AVX512F__
      alignas(64) int order[L];
      for (int j = 0; j < L; ++j) order[j] = (j % Dv) * Gv + j / Dv;
      const __m512i permutation = _mm512_load_si512(order);
      for (index_t i = 0; i < rows; ++i) {
        const Row value{_mm512_permutexvar_ps(permutation, acc[i][0].v)};
        value.store_first(out + dst_pixel[i] * ld + cb * Gv * Dv, valid, accumulate);
      }
#else
      int order[L];
      for (int j = 0; j < L; ++j) order[j] = (j % Dv) * Gv + j / Dv;
      for (index_t i = 0; i < rows; ++i) {
        const Row value = Dv == 1 ? acc[i][0] : acc[i][0].permuted(order);
        value.store_first(out + dst_pixel[i] * ld + cb * Gv * Dv, valid, accumulate);
      }
#endif
    }
  }

  ConvShape s_;
  const float* src_;
  const float* weight_;
  int threads_;
  index_t dst_ch_, src_ch_, gv_, nv_, channel_blocks_, group_blocks_, col_blocks_, src_row_, sb_;
  index_t dst_dims_[3], src_dims_[3], lead_[3], padded_[3], dst_pixels_, src_pixels_;
  std::vector<index_t> lane_channel_;
  std::vector<Phase> phases_;
  index_t residues_[3] = {1, 1, 1};  // phases along each dim (bwd_data at a stride)
  // depthwise at one phase (forward, or bwd_data at stride 1), and Gv = 1 there, read
  // the source in place; tap_at_[dim][t]: the source coordinate of tap t for destination
  // coordinate 0 (its stride times the coordinate added)
  bool in_place_ = false;
  std::vector<index_t> tap_at_[3];
  // Gv = 1 in place: the source padded along w (pad_w_ columns before it, width_
  // in all), tap_at_[2] counting from its column 0
  index_t pad_w_ = 0, width_ = 0;
  FloatBuffer relaid_, packed_, padded_w_;
#ifdef TC_PIXEL_LANES
  std::unique_ptr<const PixelLaneConv<Dir>> lanes_;  // set: the layer runs there, nothing above is set
#endif
};

}  // namespace tc::gconv
