// The convolution problem of one job: parsing, output sizes, support checks,
// coordinate helpers and the aligned buffers every direction works on.
//
// Spatial arrays are indexed [0] depth, [1] height, [2] width. C and K are per group.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "grouped_conv_config.hpp"

namespace tc::gconv {

struct ConvShape {
  index_t n = 0, g = 0, c = 0, k = 0;
  index_t in[3]{}, filt[3]{}, stride[3]{}, pad[3]{}, dil[3]{}, out[3]{};

  index_t in_pixels() const { return in[0] * in[1] * in[2]; }
  index_t out_pixels() const { return out[0] * out[1] * out[2]; }
  index_t taps() const { return filt[0] * filt[1] * filt[2]; }
  index_t input_elems() const { return n * in_pixels() * g * c; }
  index_t output_elems() const { return n * out_pixels() * g * k; }
  index_t weight_elems() const { return g * k * taps() * c; }
};

/// Number of tokens on a job line (id + 19 integers + 3 paths).
constexpr std::size_t kJobTokens = 23;
constexpr const char* kJobLineHelp =
    "<id> <N> <G> <C> <K> <Di> <Hi> <Wi> <Z> <Y> <X> <stride_d> <stride_h> <stride_w> "
    "<pad_d> <pad_h> <pad_w> <dil_d> <dil_h> <dil_w> <in1_path> <in2_path> <out_path>";

namespace detail {

inline index_t parse_int(const char* name, const std::string& text, index_t min_value) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0)
    throw std::invalid_argument(std::string(name) + " is not an integer: '" + text + "'");
  if (value < min_value)
    throw std::invalid_argument(std::string(name) + " must be >= " + std::to_string(min_value) +
                                ", got " + text);
  return value;
}

}  // namespace detail

/// Parses tokens[1..19] of a job line; throws std::invalid_argument naming the bad token.
inline ConvShape parse_shape(const std::vector<std::string>& tokens) {
  static const char* const kSpatial[5][3] = {{"Di", "Hi", "Wi"},
                                             {"Z", "Y", "X"},
                                             {"stride_d", "stride_h", "stride_w"},
                                             {"pad_d", "pad_h", "pad_w"},
                                             {"dil_d", "dil_h", "dil_w"}};
  ConvShape shape;
  shape.n = detail::parse_int("N", tokens[1], 1);
  shape.g = detail::parse_int("G", tokens[2], 1);
  shape.c = detail::parse_int("C", tokens[3], 1);
  shape.k = detail::parse_int("K", tokens[4], 1);
  index_t* fields[5] = {shape.in, shape.filt, shape.stride, shape.pad, shape.dil};
  for (int field = 0; field < 5; ++field)
    for (int dim = 0; dim < 3; ++dim)
      fields[field][dim] = detail::parse_int(kSpatial[field][dim], tokens[5 + field * 3 + dim],
                                             field == 3 ? 0 : 1);
  return shape;
}

/// Fills shape.out; returns why this binary cannot run the shape, or "" when it can.
inline std::string check_supported(ConvShape& shape) {
  static const char* const kDimNames[3] = {"d", "h", "w"};
  // Every size fits easily in 2^40; beyond that products of sizes could overflow.
  const index_t kMaxSize = index_t(1) << 20;
  for (index_t value : {shape.n, shape.g, shape.c, shape.k})
    if (value > kMaxSize) return "a size above 2^20 in N/G/C/K";
  for (int dim = 0; dim < 3; ++dim) {
    if (shape.in[dim] > kMaxSize || shape.filt[dim] > kMaxSize || shape.stride[dim] > kMaxSize ||
        shape.pad[dim] > kMaxSize || shape.dil[dim] > kMaxSize)
      return std::string("a spatial size above 2^20 in dim ") + kDimNames[dim];
    const index_t span = shape.in[dim] + 2 * shape.pad[dim] - shape.dil[dim] * (shape.filt[dim] - 1) - 1;
    if (span < 0)
      return std::string("empty output in dim ") + kDimNames[dim] + ": input " +
             std::to_string(shape.in[dim]) + " + 2*pad " + std::to_string(shape.pad[dim]) +
             " is smaller than the dilated filter " +
             std::to_string(shape.dil[dim] * (shape.filt[dim] - 1) + 1);
    shape.out[dim] = span / shape.stride[dim] + 1;
  }
  if (kNdim == 2 && (shape.in[0] != 1 || shape.filt[0] != 1 || shape.stride[0] != 1 ||
                     shape.pad[0] != 0 || shape.dil[0] != 1))
    return "2D binary needs Di=Z=stride_d=dil_d=1 and pad_d=0, got Di=" + std::to_string(shape.in[0]) +
           " Z=" + std::to_string(shape.filt[0]) + " stride_d=" + std::to_string(shape.stride[0]) +
           " pad_d=" + std::to_string(shape.pad[0]) + " dil_d=" + std::to_string(shape.dil[0]) +
           "; use a TC_NDIM=3 binary";
  const index_t kMaxElems = index_t(1) << 31;
  if (shape.input_elems() > kMaxElems || shape.output_elems() > kMaxElems ||
      shape.weight_elems() > kMaxElems)
    return "a tensor above 2^31 elements";
  if (kPipeline == kDw && (shape.c != 1 || shape.k != 1))
    return "dw pipeline needs C == 1 and K == 1 per group, got C=" + std::to_string(shape.c) +
           ", K=" + std::to_string(shape.k);
  if (kPipeline == kWinograd && (shape.filt[1] != 3 || shape.filt[2] != 3 || shape.stride[1] != 1 ||
                                 shape.stride[2] != 1 || shape.dil[1] != 1 || shape.dil[2] != 1 ||
                                 shape.in[0] != 1 || shape.filt[0] != 1))
    return "winograd pipeline needs a 2D 3x3 filter with stride 1 and dilation 1, got " +
           std::to_string(shape.filt[0]) + "x" + std::to_string(shape.filt[1]) + "x" +
           std::to_string(shape.filt[2]) + " stride " + std::to_string(shape.stride[1]) + "x" +
           std::to_string(shape.stride[2]) + " dilation " + std::to_string(shape.dil[1]) + "x" +
           std::to_string(shape.dil[2]) + " Di=" + std::to_string(shape.in[0]);
  return "";
}

/// One pixel of an N x D x H x W tensor. 2D binaries never touch d.
struct Pixel {
  index_t n, d, h, w;
};

/// Flattened (n, d, h, w) index -> coordinates for spatial dims `dims`.
inline Pixel split_pixel(index_t index, const index_t dims[3]) {
  Pixel pixel;
  pixel.w = index % dims[2];
  index /= dims[2];
  pixel.h = index % dims[1];
  index /= dims[1];
  if constexpr (kNdim == 3) {
    pixel.d = index % dims[0];
    index /= dims[0];
  } else {
    pixel.d = 0;
  }
  pixel.n = index;
  return pixel;
}

/// Flattened (z, y, x) tap index -> coordinates, as a Pixel with n = 0.
inline Pixel split_tap(index_t tap, const index_t filt[3]) {
  Pixel coords = split_pixel(tap, filt);
  coords.n = 0;
  return coords;
}

/// Input coordinate the forward window of output coordinate `out` reads at
/// filter offset `f` along `dim`, or -1 when it falls in the padding.
inline index_t forward_source(const ConvShape& s, int dim, index_t out, index_t f) {
  const index_t in = out * s.stride[dim] - s.pad[dim] + f * s.dil[dim];
  return in >= 0 && in < s.in[dim] ? in : -1;
}

/// Output coordinate whose forward window reads input coordinate `in` at filter
/// offset `f` along `dim`, or -1 when there is none (the transpose of forward_source).
inline index_t backward_source(const ConvShape& s, int dim, index_t in, index_t f) {
  index_t out = in + s.pad[dim] - f * s.dil[dim];
  if (out < 0) return -1;
  if (s.stride[dim] != 1) {
    if (out % s.stride[dim] != 0) return -1;
    out /= s.stride[dim];
  }
  return out < s.out[dim] ? out : -1;
}

/// The source coordinate a gather of direction `Dir` reads: forward_source for the
/// forward pass, backward_source for bwd_data.
template <int Dir>
inline index_t gather_source(const ConvShape& s, int dim, index_t dst, index_t f) {
  if constexpr (Dir == kForward) return forward_source(s, dim, dst, f);
  else return backward_source(s, dim, dst, f);
}

/// Valid output range [lo, hi) along `dim` for filter offset f: the outputs
/// whose forward source coordinate is inside the input. Empty when lo >= hi.
inline void forward_valid_range(const ConvShape& s, int dim, index_t f, index_t& lo, index_t& hi) {
  const index_t shift = s.pad[dim] - f * s.dil[dim];  // in = out*stride - shift
  const index_t stride = s.stride[dim];
  lo = shift > 0 ? (shift + stride - 1) / stride : 0;
  const index_t last = s.in[dim] - 1 + shift;  // out*stride <= last
  hi = last >= 0 ? std::min(last / stride + 1, s.out[dim]) : 0;
}

inline index_t ceil_div(index_t a, index_t b) { return (a + b - 1) / b; }
inline index_t round_up(index_t a, index_t b) { return ceil_div(a, b) * b; }

/// Zeroed, 64-byte aligned floats with `kSlack` readable floats past the end:
/// micro-kernels may read a full vector past a tensor's last valid element
/// into rows/columns whose results are discarded.
class FloatBuffer {
 public:
  static constexpr index_t kSlack = 64;
  FloatBuffer() = default;
  /// Only the slack is zeroed with zero_all false: for a buffer the caller fills at once.
  explicit FloatBuffer(index_t count, bool zero_all = true) : count_(count) {
    const std::size_t floats = std::size_t(round_up(count + kSlack, 16));
    void* memory = nullptr;
    if (posix_memalign(&memory, 64, floats * sizeof(float)) != 0) throw std::bad_alloc();
    data_.reset(static_cast<float*>(memory));
    std::fill(data_.get() + (zero_all ? 0 : count), data_.get() + floats, 0.0f);
  }
  float* get() const { return data_.get(); }
  index_t size() const { return count_; }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  index_t count_ = 0;
  std::unique_ptr<float[], Free> data_;
};

/// [begin, end) of part `index` when `count` units are split into `parts` near-equal ranges.
inline void split_range(index_t count, int parts, int index, index_t& begin, index_t& end) {
  begin = count * index / parts;
  end = count * (index + 1) / parts;
}

}  // namespace tc::gconv
