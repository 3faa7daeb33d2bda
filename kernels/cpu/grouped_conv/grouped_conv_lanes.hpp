// Pixel lanes: the gvec pipeline's path on AVX-512 for groups of few destination channels at
// strides 1-2 (GroupVectorConv hands such layers to PixelLaneConv; see applies for which).
// bwd_data at a stride goes in phases of din (pixels of one residue modulo the stride), each
// a stride-1 pass over dout with the taps that reach it (see Phase).
//
// gvec's own vectors hold 16 / D whole groups, lanes channel-major, so each multiply-add needs
// the groups' source values repeated D times: a 64-bit broadcast at D = 8, 128-bit at D = 4.
// On Zen 4 those broadcasts take a vector pipe: a loop of one such broadcast a multiply-add
// ran well short of the FMA peak where a 32-bit broadcast or a plain load reached it, and
// gvec read such layers at half the peak or so. Here a vector holds 16 positions
// of one channel instead, and each multiply-add takes a plain load or a 32-bit broadcast:
//
//   forward, bwd_data   dst[q, d] += src[q + off(t), s] * w[d, t, s]: per (tap, source
//                       channel) P source vectors (loads) against DB weights (32-bit
//                       broadcasts), DB x P accumulators (8 x 1-3 or 4 x 2-6);
//   bwd_weight          dw[d, t, s] += sum over q of dout[q, d] * src[q + off(t), s]: 4 x 4
//                       (d, s) accumulators a tap, reduced across their lanes once a band.
//
// Positions q = r * wp + w run over a band of destination rows in a copy of the source laid
// out planar and zero-padded along w (wp = width + 2 * lead at stride 1): a tap is one
// offset, and the pad columns' positions are computed and dropped (a few percent of a wide row; rows
// of 7 in 9 stay on gvec's own path). At a stride of 2 the copy is four phase planes, rows and
// columns by parity, and a tap is again one offset. The copy is a band's rows (plus the
// filter's reach) of a chunk of groups, sized to stay in L2 (kBandFloats), so the pass over
// the band reads it from there: relaying the whole source out first and reading it back from
// L3 took a quarter of the time.
//
// Built where the compiler targets AVX-512 F, VL and DQ (TC_PIXEL_LANES): the stores of a
// position's channels are masked 256- and 128-bit stores.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define TC_PIXEL_LANES 1

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "grouped_conv_microkernel.hpp"
#include "grouped_conv_shape.hpp"
#include "grouped_conv_transpose.hpp"

namespace tc::gconv {

namespace lanes {

constexpr int L = 16;
/// A thread's band copy: 256 KiB, a quarter of the Zen 4 EPYC's L2.
constexpr index_t kBandFloats = index_t(1) << 16;

/// put(c, w, value) for value = src[w * src_row + c], w < width, c < channels, a column of 8
/// channels' 8 pixels at a time through the AVX registers (put_row(c, w, the 8 floats of
/// channel c from pixel w)), the rest one float at a time.
template <class Put, class PutRow>
TC_INLINE void channels_by_pixels(const float* __restrict src, index_t src_row, index_t width,
                                  index_t channels, Put&& put, PutRow&& put_row) {
  index_t w = 0;
  for (; w + 8 <= width; w += 8) {
    index_t c = 0;
    for (; c + 8 <= channels; c += 8) {
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(src + (w + i) * src_row + c);
      tc::gconv::transpose_8x8(a, [&](int i, __m256 row) { put_row(c + i, w, row); });
    }
    for (; c < channels; ++c)
      for (int i = 0; i < 8; ++i) put(c, w + i, src[(w + i) * src_row + c]);
  }
  for (; w < width; ++w)
    for (index_t c = 0; c < channels; ++c) put(c, w, src[w * src_row + c]);
}

/// dst[c * ld + w] = src[w * src_row + c] for w < width, c < channels.
inline void to_planar(const float* __restrict src, index_t src_row, index_t width, index_t channels,
                      float* __restrict dst, index_t ld) {
  channels_by_pixels(
      src, src_row, width, channels, [&](index_t c, index_t w, float v) { dst[c * ld + w] = v; },
      [&](index_t c, index_t w, __m256 row) { _mm256_storeu_ps(dst + c * ld + w, row); });
}

/// to_planar at a stride of 2 along w: source column w goes to column (w + lead) / 2 of
/// phase plane (w + lead) % 2, the odd plane `phase` floats after the even one.
inline void to_planar_pairs(const float* __restrict src, index_t src_row, index_t width, index_t channels,
                            float* __restrict dst, index_t ld, index_t lead, index_t phase) {
  const __m256i evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  auto at = [&](index_t c, index_t w) { return dst + c * ld + (w + lead) % 2 * phase + (w + lead) / 2; };
  channels_by_pixels(
      src, src_row, width, channels, [&](index_t c, index_t w, float v) { *at(c, w) = v; },
      [&](index_t c, index_t w, __m256 row) {
        // columns w .. w + 7: the even-placed half to one plane, the odd to the other
        const __m256 split = _mm256_permutevar8x32_ps(row, evens_first);
        _mm_storeu_ps(at(c, w), _mm256_castps256_ps128(split));
        _mm_storeu_ps(at(c, w + 1), _mm256_extractf128_ps(split, 1));
      });
}

/// 8 vectors of 16 positions (one a channel) to 16 rows of 8 channels, in position order:
/// put(row) is called 16 times.
template <class Put>
TC_INLINE void transpose_8x16(const __m512 (&v)[8], Put&& put) {
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    __m256 a[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[j] = half ? _mm512_extractf32x8_ps(v[j], 1) : _mm512_castps512_ps256(v[j]);
    tc::gconv::transpose_8x8(a, [&](int, __m256 row) { put(row); });
  }
}

/// 4 vectors of 16 positions to 16 rows of 4 channels, in position order.
template <class Put>
TC_INLINE void transpose_4x16(const __m512 (&v)[4], Put&& put) {
  const __m512 t0 = _mm512_unpacklo_ps(v[0], v[1]), t1 = _mm512_unpackhi_ps(v[0], v[1]);
  const __m512 t2 = _mm512_unpacklo_ps(v[2], v[3]), t3 = _mm512_unpackhi_ps(v[2], v[3]);
  // r[i]'s 128-bit lane l: position 4 l + i
  const __m512 r[4] = {_mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xEE),
                       _mm512_shuffle_ps(t1, t3, 0x44), _mm512_shuffle_ps(t1, t3, 0xEE)};
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) put(_mm512_castps512_ps128(r[i]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) put(_mm512_extractf32x4_ps(r[i], 1));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) put(_mm512_extractf32x4_ps(r[i], 2));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) put(_mm512_extractf32x4_ps(r[i], 3));
}

}  // namespace lanes

/// Forward (Dir 0), bwd_data (1) or bwd_weight (2) in pixel lanes; see the top of the file.
template <int Dir>
class PixelLaneConv {
  static constexpr int L = lanes::L;

  /// Along one dim of the copy: `lead`, the rows or columns of zeros before the source's
  /// first, and `reach`, the most a tap reads past a position's own (in the copy, so at a
  /// stride of the copy's phases a tap reads reach / stride past it). bwd_data: over din's
  /// phases r (stride s) the taps f with r + pad - f dil = s a read dout at the phase's index
  /// plus a, so lead = the largest -a (or 0) and reach = lead + the largest a.
  struct Reach {
    index_t lead, reach;
  };
  static Reach reach_of(const ConvShape& s, int dim) {
    const index_t span = (s.filt[dim] - 1) * s.dil[dim];
    if (Dir != kBwdData) return {s.pad[dim], span};
    index_t low = 0, high = 0;
    for (index_t r = 0; r < std::min(s.stride[dim], s.in[dim]); ++r)
      for (index_t f = 0; f < s.filt[dim]; ++f) {
        const index_t num = r + s.pad[dim] - f * s.dil[dim];
        if (num % s.stride[dim] != 0) continue;
        low = std::min(low, num / s.stride[dim]);
        high = std::max(high, num / s.stride[dim]);
      }
    return {-low, high - low};
  }

  /// Destination positions that read the copy through the same taps: every one but in
  /// bwd_data at a stride, where din's pixels at first + step x (phase row, phase column)
  /// read dout through the taps with r + pad - f dil divisible by the stride along h and w.
  struct Phase {
    index_t first[2], step[2], rows, cols;  // along (h, w); rows x cols positions
    std::vector<index_t> taps, offsets;     // the packed weight's taps; each one's offset in the copy
  };

 public:
  /// Layers this path runs: not depthwise (gvec reads that in place); strides up to 2 along
  /// h and w (forward and bwd_weight any along d, bwd_data 1); D destination channels a group (K forward and bwd_weight, C bwd_data) where gvec's
  /// own vectors lose: forward and bwd_data at D <= 8 (their broadcasts) or at D up to 40
  /// that 16 does not divide (a group's last row of 16 part empty: faster than gvec in paired
  /// runs; at 16 and 32, where gvec's rows are full, slower bar one layer), bwd_weight at
  /// D <= 32 (faster there).
  static bool applies(const ConvShape& s) {
    const index_t D = Dir == kBwdData ? s.c : s.k, S = Dir == kBwdData ? s.k : s.c;
    if (D == 1 && S == 1) return false;
    if (Dir == kBwdWeight ? D > 32 : D > 8 && (D % 16 == 0 || D > 40)) return false;
    // strides up to 2 along h and w; forward and bwd_weight any along d (its slices are
    // copied one by one), bwd_data 1 (its phases are of h and w)
    if (s.stride[1] > 2 || s.stride[2] > 2 || (Dir == kBwdData && s.stride[0] > 1)) return false;
    // forward and bwd_data need rows whose positions are mostly kept: rows of 7 in 9 (a 3x3
    // filter on a 7x7 map) were slower than gvec's own path, rows of 14 in 16 faster
    const Reach w = reach_of(s, 2);
    const index_t width = Dir == kBwdData ? ceil_div(s.in[2], s.stride[2]) : s.out[2];
    const index_t st = Dir == kBwdData ? 1 : s.stride[2];
    const index_t row = std::max(width + w.reach / st, ceil_div((Dir == kBwdData ? s.out[2] : s.in[2]) + w.lead, st));
    return Dir == kBwdWeight || 5 * width >= 4 * row;
  }

  /// `src` is the input (forward, bwd_weight) or dout (bwd_data); `other` the weight,
  /// [G][K][taps][C] (forward, bwd_data), or dout (bwd_weight, which writes the weight's
  /// gradient).
  PixelLaneConv(const ConvShape& shape, const float* src, const float* other, int threads)
      : s_(shape), src_(src), other_(other), threads_(std::max(threads, 1)) {
    const bool from_input = Dir != kBwdData;
    D_ = Dir == kBwdData ? s_.c : s_.k;
    S_ = Dir == kBwdData ? s_.k : s_.c;
    for (int dim = 0; dim < 3; ++dim) {
      // bwd_data goes in phases of din (one a residue modulo the stride): dst_ is the
      // largest phase's size, and dout is copied at stride 1
      out_[dim] = from_input ? s_.out[dim] : s_.in[dim];
      dst_[dim] = from_input ? out_[dim] : ceil_div(out_[dim], s_.stride[dim]);
      srcd_[dim] = from_input ? s_.in[dim] : s_.out[dim];
      const Reach r = reach_of(s_, dim);
      lead_[dim] = r.lead;
      reach_[dim] = r.reach;
      st_[dim] = from_input ? s_.stride[dim] : 1;
    }
    // at a stride along h or w the copy is st_h x st_w phase planes (rows and columns by
    // their residue), so a tap is still one offset from a position: source column
    // w st + f dil is column w + (f dil) / st of phase (f dil) % st. A phase row holds every
    // source column that lands in it and every column a position reads.
    wp_ = std::max(dst_[2] + reach_[2] / st_[2], ceil_div(srcd_[2] + lead_[2], st_[2]));
    // a unit: band_ destination rows of one (n, d) x gchunk_ groups; its copy, the band's
    // source rows (and bwd_weight's dout rows) of each group's channels, about kBandFloats.
    // bwd_weight takes groups enough that a copied pixel is 8 channels or more (the copies'
    // 8 x 8 transposes; fewer go one float at a time) and the longest band that fits, its
    // sums reduced across lanes once a band.
    const index_t depth = reach_[0] + 1, phases = st_[1] * st_[2];
    const index_t halo = reach_[1] / st_[1];  // phase rows a band reads past its own
    const index_t group_row = (S_ * depth * phases + (Dir == kBwdWeight ? D_ : 0)) * wp_;
    const index_t min_band = Dir == kBwdWeight ? 4 : 8;
    if (Dir == kBwdWeight) {
      gchunk_ = std::min(s_.g, ceil_div(8, std::min(S_, D_)));
      band_ = lanes::kBandFloats / (gchunk_ * group_row) - halo;
    } else {
      band_ = std::max<index_t>(8, 4 * halo);
    }
    band_ = std::clamp<index_t>(band_, 1, dst_[1]);
    if (Dir != kBwdWeight)
      gchunk_ = std::clamp<index_t>(lanes::kBandFloats / ((band_ + halo) * group_row), 1, s_.g);
    auto units = [&] { return s_.n * dst_[0] * ceil_div(dst_[1], band_) * ceil_div(s_.g, gchunk_); };
    while (units() < 4 * threads_ && (gchunk_ > 1 || band_ > min_band)) {
      if (gchunk_ > 1 && (Dir != kBwdWeight || band_ <= min_band)) gchunk_ = ceil_div(gchunk_, 2);
      else band_ = std::max(min_band, ceil_div(band_, 2));
    }
    rows_ = band_ + halo + 1;
    // a channel's copy: depth x phases planes of rows_ x wp, then room for a tile's last vectors
    plane_ = rows_ * wp_;
    channel_ = round_up(depth * phases * plane_ + 8 * L, L);
    dout_channel_ = round_up(band_ * wp_ + L, L);
    // bwd_weight's blocks of 4 channels read up to 3 past a chunk's last group's
    source_channels_ = Dir == kBwdWeight ? round_up(gchunk_ * S_, 4) + 4 : gchunk_ * S_;
    const index_t copy = source_channels_ * channel_ +
                         (Dir == kBwdWeight ? (round_up(gchunk_ * D_, 4) + 4) * dout_channel_ : 0);
    band_copy_ = round_up(copy, L);
    copies_ = FloatBuffer(threads_ * band_copy_);
    if (Dir == kBwdWeight) {
      partials_ = FloatBuffer(threads_ * s_.weight_elems(), false);
    } else {
      db_ = D_ > 4 ? 8 : 4;
      dblocks_ = ceil_div(D_, db_);
      packed_ = FloatBuffer(s_.g * dblocks_ * s_.taps() * S_ * db_, false);
    }
    plan_phases();
  }

  void run(float* out) const {
    if constexpr (Dir == kBwdWeight) {
      run_weight_grad(out);
    } else {
      // vectors a tile: the fewest position slots over a band, then the most vectors
      const index_t positions = band_ * wp_;
      const int most = db_ == 8 ? 3 : 6, least = db_ == 8 ? 1 : 2;
      int best = most;
      for (int p = most; p >= least; --p)
        if (ceil_div(positions, index_t(p * L)) * p < ceil_div(positions, index_t(best * L)) * best) best = p;
      if (db_ == 8) {
        if (best == 3) return gather<8, 3>(out);
        if (best == 2) return gather<8, 2>(out);
        return gather<8, 1>(out);
      }
      switch (best) {
        case 6: return gather<4, 6>(out);
        case 5: return gather<4, 5>(out);
        case 4: return gather<4, 4>(out);
        case 3: return gather<4, 3>(out);
        default: return gather<4, 2>(out);
      }
    }
  }

 private:
  /// Units (plane = (n, d), band of rows, chunk of groups), dealt out as threads come free.
  template <class Body>
  void for_units(Body&& body) const {
    const index_t bands = ceil_div(dst_[1], band_), chunks = ceil_div(s_.g, gchunk_);
    const index_t units = s_.n * dst_[0] * bands * chunks;
#pragma omp for schedule(dynamic, 1) nowait
    for (index_t unit = 0; unit < units; ++unit) {
      const index_t chunk = unit % chunks, band = unit / chunks % bands, plane = unit / (chunks * bands);
      const index_t h0 = band * band_;
      body(plane, h0, std::min(band_, dst_[1] - h0), chunk * gchunk_, std::min(s_.g, (chunk + 1) * gchunk_));
    }
  }

  /// The unit's source rows R = 0 .. (rows - 1) st_h + reach_h (sh = h0 st_h + R - lead_h)
  /// at depths e (sd = d st_d + e - lead_d) into the copy: row R / st_h of phase R % st_h,
  /// source column w to column (w + lead_w) / st_w of its phase, channel gs of the chunk at
  /// gs x channel_; zero outside the image. Columns no source lands in are zero from the
  /// allocation and never written.
  void copy_source(float* copy, index_t plane, index_t h0, index_t rows, index_t g0, index_t g1) const {
    const index_t n = plane / dst_[0], od = plane % dst_[0];
    const index_t GS = s_.g * S_, CS = (g1 - g0) * S_, width = srcd_[2];
    for (index_t e = 0; e <= reach_[0]; ++e) {
      const index_t sd = od * st_[0] + e - lead_[0];
      for (index_t R = 0; R <= (rows - 1) * st_[1] + reach_[1]; ++R) {
        const index_t sh = h0 * st_[1] + R - lead_[1];
        float* to = copy + (e * st_[1] + R % st_[1]) * st_[2] * plane_ + R / st_[1] * wp_;
        if (sd < 0 || sd >= srcd_[0] || sh < 0 || sh >= srcd_[1]) {
          for (index_t c = 0; c < CS; ++c)
            for (index_t pw = 0; pw < st_[2]; ++pw)
              std::fill_n(to + c * channel_ + pw * plane_, wp_, 0.0f);
          continue;
        }
        const float* from = src_ + ((n * srcd_[0] + sd) * srcd_[1] + sh) * width * GS + g0 * S_;
        if (st_[2] == 1) lanes::to_planar(from, GS, width, CS, to + lead_[2], channel_);
        else lanes::to_planar_pairs(from, GS, width, CS, to, channel_, lead_[2], plane_);
      }
    }
  }

  /// phases_: one of every tap (forward, bwd_weight: the copy's phase planes hold a stride),
  /// or bwd_data's phases of din along h and w, each with the taps that reach it (possibly none:
  /// its pixels get zeros).
  void plan_phases() {
    const index_t phases_h = Dir == kBwdData ? std::min(s_.stride[1], out_[1]) : 1;
    const index_t phases_w = Dir == kBwdData ? std::min(s_.stride[2], out_[2]) : 1;
    for (index_t rh = 0; rh < phases_h; ++rh)
      for (index_t rw = 0; rw < phases_w; ++rw) {
        const index_t step_h = Dir == kBwdData ? s_.stride[1] : 1, step_w = Dir == kBwdData ? s_.stride[2] : 1;
        Phase phase{{rh, rw}, {step_h, step_w}, ceil_div(out_[1] - rh, step_h), ceil_div(out_[2] - rw, step_w), {}, {}};
        for (index_t t = 0; t < s_.taps(); ++t) {
          const Pixel f = split_tap(t, s_.filt);
          // the copy's slice, row and column of the tap (forward: of its phase plane)
          index_t at[3];
          bool reads = true;
          const index_t fs[3] = {f.d, f.h, f.w}, r[3] = {0, rh, rw};
          for (int dim = 0; dim < 3; ++dim) {
            if (Dir != kBwdData) {
              at[dim] = fs[dim] * s_.dil[dim];
              continue;
            }
            const index_t num = r[dim] + s_.pad[dim] - fs[dim] * s_.dil[dim], st = s_.stride[dim];
            reads = reads && num % st == 0;
            at[dim] = num / st + lead_[dim];
          }
          if (!reads) continue;
          phase.taps.push_back(t);
          phase.offsets.push_back(((at[0] * st_[1] + at[1] % st_[1]) * st_[2] + at[2] % st_[2]) * plane_ +
                                  at[1] / st_[1] * wp_ + at[2] / st_[2]);
        }
        phases_.push_back(std::move(phase));
      }
  }

  // ---- forward and bwd_data ----

  /// packed[g][b][t][s][j] = the weight of (g, d = b db_ + j, t, s), zero for d >= D.
  void pack_weight() const {
    const index_t taps = s_.taps();
#pragma omp for schedule(static) nowait
    for (index_t gbt = 0; gbt < s_.g * dblocks_ * taps; ++gbt) {
      const index_t g = gbt / (dblocks_ * taps), b = gbt / taps % dblocks_, t = gbt % taps;
      float* dst = packed_.get() + gbt * S_ * db_;
      for (index_t s = 0; s < S_; ++s)
        for (index_t j = 0; j < db_; ++j) {
          const index_t d = b * db_ + j;
          // w[g][k][t][c]: forward k = d, c = s; bwd_data k = s, c = d
          const index_t k = Dir == kForward ? d : s, c = Dir == kForward ? s : d;
          dst[s * db_ + j] = d < D_ ? other_[((g * s_.k + k) * taps + t) * s_.c + c] : 0.0f;
        }
    }
  }

  template <int DB, int P>
  void gather(float* out) const {
#pragma omp parallel num_threads(threads_)
    {
      pack_weight();
      float* copy = copies_.get() + omp_get_thread_num() * band_copy_;
#pragma omp barrier
      for_units([&](index_t plane, index_t h0, index_t rows, index_t g0, index_t g1) {
        copy_source(copy, plane, h0, rows, g0, g1);
        for (const Phase& phase : phases_) {
          const index_t kept = std::min(rows, phase.rows - h0);  // a phase a row shorter ends sooner
          for (index_t g = g0; g < g1; ++g)
            for (index_t b = 0; b < dblocks_; ++b)
              for (index_t q0 = 0; q0 < kept * wp_; q0 += P * L)
                tile<DB, P>(out, copy + (g - g0) * S_ * channel_, phase, plane, h0, kept, g, b, q0);
        }
      });
    }
  }

  /// Positions [q0, q0 + P L) of a band of a phase (q = r wp + w; row h0 + r and column w of
  /// the phase's grid) for group g's destination channels, from its channels' copy at `source`.
  template <int DB, int P>
  __attribute__((noinline)) void tile(float* out, const float* source, const Phase& phase, index_t plane, index_t h0,
                      index_t rows, index_t g, index_t b, index_t q0) const {
    const index_t taps = s_.taps();
    const float* weights = packed_.get() + (g * dblocks_ + b) * taps * S_ * DB;
    __m512 acc[DB][P];
#pragma GCC unroll 8
    for (int j = 0; j < DB; ++j)
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[j][p] = _mm512_setzero_ps();
    // the phase's taps in locals: read through `phase` in the loop, they kept the
    // accumulators in memory (stored after every FMA, at half the speed or less)
    const index_t count = index_t(phase.taps.size()), S = S_, channel = channel_;
    const index_t* taps_of = phase.taps.data();
    const index_t* offsets = phase.offsets.data();
    for (index_t k = 0; k < count; ++k) {
      const float* at = source + q0 + offsets[k];
      const float* w = weights + taps_of[k] * S * DB;
      for (index_t s = 0; s < S; ++s) {
        __m512 x[P];
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) {
          x[p] = _mm512_loadu_ps(at + s * channel + p * L);
          // in a register: as an FMA's memory operand each would be loaded (across two cache
          // lines) once a destination channel, far from the peak)
          asm("" : "+v"(x[p]));
        }
#pragma GCC unroll 8
        for (int j = 0; j < DB; ++j) {
          const __m512 wj = _mm512_set1_ps(w[s * DB + j]);
#pragma GCC unroll 8
          for (int p = 0; p < P; ++p) acc[j][p] = _mm512_fmadd_ps(x[p], wj, acc[j][p]);
        }
      }
    }
    // position q -> the phase's row h0 + q / wp, column q % wp: kept below the band's rows
    // and the phase's width, at the destination's row first_h + step_h (h0 + r), column
    // first_w + step_w w
    const index_t GD = s_.g * D_;
    const __mmask8 mask = __mmask8((1u << std::min<index_t>(DB, D_ - b * DB)) - 1);
    float* band_out = out + ((plane * out_[1] + phase.first[0] + phase.step[0] * h0) * out_[2] + phase.first[1]) * GD +
                      g * D_ + b * DB;
    const index_t row_step = phase.step[0] * out_[2] * GD, column_step = phase.step[1] * GD;
    index_t r = q0 / wp_, w = q0 % wp_;
    auto put = [&](auto row) __attribute__((always_inline)) {
      if (w < phase.cols && r < rows) {
        float* o = band_out + r * row_step + w * column_step;
        if constexpr (DB == 8) _mm256_mask_storeu_ps(o, mask, row);
        else _mm_mask_storeu_ps(o, mask, row);
      }
      if (++w == wp_) w = 0, ++r;
    };
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      __m512 column[DB];
#pragma GCC unroll 8
      for (int j = 0; j < DB; ++j) column[j] = acc[j][p];
      if constexpr (DB == 8) lanes::transpose_8x16(column, put);
      else lanes::transpose_4x16(column, put);
    }
  }

  // ---- bwd_weight ----

  void run_weight_grad(float* out) const {
    const index_t elems = s_.weight_elems();
#pragma omp parallel num_threads(threads_)
    {
      const int me = omp_get_thread_num();
      float* copy = copies_.get() + me * band_copy_;
      float* partial = partials_.get() + me * elems;
      std::fill(partial, partial + elems, 0.0f);
      for_units([&](index_t plane, index_t h0, index_t rows, index_t g0, index_t g1) {
        copy_source(copy, plane, h0, rows, g0, g1);
        float* dout = copy + source_channels_ * channel_;
        copy_dout(dout, plane, h0, rows, g0, g1);
        for (index_t g = g0; g < g1; ++g)
          weight_band(partial, copy + (g - g0) * S_ * channel_, dout + (g - g0) * D_ * dout_channel_, rows, g);
      });
#pragma omp barrier
#pragma omp for schedule(static)
      for (index_t i = 0; i < elems; ++i) {
        float sum = 0.0f;
        // the team's partials (a team can be smaller than asked for, in a nested region)
        for (int t = 0; t < omp_get_num_threads(); ++t) sum += partials_.get()[t * elems + i];
        out[i] = sum;
      }
    }
  }

  /// dout's band for groups [g0, g1), planar: copy[(g - g0) D + d][r wp + w], zero at w >= width and past the
  /// band's last row to the next whole vector.
  void copy_dout(float* copy, index_t plane, index_t h0, index_t rows, index_t g0, index_t g1) const {
    const index_t GD = s_.g * D_, width = dst_[2], channels = (g1 - g0) * D_;
    for (index_t r = 0; r < rows; ++r)
      lanes::to_planar(other_ + ((plane * dst_[1] + h0 + r) * width) * GD + g0 * D_, GD, width, channels,
                       copy + r * wp_, dout_channel_);
    const index_t end = round_up(rows * wp_, L);
    for (index_t d = 0; d < channels; ++d)
      std::fill(copy + d * dout_channel_ + rows * wp_, copy + d * dout_channel_ + end, 0.0f);
  }

  /// partial[g][d][t][s] += the band's sum over positions of dout[d] x source[s] under tap t,
  /// 4 x 4 (d, s) pairs at a time (channels past D and S read the copy's zeros).
  void weight_band(float* partial, const float* source, const float* dout, index_t rows, index_t g) const {
    const index_t taps = s_.taps(), steps = ceil_div(rows * wp_, index_t(L));
    for (index_t t = 0; t < taps; ++t)
      for (index_t d0 = 0; d0 < D_; d0 += 4)
        for (index_t s0 = 0; s0 < S_; s0 += 4) {
          __m512 acc[4][4];
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
          const float* dy = dout + d0 * dout_channel_;
          const float* x = source + s0 * channel_ + phases_.front().offsets[t];
          for (index_t v = 0; v < steps; ++v) {
            __m512 a[4], b[4];
            // both in registers (a memory operand is loaded again for each FMA that reads it)
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
              a[i] = _mm512_load_ps(dy + i * dout_channel_ + v * L);
              asm("" : "+v"(a[i]));
            }
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
              b[j] = _mm512_loadu_ps(x + j * channel_ + v * L);
              asm("" : "+v"(b[j]));
            }
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
              for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(a[i], b[j], acc[i][j]);
          }
          for (int i = 0; i < 4 && d0 + i < D_; ++i)
            for (int j = 0; j < 4 && s0 + j < S_; ++j)
              partial[((g * D_ + d0 + i) * taps + t) * S_ + s0 + j] += _mm512_reduce_add_ps(acc[i][j]);
        }
  }

  ConvShape s_;
  const float* src_;
  const float* other_;
  int threads_;
  index_t D_, S_, db_ = 0, dblocks_ = 1, source_channels_, wp_, gchunk_, band_, rows_, channel_, dout_channel_, band_copy_;
  index_t out_[3], dst_[3], srcd_[3], lead_[3], reach_[3], st_[3], plane_;
  std::vector<Phase> phases_;
  FloatBuffer copies_, packed_, partials_;
};

}  // namespace tc::gconv

#endif  // TC_PIXEL_LANES
