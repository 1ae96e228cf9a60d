// Torch-free definitions shared by every header in include/fdc, by the CPU kernels and by the CUDA kernels.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FDC_HOST_DEVICE __host__ __device__
#else
#define FDC_HOST_DEVICE
#endif

namespace fdc {

// Every per-head width (qk and v) is a multiple of this: 8 half-precision elements make a 16-byte row segment, the
// unit of a vectorised load on both CPUs (SSE/AVX lanes) and GPUs (ld.global.v4).
constexpr int32_t kDimMultiple = 8;
// Widest head the kernels accept: the largest head_dim of current models; wider heads would not fit a GPU tile.
constexpr int32_t kMaxHeadDim = 256;

// Status codes returned by the planners and layout checks; the op layer turns them into messages.
enum class Status : int32_t {
  kOk = 0,
  kBadOffsets = 1,        // offsets[0] != 0, not increasing, a width not a multiple of 8, or a width over 256
  kBadSeqlens = 2,        // negative or decreasing sequence lengths
  kBadArgument = 3,       // a non-positive worker count, row block or group
  kCapacityExceeded = 4,  // the plan would not fit its buffer (a planner bug: capacities are proven bounds)
};

FDC_HOST_DEVICE inline const char* status_message(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kBadOffsets: return "offsets must start at 0 and increase by multiples of 8 of at most 256";
    case Status::kBadSeqlens: return "sequence lengths must be non-negative (cu_seqlens non-decreasing)";
    case Status::kBadArgument: return "worker count, row block and group must be positive";
    case Status::kCapacityExceeded: return "plan capacity exceeded";
  }
  return "unknown status";
}

FDC_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
FDC_HOST_DEVICE inline int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }
FDC_HOST_DEVICE inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
FDC_HOST_DEVICE inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

}  // namespace fdc
