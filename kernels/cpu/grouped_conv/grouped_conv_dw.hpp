// Depthwise pipeline (C == K == 1 per group) for all three directions.
//
// With C = K = 1 the NDHWGC layout puts the group index at unit stride, so the
// vectors run over groups (16 per zmm) and each output pixel is a row: the
// per-group GEMM has a single column and would waste 15/16 of every vector.
// Vectorising over width instead would need stride-G gathers.
//
//   forward / bwd_data  tile = MR pixels x NR groups, reduced over taps;
//                       BM pixels x BN groups per block, BK taps per pass
//   bwd_weight          input and dout read in place, a vector of groups at a time: one
//                       accumulator a tap, reduced along lines (DepthwiseWeightGrad);
//                       BN groups x lines of about BM x BK pixels per block
//
// Waves: intra splits one group block's pixel blocks (bwd_weight: the (group block, line
// block) grid, each thread's sums added up at the end); inter takes whole (group block,
// image) units (bwd_weight: whole group blocks).
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "grouped_conv_microkernel.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

/// Forward (Dir 0) or bwd_data (Dir 1): dst[m, g] = sum_t src[source(m, t), g] * w[g, t].
template <int Dir>
class DepthwiseGather {
 public:
  DepthwiseGather(const ConvShape& shape, const float* src, const float* weight, float* packed,
                  const float* zeros)
      : s_(shape), src_(src), weight_(weight), packed_(packed), zeros_(zeros) {
    for (int dim = 0; dim < 3; ++dim) {
      dst_dims_[dim] = Dir == kForward ? s_.out[dim] : s_.in[dim];
      src_dims_[dim] = Dir == kForward ? s_.in[dim] : s_.out[dim];
    }
    dst_pixels_ = dst_dims_[0] * dst_dims_[1] * dst_dims_[2];
    groups_padded_ = round_up(s_.g, kNR);
    // each (destination coordinate, filter offset)'s source coordinate, looked up in the
    // tile instead of computed there: bwd_data's is a division by the stride
    for (int dim = 0; dim < 3; ++dim) {
      sources_[dim].resize(dst_dims_[dim] * s_.filt[dim]);
      for (index_t d = 0; d < dst_dims_[dim]; ++d)
        for (index_t f = 0; f < s_.filt[dim]; ++f)
          sources_[dim][d * s_.filt[dim] + f] = gather_source<Dir>(s_, dim, d, f);
    }
  }

  static index_t packed_weight_elems(const ConvShape& s) { return s.taps() * round_up(s.g, kNR); }

  void run(float* out, int threads) const {
    const index_t taps = s_.taps(), rows = s_.n * dst_pixels_;
    const index_t group_blocks = ceil_div(s_.g, kBN), m_blocks = ceil_div(rows, kBM);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
      for (index_t t = 0; t < taps; ++t)  // transposed weight: w[t][g], groups contiguous
        for (index_t g = 0; g < groups_padded_; ++g)
          packed_[t * groups_padded_ + g] = g < s_.g ? weight_[g * taps + t] : 0.0f;
      if constexpr (!kInterWave) {
        for (index_t gb = 0; gb < group_blocks; ++gb) {
#pragma omp for schedule(static) nowait
          for (index_t mb = 0; mb < m_blocks; ++mb)
            block(out, gb * kBN, mb * kBM, std::min(rows, (mb + 1) * kBM));
        }
      } else {
#pragma omp for schedule(dynamic, 1)
        for (index_t unit = 0; unit < group_blocks * s_.n; ++unit) {
          const index_t gb = unit / s_.n, n = unit % s_.n;
          for (index_t m = n * dst_pixels_; m < (n + 1) * dst_pixels_; m += kBM)
            block(out, gb * kBN, m, std::min((n + 1) * dst_pixels_, m + kBM));
        }
      }
    }
  }

 private:
  /// Groups [g_begin, g_begin + BN) x rows [m_begin, m_end).
  void block(float* out, index_t g_begin, index_t m_begin, index_t m_end) const {
    const index_t taps = s_.taps();
    const index_t g_end = std::min(g_begin + kBN, s_.g);
    for (index_t g0 = g_begin; g0 < g_end; g0 += kNR)
      for (index_t t0 = 0; t0 < taps; t0 += kBK)
        for (index_t m0 = m_begin; m0 < m_end; m0 += kMR)
          tile(out, g0, m0, std::min<index_t>(kMR, m_end - m0), t0, std::min(taps, t0 + kBK));
  }

  TC_INLINE void tile(float* out, index_t g0, index_t m0, index_t rows, index_t t_begin,
                      index_t t_end) const {
    Pixel dst[kMR];
    for (int i = 0; i < kMR; ++i) dst[i] = split_pixel(i < rows ? m0 + i : m0, dst_dims_);
    MicroTile acc;
    acc.zero();
    for (index_t t = t_begin; t < t_end; ++t) {
      const Pixel f = split_tap(t, s_.filt);
      reg w[kNV];
      for (int v = 0; v < kNV; ++v) w[v] = Vec::load(packed_ + t * groups_padded_ + g0 + v * kLanes);
#pragma GCC unroll 8
      for (int i = 0; i < kMR; ++i) {
        const float* row = zeros_;
        const index_t sd = kNdim == 3 ? source(0, dst[i].d, f.d) : 0;
        const index_t sh = source(1, dst[i].h, f.h), sw = source(2, dst[i].w, f.w);
        if (i < rows && (sd | sh | sw) >= 0)
          row = src_ + (((dst[i].n * src_dims_[0] + sd) * src_dims_[1] + sh) * src_dims_[2] + sw) * s_.g + g0;
#pragma GCC unroll 8
        for (int v = 0; v < kNV; ++v)
          acc.acc[i][v] = Vec::fma(Vec::load(row + v * kLanes), w[v], acc.acc[i][v]);
      }
    }
    tile_store(acc, out + m0 * s_.g + g0, s_.g, rows, s_.g - g0, t_begin > 0);
  }

  TC_INLINE index_t source(int dim, index_t dst, index_t f) const {
    return sources_[dim][dst * s_.filt[dim] + f];
  }

  ConvShape s_;
  const float* src_;
  const float* weight_;
  float* packed_;
  const float* zeros_;
  index_t dst_dims_[3], src_dims_[3], dst_pixels_, groups_padded_;
  std::vector<index_t> sources_[3];
};

/// bwd_weight: dwei[g, t] = sum over output pixels p of in[forward_source(p, t), g] * dout[p, g],
/// the input and dout read where they lie. Each group vector runs a line's taps in passes of
/// up to M filter rows (those whose source row is inside the input) x S filter columns, one
/// accumulator a tap kept in registers along the line and down the lines that read the same
/// filter rows: per pixel, one dout vector and one input vector a tap (a 3x3 filter: 10
/// loads for 9 FMAs, where a (tap, pixel) at a time took 2 loads an FMA). The pixels at a
/// line's ends whose window reaches the padding run only the taps they read. Each thread adds
/// into its own [tap][group] partial sums, added up at the end.
///   intrawave  units of (BN groups, lines of about BM x BK pixels)
///   interwave  units of BN groups, every line
class DepthwiseWeightGrad {
 public:
  DepthwiseWeightGrad(const ConvShape& shape, const float* input, const float* dout, int threads)
      : s_(shape), in_(input), dout_(dout), threads_(std::max(threads, 1)) {
    groups_padded_ = round_up(s_.g, kLanes);
    partials_ = FloatBuffer(threads_ * s_.taps() * groups_padded_);
    lines_ = s_.n * s_.out[0] * s_.out[1];
    for (index_t f = 0; f < s_.filt[2]; ++f) {
      index_t lo, hi;
      forward_valid_range(s_, 2, f, lo, hi);
      valid_w_.push_back({lo, std::max(lo, hi)});
    }
    // filter columns in chunks of at most kMaxS, as even as that allows; a chunk's interior:
    // the output columns where all its taps read inside the input
    const index_t fw = s_.filt[2], chunks = ceil_div(fw, kMaxS);
    for (index_t c = 0; c < chunks; ++c) {
      Columns cols{fw * c / chunks, fw * (c + 1) / chunks, 0, s_.out[2]};
      for (index_t f = cols.first; f < cols.last; ++f) {
        cols.lo = std::max(cols.lo, valid_w_[f].lo);
        cols.hi = std::min(cols.hi, valid_w_[f].hi);
      }
      cols.lo = std::min(cols.lo, s_.out[2]);
      cols.hi = std::max(cols.hi, cols.lo);
      columns_.push_back(cols);
    }
    rows_a_pass_ = std::max<index_t>(1, std::min<index_t>(kMaxM, kMaxAcc / (columns_[0].last - columns_[0].first)));
    // the output rows whose every filter row reads inside: such lines of one image plane
    // share their filter rows, so a pass runs down them
    index_t lo = 0, hi = s_.out[1];
    for (index_t f = 0; f < s_.filt[1]; ++f) {
      index_t f_lo, f_hi;
      forward_valid_range(s_, 1, f, f_lo, f_hi);
      lo = std::max(lo, f_lo);
      hi = std::min(hi, f_hi);
    }
    inner_h_ = {lo, std::max(lo, hi)};
  }

  void run(float* out, int threads) const {
    const index_t taps = s_.taps(), gp = groups_padded_;
    const index_t block = round_up(kBN, kLanes), group_blocks = ceil_div(s_.g, block);
    const index_t per_unit = kInterWave ? lines_ : std::max<index_t>(1, kBM * kBK / s_.out[2]);
    const index_t line_blocks = ceil_div(lines_, per_unit);
    const int team = std::max(1, std::min(threads, threads_));
#pragma omp parallel num_threads(team)
    {
      float* partial = partials_.get() + omp_get_thread_num() * taps * gp;
      std::fill(partial, partial + taps * gp, 0.0f);
      std::vector<const float*> rows(s_.filt[0] * s_.filt[1]);  // a line's filter rows inside
      std::vector<index_t> row_taps(rows.size());
#pragma omp for schedule(dynamic, 1)
      for (index_t unit = 0; unit < group_blocks * line_blocks; ++unit) {
        const index_t gb = unit / line_blocks, lb = unit % line_blocks;
        const index_t g_end = std::min(s_.g, (gb + 1) * block);
        const index_t end = std::min(lines_, (lb + 1) * per_unit);
        for (index_t line = lb * per_unit; line < end;) {
          // a run: the line alone, or the next lines of its plane in inner_h_
          const index_t oh = line % s_.out[1];
          const index_t run = oh >= inner_h_.lo && oh < inner_h_.hi
                                  ? std::min(end - line, inner_h_.hi - oh) : 1;
          run_lines(partial, line, run, gb * block, g_end, rows.data(), row_taps.data());
          line += run;
        }
      }
      // implicit barrier: every partial is complete (those of the threads the team has: the
      // runtime may give fewer than asked)
      const int members = omp_get_num_threads();
#pragma omp for schedule(static)
      for (index_t g = 0; g < s_.g; ++g)
        for (index_t t = 0; t < taps; ++t) {
          float total = 0.0f;
          for (int thread = 0; thread < members; ++thread) total += partials_.get()[(thread * taps + t) * gp + g];
          out[g * taps + t] = total;
        }
    }
  }

 private:
  // accumulators a pass (the registers less dout's vector and a masked load's), filter rows
  // a pass (their input pointers stay in registers) and filter columns a chunk
#ifdef __AVX512F__
  static constexpr index_t kMaxAcc = 24;
#else
  static constexpr index_t kMaxAcc = 12;
#endif
  static constexpr index_t kMaxM = 4, kMaxS = 7;

  struct Range {
    index_t lo, hi;
  };
  struct Columns {
    index_t first, last;  // filter columns [first, last)
    index_t lo, hi;       // output columns [lo, hi) where all of them read inside
  };
  /// What a pass needs of the layer, the same for all its lines.
  struct Walk {
    index_t width, pixel_step, tap_step, line_in, line_out, G, gp;
    const Range* valid;   // each of the chunk's columns: the output columns it reads inside
    index_t lo, hi;       // the chunk's interior
  };

  /// Lines [line, line + count) of one image plane, sharing their filter rows: groups
  /// [g_begin, g_end) into `partial`.
  void run_lines(float* partial, index_t line, index_t count, index_t g_begin, index_t g_end,
                 const float** rows, index_t* row_taps) const {
    const index_t oh = line % s_.out[1], od = kNdim == 3 ? line / s_.out[1] % s_.out[0] : 0;
    const index_t n = line / s_.out[1] / (kNdim == 3 ? s_.out[0] : 1);
    const index_t G = s_.g, width = s_.out[2];
    // the filter rows (fd, fh) whose source row is inside: the input row, the tap of column 0
    index_t m = 0;
    for (index_t fd = 0; fd < s_.filt[0]; ++fd) {
      const index_t id = kNdim == 3 ? forward_source(s_, 0, od, fd) : 0;
      if (id < 0) continue;
      for (index_t fh = 0; fh < s_.filt[1]; ++fh) {
        const index_t ih = forward_source(s_, 1, oh, fh);
        if (ih < 0) continue;
        rows[m] = in_ + ((n * s_.in[0] + id) * s_.in[1] + ih) * s_.in[2] * G;
        row_taps[m++] = (fd * s_.filt[1] + fh) * s_.filt[2];
      }
    }
    const float* dout = dout_ + line * width * G;
    const index_t passes = ceil_div(m, rows_a_pass_);
    for (const Columns& cols : columns_) {
      const Walk walk{width, s_.stride[2] * G, s_.dil[2] * G, s_.stride[1] * s_.in[2] * G, width * G,
                      G, groups_padded_, valid_w_.data() + cols.first, cols.lo, cols.hi};
      for (index_t g0 = g_begin; g0 < g_end; g0 += kLanes) {
        const index_t lanes = std::min<index_t>(kLanes, g_end - g0);
        for (index_t pass = 0; pass < passes; ++pass) {
          const index_t r0 = m * pass / passes, r1 = m * (pass + 1) / passes;
          const float* at[kMaxM];  // pixel 0's input under the chunk's column 0, each filter row
          float* acc_at[kMaxM];
          for (index_t r = r0; r < r1; ++r) {
            at[r - r0] = rows[r] + (cols.first * s_.dil[2] - s_.pad[2]) * G + g0;
            acc_at[r - r0] = partial + (row_taps[r] + cols.first) * groups_padded_ + g0;
          }
          dispatch(r1 - r0, cols.last - cols.first, lanes < kLanes, walk, at, acc_at, dout + g0, count,
                   lane_mask(lanes));
        }
      }
    }
  }

  static void dispatch(index_t m, index_t S, bool masked, const Walk& walk, const float* const* at,
                       float* const* acc_at, const float* dout, index_t lines, LaneMask mask) {
    switch (m) {
      case 1: return dispatch_s<1>(S, masked, walk, at, acc_at, dout, lines, mask);
      case 2: return dispatch_s<2>(S, masked, walk, at, acc_at, dout, lines, mask);
      case 3: return dispatch_s<3>(S, masked, walk, at, acc_at, dout, lines, mask);
      default: return dispatch_s<4>(S, masked, walk, at, acc_at, dout, lines, mask);
    }
  }

  template <int M>
  static void dispatch_s(index_t S, bool masked, const Walk& walk, const float* const* at,
                         float* const* acc_at, const float* dout, index_t lines, LaneMask mask) {
    switch (S * 2 + masked) {
#define TC_DW_PASS(S_)                                                      \
  case 2 * S_: return pass<M, S_, false>(walk, at, acc_at, dout, lines, mask); \
  case 2 * S_ + 1: return pass<M, S_, true>(walk, at, acc_at, dout, lines, mask);
      TC_DW_PASS(1) TC_DW_PASS(2) TC_DW_PASS(3) TC_DW_PASS(4) TC_DW_PASS(5) TC_DW_PASS(6)
      TC_DW_PASS(7)
#undef TC_DW_PASS
      default: return;
    }
  }

  /// M filter rows x S columns down `lines` lines: the accumulator of row r, column j (at
  /// acc_at[r] + j gp, kept in registers) += the input at at[r] + j tap_step (a pixel_step a
  /// pixel along, a line_in a line down) times dout's vector (at dout, G a pixel, line_out a
  /// line). The pixels outside [lo, hi) run the columns whose valid range holds them.
  template <int M, int S, bool kMasked>
  static void pass(const Walk& walk, const float* const* at, float* const* acc_at, const float* dout,
                   index_t lines, LaneMask mask) {
    if constexpr (M * S > kMaxAcc) {
      // not taken (rows_a_pass_ keeps M x S within kMaxAcc): one row at a time
      for (int r = 0; r < M; ++r) pass<1, S, kMasked>(walk, at + r, acc_at + r, dout, lines, mask);
    } else {
      auto load = [&](const float* p) __attribute__((always_inline)) {
        return kMasked ? masked_load(mask, p) : Vec::load(p);
      };
      reg acc[M][S];
#pragma GCC unroll 4
      for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < S; ++j) acc[r][j] = Vec::load(acc_at[r] + j * walk.gp);
      for (index_t line = 0; line < lines; ++line) {
        const float* row[M];
#pragma GCC unroll 4
        for (int r = 0; r < M; ++r) row[r] = at[r] + line * walk.line_in;
        const float* d_row = dout + line * walk.line_out;
        // a pixel at a line's end: only the columns that read inside
        auto edge = [&](index_t w) __attribute__((always_inline)) {
          const reg d = load(d_row + w * walk.G);
#pragma GCC unroll 8
          for (int j = 0; j < S; ++j)
            if (w >= walk.valid[j].lo && w < walk.valid[j].hi)
#pragma GCC unroll 4
              for (int r = 0; r < M; ++r)
                acc[r][j] = Vec::fma(load(row[r] + w * walk.pixel_step + j * walk.tap_step), d, acc[r][j]);
        };
        for (index_t w = 0; w < walk.lo; ++w) edge(w);
        const float* p[M];
#pragma GCC unroll 4
        for (int r = 0; r < M; ++r) p[r] = row[r] + walk.lo * walk.pixel_step;
        const float* d_at = d_row + walk.lo * walk.G;
        for (index_t w = walk.lo; w < walk.hi; ++w) {
          const reg d = load(d_at);
#pragma GCC unroll 4
          for (int r = 0; r < M; ++r) {
#pragma GCC unroll 8
            for (int j = 0; j < S; ++j) acc[r][j] = Vec::fma(load(p[r] + j * walk.tap_step), d, acc[r][j]);
            p[r] += walk.pixel_step;
          }
          d_at += walk.G;
        }
        for (index_t w = walk.hi; w < walk.width; ++w) edge(w);
      }
#pragma GCC unroll 4
      for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
        for (int j = 0; j < S; ++j) Vec::store(acc_at[r] + j * walk.gp, acc[r][j]);
    }
  }

  ConvShape s_;
  const float* in_;
  const float* dout_;
  int threads_;
  index_t groups_padded_, lines_, rows_a_pass_;
  Range inner_h_;
  FloatBuffer partials_;
  std::vector<Range> valid_w_;
  std::vector<Columns> columns_;
};

}  // namespace tc::gconv
