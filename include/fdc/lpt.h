// Building blocks of both planners: a stable sort of tasks by descending cost, and a pool of workers that hands out
// the least-loaded one. Plain arrays and caller-owned scratch only, so the same code runs on the host and in a
// single device thread; ties are broken by index everywhere, so host and device plans agree integer for integer.
#pragma once

#include "fdc/common.h"

namespace fdc {

// Sorts order[0, n) (task indices) by cost[order[i]] descending; equal costs keep their input order (stable).
// Bottom-up merge sort, O(n log n), with scratch[n] as the second buffer. The result is left in `order`.
FDC_HOST_DEVICE inline void sort_by_cost_desc(int32_t* order, int32_t* scratch, const int64_t* cost, int32_t n) {
  int32_t* src = order;
  int32_t* dst = scratch;
  for (int32_t width = 1; width < n; width *= 2) {
    for (int32_t lo = 0; lo < n; lo += 2 * width) {
      const int32_t mid = static_cast<int32_t>(min64(lo + width, n));
      const int32_t hi = static_cast<int32_t>(min64(lo + 2 * int64_t(width), n));
      int32_t a = lo, b = mid, out = lo;
      while (a < mid && b < hi) dst[out++] = (cost[src[b]] > cost[src[a]]) ? src[b++] : src[a++];
      while (a < mid) dst[out++] = src[a++];
      while (b < hi) dst[out++] = src[b++];
    }
    int32_t* t = src;
    src = dst;
    dst = t;
  }
  if (src != order) {
    for (int32_t i = 0; i < n; ++i) order[i] = src[i];
  }
}

// Workers with an accumulated load each; take() returns the least-loaded worker (the lowest index among equals)
// and adds a cost to it. A binary min-heap over (load, worker): O(log N) per task.
class WorkerPool {
 public:
  // load[N] and heap[N] are caller-owned storage for N workers.
  FDC_HOST_DEVICE WorkerPool(int64_t* load, int32_t* heap, int32_t num_workers)
      : load_(load), heap_(heap), n_(num_workers) {
    for (int32_t w = 0; w < n_; ++w) {
      load_[w] = 0;
      heap_[w] = w;  // all loads equal: index order is already a valid heap
    }
  }

  FDC_HOST_DEVICE int32_t take(int64_t cost) {
    const int32_t w = heap_[0];
    load_[w] += cost;
    sift_down(0);
    return w;
  }

  FDC_HOST_DEVICE int64_t load(int32_t w) const { return load_[w]; }

 private:
  FDC_HOST_DEVICE bool before(int32_t a, int32_t b) const {
    return load_[a] < load_[b] || (load_[a] == load_[b] && a < b);
  }
  FDC_HOST_DEVICE void sift_down(int32_t i) {
    for (;;) {
      const int32_t l = 2 * i + 1, r = l + 1;
      int32_t best = i;
      if (l < n_ && before(heap_[l], heap_[best])) best = l;
      if (r < n_ && before(heap_[r], heap_[best])) best = r;
      if (best == i) return;
      const int32_t t = heap_[i];
      heap_[i] = heap_[best];
      heap_[best] = t;
      i = best;
    }
  }

  int64_t* load_;
  int32_t* heap_;
  int32_t n_;
};

// Writes worker_offsets[N + 1] and regroups records by worker, keeping each worker's records in assignment order
// (a stable counting sort). record_worker[i] is the worker of record i; records are `fields` int32 wide; `out`
// receives the regrouped records.
FDC_HOST_DEVICE inline void group_records_by_worker(const int32_t* records, const int32_t* record_worker,
                                                    int32_t num_records, int32_t fields, int32_t num_workers,
                                                    int32_t* worker_offsets, int32_t* out) {
  for (int32_t w = 0; w <= num_workers; ++w) worker_offsets[w] = 0;
  for (int32_t i = 0; i < num_records; ++i) ++worker_offsets[record_worker[i] + 1];
  for (int32_t w = 0; w < num_workers; ++w) worker_offsets[w + 1] += worker_offsets[w];
  // Fill cursors live in the first N entries and are restored afterwards, so no extra scratch is needed.
  for (int32_t i = 0; i < num_records; ++i) {
    const int32_t slot = worker_offsets[record_worker[i]]++;
    for (int32_t f = 0; f < fields; ++f) out[int64_t(slot) * fields + f] = records[int64_t(i) * fields + f];
  }
  for (int32_t w = num_workers; w > 0; --w) worker_offsets[w] = worker_offsets[w - 1];
  worker_offsets[0] = 0;
}

}  // namespace fdc
