// The torch-free half of the CUDA helpers: element conversions, quantized codes, 16-byte packets and cp.async, and
// the status a kernel's launcher hands back. The kernel headers (decode_kernels.cuh, prefill_kernels.cuh) and the
// instantiations compiled from them (generated/) include only this and include/fdc, so that each of those units
// compiles without parsing torch's ATen headers: about 33 of nvcc's 35 s for a one-kernel unit on the 2-core build
// machine (bench/results/ci/README.md). cuda_common.cuh adds the ATen-facing half, which raises the ops' errors.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fdc/kv_format.h"

namespace fdc::cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(c10::Half x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}

// A quantized cache's code (fdc/kv_format.h) as a float, before its scale: a one-byte code of an int8 cache (two's
// complement) or a float8 e4m3fn one (cuda_fp8.h's conversion: exact, NaN for the NaN codes). format is uniform over a
// launch, so the branch costs every thread the same.
__device__ __forceinline__ float code_to_float(uint8_t code, KvFormat format) {
  if (format == KvFormat::kInt8) return static_cast<float>(static_cast<int8_t>(code));
  __nv_fp8_e4m3 e4m3;
  e4m3.__x = code;
  return static_cast<float>(e4m3);
}

// The code of q = x / scale (fdc/kv_format.h), as append_kv's CPU kernel computes it: int8 rounds to the nearest
// integer, ties to even, within [-127, 127]; e4m3fn rounds to the nearest e4m3 value, ties to even, within [-448, 448].
// q is finite.
__device__ __forceinline__ uint8_t float_to_code(float q, KvFormat format) {
  if (format == KvFormat::kInt8)
    return static_cast<uint8_t>(static_cast<int8_t>(rintf(fminf(fmaxf(q, -127.f), 127.f))));
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(fminf(fmaxf(q, -448.f), 448.f), __NV_SATFINITE, __NV_E4M3));
}

// Elements of T in one 16-byte packet (the unit of ld.global.v4 / cp.async.cg): 8 halves, 4 floats or 16 one-byte
// codes. Every packed width is a multiple of 8 elements, so a head's row segment of a float cache is a whole number of
// packets; a quantized cache's is a whole number of 8-byte halves only.
template <typename T>
constexpr int kPacket = 16 / static_cast<int>(sizeof(T));

// Whether p may be read or written in 16-byte packets.
inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// cp.async: 16-byte copies from global to shared memory that do not hold up the issuing thread; commit_group closes
// a batch, wait<N> blocks until at most N batches are still in flight (a __syncthreads must follow before other
// threads read the data).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* global_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src));
}
// The same for one aligned 4-byte word: a quantized cache's row segments (whose rows are 4-byte multiples: codes,
// then 4 bytes of scale per KV head) and its scales. cp.async.ca: 4-byte copies go through L1, which .cg refuses.
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* global_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(global_src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// What a launcher of a kernel header reports to the op that called it, which raises the op's errors from it
// (cuda_common.cuh's check_launch): the first CUDA error of its attribute calls or of the launch, and the dynamic
// shared memory the current device lets the kernel have per CTA (-1 where the launcher does not ask).
struct LaunchStatus {
  cudaError_t error = cudaSuccess;
  int64_t smem_limit = -1;
};

// Lets `kernel` use all the dynamic shared memory the current device gives a block (its opt-in maximum less the
// kernel's static shared memory): that many bytes in smem_limit. The attribute is the same value on every call: a
// host thread launching with a smaller size cannot lower it between another thread's set and launch.
template <typename Kernel>
LaunchStatus allow_all_shared_memory(Kernel kernel) {
  LaunchStatus status;
  int device = 0, optin = 0;
  cudaFuncAttributes attributes;
  if ((status.error = cudaGetDevice(&device)) != cudaSuccess ||
      (status.error = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess ||
      (status.error = cudaFuncGetAttributes(&attributes, kernel)) != cudaSuccess)
    return status;
  const int64_t limit = int64_t(optin) - int64_t(attributes.sharedSizeBytes);
  status.error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit));
  if (status.error == cudaSuccess) status.smem_limit = limit;
  return status;
}

}  // namespace fdc::cuda
