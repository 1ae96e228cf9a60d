// The attention variants of today's models, one definition for every planner and kernel (CPU and CUDA):
// - a sliding window: a query at position p sees keys [p - window_left, p] (and, when not causal, every key after
//   p); window_left = kNoWindow (-1) means no window. Positions are bottom-right aligned as the causal mask is: query i
//   of a sequence with s_q queries and s_k keys sits at p = i + s_k - s_q; a decode query is its cache's newest key.
//   This is FlashAttention's window_size = (window_left, causal ? 0 : -1) and FlashInfer's window_left; a model
//   config's `sliding_window` W (keys within W positions, the query's own included) is window_left = W - 1;
// - logit soft-capping: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2); 0 means none;
// - attention sinks: one logit per query head that joins every row's softmax denominator and adds nothing to its
//   numerator (gpt-oss's learned sinks, StreamingLLM's sink as a logit), in the units of the scaled, capped scores.
#pragma once

#include <math.h>

#include "fdc/common.h"
#include "fdc/float_math.h"

namespace fdc {

constexpr int64_t kNoWindow = -1;

// First key visible to the query at position `query_pos` (keys before it are outside the window).
FDC_HOST_DEVICE inline int64_t window_start(int64_t query_pos, int64_t window_left) {
  return window_left < 0 ? 0 : max64(0, query_pos - window_left);
}

// First key visible to a decode query, the newest of a cache's `length` keys: the visible keys are
// [decode_window_start(length, window_left), length).
FDC_HOST_DEVICE inline int64_t decode_window_start(int64_t length, int64_t window_left) {
  return length <= 0 ? 0 : window_start(length - 1, window_left);
}

// A scaled score after soft-capping (softcap > 0), or as it is (softcap == 0), with a tanh accurate to a few ulps of
// its result at every argument, so scores far below the cap come back nearly unchanged, not rounded to ulps of the
// cap: on the CPU tanh_approx (fdc/float_math.h, branch-free for the vectorised loops), on a GPU CUDA's tanhf (within
// 2 ulp over its whole range, CUDA Math API), which the 256-wide prefill kernel fits in its registers where
// tanh_approx spilled 24 bytes.
FDC_HOST_DEVICE inline float soft_cap(float scaled_score, float softcap) {
  if (softcap <= 0.f) return scaled_score;
#if defined(__CUDA_ARCH__)
  return softcap * tanhf(scaled_score / softcap);
#else
  return softcap * tanh_approx(scaled_score / softcap);
#endif
}

// What a sink logit does to a row's output: the output normalised over the visible keys' scores (whose log-sum-exp
// is `lse`) times 1 / (1 + exp(sink - lse)) is the output normalised over those scores and the sink. A row that
// sees no key (lse = -inf) gets 0, and its output is 0 already.
FDC_HOST_DEVICE inline float sink_factor(float lse, float sink) { return 1.f / (1.f + expf(sink - lse)); }

}  // namespace fdc
