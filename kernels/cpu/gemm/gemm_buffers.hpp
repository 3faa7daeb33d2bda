// Scratch buffers of one GEMM job, and how work is split between threads.
#pragma once

#include <cstdlib>
#include <memory>
#include <new>

#include "gemm_config.hpp"
#include "gemm_pack.hpp"

namespace tc::gemm {

/// A 64-byte aligned float buffer, freed with the job.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(index_t count) {
    if (count <= 0) return;
    const std::size_t bytes = round_up(count * index_t(sizeof(float)), 64);
    void* memory = nullptr;
    if (posix_memalign(&memory, 64, bytes) != 0) throw std::bad_alloc();
    data_.reset(static_cast<float*>(memory));
  }
  float* get() const { return data_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float[], Free> data_;
};

/// Per-thread slices are padded to whole pages so threads never share a line
/// and slices do not alias in the cache sets.
constexpr index_t kSliceAlignFloats = 4096 / sizeof(float);

/// A buffer of `slices` equal, page-aligned slices of `count` floats.
class SlicedBuffer {
 public:
  SlicedBuffer() = default;
  SlicedBuffer(index_t slices, index_t count)
      : stride_(round_up(count, kSliceAlignFloats)), buffer_(slices * stride_) {}
  float* slice(int index) const { return buffer_.get() + index * stride_; }
  index_t stride() const { return stride_; }

 private:
  index_t stride_ = 0;
  AlignedBuffer buffer_;
};

/// [begin, end) of part `index` when `count` units are split into `parts`
/// near-equal contiguous ranges.
inline void split_range(index_t count, int parts, int index, index_t& begin, index_t& end) {
  begin = count * index / parts;
  end = count * (index + 1) / parts;
}

}  // namespace tc::gemm
