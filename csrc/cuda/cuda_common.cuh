// The ATen-facing half of the CUDA helpers: the ops' checks of what a kernel's launcher reports, device properties,
// and the plan entry points (each plan op also runs inside its attention op when no plan is passed). The torch-free
// half, which the kernel headers include alone, is device_common.cuh.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "checks.h"
#include "cuda/device_common.cuh"
#include "dispatch.h"
#include "fdc/kv_format.h"

namespace fdc::cuda {

// Raises the CUDA error a launcher reported, as torch reports one (C10_CUDA_CHECK).
inline void check_launch(const LaunchStatus& status) { C10_CUDA_CHECK(status.error); }

// The same, then refuses a launch that needed more dynamic shared memory per CTA (smem_bytes) than the device let the
// kernel have (the launcher did not launch it), naming the op.
inline void check_launch(const LaunchStatus& status, const char* op, int64_t smem_bytes) {
  check_launch(status);
  FDC_CHECK(smem_bytes <= status.smem_limit, op, "the kernel needs ", smem_bytes,
            " bytes of shared memory per CTA but the device allows ", status.smem_limit);
}

// Streaming multiprocessors of the current device: the default worker count of the device planners.
inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// A prefill plan for boundaries already read on the host, on the host and on the device; both are cached per
// (boundaries, layout, group, causal, workers, row block, window, device) and must not be changed by the caller.
struct PrefillPlans {
  at::Tensor host;    // int32 plan on the CPU
  at::Tensor device;  // the same plan on the device
};

PrefillPlans cached_prefill_plan(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                                 const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group, bool causal,
                                 int64_t workers, int64_t row_block, int64_t window_left, at::Device device);

at::Tensor prefill_plan_cuda(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                             const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group, bool causal,
                             std::optional<int64_t> num_workers, int64_t row_block, int64_t window_left);

at::Tensor decode_plan_cuda(const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets, const at::Tensor& v_offsets,
                            int64_t group, std::optional<int64_t> num_workers, int64_t window_left);

}  // namespace fdc::cuda
