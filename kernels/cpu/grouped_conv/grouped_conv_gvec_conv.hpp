// The gvec pipeline's kernel object (grouped_conv_gvec.hpp): its plan, made once per layer in
// the constructor (column blocks, phases, copies), and the entry that picks the tile's
// compile-time shape. The member functions are defined in grouped_conv_gvec_gather.hpp,
// _weight_grad.hpp, _in_place.hpp and _layout.hpp.
#pragma once

#include <omp.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "grouped_conv_gvec_tiles.hpp"
#include "grouped_conv_lanes.hpp"
#include "grouped_conv_shape.hpp"

namespace tc::gconv {

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
      // pixels at its ends alone, with only their taps, slowed a 3D 7x7x7 stem)
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
  using InPlaceLine = gvec::InPlaceLine;

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

  // the tiled path over the source's padded copy (grouped_conv_gvec_gather.hpp)
  template <int Gv, int SB, int NV>
  void run_gather(float* out) const;
  template <int Gv, int SB, int NV, int MR>
  void block(float* out, const float* src, index_t cb_begin, index_t cb_end, const Phase& phase,
             index_t m_begin, index_t m_end) const;
  template <int Gv, int SB, int NV, int MR>
  TC_INLINE void tile(float* out, const float* src, index_t cb, const Phase& phase, index_t m0,
                      Pixel first, index_t rows, index_t k_begin, index_t k_end) const;
  template <int Gv, int NV, int MR>
  TC_INLINE void store(const Row (*acc)[NV], float* out, index_t cb, const index_t* dst_pixel, index_t rows,
                       bool accumulate) const;

  // bwd_weight (grouped_conv_gvec_weight_grad.hpp)
  template <int Gv, int NV>
  void run_weight_grad(float* out) const;
  template <int NV>
  void pack_dout() const;
  template <int Gv, int NV, int R>
  void weight_grad_pairs(float* out, index_t cb, index_t pair_begin) const;

  // the source in place (grouped_conv_gvec_in_place.hpp)
  template <bool Channels>
  void in_place_block(float* out, const Phase& phase, index_t cb_begin, index_t cb_end, index_t m_begin,
                      index_t m_end, index_t* scratch) const;
  template <int MR, bool Partial, bool Channels>
  void in_place_line(const InPlaceLine& line, index_t begin, index_t lo, index_t hi, index_t end,
                     index_t kept, index_t stride, index_t* scratch) const;
  void pad_along_w() const;

  // the packed copies and the phases (grouped_conv_gvec_layout.hpp)
  void pack_weight() const;
  template <int Gv>
  void relayout() const;
  void plan_phases();
  index_t padded_pixel(const Pixel& p, int scale) const;
  static TC_INLINE void advance(Pixel& p, index_t count, const index_t (&dims)[3]);

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
