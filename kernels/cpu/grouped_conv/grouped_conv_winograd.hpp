// The "winograd" pipeline: 3x3, stride 1, undilated 2D layers, forward and bwd_data, as
// Winograd F(2x2, 3x3) on tilecast's GEMM library. Each 2x2 block of outputs (a tile) is
// computed from the 4x4 block of inputs around it:
//
//   Y = A^T [ (G w G^T) .* (B^T d B) ] A      (per input channel, summed over channels)
//
// so the 16 elements of the transformed domain are 16 independent GEMMs, each over the
// channels: M_e (tiles x Ko) = V_e (tiles x Ci) x U_e (Ci x Ko), 16 multiply-adds per tile
// and channel pair where a direct 3x3 convolution has 36 (2.25x fewer flops), plus the three
// transforms, which read and write every element once (weight each call, input and output
// per tile).
//
// bwd_data of a stride-1 3x3 convolution is itself one: dx = conv(dy, w flipped in y and x,
// C and K swapped, padding 2 - pad), so both directions run the same code on the
// "forward-equivalent" problem (Ci in, Ko out, offset = its padding, negative when pad > 2).
//
// Scratch is bounded (kScratchFloats): tiles are taken a chunk at a time. Parallelism:
// intrawave (TC_WAVE=0) shares each of the 16 GEMMs among the threads (the GEMM's m-split);
// interwave (TC_WAVE=1) gives each thread whole GEMMs of the 16, each on one thread. The
// transforms split tiles (or weight rows) among the threads either way.
#pragma once

#include <omp.h>

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include "../gemm/gemm_parallel.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

template <int Dir>
class WinogradConv {
  using View = gemm::StridedView<float>;
  static constexpr int kElems = 16;                       // the 4x4 transformed domain
  static constexpr index_t kScratchFloats = index_t(1) << 23;   // V and M of one chunk

 public:
  WinogradConv(const ConvShape& shape, const float* in1, const float* in2, int threads)
      : s_(shape), src_(in1), weight_(in2), threads_(std::max(threads, 1)) {
    // forward-equivalent problem: src (in_h x in_w x Ci) -> dst (out_h x out_w x Ko)
    const bool fwd = Dir == kForward;
    ci_ = fwd ? s_.c : s_.k;
    ko_ = fwd ? s_.k : s_.c;
    src_h_ = fwd ? s_.in[1] : s_.out[1];
    src_w_ = fwd ? s_.in[2] : s_.out[2];
    dst_h_ = fwd ? s_.out[1] : s_.in[1];
    dst_w_ = fwd ? s_.out[2] : s_.in[2];
    pad_h_ = fwd ? s_.pad[1] : 2 - s_.pad[1];
    pad_w_ = fwd ? s_.pad[2] : 2 - s_.pad[2];
    tiles_h_ = ceil_div(dst_h_, 2);
    tiles_w_ = ceil_div(dst_w_, 2);
    tiles_ = s_.n * tiles_h_ * tiles_w_;
    chunk_ = std::clamp<index_t>(kScratchFloats / (kElems * (ci_ + ko_)), 1, tiles_);
    u_ = FloatBuffer(kElems * ci_ * ko_);
    v_ = FloatBuffer(kElems * chunk_ * ci_);
    m_ = FloatBuffer(kElems * chunk_ * ko_);
    zeros_ = FloatBuffer(ci_);
    // interwave: one set of GEMM workspaces per thread, each GEMM on one thread
    for (int w = 0; w < (kInterWave ? threads_ : 1); ++w)
      workspaces_.push_back(gemm::chunk_workspaces(chunk_, tiles_, kInterWave ? 1 : threads_,
                                                   [&](index_t rows) { return problem(0, rows); }));
  }

  void run(float* out) const {
    for (index_t g = 0; g < s_.g; ++g) {
      transform_weight(g);
      for (index_t first = 0; first < tiles_; first += chunk_) {
        const index_t rows = std::min(chunk_, tiles_ - first);
        transform_input(g, first, rows);
        if constexpr (kInterWave) {
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
          for (int e = 0; e < kElems; ++e)
            gemm::gemm(problem(e, rows), *workspaces_[omp_get_thread_num()].at(rows));
        } else {
          for (int e = 0; e < kElems; ++e) gemm::gemm(problem(e, rows), *workspaces_[0].at(rows));
        }
        transform_output(g, first, rows, out);
      }
    }
  }

 private:
  /// Element e's GEMM of a chunk of `rows` tiles: M_e = V_e x U_e. U_e is Ci x Ko; forward
  /// stores it as Ko rows of Ci (the weight's own order), bwd_data as Ci rows of Ko.
  gemm::Problem problem(int e, index_t rows) const {
    const float* u = u_.get() + e * ci_ * ko_;
    const View b = Dir == kForward ? View{u, 1, ci_} : View{u, ko_, 1};
    return {rows, ko_, ci_, View{v_.get() + e * chunk_ * ci_, ci_, 1}, b,
            m_.get() + e * chunk_ * ko_, ko_};
  }

  /// U = G w G^T for every (outer, inner) channel pair of group g, where the weight is read
  /// as [outer][tap][inner] with inner contiguous: forward (Ko, Ci), bwd_data (Ci, Ko) with
  /// the taps flipped. G = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1].
  void transform_weight(index_t g) const {
    const index_t outer = Dir == kForward ? ko_ : ci_, inner = Dir == kForward ? ci_ : ko_;
    const float* w = weight_ + g * s_.k * 9 * s_.c;
    float* u = u_.get();
    const index_t plane = ci_ * ko_;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (index_t o = 0; o < outer; ++o) {
      const float* row = w + o * 9 * inner;
      float* dst = u + o * inner;
#pragma omp simd
      for (index_t i = 0; i < inner; ++i) {
        float t[3][3];
        for (int r = 0; r < 3; ++r)
          for (int c = 0; c < 3; ++c) {
            const int tap = Dir == kForward ? r * 3 + c : (2 - r) * 3 + (2 - c);
            t[r][c] = row[tap * inner + i];
          }
        float gw[4][3];
        for (int c = 0; c < 3; ++c) {
          gw[0][c] = t[0][c];
          gw[1][c] = 0.5f * (t[0][c] + t[1][c] + t[2][c]);
          gw[2][c] = 0.5f * (t[0][c] - t[1][c] + t[2][c]);
          gw[3][c] = t[2][c];
        }
        for (int a = 0; a < 4; ++a) {
          dst[(a * 4 + 0) * plane + i] = gw[a][0];
          dst[(a * 4 + 1) * plane + i] = 0.5f * (gw[a][0] + gw[a][1] + gw[a][2]);
          dst[(a * 4 + 2) * plane + i] = 0.5f * (gw[a][0] - gw[a][1] + gw[a][2]);
          dst[(a * 4 + 3) * plane + i] = gw[a][2];
        }
      }
    }
  }

  /// Tile `tile` of the N x tiles_h x tiles_w tiles as (image, tile row, tile column).
  struct TileAt {
    index_t n, th, tw;
  };
  TileAt tile_at(index_t tile) const {
    return {tile / (tiles_h_ * tiles_w_), tile / tiles_w_ % tiles_h_, tile % tiles_w_};
  }

  /// V = B^T d B for tiles [first, first + rows) of group g: d is the 4x4 block of source
  /// pixels at (2 th - pad_h, 2 tw - pad_w), zeros outside the source.
  /// B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1].
  void transform_input(index_t g, index_t first, index_t rows) const {
    const index_t gc = s_.g * ci_;
    const index_t plane = chunk_ * ci_;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (index_t row = 0; row < rows; ++row) {
      const auto [n, th, tw] = tile_at(first + row);
      const float* at[4][4];
      for (int a = 0; a < 4; ++a)
        for (int b = 0; b < 4; ++b) {
          const index_t h = 2 * th - pad_h_ + a, w = 2 * tw - pad_w_ + b;
          at[a][b] = h >= 0 && h < src_h_ && w >= 0 && w < src_w_
                         ? src_ + ((n * src_h_ + h) * src_w_ + w) * gc + g * ci_
                         : zeros_.get();
        }
      float* dst = v_.get() + row * ci_;
#pragma omp simd
      for (index_t c = 0; c < ci_; ++c) {
        float d[4][4], e[4][4];
        for (int a = 0; a < 4; ++a)
          for (int b = 0; b < 4; ++b) d[a][b] = at[a][b][c];
        for (int b = 0; b < 4; ++b) {
          e[0][b] = d[0][b] - d[2][b];
          e[1][b] = d[1][b] + d[2][b];
          e[2][b] = d[2][b] - d[1][b];
          e[3][b] = d[1][b] - d[3][b];
        }
        for (int a = 0; a < 4; ++a) {
          dst[(a * 4 + 0) * plane + c] = e[a][0] - e[a][2];
          dst[(a * 4 + 1) * plane + c] = e[a][1] + e[a][2];
          dst[(a * 4 + 2) * plane + c] = e[a][2] - e[a][1];
          dst[(a * 4 + 3) * plane + c] = e[a][1] - e[a][3];
        }
      }
    }
  }

  /// Y = A^T M A for tiles [first, first + rows) of group g, written to the 2x2 outputs
  /// inside the destination. A^T = [1 1 1 0; 0 1 -1 -1].
  void transform_output(index_t g, index_t first, index_t rows, float* out) const {
    const index_t gk = s_.g * ko_;
    const index_t plane = chunk_ * ko_;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (index_t row = 0; row < rows; ++row) {
      const auto [n, th, tw] = tile_at(first + row);
      const float* m = m_.get() + row * ko_;
      const index_t h0 = 2 * th, w0 = 2 * tw;
      const bool h1 = h0 + 1 < dst_h_, w1 = w0 + 1 < dst_w_;
      float* y[2][2];
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b)
          y[a][b] = out + ((n * dst_h_ + h0 + (a && h1)) * dst_w_ + w0 + (b && w1)) * gk + g * ko_;
      // an edge tile's missing row or column is computed and dropped: its pointer repeats
      // the valid one, written first and then overwritten with the valid value last
#pragma omp simd
      for (index_t k = 0; k < ko_; ++k) {
        float r[2][4];
        for (int b = 0; b < 4; ++b) {
          const float m0 = m[(0 * 4 + b) * plane + k], m1 = m[(1 * 4 + b) * plane + k],
                      m2 = m[(2 * 4 + b) * plane + k], m3 = m[(3 * 4 + b) * plane + k];
          r[0][b] = m0 + m1 + m2;
          r[1][b] = m1 - m2 - m3;
        }
        for (int a = 1; a >= 0; --a) {
          y[a][1][k] = r[a][1] - r[a][2] - r[a][3];
          y[a][0][k] = r[a][0] + r[a][1] + r[a][2];
        }
      }
    }
  }

  ConvShape s_;
  const float* src_;
  const float* weight_;
  int threads_;
  index_t ci_ = 0, ko_ = 0, src_h_ = 0, src_w_ = 0, dst_h_ = 0, dst_w_ = 0;
  index_t pad_h_ = 0, pad_w_ = 0, tiles_h_ = 0, tiles_w_ = 0, tiles_ = 0, chunk_ = 1;
  FloatBuffer u_, v_, m_;
  FloatBuffer zeros_;   // Ci zeros: what a tile's pixels outside the source read
  std::vector<std::map<index_t, std::unique_ptr<gemm::Workspace>>> workspaces_;
};

}  // namespace tc::gconv
