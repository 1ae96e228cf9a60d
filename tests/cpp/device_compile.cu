// Compile-only: proves the planners and the softmax merge of include/fdc are device code, as the CUDA scheduling
// kernels will use them. Built by CMakeLists.txt when a CUDA compiler is found; nothing here runs.
#include "fdc/decode_plan.h"
#include "fdc/prefill_plan.h"
#include "fdc/softmax_merge.h"

__global__ void plan_on_device(const int32_t* seqlens, const int32_t* cu_q, const int32_t* cu_k, int32_t batch,
                               fdc::HeadLayoutView layout, int32_t workers, int64_t capacity, int32_t* decode_plan,
                               int32_t* prefill_plan, void* workspace, float* lse, float* weight, int32_t* status) {
  status[0] = static_cast<int32_t>(
      fdc::build_decode_plan(seqlens, batch, layout, workers, decode_plan, workspace, fdc::kNoWindow));
  status[1] = static_cast<int32_t>(fdc::build_prefill_plan(cu_q, cu_k, batch, layout, true, fdc::kDefaultRowBlock,
                                                           workers, capacity, prefill_plan, workspace));
  fdc::OnlineSoftmax softmax;
  softmax.rescale_for(lse[0]);
  lse[1] = softmax.lse() + fdc::merge_weights(lse, 2, weight);
}
