// Integer building blocks of the device decode planner (csrc/cuda/decode_plan.cu), kept torch-free and
// FDC_HOST_DEVICE so tests/cpp can check them, and a sequential run of the device algorithm built from them,
// against the host planner of decode_plan.h.
//
// The device planner computes build_decode_plan()'s plan with a different formulation of the same algorithm:
//   - tasks are enumerated in (b, j, chunk) order; task t of pair p = b * H_kv + j is chunk t - split_offsets[p],
//     whose keys follow from the request's length, the window and the chunk length alone (decode_chunk_keys);
//   - the stable sort by cost descending is an ascending sort of unique 64-bit keys (cost descending, then
//     enumeration index ascending), which any sorting network reproduces exactly: the device uses a bitonic one;
//   - the least-loaded worker (ties: lowest index) is the minimum of 64-bit worker keys (load, then worker index);
//   - records are regrouped by worker through each task's rank among its worker's tasks.
#pragma once

#include "fdc/attention_variant.h"
#include "fdc/common.h"
#include "fdc/decode_plan.h"

namespace fdc {

// Task keys: (kTaskCostMask - cost) << kTaskIndexBits | index, sorted ascending. A cost is a chunk length (at most
// INT32_MAX keys) times d_sum (at most 2 * kMaxHeadDim + 1 = 513 < 2^10), so below 2^41; that leaves 23 bits for
// the enumeration index, so the device planner takes at most 2^23 tasks (a plan of that capacity is 128 MiB).
constexpr int kTaskIndexBits = 23;
constexpr int64_t kMaxDevicePlanCapacity = int64_t(1) << kTaskIndexBits;
constexpr uint64_t kTaskCostMask = (uint64_t(1) << (64 - kTaskIndexBits)) - 1;
// Pads a key array to a power of two for the bitonic network: above every real key, since every real task has a
// positive cost (its inverted cost is below kTaskCostMask).
constexpr uint64_t kPaddingTaskKey = ~uint64_t(0);

FDC_HOST_DEVICE inline uint64_t pack_task_key(int64_t cost, int32_t index) {
  return ((kTaskCostMask - uint64_t(cost)) << kTaskIndexBits) | uint64_t(index);
}
FDC_HOST_DEVICE inline int64_t task_key_cost(uint64_t key) {
  return static_cast<int64_t>(kTaskCostMask - (key >> kTaskIndexBits));
}
FDC_HOST_DEVICE inline int32_t task_key_index(uint64_t key) {
  return static_cast<int32_t>(key & ((uint64_t(1) << kTaskIndexBits) - 1));
}

// Worker keys: relative load << kWorkerBits | worker, whose minimum is the least-loaded worker with the lowest
// index among equals. 10 bits: the device planner balances at most 1024 workers, whose loads one warp keeps in
// registers (32 per lane); devices have at most a few hundred SMs, the default worker count.
constexpr int kWorkerBits = 10;
constexpr int32_t kMaxDeviceWorkers = int32_t(1) << kWorkerBits;
// Marks a register slot with no worker behind it (N not a multiple of 32): never the minimum.
constexpr uint64_t kNoWorkerKey = ~uint64_t(0);
// Loads are kept relative to a base, so they fit the 54 bits left beside the worker index. LPT keeps every load
// within the largest task cost C < 2^41 of the smallest load, so rebasing (subtracting the smallest load) whenever
// the smallest relative load reaches 2^42 keeps every relative load below 2^42 + 2 * 2^41 < 2^44, far from 2^54.
constexpr uint64_t kRebaseLoad = uint64_t(1) << 42;

FDC_HOST_DEVICE inline uint64_t pack_worker_key(uint64_t relative_load, int32_t worker) {
  return (relative_load << kWorkerBits) | uint64_t(worker);
}
FDC_HOST_DEVICE inline uint64_t worker_key_load(uint64_t key) { return key >> kWorkerBits; }
FDC_HOST_DEVICE inline int32_t worker_key_index(uint64_t key) {
  return static_cast<int32_t>(key & ((uint64_t(1) << kWorkerBits) - 1));
}

// The device planner passes each KV head's d_sum in its kernel parameters (2 bytes each: d_sum <= 513), so the
// layout needs no host-to-device copy, which a CUDA graph capture could not replay safely. 1024 heads keep the
// parameters within the 4 KiB every CUDA device accepts.
constexpr int32_t kMaxDevicePlanHeads = 1024;

FDC_HOST_DEVICE inline int64_t next_pow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

// Bitonic sorting network over size (a power of two) keys, ascending. Stage (span, stride) with span = 2, 4, ...,
// size and stride = span / 2, ..., 1 has size / 2 independent comparators; comparator c joins elements lo and
// lo + stride, lo = c with a zero bit inserted at stride's position, and orders them ascending when lo's span-block
// is even, descending when odd.
FDC_HOST_DEVICE inline int64_t bitonic_low(int64_t comparator, int64_t stride) {
  return ((comparator & ~(stride - 1)) << 1) | (comparator & (stride - 1));
}
FDC_HOST_DEVICE inline void bitonic_compare_swap(uint64_t* keys, int64_t comparator, int64_t stride, int64_t span) {
  const int64_t lo = bitonic_low(comparator, stride);
  const int64_t hi = lo + stride;
  const uint64_t a = keys[lo], b = keys[hi];
  const bool ascending = (lo & span) == 0;
  if ((a > b) == ascending) {
    keys[lo] = b;
    keys[hi] = a;
  }
}

// Bytes of the device planner's scratch for a plan of the given capacity: the task keys, padded to a power of
// two, then a (worker, rank) pair per sorted task.
FDC_HOST_DEVICE inline int64_t decode_plan_scratch_bytes(int64_t capacity) {
  return 8 * next_pow2(capacity) + 8 * capacity;
}

// The (request, KV head) pair of task t: the last p with split_offsets[p] <= t (pairs without chunks share their
// offset with the next pair, so the last one is the pair that owns the chunk). Binary search over num_pairs + 1
// non-decreasing offsets; requires t < split_offsets[num_pairs].
FDC_HOST_DEVICE inline int32_t decode_task_pair(const int32_t* split_offsets, int32_t num_pairs, int32_t t) {
  int32_t lo = 0, hi = num_pairs - 1;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (split_offsets[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Keys a decode query sees in a cache of `length` keys: [decode_window_start(length, window_left), length). A task's
// cost counts only these, so the planner's total, and with it every chunk length, is the windowed work.
FDC_HOST_DEVICE inline int64_t decode_visible_keys(int64_t length, int64_t window_left) {
  return length - decode_window_start(length, window_left);
}

// Chunks of one (request, KV head) pair: ceil(visible keys / chunk_len), 0 for an empty request: decode_plan.h's
// formula over the visible keys, so its capacity bound holds with the total counting visible keys.
FDC_HOST_DEVICE inline int64_t decode_chunk_count(int64_t length, int64_t window_left, int64_t chunk_len) {
  return ceil_div(decode_visible_keys(length, window_left), chunk_len);
}

struct KeyRange {
  int64_t start;
  int64_t end;
};

// Keys of chunk `chunk` of the `chunks` chunks of a request of `length` keys. With s the window start and
// base = s rounded down to kChunkAlign, chunk c covers [c == 0 ? s : base + c * chunk_len, c == chunks - 1 ? length
// : base + (c + 1) * chunk_len): every chunk but the first starts on a multiple of kChunkAlign (the tile and packet
// alignment the kernels' loads rely on), the first starts where the window does, and the last ends at the length
// (up to kChunkAlign - 1 keys longer than chunk_len when the window start was rounded down). Without a window
// (s = 0) these are the chunks [c * chunk_len, min(length, (c + 1) * chunk_len)).
FDC_HOST_DEVICE inline KeyRange decode_chunk_keys(int64_t length, int64_t window_left, int64_t chunk_len, int64_t chunk,
                                                  int64_t chunks) {
  const int64_t first = decode_window_start(length, window_left);
  const int64_t base = first - first % kChunkAlign;
  return KeyRange{chunk == 0 ? first : base + chunk * chunk_len,
                  chunk == chunks - 1 ? length : base + (chunk + 1) * chunk_len};
}

// One task of the enumeration: its record (b * H_kv + j, chunk, kv_start, kv_end) and cost.
struct DecodeTask {
  int32_t pair;
  int32_t chunk;
  int32_t kv_start;
  int32_t kv_end;
  int64_t cost;
};

// Task t, recomputed from the split offsets: d_sum(j) is d_sum[j], chunk lengths follow decode_chunk_len(target),
// chunk bounds decode_chunk_keys() with the window of window_left (kNoWindow for none).
FDC_HOST_DEVICE inline DecodeTask decode_task(int32_t t, const int32_t* split_offsets, const int32_t* seqlens,
                                              int32_t batch, int32_t num_kv_heads, const int16_t* d_sum, int64_t target,
                                              int64_t window_left) {
  const int32_t pair = decode_task_pair(split_offsets, batch * num_kv_heads, t);
  const int32_t j = pair % num_kv_heads;
  const int64_t chunk = t - split_offsets[pair];
  const int64_t chunks = split_offsets[pair + 1] - split_offsets[pair];
  const KeyRange keys =
      decode_chunk_keys(seqlens[pair / num_kv_heads], window_left, decode_chunk_len(target, d_sum[j]), chunk, chunks);
  return DecodeTask{pair, static_cast<int32_t>(chunk), static_cast<int32_t>(keys.start), static_cast<int32_t>(keys.end),
                    (keys.end - keys.start) * d_sum[j]};
}

}  // namespace fdc
