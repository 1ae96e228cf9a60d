// fdc::decode_plan on the CPU: the planner of include/fdc/decode_plan.h over host arrays.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/cpu_common.h"
#include "fdc/decode_plan.h"

namespace fdc::cpu {

at::Tensor decode_plan_cpu(const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets, const at::Tensor& v_offsets,
                           int64_t group, std::optional<int64_t> num_workers, int64_t window_left) {
  const char* op = "decode_plan";
  checks::check_window(op, window_left);
  const checks::HostLayout layout = checks::read_layout(op, qk_offsets, &v_offsets, group);
  checks::check_int32_vector(op, "cache_seqlens", cache_seqlens, -1);
  const int64_t batch = cache_seqlens.size(0);
  const std::vector<int32_t> seqlens = checks::read_cache_seqlens(op, cache_seqlens, batch, INT32_MAX);
  const int32_t workers = checks::read_num_workers(op, num_workers, at::get_num_threads());
  const int64_t hkv = layout.num_kv_heads();

  at::Tensor plan = at::empty({decode_plan_size(batch, hkv, workers)}, cache_seqlens.options().device(at::kCPU));
  std::vector<int64_t> workspace(ceil_div(decode_plan_workspace_bytes(batch, hkv, workers), 8));
  const Status status = build_decode_plan(seqlens.data(), static_cast<int32_t>(batch), layout.view(), workers,
                                          plan.data_ptr<int32_t>(), workspace.data(), window_left);
  FDC_CHECK(status == Status::kOk, op, "planner failed: ", status_message(status));
  return plan;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("decode_plan", &fdc::cpu::decode_plan_cpu); }
