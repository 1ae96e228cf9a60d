// Online softmax and the log-sum-exp merge of partial attention results, shared by host and device kernels.
//
// A partial result over a subset of keys is (o, lse): o the softmax-weighted average of the subset's values (already
// normalised) and lse = log(sum over the subset of exp(score)). Two partials merge exactly:
//     lse = log(exp(lse_a) + exp(lse_b)),   o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b.
// An empty subset has lse = -inf and contributes nothing; if every subset is empty the merged output is zero.
#pragma once

#include <cmath>

#include "fdc/common.h"

namespace fdc {

// Running state of a softmax over a stream of scores: the running maximum and the sum of exp(score - max).
struct OnlineSoftmax {
  float max = -INFINITY;
  float sum = 0.f;

  // Folds in a block whose largest score is block_max; returns the factor by which everything accumulated so far
  // (sum and the weighted value accumulator) must be scaled. The caller then adds exp(score - max) terms.
  FDC_HOST_DEVICE float rescale_for(float block_max) {
    if (block_max <= max) return 1.f;
    const float factor = (max == -INFINITY) ? 0.f : expf(max - block_max);
    sum *= factor;
    max = block_max;
    return factor;
  }

  // log(sum over seen keys of exp(score)); -inf when no key was seen.
  FDC_HOST_DEVICE float lse() const { return sum > 0.f ? max + logf(sum) : -INFINITY; }
  FDC_HOST_DEVICE float inverse_sum() const { return sum > 0.f ? 1.f / sum : 0.f; }
};

// Merge weights for n partials with log-sum-exps lse[n]: writes weight[i] = exp(lse[i] - lse_total) (0 for an empty
// partial) and returns lse_total (-inf if all are empty, with all weights 0).
FDC_HOST_DEVICE inline float merge_weights(const float* lse, int32_t n, float* weight) {
  float m = -INFINITY;
  for (int32_t i = 0; i < n; ++i) m = lse[i] > m ? lse[i] : m;
  if (m == -INFINITY) {
    for (int32_t i = 0; i < n; ++i) weight[i] = 0.f;
    return -INFINITY;
  }
  float total = 0.f;
  for (int32_t i = 0; i < n; ++i) {
    weight[i] = expf(lse[i] - m);
    total += weight[i];
  }
  for (int32_t i = 0; i < n; ++i) weight[i] /= total;
  return m + logf(total);
}

}  // namespace fdc
