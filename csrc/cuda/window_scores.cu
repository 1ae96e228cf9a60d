// fdc::window_scores on CUDA: no kernel yet. It is a prompt's one-off cost (token eviction's scores, a window of
// queries against the cached keys), so on a GPU fdc_ops.eviction.window_scores computes it with torch ops instead;
// this refusal names that path rather than leaving the dispatcher's generic "no CUDA kernel" message.
#include <torch/library.h>

#include "checks.h"

namespace fdc::cuda {

at::Tensor window_scores_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, int64_t, double, int64_t, double, const std::optional<at::Tensor>&,
                              double) {
  FDC_CHECK(false, "window_scores",
            "has no CUDA kernel yet; fdc_ops.eviction.window_scores scores CUDA tensors with torch operations");
  return {};
}

}  // namespace fdc::cuda

TORCH_LIBRARY_IMPL(fdc, CUDA, m) { m.impl("window_scores", &fdc::cuda::window_scores_cuda); }
