// Helpers shared by the CUDA kernels: element conversions, 16-byte packets, device properties, and the plan entry
// points (each plan op also runs inside its attention op when no plan is passed).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <optional>

#include "checks.h"
#include "dispatch.h"

namespace fdc::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(c10::Half x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}

// Elements of T in one 16-byte packet (the unit of ld.global.v4 / cp.async.cg): 8 halves or 4 floats. Every packed
// width is a multiple of 8 elements, so a head's row segment is a whole number of packets in every dtype.
template <typename T>
constexpr int kPacket = 16 / static_cast<int>(sizeof(T));

// Streaming multiprocessors of the current device: the default worker count of the device planners.
inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

at::Tensor decode_plan_cuda(const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets,
                            const at::Tensor& v_offsets, int64_t group, std::optional<int64_t> num_workers);

}  // namespace fdc::cuda
