// fdc::decode_plan on CUDA: the plan of include/fdc/decode_plan.h built on the device, in one kernel launch on the
// current stream, with no host synchronisation and no host read of cache_seqlens, so a decode step (plan and
// attention) can be captured in a CUDA graph and replayed with new cache lengths. The plan equals the host
// planner's integer for integer; include/fdc/decode_plan_device.h gives the formulation and its integer helpers.
//
// One CTA of kThreads threads runs seven phases separated by block barriers. A grid-wide version would need a
// cooperative launch or a kernel per phase for its barriers, for a problem of a few thousand tasks, most of whose
// time is the sequential phase 5 anyway; one CTA leaves the rest of the GPU free.
//   1. total cost: a block reduction of the keys each request's query sees (its cache length, or the last
//      window_left + 1 keys with a sliding window: total = sum_b visible(b) * sum_j d_sum(j)) that also detects
//      negative lengths. O(B / kThreads) per thread.
//   2. split_offsets: each pair (b, j) writes its chunk count, then an in-place block scan in tiles of kThreads
//      pairs. O(B * H_kv / kThreads) per thread.
//   3. task keys: one thread per task finds its pair by binary search over split_offsets and packs (cost, index);
//      padding keys fill up to a power of two. Parallel over tasks rather than pairs, so one long request split
//      into hundreds of chunks does not fall on one thread. O(n log(B * H_kv) / kThreads).
//   4. bitonic sort of the keys: log2(S) (log2(S) + 1) / 2 stages of S / 2 independent compare-swaps each
//      (S = n padded to a power of two), data-independent, so every thread just strides over comparators between
//      barriers. In shared memory when the scratch fits the device's opt-in limit, else in the global workspace
//      with the same code (slower, for very large batches only).
//   5. greedy assignment: inherently sequential (each choice depends on the loads so far), so one warp runs it,
//      keeping the N worker loads in registers (ceil(N / 32) per lane) and finding the least-loaded worker with
//      two warp min-reductions per task; the first min(N, n) tasks provably go to workers 0, 1, ... in order (all
//      costs are positive), so they are placed without a search. n - min(N, n) dependent steps, each two redux.sync
//      and the owner lane's update of its keys (estimated at around a hundred cycles, not yet measured): the phase
//      that dominates, about 0.1 ms for 2000 tasks. It records each task's worker and rank within the worker.
//   6. worker_offsets: the per-worker counts, block-scanned in place.
//   7. records scattered to worker_offsets[worker] + rank, one thread per task; -1 padding in parallel.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/cuda_common.cuh"
#include "fdc/decode_plan.h"
#include "fdc/decode_plan_device.h"

namespace fdc::cuda {
namespace {

// 512 threads: the assignment warp keeps up to 32 worker keys (64 registers) and 32 counts per lane, which fits
// the 128 registers a thread of a 512-thread CTA may use; at 1024 threads (64 registers) it would spill. The other
// phases are short loops over at most a few thousand elements, for which 16 warps are plenty.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

struct DecodePlanParams {
  const int32_t* seqlens;   // (B) cache lengths, on the device
  int32_t* plan;            // (decode_plan_size(B, H_kv, N)) the output
  uint8_t* global_scratch;  // (decode_plan_scratch_bytes(capacity)) bytes, or null: scratch in dynamic shared memory
  int64_t d_sum_total;      // sum over KV heads of d_sum(j)
  int64_t window_left;      // the sliding window (kNoWindow: none); a kernel parameter, so graph replays keep it
  int32_t batch;
  int32_t num_kv_heads;
  int32_t num_workers;
  int32_t group;
  int32_t capacity;
  int16_t d_sum[kMaxDevicePlanHeads];  // (H_kv) used entries: d_sum(j) = qk_dim(j) + v_dim(j) + 1
};

__device__ __forceinline__ int64_t warp_inclusive_scan(int64_t x) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int64_t y = __shfl_up_sync(kFullMask, x, offset);
    if (lane >= offset) x += y;
  }
  return x;
}

// Inclusive prefix sum of one value per thread over the block; *total receives the block's sum. Every thread of
// the block calls it. warp_totals: (kWarps) shared scratch.
__device__ int64_t block_inclusive_scan(int64_t x, int64_t* warp_totals, int64_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_inclusive_scan(x);
  if (lane == 31) warp_totals[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < kWarps ? warp_totals[lane] : 0;
    w = warp_inclusive_scan(w);
    if (lane < kWarps) warp_totals[lane] = w;
  }
  __syncthreads();
  const int64_t prefix = warp > 0 ? warp_totals[warp - 1] : 0;
  *total = warp_totals[kWarps - 1];
  __syncthreads();  // warp_totals is reused by the next call
  return x + prefix;
}

// Replaces values (count) by their inclusive prefix sums, in tiles of kThreads; returns the sum. Partial sums
// above INT32_MAX are clamped when stored (only possible in a plan the caller then marks as overflowed).
__device__ int64_t block_scan_in_place(int32_t* values, int32_t count, int64_t* warp_totals) {
  int64_t carry = 0;
  for (int32_t base = 0; base < count; base += kThreads) {
    const int32_t i = base + static_cast<int32_t>(threadIdx.x);
    const int64_t x = i < count ? values[i] : 0;
    int64_t tile_total;
    const int64_t inclusive = block_inclusive_scan(x, warp_totals, &tile_total);
    if (i < count) values[i] = static_cast<int32_t>(min64(carry + inclusive, INT32_MAX));
    carry += tile_total;
  }
  return carry;
}

// The plan of a failed build: header with the status and no tasks, all offsets 0, all records -1. Every thread of
// the block calls it.
__device__ void write_failed_plan(const DecodePlanParams& params, Status status) {
  int32_t* plan = params.plan;
  if (threadIdx.x == 0) {
    plan[0] = kDecodePlanTag;
    plan[1] = params.batch;
    plan[2] = params.num_kv_heads;
    plan[3] = params.num_workers;
    plan[4] = params.capacity;
    plan[5] = 0;
    plan[6] = params.group;
    plan[7] = static_cast<int32_t>(status);
  }
  const int64_t offsets = (int64_t(params.batch) * params.num_kv_heads + 1) + (params.num_workers + 1);
  const int64_t body = offsets + int64_t(kDecodeRecordFields) * params.capacity;
  for (int64_t i = threadIdx.x; i < body; i += kThreads) plan[kDecodeHeader + i] = i < offsets ? 0 : -1;
}

// Minimum over the warp of one 64-bit key per lane: two 32-bit redux.sync (high halves, then the low halves of the
// lanes holding the smallest high half) where the hardware has them (sm_80+), else five shuffle rounds.
__device__ __forceinline__ uint64_t warp_min(uint64_t key) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned hi = __reduce_min_sync(kFullMask, static_cast<unsigned>(key >> 32));
  const unsigned lo =
      __reduce_min_sync(kFullMask, static_cast<unsigned>(key >> 32) == hi ? static_cast<unsigned>(key) : ~0u);
  return (uint64_t(hi) << 32) | lo;
#else
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint64_t other = __shfl_xor_sync(kFullMask, key, offset);
    key = other < key ? other : key;
  }
  return key;
#endif
}

// Smallest of a lane's kKeys worker keys, by a pairwise tree (depth log2(kKeys) rather than a kKeys-long chain:
// the owner lane recomputes it on every assignment step).
template <int kKeys>
__device__ __forceinline__ uint64_t lane_min(const uint64_t (&keys)[kKeys]) {
  uint64_t m[kKeys];
#pragma unroll
  for (int k = 0; k < kKeys; ++k) m[k] = keys[k];
#pragma unroll
  for (int step = 1; step < kKeys; step *= 2) {
#pragma unroll
    for (int k = 0; k + step < kKeys; k += 2 * step) m[k] = m[k + step] < m[k] ? m[k + step] : m[k];
  }
  return m[0];
}

// Phase 5, run by warp 0: greedy LPT over sorted_keys (n), the sorted task keys. Worker w lives in lane w % 32,
// register slot w / 32, as a worker key (relative load, w). placement: (n, 2) int32 (worker, rank among the
// worker's tasks) per sorted position; worker_counts: (N) the number of tasks of each worker.
template <int kKeysPerLane>
__device__ void assign_workers(const uint64_t* sorted_keys, int32_t n, int32_t workers, int32_t* placement,
                               int32_t* worker_counts) {
  const int lane = threadIdx.x & 31;
  uint64_t worker_key[kKeysPerLane];
  int32_t count[kKeysPerLane];
  // The first round: with every load still 0, task i < min(N, n) goes to worker i (the lowest-indexed idle one).
  const int32_t first = n < workers ? n : workers;
#pragma unroll
  for (int k = 0; k < kKeysPerLane; ++k) {
    const int32_t w = lane + 32 * k;
    const bool first_round = w < first;
    const uint64_t load = first_round ? uint64_t(task_key_cost(sorted_keys[w])) : 0;
    worker_key[k] = w < workers ? pack_worker_key(load, w) : kNoWorkerKey;
    count[k] = first_round ? 1 : 0;
    if (first_round) {
      placement[2 * w] = w;
      placement[2 * w + 1] = 0;
    }
  }
  uint64_t least = lane_min(worker_key);
  uint64_t next_key = first < n ? sorted_keys[first] : 0;
  for (int32_t i = first; i < n; ++i) {
    const uint64_t cost = uint64_t(task_key_cost(next_key));
    if (i + 1 < n) next_key = sorted_keys[i + 1];  // issued before the reduction, so its latency is hidden
    const uint64_t best = warp_min(least);
    const int32_t w = worker_key_index(best);
    if ((w & 31) == lane) {
      const int slot = w >> 5;
#pragma unroll
      for (int k = 0; k < kKeysPerLane; ++k) {
        if (k == slot) {  // a static register index per k: a dynamic one would move the array to local memory
          worker_key[k] += cost << kWorkerBits;
          placement[2 * i] = w;
          placement[2 * i + 1] = count[k]++;
        }
      }
      least = lane_min(worker_key);
    }
    const uint64_t base = worker_key_load(best);
    if (base >= kRebaseLoad) {  // warp-uniform; every load is >= base, the minimum before this step
#pragma unroll
      for (int k = 0; k < kKeysPerLane; ++k) {
        if (worker_key[k] != kNoWorkerKey) worker_key[k] -= base << kWorkerBits;
      }
      least = lane_min(worker_key);
    }
  }
#pragma unroll
  for (int k = 0; k < kKeysPerLane; ++k) {
    const int32_t w = lane + 32 * k;
    if (w < workers) worker_counts[w] = count[k];
  }
}

template <int kKeysPerLane>
__global__ void __launch_bounds__(kThreads) decode_plan_kernel(const __grid_constant__ DecodePlanParams params) {
  extern __shared__ __align__(16) uint8_t dynamic_scratch[];
  __shared__ int64_t warp_totals[kWarps];
  uint8_t* scratch = params.global_scratch != nullptr ? params.global_scratch : dynamic_scratch;
  uint64_t* keys = reinterpret_cast<uint64_t*>(scratch);  // (next_pow2(capacity)) task keys
  int32_t* placement = reinterpret_cast<int32_t*>(scratch + 8 * next_pow2(params.capacity));  // (capacity, 2)

  const int32_t batch = params.batch, hkv = params.num_kv_heads, workers = params.num_workers;
  const int32_t pairs = batch * hkv;
  int32_t* plan = params.plan;
  int32_t* split_offsets = plan + kDecodeHeader;
  int32_t* worker_offsets = split_offsets + pairs + 1;
  int32_t* records = worker_offsets + workers + 1;

  // Phase 1: total cost, and negative lengths (which the host planner rejects) turned into a status.
  int64_t visible_sum = 0;
  int negative = 0;
  for (int32_t b = threadIdx.x; b < batch; b += kThreads) {
    const int32_t s = params.seqlens[b];
    negative |= s < 0;
    visible_sum += decode_visible_keys(s, params.window_left);
  }
  if (__syncthreads_or(negative)) {
    write_failed_plan(params, Status::kBadSeqlens);
    return;
  }
  int64_t visible_total;
  block_inclusive_scan(visible_sum, warp_totals, &visible_total);
  const int64_t target = decode_chunk_target(visible_total * params.d_sum_total, workers);

  // Phase 2: chunk counts, scanned in place into split_offsets.
  for (int32_t p = threadIdx.x; p < pairs; p += kThreads) {
    const int64_t chunk_len = decode_chunk_len(target, params.d_sum[p % hkv]);
    split_offsets[p + 1] =
        static_cast<int32_t>(decode_chunk_count(params.seqlens[p / hkv], params.window_left, chunk_len));
  }
  if (threadIdx.x == 0) split_offsets[0] = 0;
  __syncthreads();
  const int64_t num_tasks = block_scan_in_place(split_offsets + 1, pairs, warp_totals);
  if (num_tasks > params.capacity) {  // uniform: every thread has the same sum
    write_failed_plan(params, Status::kCapacityExceeded);
    return;
  }
  const int32_t n = static_cast<int32_t>(num_tasks);
  if (threadIdx.x == 0) {
    plan[0] = kDecodePlanTag;
    plan[1] = batch;
    plan[2] = hkv;
    plan[3] = workers;
    plan[4] = params.capacity;
    plan[5] = n;
    plan[6] = params.group;
    plan[7] = static_cast<int32_t>(Status::kOk);
  }
  __syncthreads();  // split_offsets complete for every thread

  // Phase 3: one key per task, padding keys up to a power of two.
  const int32_t sort_size = n > 0 ? static_cast<int32_t>(next_pow2(n)) : 0;
  for (int32_t t = threadIdx.x; t < sort_size; t += kThreads) {
    keys[t] = t < n ? pack_task_key(decode_task(t, split_offsets, params.seqlens, batch, hkv, params.d_sum, target,
                                                params.window_left)
                                        .cost,
                                    t)
                    : kPaddingTaskKey;
  }
  __syncthreads();

  // Phase 4: bitonic sort, ascending keys = cost descending, then enumeration index ascending.
  for (int32_t span = 2; span <= sort_size; span *= 2) {
    for (int32_t stride = span / 2; stride > 0; stride /= 2) {
      for (int32_t c = threadIdx.x; c < sort_size / 2; c += kThreads) bitonic_compare_swap(keys, c, stride, span);
      __syncthreads();
    }
  }

  // Phase 5: greedy assignment by warp 0; the counts land where phase 6 scans them.
  if (threadIdx.x < 32) assign_workers<kKeysPerLane>(keys, n, workers, placement, worker_offsets + 1);
  if (threadIdx.x == 0) worker_offsets[0] = 0;
  __syncthreads();

  // Phase 6: worker_offsets.
  block_scan_in_place(worker_offsets + 1, workers, warp_totals);
  __syncthreads();

  // Phase 7: records in worker order, each worker's in assignment order; -1 past the last task.
  for (int32_t i = threadIdx.x; i < n; i += kThreads) {
    const DecodeTask task = decode_task(task_key_index(keys[i]), split_offsets, params.seqlens, batch, hkv,
                                        params.d_sum, target, params.window_left);
    const int32_t slot = worker_offsets[placement[2 * i]] + placement[2 * i + 1];
    int32_t* record = records + int64_t(kDecodeRecordFields) * slot;
    record[0] = task.pair;
    record[1] = task.chunk;
    record[2] = task.kv_start;
    record[3] = task.kv_end;
  }
  const int64_t record_entries = int64_t(kDecodeRecordFields) * params.capacity;
  for (int64_t i = int64_t(kDecodeRecordFields) * n + threadIdx.x; i < record_entries; i += kThreads) records[i] = -1;
}

template <int kKeysPerLane>
void launch_decode_plan(DecodePlanParams params, int64_t scratch_bytes, const at::Tensor& like, cudaStream_t stream) {
  const auto kernel = decode_plan_kernel<kKeysPerLane>;
  int64_t dynamic_bytes = 0;
  at::Tensor workspace;
  const LaunchStatus shared = allow_all_shared_memory(kernel);
  check_launch(shared);
  if (scratch_bytes <= shared.smem_limit) {
    dynamic_bytes = scratch_bytes;
  } else {
    // The caching allocator keeps this valid past the launch (it is stream-ordered) and inside graph captures.
    workspace = at::empty({scratch_bytes}, like.options().dtype(at::kByte));
    params.global_scratch = workspace.data_ptr<uint8_t>();
  }
  kernel<<<1, kThreads, dynamic_bytes, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// cache_seqlens: (B) int32 on the device; qk_offsets, v_offsets: (H_kv + 1) int32 on the CPU. Returns the plan,
// (decode_plan_size(B, H_kv, N)) int32 on cache_seqlens' device.
at::Tensor decode_plan_cuda(const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets, const at::Tensor& v_offsets,
                            int64_t group, std::optional<int64_t> num_workers, int64_t window_left) {
  const char* op = "decode_plan";
  checks::check_window(op, window_left);
  const checks::HostLayout layout = checks::read_layout(op, qk_offsets, &v_offsets, group);
  checks::check_int32_vector(op, "cache_seqlens", cache_seqlens, -1);
  checks::check_cuda_tensor(op, "cache_seqlens", cache_seqlens);
  const c10::cuda::CUDAGuard guard(cache_seqlens.device());
  const int64_t batch = cache_seqlens.size(0);
  const int32_t workers = checks::read_num_workers(op, num_workers, num_sms());
  const int32_t hkv = layout.num_kv_heads();
  checks::check_device_decode_plan(op, batch, hkv, workers);

  const at::Tensor seqlens = cache_seqlens.contiguous();
  at::Tensor plan = at::empty({decode_plan_size(batch, hkv, workers)}, seqlens.options());
  const int64_t capacity = decode_plan_capacity(batch, hkv, workers);

  DecodePlanParams params{};
  params.seqlens = seqlens.data_ptr<int32_t>();
  params.plan = plan.data_ptr<int32_t>();
  params.global_scratch = nullptr;
  params.batch = static_cast<int32_t>(batch);
  params.num_kv_heads = hkv;
  params.num_workers = workers;
  params.group = layout.group;
  params.capacity = static_cast<int32_t>(capacity);
  params.window_left = window_left;
  const HeadLayoutView view = layout.view();
  params.d_sum_total = 0;
  for (int32_t j = 0; j < hkv; ++j) {
    params.d_sum[j] = static_cast<int16_t>(view.d_sum(j));
    params.d_sum_total += view.d_sum(j);
  }

  const int64_t scratch_bytes = decode_plan_scratch_bytes(capacity);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Worker keys per lane of the assignment warp: ceil(N / 32), rounded up to a compiled power of two.
  const int64_t keys_per_lane = next_pow2(ceil_div(workers, 32));
  switch (keys_per_lane) {
    case 1: launch_decode_plan<1>(params, scratch_bytes, seqlens, stream); break;
    case 2: launch_decode_plan<2>(params, scratch_bytes, seqlens, stream); break;
    case 4: launch_decode_plan<4>(params, scratch_bytes, seqlens, stream); break;
    case 8: launch_decode_plan<8>(params, scratch_bytes, seqlens, stream); break;
    case 16: launch_decode_plan<16>(params, scratch_bytes, seqlens, stream); break;
    case 32: launch_decode_plan<32>(params, scratch_bytes, seqlens, stream); break;
    default:
      FDC_CHECK(false, op, "num_workers = ", workers, " needs ", keys_per_lane,
                " worker keys per lane, which no compiled planner kernel holds");
  }
  return plan;
}

}  // namespace fdc::cuda

TORCH_LIBRARY_IMPL(fdc, CUDA, m) { m.impl("decode_plan", &fdc::cuda::decode_plan_cuda); }
