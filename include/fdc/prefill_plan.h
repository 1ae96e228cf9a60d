// The prefill planner (docs/design.md sections 1 and 4): varlen attention of many query rows per sequence.
//
// Task: (sequence b, query head h, row block [row_start, row_end)), rows counted from the sequence's first query.
// Row blocks are sized per head so tiles of wide and narrow heads cost about the same: with
// d_sum(j) = d_qk(j) + d_v(j) + 1 and d_sum_max the largest over KV heads,
//     rows(j) = max(16, round_down(row_block * d_sum_max / d_sum(j), 16))
// (16 = the row tile of a tensor-core product; rounding down keeps no tile above the widest head's cost).
//
// Cost model. Row r of a sequence with s_q queries and s_k keys sits at position p = r + s_k - s_q (aligned
// bottom-right as in FlashAttention) and sees the keys [lo(r), hi(r)) with
//     hi(r) = s_k                                  (non-causal)
//     hi(r) = clamp(p + 1, 0, s_k)                 (causal)
//     lo(r) = 0                                    (no window: window_left = kNoWindow)
//     lo(r) = clamp(p - window_left, 0, s_k)       (sliding window, include/fdc/attention_variant.h)
// so visible(r) = hi(r) - lo(r) (never negative: p - window_left <= p + 1 and clamping keeps the order), and costs
// d_sum(j) * visible(r): QK^T, softmax and PV over exactly the keys it sees (whole masked-out key tiles are skipped by
// the kernels). A task costs the sum over its rows, in closed form, so under causal masking a late row block of a long
// sequence costs up to twice its early neighbours and up to s_k / 16 times the first block; under a causal window the
// row blocks past the window's length all cost the same.
//
// Assignment, with N workers and T tasks:
//   1. Tasks sorted by cost, descending (ties: enumeration order b, h, block).
//   2. The first floor(T / N) * N tasks (the full rounds) go one at a time to the least-loaded worker (ties: lowest
//      index). With equal costs this is exactly round-robin rounds; with causal costs it is LPT.
//   3. The T mod N tasks of the last, partial round would leave workers idle. Their total work W_last is spread
//      evenly: wl = ceil(W_last / N), and each such task (in sorted order) is cut into pieces of whole 16-row steps,
//      a piece growing while it stays within wl (every piece has at least one step); each piece goes, when cut, to
//      the least-loaded worker.
// Capacity: row blocks and pieces start on 16-row boundaries of their sequence, so every record except one per
// (b, h) holds a multiple of 16 rows: records <= H * (floor(T_q / 16) + B), T_q the total query rows.
//
// Plan format (int32, prefill_plan_size(N, R) entries; a longer buffer holds the same plan followed by unused space):
//   [0] kPrefillPlanTag  [1] B  [2] H  [3] N  [4] R = records  [5] causal  [6] row_block  [7] group
//   worker_offsets[N + 1]   worker w runs records worker_offsets[w] .. worker_offsets[w+1] - 1, in that order.
//   records[R][4]           (b, h, row_start, row_end).
#pragma once

#include "fdc/attention_variant.h"
#include "fdc/common.h"
#include "fdc/head_layout.h"
#include "fdc/lpt.h"

namespace fdc {

constexpr int32_t kPrefillPlanTag = 0x46444350;  // "FDCP"
constexpr int32_t kPrefillHeader = 8;
constexpr int32_t kPrefillRecordFields = 4;
// Row blocks and pieces are whole multiples of this many query rows (the m16 tile of mma.sync / wgmma).
constexpr int64_t kRowStep = 16;
// The paper's B_r for the widest head: 64 rows keep a fp32 accumulator tile of 64 x 256 within one CTA's registers.
constexpr int32_t kDefaultRowBlock = 64;

FDC_HOST_DEVICE inline int64_t prefill_plan_capacity(int64_t total_q, int64_t batch, int64_t num_heads) {
  return num_heads * (total_q / kRowStep + batch);
}

FDC_HOST_DEVICE inline int64_t prefill_plan_size(int64_t num_workers, int64_t num_records) {
  return kPrefillHeader + (num_workers + 1) + kPrefillRecordFields * num_records;
}

FDC_HOST_DEVICE inline int64_t prefill_plan_workspace_bytes(int64_t capacity, int64_t num_workers) {
  return 8 * (capacity + num_workers) + 4 * (3 * capacity + num_workers + 2 * kPrefillRecordFields * capacity);
}

// Sum of clamp(r + shift, 0, s_k) over rows [r0, r1), in closed form.
FDC_HOST_DEVICE inline int64_t clamped_row_sum(int64_t r0, int64_t r1, int64_t shift, int64_t s_k) {
  // Rows with r + shift <= 0 add nothing, rows with r + shift >= s_k add s_k, the rest add r + shift.
  const int64_t lin_lo = max64(r0, -shift + 1);
  const int64_t lin_hi = min64(r1, s_k - shift);  // exclusive
  int64_t sum = 0;
  if (lin_hi > lin_lo) sum += (lin_lo + lin_hi - 1 + 2 * shift) * (lin_hi - lin_lo) / 2;
  const int64_t full_lo = max64(r0, s_k - shift);
  if (r1 > full_lo) sum += (r1 - full_lo) * s_k;
  return sum;
}

// Sum of visible(r) = hi(r) - lo(r) over rows [r0, r1) (see the file comment), in closed form.
FDC_HOST_DEVICE inline int64_t visible_keys(int64_t r0, int64_t r1, int64_t s_q, int64_t s_k, bool causal,
                                            int64_t window_left = kNoWindow) {
  if (r1 <= r0 || s_k <= 0) return 0;
  const int64_t shift = s_k - s_q;  // row r sits at position r + shift
  const int64_t hi_sum = causal ? clamped_row_sum(r0, r1, shift + 1, s_k) : (r1 - r0) * s_k;
  const int64_t lo_sum = window_left == kNoWindow ? 0 : clamped_row_sum(r0, r1, shift - window_left, s_k);
  return hi_sum - lo_sum;
}

// Rows per task for KV head j's query heads (see the file comment).
FDC_HOST_DEVICE inline int64_t prefill_rows_per_task(int32_t row_block, int32_t max_d_sum, int32_t d_sum) {
  const int64_t scaled = int64_t(row_block) * max_d_sum / d_sum;
  return max64(kRowStep, scaled / kRowStep * kRowStep);
}

struct PrefillPlanView {
  const int32_t* data;
  FDC_HOST_DEVICE int32_t batch() const { return data[1]; }
  FDC_HOST_DEVICE int32_t num_heads() const { return data[2]; }
  FDC_HOST_DEVICE int32_t num_workers() const { return data[3]; }
  FDC_HOST_DEVICE int32_t num_records() const { return data[4]; }
  FDC_HOST_DEVICE bool causal() const { return data[5] != 0; }
  FDC_HOST_DEVICE int32_t row_block() const { return data[6]; }
  FDC_HOST_DEVICE int32_t group() const { return data[7]; }
  FDC_HOST_DEVICE const int32_t* worker_offsets() const { return data + kPrefillHeader; }
  FDC_HOST_DEVICE const int32_t* records() const { return worker_offsets() + num_workers() + 1; }
};

// Builds the plan into plan[prefill_plan_size(N, capacity)]; the plan proper is its first
// prefill_plan_size(N, plan[4]) entries. cu_seqlens_q/k[B + 1] are the query/key sequence boundaries; capacity is
// prefill_plan_capacity(cu_seqlens_q[B] - cu_seqlens_q[0], B, H) or more; workspace holds
// prefill_plan_workspace_bytes(capacity, N) bytes, 8-byte aligned. window_left (kNoWindow or in [0, 2^31)) only changes
// the tasks' costs: the plan's format and its coverage of the rows are the same with or without it.
FDC_HOST_DEVICE inline Status build_prefill_plan(const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
                                                 int32_t batch, HeadLayoutView layout, bool causal, int32_t row_block,
                                                 int32_t num_workers, int64_t capacity, int32_t* plan, void* workspace,
                                                 int64_t window_left = kNoWindow) {
  if (batch < 0 || num_workers <= 0 || layout.group <= 0 || row_block < kRowStep || row_block % kRowStep != 0 ||
      window_left < kNoWindow || window_left > INT32_MAX)
    return Status::kBadArgument;
  for (int32_t b = 0; b < batch; ++b) {
    if (cu_seqlens_q[b + 1] < cu_seqlens_q[b] || cu_seqlens_k[b + 1] < cu_seqlens_k[b]) return Status::kBadSeqlens;
  }
  const int32_t num_heads = layout.num_heads();
  const int64_t cap = capacity;

  int64_t* cost = static_cast<int64_t*>(workspace);
  int64_t* load = cost + cap;
  int32_t* order = reinterpret_cast<int32_t*>(load + num_workers);
  int32_t* scratch = order + cap;
  int32_t* record_worker = scratch + cap;
  int32_t* heap = record_worker + cap;
  int32_t* task_records = heap + num_workers;                           // [cap][4], enumeration order
  int32_t* sorted_records = task_records + cap * kPrefillRecordFields;  // [cap][4], assignment order

  const int32_t max_d_sum = layout.max_d_sum();
  int32_t n = 0;
  for (int32_t b = 0; b < batch; ++b) {
    const int64_t s_q = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
    const int64_t s_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    for (int32_t h = 0; h < num_heads; ++h) {
      const int32_t j = h / layout.group;
      const int64_t rows = prefill_rows_per_task(row_block, max_d_sum, layout.d_sum(j));
      for (int64_t r0 = 0; r0 < s_q; r0 += rows) {
        if (n >= cap) return Status::kCapacityExceeded;
        const int64_t r1 = min64(s_q, r0 + rows);
        int32_t* r = task_records + int64_t(n) * kPrefillRecordFields;
        r[0] = b;
        r[1] = h;
        r[2] = static_cast<int32_t>(r0);
        r[3] = static_cast<int32_t>(r1);
        cost[n] = layout.d_sum(j) * visible_keys(r0, r1, s_q, s_k, causal, window_left);
        order[n] = n;
        ++n;
      }
    }
  }
  sort_by_cost_desc(order, scratch, cost, n);

  WorkerPool pool(load, heap, num_workers);
  int32_t num_records = 0;
  auto emit = [&](int32_t b, int32_t h, int64_t r0, int64_t r1, int64_t c) {
    int32_t* r = sorted_records + int64_t(num_records) * kPrefillRecordFields;
    r[0] = b;
    r[1] = h;
    r[2] = static_cast<int32_t>(r0);
    r[3] = static_cast<int32_t>(r1);
    record_worker[num_records] = pool.take(c);
    ++num_records;
  };

  const int32_t full = n / num_workers * num_workers;
  for (int32_t i = 0; i < full; ++i) {
    const int32_t* t = task_records + int64_t(order[i]) * kPrefillRecordFields;
    emit(t[0], t[1], t[2], t[3], cost[order[i]]);
  }
  int64_t last_round_work = 0;
  for (int32_t i = full; i < n; ++i) last_round_work += cost[order[i]];
  const int64_t wl = ceil_div(last_round_work, num_workers);
  for (int32_t i = full; i < n; ++i) {
    const int32_t* t = task_records + int64_t(order[i]) * kPrefillRecordFields;
    const int32_t b = t[0], h = t[1];
    const int64_t s_q = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
    const int64_t s_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    const int64_t d_sum = layout.d_sum(h / layout.group);
    int64_t p0 = t[2];
    while (p0 < t[3]) {
      int64_t p1 = min64(t[3], p0 + kRowStep);
      int64_t piece_cost = d_sum * visible_keys(p0, p1, s_q, s_k, causal, window_left);
      while (p1 < t[3]) {
        const int64_t next = min64(t[3], p1 + kRowStep);
        const int64_t step_cost = d_sum * visible_keys(p1, next, s_q, s_k, causal, window_left);
        if (piece_cost + step_cost > wl) break;
        piece_cost += step_cost;
        p1 = next;
      }
      if (num_records >= cap) return Status::kCapacityExceeded;
      emit(b, h, p0, p1, piece_cost);
      p0 = p1;
    }
  }

  plan[0] = kPrefillPlanTag;
  plan[1] = batch;
  plan[2] = num_heads;
  plan[3] = num_workers;
  plan[4] = num_records;
  plan[5] = causal ? 1 : 0;
  plan[6] = row_block;
  plan[7] = layout.group;
  int32_t* worker_offsets = plan + kPrefillHeader;
  group_records_by_worker(sorted_records, record_worker, num_records, kPrefillRecordFields, num_workers, worker_offsets,
                          worker_offsets + num_workers + 1);
  return Status::kOk;
}

}  // namespace fdc
