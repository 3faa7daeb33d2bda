// CUDA DISCO contraction with psi in CSR: the kernels and their extern "C" entry points for
// ctypes (tilecast/disco/cuda.py). Raw device pointers in, float32 / bfloat16 / float16
// activations computed in float32, launched on the caller's stream. No torch dependency:
// builds with nvcc alone.
//
// Files: disco_csr.cuh (shared types, checks, conversions), disco_csr_forward.cuh and
// disco_csr_transpose.cuh (each direction's staging, FMAs and stores), disco_csr_cta.cuh
// (one CTA's loop over them), this file (kernels, variant tables, entry points),
// disco_csr_emulate.cu (the same CTAs run on the CPU, for tests without a GPU).
//
// Return value: 0 ok, else a Status (disco_csr.cuh); kCudaErrorBase + a cudaError_t when the
// launch failed. psi's offsets and columns are not checked here (that would need a copy to
// the host or a sync); the kernels clamp them so that bad ones read no memory outside psi
// and the planes, and tilecast/disco/cuda.py checks each psi once.
#include <cuda_runtime.h>

#include <cstdint>

#include "disco_csr_cta.cuh"
#include "disco_csr_forward.cuh"
#include "disco_csr_transpose.cuh"

namespace tc::disco_cuda {
namespace {

/// The CTA body as one thread of a real CTA: its sums stay in registers.
template <int BT>
struct DeviceCta {
  StagedEntries& staged;
  Accumulators<BT> acc;

  template <typename F>
  __device__ __forceinline__ void each_thread(F&& f) {
    f(static_cast<int>(threadIdx.x), acc);
  }
  __device__ __forceinline__ void sync() { __syncthreads(); }
};

template <typename Direction, int BT, typename Elem>
__global__ void __launch_bounds__(kThreads) disco_csr_kernel(Operands<Elem> a, Grid grid) {
  __shared__ StagedEntries staged;
  DeviceCta<BT> cta{staged, {}};
  run_cta<Direction, BT>(cta, a, grid, blockIdx.x);
}

template <typename Elem>
using Kernel = void (*)(Operands<Elem>, Grid);

/// One instantiation per channel tile BT (the seed's BC_TILE), chosen per call.
template <typename Elem>
struct TileVariant {
  int channels;
  Kernel<Elem> kernel;
};

template <typename Direction, typename Elem>
Kernel<Elem> kernel_for(int channels) {
  static constexpr TileVariant<Elem> variants[] = {{1, disco_csr_kernel<Direction, 1, Elem>},
                                                   {4, disco_csr_kernel<Direction, 4, Elem>},
                                                   {8, disco_csr_kernel<Direction, 8, Elem>}};
  for (const TileVariant<Elem>& variant : variants)
    if (variant.channels == channels) return variant.kernel;
  return nullptr;
}

/// Selects the device for one call and restores the caller's afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    status_ = cudaGetDevice(&previous_);
    if (status_ == cudaSuccess && previous_ != device) status_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  cudaError_t status_;
};

int cuda_status(cudaError_t err) {
  return err == cudaSuccess ? kOk : kCudaErrorBase + static_cast<int>(err);
}

template <typename Direction, typename Elem>
int launch(const void* src, void* dst, const Dims& d, const index_t* offsets,
           const index_t* columns, const float* vals, index_t nnz, cudaStream_t stream) {
  const int channels = channel_tile_for(d.bc);
  const Grid grid = grid_for(Direction::items(d), d, channels);
  const Operands<Elem> a{static_cast<const Elem*>(src), static_cast<Elem*>(dst), d, offsets,
                         columns, vals, nnz};
  kernel_for<Direction, Elem>(channels)<<<static_cast<unsigned>(grid.ctas()), kThreads, 0, stream>>>(a, grid);
  return cuda_status(cudaGetLastError());
}

using Launcher = int (*)(const void*, void*, const Dims&, const index_t*, const index_t*,
                         const float*, index_t, cudaStream_t);

/// The launcher of each storage type, indexed by its Storage code.
template <typename Direction>
Launcher launcher_for(int storage) {
  static constexpr Launcher launchers[] = {launch<Direction, float>,
                                           launch<Direction, __nv_bfloat16>,
                                           launch<Direction, __half>};
  return launchers[storage];
}

template <typename Direction>
int run(const void* src, void* dst, const Dims& d, const index_t* offsets,
        const index_t* columns, const float* vals, index_t nnz, int storage, int device,
        void* stream) {
  const Status shape = check_dims(d);
  if (shape != kOk) return shape;
  if (storage < kFloat32 || storage > kFloat16) return kBadStorage;
  if (nnz < 0) return kBadShape;
  const DeviceScope scope(device);
  if (scope.status() != cudaSuccess) return cuda_status(scope.status());
  return launcher_for<Direction>(storage)(src, dst, d, offsets, columns, vals, nnz,
                                          static_cast<cudaStream_t>(stream));
}

}  // namespace
}  // namespace tc::disco_cuda

extern "C" {

using tc::disco_cuda::Dims;
using tc::disco_cuda::index_t;

/// y (bc, k, ho, wo) = psi contracted with x (bc, hi, wi), both of `storage` type on
/// `device`; psi rows k*ho_n+ho in CSR (roff [k*ho_n + 1], col = hi*wi_n + wi, vals), device
/// pointers. Enqueued on `stream` (a cudaStream_t; null: the legacy default stream).
int tc_disco_cuda_contraction(const void* x, void* y, index_t bc, index_t hi, index_t wi,
                              index_t k, index_t ho, index_t wo, const std::int64_t* roff,
                              const std::int64_t* col, const float* vals, index_t nnz,
                              int storage, int device, void* stream) {
  return tc::disco_cuda::run<tc::disco_cuda::Forward>(x, y, Dims{bc, hi, wi, k, ho, wo}, roff,
                                                      col, vals, nnz, storage, device, stream);
}

/// gx (bc, hi, wi) = the adjoint of tc_disco_cuda_contraction applied to gy (bc, k, ho, wo),
/// with psi transposed: rows hi*s + p (s = wi / wo), col = (k*ho_n + ho)*wo_n + q, vals.
int tc_disco_cuda_transpose_contraction(const void* gy, void* gx, index_t bc, index_t hi,
                                        index_t wi, index_t k, index_t ho, index_t wo,
                                        const std::int64_t* troff, const std::int64_t* tcol,
                                        const float* tvals, index_t nnz, int storage, int device,
                                        void* stream) {
  return tc::disco_cuda::run<tc::disco_cuda::Transpose>(gy, gx, Dims{bc, hi, wi, k, ho, wo},
                                                        troff, tcol, tvals, nnz, storage, device,
                                                        stream);
}

/// Channels per CTA (BC_TILE) for bc channels: 8, 4 or 1.
int tc_disco_cuda_channel_tile(index_t bc) { return tc::disco_cuda::channel_tile_for(bc); }

/// CUDA's description of a status >= kCudaErrorBase; null for other statuses.
const char* tc_disco_cuda_error_string(int status) {
  if (status < tc::disco_cuda::kCudaErrorBase) return nullptr;
  return cudaGetErrorString(static_cast<cudaError_t>(status - tc::disco_cuda::kCudaErrorBase));
}

}  // extern "C"
