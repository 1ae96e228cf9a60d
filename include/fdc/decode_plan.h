// The decode planner (docs/design.md sections 1 and 4): one new query token per request against its KV cache.
//
// Task: (request b, KV head j with all its G query heads, KV chunk [kv_start, kv_end)). The G query heads share one
// read of the chunk's K/V rows, which is what a memory-bound decode pays for. Cost: (kv_end - kv_start) * d_sum(j),
// d_sum = d_qk + d_v + 1.
//
// Visible keys. With a sliding window (window_left >= 0, fdc/attention_variant.h) request b's query sees keys
// [start(b), seqlen(b)), start(b) = decode_window_start(seqlen(b), window_left); without one (kNoWindow) start(b) = 0.
// The tasks cover exactly those keys: keys outside the window are neither read nor costed.
//
// Chunking. Let total = sum over (b, j) of (seqlen(b) - start(b)) * d_sum(j) and N the worker count. A task whose
// cost exceeds target = ceil(total / (kChunksPerWorker * N)) would stretch the makespan past the ideal total / N, so
// each KV head gets a chunk length
//     chunk_len(j) = max(kMinChunk, round_up(ceil(target / d_sum(j)), kChunkAlign))
// and request b is cut into count = ceil((seqlen(b) - start(b)) / chunk_len(j)) chunks on a grid of that length from
// base = start(b) rounded down to a multiple of kChunkAlign: chunk c covers [c == 0 ? start(b) : base + c * L,
// c == count - 1 ? seqlen(b) : base + (c + 1) * L) with L = chunk_len(j). So every chunk but the first starts on a
// multiple of kChunkAlign (a tensor-core key tile); the first has at most L keys, the last at most L plus the grid's
// offset start(b) - base (< kChunkAlign). Without a window these are the chunks of length L from key 0, the last one
// shorter. With few, long requests this splits them; with many short ones nothing is split. Chunk counts are bounded,
// s being a request's visible keys: sum ceil(s/L) <= total / target + B*H_kv <= kChunksPerWorker * N + B*H_kv, the
// plan's capacity.
//
// Assignment: tasks sorted by cost descending (ties: enumeration order b, j, chunk), each given in turn to the
// least-loaded worker (ties: lowest worker index): greedy LPT, makespan <= (4/3 - 1/(3N)) of the optimal schedule's
// and <= total / N + the largest task.
//
// Plan format (int32, decode_plan_size() entries):
//   [0] kDecodePlanTag  [1] B  [2] H_kv  [3] N  [4] capacity  [5] num_tasks  [6] group  [7] status
//   status is a Status code, 0 (kOk) for a usable plan; the host planner always writes 0 (it reports errors to its
//   caller instead). The device planner (csrc/cuda/decode_plan.cu) cannot report to the host without a
//   synchronisation, so on bad input it writes a plan that says so: kBadSeqlens when a cache length is negative,
//   kCapacityExceeded if the chunk count ever exceeded the capacity (the bound below says it cannot); such a plan
//   has num_tasks = 0, all offsets 0 and all records -1, and the attention kernels turn it into NaN outputs.
//   split_offsets[B*H_kv + 1]   from kDecodeHeader: chunks of (b, j) are split ids split_offsets[b*H_kv + j] ...
//                               split_offsets[b*H_kv + j + 1] - 1; one chunk means no merge is needed, zero chunks
//                               (an empty request) means the output is zero.
//   worker_offsets[N + 1]       worker w runs records worker_offsets[w] .. worker_offsets[w+1] - 1, in that order
//                               (its tasks in descending cost).
//   records[capacity][4]        (b * H_kv + j, chunk index, kv_start, kv_end); entries past num_tasks are -1.
// Partial results of chunk c of (b, j) go to split slot split_offsets[b*H_kv + j] + c and are merged by log-sum-exp
// (softmax_merge.h).
#pragma once

#include "fdc/attention_variant.h"
#include "fdc/common.h"
#include "fdc/head_layout.h"
#include "fdc/lpt.h"

namespace fdc {

constexpr int32_t kDecodePlanTag = 0x46444344;  // "FDCD"
constexpr int32_t kDecodeHeader = 8;
constexpr int32_t kDecodeRecordFields = 4;
// Chunks per worker aimed at. LPT's makespan is at most the average load plus the one task that ends last, so with
// every chunk costing about total / (3N) or less it stays within 4/3 of the ideal total / N (unless kMinChunk holds
// chunks above that: then there is too little work to matter). More chunks would only add partials to merge.
constexpr int64_t kChunksPerWorker = 3;
// Shortest chunk: each split costs a re-read of the G query rows and a partial result (G * d_v + 1 floats) to write
// and merge; below a few hundred keys that overhead is no longer small against the chunk's own K/V reads.
constexpr int64_t kMinChunk = 256;
// Chunk lengths are multiples of 16 keys, the key tile of a tensor-core (m16n8k16) product.
constexpr int64_t kChunkAlign = 16;

// The largest cost a chunk should have: total / (kChunksPerWorker * N), rounded up, at least 1.
FDC_HOST_DEVICE inline int64_t decode_chunk_target(int64_t total, int32_t num_workers) {
  return max64(1, ceil_div(total, kChunksPerWorker * num_workers));
}

// Keys per chunk of a KV head with the given d_sum: enough to reach the target, aligned, at least kMinChunk.
FDC_HOST_DEVICE inline int64_t decode_chunk_len(int64_t target, int64_t d_sum) {
  return max64(kMinChunk, round_up(ceil_div(target, d_sum), kChunkAlign));
}

FDC_HOST_DEVICE inline int64_t decode_plan_capacity(int64_t batch, int64_t num_kv_heads, int64_t num_workers) {
  return batch * num_kv_heads + kChunksPerWorker * num_workers;
}

FDC_HOST_DEVICE inline int64_t decode_plan_size(int64_t batch, int64_t num_kv_heads, int64_t num_workers) {
  return kDecodeHeader + (batch * num_kv_heads + 1) + (num_workers + 1) +
         kDecodeRecordFields * decode_plan_capacity(batch, num_kv_heads, num_workers);
}

// Scratch for build_decode_plan, in bytes (int64 costs and loads, int32 indices); 8-byte aligned storage.
FDC_HOST_DEVICE inline int64_t decode_plan_workspace_bytes(int64_t batch, int64_t num_kv_heads, int64_t num_workers) {
  const int64_t cap = decode_plan_capacity(batch, num_kv_heads, num_workers);
  return 8 * (cap + num_workers) + 4 * (3 * cap + num_workers + 2 * kDecodeRecordFields * cap);
}

// Read-only view of a plan buffer, for the kernels that execute it.
struct DecodePlanView {
  const int32_t* data;
  FDC_HOST_DEVICE int32_t batch() const { return data[1]; }
  FDC_HOST_DEVICE int32_t num_kv_heads() const { return data[2]; }
  FDC_HOST_DEVICE int32_t num_workers() const { return data[3]; }
  FDC_HOST_DEVICE int32_t capacity() const { return data[4]; }
  FDC_HOST_DEVICE int32_t num_tasks() const { return data[5]; }
  FDC_HOST_DEVICE int32_t group() const { return data[6]; }
  FDC_HOST_DEVICE const int32_t* split_offsets() const { return data + kDecodeHeader; }
  FDC_HOST_DEVICE const int32_t* worker_offsets() const {
    return split_offsets() + int64_t(batch()) * num_kv_heads() + 1;
  }
  FDC_HOST_DEVICE const int32_t* records() const { return worker_offsets() + num_workers() + 1; }
};

// Builds the plan into plan[decode_plan_size(B, H_kv, N)]. seqlens[B] are the cache lengths; workspace holds
// decode_plan_workspace_bytes(B, H_kv, N) bytes, 8-byte aligned; window_left is the attention's sliding window
// (kNoWindow for none; the caller has checked it is >= kNoWindow).
FDC_HOST_DEVICE inline Status build_decode_plan(const int32_t* seqlens, int32_t batch, HeadLayoutView layout,
                                                int32_t num_workers, int32_t* plan, void* workspace,
                                                int64_t window_left) {
  if (batch < 0 || num_workers <= 0 || layout.group <= 0) return Status::kBadArgument;
  const int32_t hkv = layout.num_kv_heads;
  const int64_t cap = decode_plan_capacity(batch, hkv, num_workers);

  int64_t* cost = static_cast<int64_t*>(workspace);
  int64_t* load = cost + cap;
  int32_t* order = reinterpret_cast<int32_t*>(load + num_workers);
  int32_t* scratch = order + cap;
  int32_t* record_worker = scratch + cap;
  int32_t* heap = record_worker + cap;
  int32_t* task_records = heap + num_workers;                          // [cap][4], enumeration order
  int32_t* sorted_records = task_records + cap * kDecodeRecordFields;  // [cap][4], assignment order

  int64_t total = 0;
  for (int32_t b = 0; b < batch; ++b) {
    if (seqlens[b] < 0) return Status::kBadSeqlens;
    const int64_t visible = seqlens[b] - decode_window_start(seqlens[b], window_left);
    for (int32_t j = 0; j < hkv; ++j) total += visible * layout.d_sum(j);
  }
  const int64_t target = decode_chunk_target(total, num_workers);

  plan[0] = kDecodePlanTag;
  plan[1] = batch;
  plan[2] = hkv;
  plan[3] = num_workers;
  plan[4] = static_cast<int32_t>(cap);
  plan[6] = layout.group;
  plan[7] = 0;
  int32_t* split_offsets = plan + kDecodeHeader;
  int32_t* worker_offsets = split_offsets + int64_t(batch) * hkv + 1;
  int32_t* records = worker_offsets + num_workers + 1;

  int32_t n = 0;
  split_offsets[0] = 0;
  for (int32_t b = 0; b < batch; ++b) {
    const int64_t length = seqlens[b], first = decode_window_start(length, window_left);
    const int64_t base = first - first % kChunkAlign;
    for (int32_t j = 0; j < hkv; ++j) {
      const int64_t d_sum = layout.d_sum(j);
      const int64_t chunk_len = decode_chunk_len(target, d_sum);
      const int64_t chunks = ceil_div(length - first, chunk_len);
      if (n + chunks > cap) return Status::kCapacityExceeded;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t start = c == 0 ? first : base + c * chunk_len;
        const int64_t end = c == chunks - 1 ? length : base + (c + 1) * chunk_len;
        int32_t* r = task_records + int64_t(n) * kDecodeRecordFields;
        r[0] = b * hkv + j;
        r[1] = static_cast<int32_t>(c);
        r[2] = static_cast<int32_t>(start);
        r[3] = static_cast<int32_t>(end);
        cost[n] = (end - start) * d_sum;
        order[n] = n;
        ++n;
      }
      split_offsets[int64_t(b) * hkv + j + 1] = n;
    }
  }
  plan[5] = n;

  sort_by_cost_desc(order, scratch, cost, n);
  WorkerPool pool(load, heap, num_workers);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t t = order[i];
    record_worker[i] = pool.take(cost[t]);
    for (int32_t f = 0; f < kDecodeRecordFields; ++f)
      sorted_records[int64_t(i) * kDecodeRecordFields + f] = task_records[int64_t(t) * kDecodeRecordFields + f];
  }
  group_records_by_worker(sorted_records, record_worker, n, kDecodeRecordFields, num_workers, worker_offsets, records);
  for (int64_t i = int64_t(n) * kDecodeRecordFields; i < cap * kDecodeRecordFields; ++i) records[i] = -1;
  return Status::kOk;
}

}  // namespace fdc
