// The "gemm" pipeline: every direction as one GEMM per group on tilecast's GEMM library
// (gemm_parallel.hpp: its register tiles, packing, cache blocks and parallel schemes, which
// the TC_PIPELINE=3 branch of grouped_conv_config.hpp sets from BM/BN/BK and the wave):
//
//               A (M x depth)                    B (depth x cols)             C (M x cols)
//   forward     im2col(x)  (N*Po x T*C)          w_g^T      (T*C x K)         y_g
//   bwd_data    dy_g       (N*Po x K)            w_g        (K x T*C)         dcol, then col2im -> dx_g
//   bwd_weight  dy_g^T     (K x N*Po)            im2col(x)  (N*Po x T*C)      dw_g
//
// with Po the output pixels, T the taps and every operand a strided view of the tensors as they
// lie (NDHWGC / GKZYXC / NDHWGK): only im2col(x) and dcol are scratch. A 1x1 layer with stride
// 1 and no padding reads x (and writes dx) in place. bwd_data's col2im is a gather (each input
// pixel sums the columns of the output pixels whose window covers it, looked up per dim:
// working them out per pixel took many divisions, and a 3D stem at a stride ran several times
// slower): no scatter, no atomics.
// Scratch is bounded (kScratchFloats): the N*Po rows are taken a chunk at a time (bwd_weight
// summing the chunks' products; bwd_data's chunks are whole images, which its col2im needs,
// so one image's dcol is its least).
//
// Forward skips the padding a layer's filter mostly reads (dilated layers, small maps): the
// output rows (2D; output depth slices in 3D) fall into bands that read the same range of
// filter rows (depth slices), and each band is its own GEMM over just those taps (their
// weight rows are one contiguous run), when that drops at least kBandSaving of the products
// and every band keeps kBandRows rows.
//
// Parallelism: intrawave (TC_WAVE=0) shares each group's GEMM among the threads with the
// GEMM's m-split scheme, or split-K with TC_SI=1; interwave (TC_WAVE=1) gives each thread
// whole groups, each GEMM on one thread.
#pragma once

#include <omp.h>

#include <algorithm>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "../gemm/gemm_parallel.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

/// The most floats one scratch matrix (im2col or dcol) holds: 32 MiB.
constexpr index_t kScratchFloats = index_t(1) << 23;
/// Forward runs in bands when they skip at least this share of the layer's products and
/// each band's GEMM has at least kBandRows rows (on a 3x3 or 4x4 map, bands of a few rows ran
/// much slower than the one GEMM they replace).
constexpr double kBandSaving = 0.15;
constexpr index_t kBandRows = 24;
/// Forward packs its A operand (the im2col rows, or x in place) only with at least this many
/// output channels to spread the packing over; with fewer it reads A in place. In paired runs
/// on AVX2, in place was faster at 64 and 128 output channels, level at 256 and slower at 512.
constexpr index_t kPackAMinCols = 256;

template <int Dir>
class GemmConv {
  using View = gemm::StridedView<float>;

 public:
  GemmConv(const ConvShape& shape, const float* in1, const float* in2, int threads)
      : s_(shape), in1_(in1), in2_(in2), threads_(std::max(threads, 1)) {
    taps_ = s_.taps();
    contiguous_x_ = s_.g == 1 && s_.dil[2] == 1;
    in_place_ = taps_ == 1 && s_.stride[0] == 1 && s_.stride[1] == 1 && s_.stride[2] == 1 &&
                s_.pad[0] == 0 && s_.pad[1] == 0 && s_.pad[2] == 0;
    const index_t rows = s_.n * s_.out_pixels(), row_floats = taps_ * s_.c;   // im2col / dcol
    if (in_place_) {
      chunk_rows_ = rows;
    } else if constexpr (Dir == kBwdData) {   // whole images: col2im reads an image's dcol
      chunk_rows_ = s_.out_pixels() *
                    std::clamp<index_t>(kScratchFloats / (s_.out_pixels() * row_floats), 1, s_.n);
    } else {
      chunk_rows_ = std::clamp<index_t>(kScratchFloats / row_floats, 1, rows);
    }
    if (Dir == kForward && !in_place_) plan_bands();
    if (Dir == kBwdData && !in_place_) plan_col2im();
    workers_ = kInterWave ? std::min<index_t>(threads_, s_.g) : 1;
    const int gemm_threads = kInterWave ? 1 : threads_;
    // Measured on AVX2 only: AVX-512 builds (MR 8, whole-vector transposes) keep packing.
    const bool pack_a = Dir != kForward || s_.k >= kPackAMinCols || TC_ISA == 1;
    workers_list_.reserve(workers_);
    for (int w = 0; w < workers_; ++w) {
      Worker& worker = workers_list_.emplace_back();
      if (!in_place_) worker.scratch = FloatBuffer(chunk_rows_ * row_floats);
      if (Dir == kBwdWeight && chunk_rows_ < rows) worker.partial = FloatBuffer(s_.k * row_floats);
      if (bands_.empty()) {
        worker.workspace = gemm::chunk_workspaces(
            chunk_rows_, rows, gemm_threads,
            [&](index_t count) { return problem(0, 0, count, worker, nullptr); }, pack_a);
      }
      for (const Band& band : bands_)
        for (index_t done = 0; done < band.rows && band.taps > 0; done += chunk_rows_) {
          const index_t count = std::min(chunk_rows_, band.rows - done);
          auto& slot = worker.band_workspace[{count, band.taps}];
          if (!slot)
            slot = std::make_unique<gemm::Workspace>(band_problem(0, 0, count, band, worker, nullptr),
                                                     gemm_threads, pack_a);
        }
    }
  }

  void run(float* out) const {
    if constexpr (kInterWave) {
#pragma omp parallel for num_threads(workers_) schedule(static)
      for (index_t g = 0; g < s_.g; ++g) group(g, out, omp_get_thread_num(), 1);
    } else {
      for (index_t g = 0; g < s_.g; ++g) group(g, out, 0, threads_);
    }
  }

 private:
  struct Worker {
    FloatBuffer scratch;   // im2col (forward, bwd_weight) or dcol (bwd_data) of one chunk
    FloatBuffer partial;   // bwd_weight: a chunk's dw when there is more than one chunk
    std::map<index_t, std::unique_ptr<gemm::Workspace>> workspace;   // by chunk rows
    // forward in bands: by (chunk rows, taps)
    std::map<std::pair<index_t, index_t>, std::unique_ptr<gemm::Workspace>> band_workspace;
  };

  /// Output pixels [first, first + rows) of each image whose windows read filter slices
  /// [z0, z1) and rows [y0, y1) (one of the two ranges is the whole extent) and none other:
  /// the taps [tap0, tap0 + taps) of the tap order.
  struct Band {
    index_t first, rows, tap0, taps;
    index_t z0, z1, y0, y1;
  };

  /// Bands over the outermost filter dimension of extent > 1 (depth in 3D, else height),
  /// kept when they skip at least kBandSaving of the products and each band that computes
  /// has kBandRows rows. In 3D with a depth-1 filter the rows of a height band are not one
  /// run (one per output slice): no bands then.
  void plan_bands() {
    const int outer = s_.filt[0] > 1 ? 0 : 1;
    if (outer == 1 && s_.out[0] > 1) return;
    const index_t inner_taps = outer == 0 ? s_.filt[1] * s_.filt[2] : s_.filt[2];
    const index_t pixels_a_step = outer == 0 ? s_.out[1] * s_.out[2] : s_.out[2];
    std::vector<Band> bands;
    index_t useful = 0;
    for (index_t o = 0; o < s_.out[outer]; ++o) {
      index_t lo = 0, hi = s_.filt[outer];
      while (lo < hi && forward_source(s_, outer, o, lo) < 0) ++lo;
      while (hi > lo && forward_source(s_, outer, o, hi - 1) < 0) --hi;
      const Band step{o * pixels_a_step, pixels_a_step, lo * inner_taps, (hi - lo) * inner_taps,
                      outer == 0 ? lo : 0, outer == 0 ? hi : 1,
                      outer == 1 ? lo : 0, outer == 1 ? hi : s_.filt[1]};
      if (!bands.empty() && bands.back().tap0 == step.tap0 && bands.back().taps == step.taps)
        bands.back().rows += pixels_a_step;
      else
        bands.push_back(step);
      useful += step.taps * pixels_a_step;
    }
    for (const Band& band : bands)
      if (band.taps > 0 && band.rows < kBandRows) return;
    if (double(useful) <= (1.0 - kBandSaving) * double(taps_ * s_.out_pixels())) bands_ = std::move(bands);
  }

  /// Group g's forward GEMM over `rows` output pixels of one band from (n, pixel) row `first`:
  /// the band's taps only (the weight rows of taps [tap0, tap0 + taps) are one run).
  gemm::Problem band_problem(index_t g, index_t first, index_t rows, const Band& band,
                             const Worker& worker, float* out) const {
    const index_t depth = taps_ * s_.c, band_depth = band.taps * s_.c, gk = s_.g * s_.k;
    return {rows, s_.k, band_depth, View{worker.scratch.get(), band_depth, 1},
            View{in2_ + g * s_.k * depth + band.tap0 * s_.c, 1, depth},
            out ? out + first * gk + g * s_.k : nullptr, gk};
  }

  /// Group g's GEMM over rows [first, first + rows) of the N*Po (n, output pixel) rows; `c`
  /// (when not null) replaces the natural output (bwd_weight's per-chunk partial).
  gemm::Problem problem(index_t g, index_t first, index_t rows, const Worker& worker,
                        float* out, float* c = nullptr) const {
    const index_t depth = taps_ * s_.c;
    const index_t gc = s_.g * s_.c, gk = s_.g * s_.k;
    float* scratch = worker.scratch.get();
    if constexpr (Dir == kForward) {
      const float* x = in1_ + first * gc + g * s_.c;   // in place: input rows are output rows
      const View a = in_place_ ? View{x, gc, 1} : View{scratch, depth, 1};
      return {rows, s_.k, depth, a, View{in2_ + g * s_.k * depth, 1, depth},
              out ? out + first * gk + g * s_.k : nullptr, gk};
    } else if constexpr (Dir == kBwdData) {
      const View a{in1_ + first * gk + g * s_.k, gk, 1};
      if (in_place_)
        return {rows, s_.c, s_.k, a, View{in2_ + g * s_.k * depth, depth, 1},
                out ? out + first * gc + g * s_.c : nullptr, gc};
      return {rows, depth, s_.k, a, View{in2_ + g * s_.k * depth, depth, 1}, scratch, depth};
    } else {
      const View a{in2_ + first * gk + g * s_.k, 1, gk};
      const float* x = in1_ + first * gc + g * s_.c;
      const View b = in_place_ ? View{x, gc, 1} : View{scratch, depth, 1};
      return {s_.k, depth, rows, a, b, c ? c : (out ? out + g * s_.k * depth : nullptr), depth};
    }
  }

  void group(index_t g, float* out, int worker_index, int threads) const {
    const Worker& worker = workers_list_[worker_index];
    if (!bands_.empty()) {
      forward_bands(g, out, worker, threads);
      return;
    }
    const index_t dw_elems = s_.k * taps_ * s_.c;
    const index_t total = s_.n * s_.out_pixels();
    for (index_t first = 0; first < total; first += chunk_rows_) {
      const index_t rows = std::min(chunk_rows_, total - first);
      if (!in_place_ && Dir != kBwdData) im2col(g, first, rows, worker.scratch.get(), threads);
      const bool summed = Dir == kBwdWeight && first > 0;
      const gemm::Problem p =
          problem(g, first, rows, worker, out, summed ? worker.partial.get() : nullptr);
      gemm::gemm(p, *worker.workspace.at(rows));
      if (Dir == kBwdData && !in_place_)
        col2im(g, first / s_.out_pixels(), rows / s_.out_pixels(), worker.scratch.get(), out, threads);
      if (summed) {
        float* dw = out + g * dw_elems;
        const float* part = worker.partial.get();
#pragma omp parallel for num_threads(threads) schedule(static)
        for (index_t i = 0; i < dw_elems; ++i) dw[i] += part[i];
      }
    }
  }

  /// Group g's forward, band by band of every image.
  void forward_bands(index_t g, float* out, const Worker& worker, int threads) const {
    const index_t gk = s_.g * s_.k;
    for (index_t n = 0; n < s_.n; ++n)
      for (const Band& band : bands_) {
        const index_t image_first = n * s_.out_pixels() + band.first;
        if (band.taps == 0) {   // every tap in the padding
          for (index_t row = 0; row < band.rows; ++row)
            std::fill_n(out + (image_first + row) * gk + g * s_.k, s_.k, 0.0f);
          continue;
        }
        for (index_t done = 0; done < band.rows; done += chunk_rows_) {
          const index_t rows = std::min(chunk_rows_, band.rows - done);
          im2col(g, image_first + done, rows, worker.scratch.get(), threads, band.z0, band.z1,
                 band.y0, band.y1);
          gemm::gemm(band_problem(g, image_first + done, rows, band, worker, out),
                     *worker.band_workspace.at({rows, band.taps}));
        }
      }
  }

  /// Rows [first, first + rows) of the (n, output pixel) rows: per tap (z, y, x) with z in
  /// [z0, z1) and y in [y0, y1) (every tap by default), the C values of group g at the input
  /// pixel the tap reads, or zeros in the padding.
  void im2col(index_t g, index_t first, index_t rows, float* col, int threads, index_t z0 = 0,
              index_t z1 = -1, index_t y0 = 0, index_t y1 = -1) const {
    const index_t c = s_.c, gc = s_.g * s_.c;
    if (z1 < 0) z1 = s_.filt[0];
    if (y1 < 0) y1 = s_.filt[1];
    const index_t row_floats = (z1 - z0) * (y1 - y0) * s_.filt[2] * c;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (index_t row = 0; row < rows; ++row) {
      const Pixel o = split_pixel(first + row, s_.out);
      const float* image = in1_ + o.n * s_.in_pixels() * gc + g * c;
      float* dst = col + row * row_floats;
      for (index_t z = z0; z < z1; ++z) {
        const index_t d = kNdim == 3 ? forward_source(s_, 0, o.d, z) : 0;
        for (index_t y = y0; y < y1; ++y) {
          const index_t h = d < 0 ? -1 : forward_source(s_, 1, o.h, y);
          const float* line = image + (d * s_.in[1] + h) * s_.in[2] * gc;
          if (h >= 0 && contiguous_x_ && forward_source(s_, 2, o.w, 0) >= 0 &&
              forward_source(s_, 2, o.w, s_.filt[2] - 1) >= 0) {
            // one group, undilated, the whole row of taps inside: X * C floats in a run
            const float* src = line + forward_source(s_, 2, o.w, 0) * gc;
            for (index_t l = 0; l < s_.filt[2] * c; ++l) dst[l] = src[l];
            dst += s_.filt[2] * c;
            continue;
          }
          for (index_t x = 0; x < s_.filt[2]; ++x, dst += c) {
            const index_t w = h < 0 ? -1 : forward_source(s_, 2, o.w, x);
            if (w < 0) {
              for (index_t l = 0; l < c; ++l) dst[l] = 0.0f;
            } else {
              const float* src = line + w * gc;
              for (index_t l = 0; l < c; ++l) dst[l] = src[l];
            }
          }
        }
      }
    }
  }

  /// dx of group g for images [first, first + images): each input pixel sums, over the taps,
  /// the dcol columns of the output pixel whose window reads it there.
  void col2im(index_t g, index_t first, index_t images, const float* dcol, float* dx,
              int threads) const {
    const index_t rows = images * s_.in_pixels(), c = s_.c, gc = s_.g * s_.c;
    const Cover* covers[3] = {covers_[0].data(), covers_[1].data(), covers_[2].data()};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (index_t row = 0; row < rows; ++row) {
      const Pixel i = split_pixel(row, s_.in);
      const float* image = dcol + i.n * s_.out_pixels() * taps_ * c;
      float* dst = dx + (first * s_.in_pixels() + row) * gc + g * c;
      std::fill(dst, dst + c, 0.0f);
      const index_t at[3] = {kNdim == 3 ? i.d : 0, i.h, i.w};
      // the (filter offset, output coordinate) pairs that cover this pixel along each dim,
      // looked up: no division by the stride a tap
      for (index_t a = cover_start_[0][at[0]]; a < cover_start_[0][at[0] + 1]; ++a)
        for (index_t b = cover_start_[1][at[1]]; b < cover_start_[1][at[1] + 1]; ++b) {
          const index_t tap_zy = (covers[0][a].f * s_.filt[1] + covers[1][b].f) * s_.filt[2];
          const index_t out_zy = (covers[0][a].o * s_.out[1] + covers[1][b].o) * s_.out[2];
          for (index_t e = cover_start_[2][at[2]]; e < cover_start_[2][at[2] + 1]; ++e) {
            const float* src = image + ((out_zy + covers[2][e].o) * taps_ + tap_zy + covers[2][e].f) * c;
            for (index_t l = 0; l < c; ++l) dst[l] += src[l];
          }
        }
    }
  }

  /// col2im's lookup: for each input coordinate along each dim, the (filter offset, output
  /// coordinate) pairs whose forward window reads it (backward_source), in filter order.
  void plan_col2im() {
    for (int dim = 0; dim < 3; ++dim) {
      cover_start_[dim].push_back(0);
      for (index_t in = 0; in < s_.in[dim]; ++in) {
        for (index_t f = 0; f < s_.filt[dim]; ++f) {
          const index_t o = backward_source(s_, dim, in, f);
          if (o >= 0) covers_[dim].push_back({f, o});
        }
        cover_start_[dim].push_back(index_t(covers_[dim].size()));
      }
    }
  }

  ConvShape s_;
  const float* in1_;
  const float* in2_;
  int threads_;
  index_t taps_ = 1;
  bool in_place_ = false;
  bool contiguous_x_ = false;   // a row of x taps reads X * C consecutive floats of x
  index_t chunk_rows_ = 1;   // rows of the N*Po (n, output pixel) rows per GEMM
  int workers_ = 1;
  std::vector<Worker> workers_list_;
  std::vector<Band> bands_;   // forward in bands (plan_bands), or empty
  struct Cover {
    index_t f, o;   // filter offset, output coordinate
  };
  // bwd_data's col2im (plan_col2im): covers_[dim][cover_start_[dim][i] ...
  // cover_start_[dim][i + 1]) cover input coordinate i
  std::vector<Cover> covers_[3];
  std::vector<index_t> cover_start_[3];
};

}  // namespace tc::gconv
