// fdc::prefill_plan on the CPU: the planner of include/fdc/prefill_plan.h over host arrays.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/cpu_common.h"
#include "fdc/prefill_plan.h"

namespace fdc::cpu {

at::Tensor prefill_plan_cpu(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                            const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group, bool causal,
                            std::optional<int64_t> num_workers, int64_t row_block, int64_t window_left) {
  const char* op = "prefill_plan";
  checks::check_window(op, window_left);
  const checks::HostLayout layout = checks::read_layout(op, qk_offsets, &v_offsets, group);
  checks::check_int32_vector(op, "cu_seqlens_q", cu_seqlens_q, -1);
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  const std::vector<int32_t> cu_q = checks::read_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, batch, INT32_MAX, "q");
  const std::vector<int32_t> cu_k = checks::read_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, batch, INT32_MAX, "k");
  const int32_t workers = checks::read_num_workers(op, num_workers, at::get_num_threads());
  FDC_CHECK(row_block >= kRowStep && row_block % kRowStep == 0 && row_block <= (1 << 16), op,
            "row_block must be a positive multiple of ", kRowStep, " of at most 65536 but got ", row_block);

  const int64_t capacity = prefill_plan_capacity(cu_q[batch] - cu_q[0], batch, layout.num_heads());
  std::vector<int32_t> buffer(prefill_plan_size(workers, capacity));
  std::vector<int64_t> workspace(ceil_div(prefill_plan_workspace_bytes(capacity, workers), 8));
  const Status status = build_prefill_plan(cu_q.data(), cu_k.data(), static_cast<int32_t>(batch), layout.view(), causal,
                                           static_cast<int32_t>(row_block), workers, capacity, buffer.data(),
                                           workspace.data(), window_left);
  FDC_CHECK(status == Status::kOk, op, "planner failed: ", status_message(status));
  const int64_t size = prefill_plan_size(workers, PrefillPlanView{buffer.data()}.num_records());
  at::Tensor plan = at::empty({size}, cu_seqlens_q.options().device(at::kCPU));
  std::copy(buffer.begin(), buffer.begin() + size, plan.data_ptr<int32_t>());
  return plan;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("prefill_plan", &fdc::cpu::prefill_plan_cpu); }
