// fdc::prefill_plan on CUDA: the host planner of include/fdc/prefill_plan.h on the boundaries copied to the host,
// the plan copied back to the device.
//
// Why on the host: a prefill plan's size depends on the sequence lengths (its record count), so prefill cannot be
// captured in a CUDA graph whatever builds the plan, and its attention op reads the boundaries on the host anyway
// to validate them and the plan; the host planner is exact by construction and costs O(T log T) for T row blocks.
// Plans are cached per (boundaries, layout, group, causal, workers, row block, window) and device, so repeated shapes
// (benchmarks, a serving loop's fixed buckets) pay for neither the planning nor the copy.
#include <torch/library.h>

#include <list>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/cpu_common.h"
#include "cuda/cuda_common.cuh"
#include "fdc/prefill_plan.h"

namespace fdc::cuda {
namespace {

// Plans kept per process: enough for the distinct shapes of a benchmark sweep or a serving loop's prompt buckets;
// a plan of 64K tokens and 32 heads is about 0.5 MiB of device memory.
constexpr size_t kCachedPlans = 64;

// The boundaries, the layout, every planner argument (a window changes the costs, so the plan) and the device.
using PlanKey = std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<int32_t>, std::vector<int32_t>,
                           int64_t, bool, int64_t, int64_t, int64_t, int64_t>;

class PlanCache {
 public:
  std::optional<PrefillPlans> find(const PlanKey& key) {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->first == key) {
        entries_.splice(entries_.begin(), entries_, it);  // most recently used first
        return it->second;
      }
    }
    return std::nullopt;
  }

  void insert(PlanKey key, PrefillPlans plans) {
    const std::lock_guard<std::mutex> lock(mutex_);
    entries_.emplace_front(std::move(key), std::move(plans));
    if (entries_.size() > kCachedPlans) entries_.pop_back();
  }

 private:
  std::mutex mutex_;
  std::list<std::pair<PlanKey, PrefillPlans>> entries_;
};

PlanCache& plan_cache() {
  static PlanCache cache;
  return cache;
}

std::vector<int32_t> host_values(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  return std::vector<int32_t>(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.numel());
}

at::Tensor host_tensor(const std::vector<int32_t>& values) {
  return at::tensor(at::ArrayRef<int32_t>(values), at::TensorOptions().dtype(at::kInt));
}

}  // namespace

PrefillPlans cached_prefill_plan(const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                                 const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group, bool causal,
                                 int64_t workers, int64_t row_block, int64_t window_left, at::Device device) {
  const checks::HostLayout layout = checks::read_layout("prefill_plan", qk_offsets, &v_offsets, group);
  PlanKey key(cu_q, cu_k, layout.qk_offsets, layout.v_offsets, group, causal, workers, row_block, window_left,
              device.index());
  if (std::optional<PrefillPlans> cached = plan_cache().find(key)) return *cached;
  // The host planner validates everything (boundaries, layout, workers, row block) with the same messages.
  PrefillPlans plans;
  plans.host = cpu::prefill_plan_cpu(host_tensor(cu_q), host_tensor(cu_k), qk_offsets, v_offsets, group, causal,
                                     workers, row_block, window_left);
  plans.device = plans.host.to(device);
  plan_cache().insert(std::move(key), plans);
  return plans;
}

// cu_seqlens_q, cu_seqlens_k: (B + 1) int32 on the device; qk_offsets, v_offsets: (H_kv + 1) int32 on the CPU.
// Returns the plan, (prefill_plan_size(N, records)) int32 on cu_seqlens_q's device.
at::Tensor prefill_plan_cuda(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                             const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group, bool causal,
                             std::optional<int64_t> num_workers, int64_t row_block, int64_t window_left) {
  const char* op = "prefill_plan";
  checks::check_window(op, window_left);
  checks::read_layout(op, qk_offsets, &v_offsets, group);
  checks::check_int32_vector(op, "cu_seqlens_q", cu_seqlens_q, -1);
  checks::check_int32_vector(op, "cu_seqlens_k", cu_seqlens_k, -1);
  checks::check_cuda_tensor(op, "cu_seqlens_q", cu_seqlens_q);
  checks::check_same_device(op, "cu_seqlens_k", cu_seqlens_k, "cu_seqlens_q", cu_seqlens_q);
  const c10::cuda::CUDAGuard guard(cu_seqlens_q.device());
  // A copy: the caller owns what it gets back and may change it without touching the cached plan.
  return cached_prefill_plan(host_values(cu_seqlens_q), host_values(cu_seqlens_k), qk_offsets, v_offsets, group, causal,
                             num_workers.value_or(num_sms()), row_block, window_left, cu_seqlens_q.device())
      .device.clone();
}

}  // namespace fdc::cuda

TORCH_LIBRARY_IMPL(fdc, CUDA, m) { m.impl("prefill_plan", &fdc::cuda::prefill_plan_cuda); }
