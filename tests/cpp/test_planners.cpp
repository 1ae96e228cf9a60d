// Tests of the torch-free headers (include/fdc): the planners against independent, naive implementations of the
// algorithms their headers document, the CPU decode kernel's pieces, exact coverage of the work, the LPT bound, the
// closed-form causal cost, the sort, the worker pool and the log-sum-exp merge. Fresh random cases from a seeded
// generator (the seed is printed; pass one as argv[1] to replay), plus fixed edge cases. Exit code = number of failed
// checks (capped at 255).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "fdc/decode_pieces.h"
#include "fdc/decode_plan.h"
#include "fdc/decode_plan_device.h"
#include "fdc/decode_tiles.h"
#include "fdc/head_layout.h"
#include "fdc/lpt.h"
#include "fdc/prefill_plan.h"
#include "fdc/softmax_merge.h"

#include "test_support.h"

using fdc_test::failures;
using fdc_test::Layout;
using fdc_test::random_layout;
using fdc_test::seed;

namespace {

// LPT done plainly: tasks sorted by cost descending (stable), each to the least-loaded worker, lowest index on ties.
std::vector<int64_t> naive_lpt_loads(std::vector<int64_t> costs, int32_t workers) {
  std::stable_sort(costs.begin(), costs.end(), [](int64_t a, int64_t b) { return a > b; });
  std::vector<int64_t> loads(workers, 0);
  for (int64_t c : costs) {
    int32_t best = 0;
    for (int32_t w = 1; w < workers; ++w)
      if (loads[w] < loads[best]) best = w;
    loads[best] += c;
  }
  return loads;
}

// The shortest makespan over all assignments of a few tasks (exhaustive search).
int64_t optimal_makespan(const std::vector<int64_t>& costs, int32_t workers) {
  std::vector<int64_t> loads(workers, 0);
  int64_t best = INT64_MAX;
  auto place = [&](auto&& self, size_t i, int64_t current) -> void {
    if (current >= best) return;
    if (i == costs.size()) {
      best = current;
      return;
    }
    for (int32_t w = 0; w < workers; ++w) {
      loads[w] += costs[i];
      self(self, i + 1, std::max(current, loads[w]));
      loads[w] -= costs[i];
      if (loads[w] == 0) break;  // empty workers are interchangeable
    }
  };
  place(place, 0, 0);
  return best;
}

// LPT's guarantees: at most the average load plus the largest task; within 4/3 of max(average, largest) whenever no
// task exceeds a third of that lower bound (the chunking aims for this); and, for few tasks, within
// (4/3 - 1/(3N)) of the optimal makespan, found by exhaustive search.
void check_lpt_bounds(const std::vector<int64_t>& costs, int64_t makespan, int32_t workers) {
  if (costs.empty()) return;
  int64_t total = 0, largest = 0;
  for (int64_t c : costs) total += c, largest = std::max(largest, c);
  const double average = double(total) / workers, lower = std::max(average, double(largest));
  CHECK(makespan <= average + largest + 1e-9, "makespan %lld above average %.1f + largest %lld",
        static_cast<long long>(makespan), average, static_cast<long long>(largest));
  if (3 * largest <= lower)
    CHECK(makespan <= 4.0 / 3.0 * lower + 1e-9, "makespan %lld above 4/3 of %.1f", static_cast<long long>(makespan),
          lower);
  if (costs.size() <= 9 && workers <= 4) {
    const int64_t optimal = optimal_makespan(costs, workers);
    CHECK(makespan <= (4.0 / 3.0 - 1.0 / (3.0 * workers)) * optimal + 1e-9, "makespan %lld vs optimal %lld",
          static_cast<long long>(makespan), static_cast<long long>(optimal));
  }
}

// The first key a decode query sees, written plainly (fdc/attention_variant.h): the last window_left + 1 keys of a
// windowed request, all of them otherwise.
int64_t first_visible_key(int64_t length, int64_t window_left) {
  return window_left < 0 ? 0 : std::max<int64_t>(0, length - 1 - window_left);
}

std::vector<int32_t> decode_plan_of(const Layout& layout, const std::vector<int32_t>& lens, int32_t workers,
                                    int64_t window_left) {
  const int32_t batch = static_cast<int32_t>(lens.size());
  const int32_t hkv = layout.view().num_kv_heads;
  std::vector<int32_t> plan(fdc::decode_plan_size(batch, hkv, workers), 12345);
  std::vector<int64_t> ws(fdc::ceil_div(fdc::decode_plan_workspace_bytes(batch, hkv, workers), 8));
  const fdc::Status status =
      fdc::build_decode_plan(lens.data(), batch, layout.view(), workers, plan.data(), ws.data(), window_left);
  CHECK(status == fdc::Status::kOk, "decode status %d (window_left %lld)", static_cast<int>(status),
        static_cast<long long>(window_left));
  return status == fdc::Status::kOk ? plan : std::vector<int32_t>{};
}

// The decode plan against its documented algorithm (fdc/decode_plan.h), recomputed plainly: the chunks of each
// (request, KV head) on their grid and their records, coverage of exactly the visible keys, the capacity, the worker
// loads of a plain LPT and LPT's bounds.
void test_decode_plan(const Layout& layout, const std::vector<int32_t>& lens, int32_t workers,
                      int64_t window_left = fdc::kNoWindow) {
  const int32_t batch = static_cast<int32_t>(lens.size());
  const fdc::HeadLayoutView view = layout.view();
  const int32_t hkv = view.num_kv_heads;
  const std::vector<int32_t> plan = decode_plan_of(layout, lens, workers, window_left);
  if (plan.empty()) return;
  const fdc::DecodePlanView p{plan.data()};
  CHECK(p.num_tasks() <= p.capacity(), "tasks %d > capacity %d", p.num_tasks(), p.capacity());

  // The documented chunking, recomputed: total cost of the visible keys, target, chunk length per KV head, chunks on
  // a 16-aligned grid from the first visible key.
  int64_t total = 0;
  for (int32_t b = 0; b < batch; ++b)
    for (int32_t j = 0; j < hkv; ++j) total += (lens[b] - first_visible_key(lens[b], window_left)) * view.d_sum(j);
  const int64_t target = std::max<int64_t>(1, (total + 3 * workers - 1) / (3 * workers));
  std::vector<int64_t> costs;
  std::map<std::tuple<int32_t, int32_t>, std::pair<int32_t, int32_t>> expected_chunks;  // (pair, chunk) -> keys
  for (int32_t b = 0; b < batch; ++b) {
    const int64_t first = first_visible_key(lens[b], window_left), base = first / 16 * 16;
    for (int32_t j = 0; j < hkv; ++j) {
      const int64_t need = (target + view.d_sum(j) - 1) / view.d_sum(j);
      const int64_t chunk = std::max<int64_t>(256, (need + 15) / 16 * 16);
      const int64_t count = (lens[b] - first + chunk - 1) / chunk;
      CHECK(p.split_offsets()[b * hkv + j + 1] - p.split_offsets()[b * hkv + j] == count,
            "request %d head %d: %d chunks, expected %lld", b, j,
            p.split_offsets()[b * hkv + j + 1] - p.split_offsets()[b * hkv + j], static_cast<long long>(count));
      for (int64_t c = 0; c < count; ++c) {
        const int64_t start = c == 0 ? first : base + c * chunk;
        const int64_t end = c == count - 1 ? lens[b] : base + (c + 1) * chunk;
        CHECK(start < end && end - start <= chunk + 15 && (c == 0 || start % 16 == 0),
              "request %d head %d chunk %lld: keys [%lld, %lld)", b, j, static_cast<long long>(c),
              static_cast<long long>(start), static_cast<long long>(end));
        expected_chunks[{b * hkv + j, int32_t(c)}] = {int32_t(start), int32_t(end)};
        costs.push_back((end - start) * view.d_sum(j));
      }
    }
  }
  CHECK(int64_t(expected_chunks.size()) == p.num_tasks(), "%d tasks, expected %zu", p.num_tasks(),
        expected_chunks.size());

  // Coverage: every (request, head) visible key exactly once, no other key; each record the expected chunk; records
  // per worker in non-increasing cost.
  std::vector<std::vector<int>> seen(batch * hkv);
  for (int32_t b = 0; b < batch; ++b)
    for (int32_t j = 0; j < hkv; ++j) seen[b * hkv + j].assign(lens[b], 0);
  std::vector<int64_t> loads(workers, 0);
  for (int32_t w = 0; w < workers; ++w) {
    int64_t previous = INT64_MAX;
    for (int32_t r = p.worker_offsets()[w]; r < p.worker_offsets()[w + 1]; ++r) {
      const int32_t* rec = p.records() + 4 * r;
      const int32_t bj = rec[0];
      const auto expected = expected_chunks.find({bj, rec[1]});
      CHECK(expected != expected_chunks.end() && expected->second == std::make_pair(rec[2], rec[3]),
            "record (%d, %d, %d, %d) is not a chunk of the documented chunking", rec[0], rec[1], rec[2], rec[3]);
      const int64_t cost = int64_t(rec[3] - rec[2]) * view.d_sum(bj % hkv);
      CHECK(cost <= previous, "worker %d runs a costlier task after a cheaper one", w);
      previous = cost;
      loads[w] += cost;
      for (int32_t t = rec[2]; t < rec[3]; ++t) ++seen[bj][t];
    }
  }
  for (int32_t bj = 0; bj < batch * hkv; ++bj) {
    const int64_t first = first_visible_key(lens[bj / hkv], window_left);
    for (int64_t t = 0; t < lens[bj / hkv]; ++t)
      CHECK(seen[bj][t] == (t >= first ? 1 : 0), "key %lld of request %d (visible from %lld) covered %d times",
            static_cast<long long>(t), bj / hkv, static_cast<long long>(first), seen[bj][t]);
  }

  // The same loads as a plain LPT over the same tasks, and LPT's bounds.
  const std::vector<int64_t> expected = naive_lpt_loads(costs, workers);
  CHECK(loads == expected, "decode worker loads differ from a plain LPT");
  const int64_t makespan = loads.empty() ? 0 : *std::max_element(loads.begin(), loads.end());
  check_lpt_bounds(costs, makespan, workers);
}

// The documented prefill algorithm, written plainly: returns each worker's load and the records (b, h, r0, r1).
std::vector<int64_t> naive_prefill_loads(const Layout& layout, const std::vector<int32_t>& cu_q,
                                         const std::vector<int32_t>& cu_k, bool causal, int32_t row_block,
                                         int32_t workers) {
  const fdc::HeadLayoutView view = layout.view();
  auto row_cost = [&](int32_t b, int64_t r, int64_t d_sum) {
    const int64_t s_q = cu_q[b + 1] - cu_q[b], s_k = cu_k[b + 1] - cu_k[b];
    const int64_t keys = causal ? std::clamp<int64_t>(r + s_k - s_q + 1, 0, s_k) : s_k;
    return keys * d_sum;
  };
  int32_t max_d_sum = 0;
  for (int32_t j = 0; j < view.num_kv_heads; ++j) max_d_sum = std::max(max_d_sum, view.d_sum(j));
  struct Task {
    int32_t b, h;
    int64_t r0, r1, cost;
  };
  std::vector<Task> tasks;
  for (int32_t b = 0; b + 1 < static_cast<int32_t>(cu_q.size()); ++b) {
    const int64_t s_q = cu_q[b + 1] - cu_q[b];
    for (int32_t h = 0; h < view.num_heads(); ++h) {
      const int64_t d_sum = view.d_sum(h / view.group);
      const int64_t rows = std::max<int64_t>(16, int64_t(row_block) * max_d_sum / d_sum / 16 * 16);
      for (int64_t r0 = 0; r0 < s_q; r0 += rows) {
        Task t{b, h, r0, std::min(s_q, r0 + rows), 0};
        for (int64_t r = t.r0; r < t.r1; ++r) t.cost += row_cost(b, r, d_sum);
        tasks.push_back(t);
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::vector<int64_t> loads(workers, 0);
  auto give = [&](int64_t cost) {
    int32_t best = 0;
    for (int32_t w = 1; w < workers; ++w)
      if (loads[w] < loads[best]) best = w;
    loads[best] += cost;
  };
  const size_t full = tasks.size() / workers * workers;
  int64_t last = 0;
  for (size_t i = 0; i < tasks.size(); ++i) (i < full ? give(tasks[i].cost) : void(last += tasks[i].cost));
  const int64_t wl = (last + workers - 1) / workers;
  for (size_t i = full; i < tasks.size(); ++i) {
    const Task& t = tasks[i];
    const int64_t d_sum = view.d_sum(t.h / view.group);
    int64_t piece = 0, steps = 0;
    for (int64_t r0 = t.r0; r0 < t.r1; r0 += 16) {
      int64_t step = 0;
      for (int64_t r = r0; r < std::min(t.r1, r0 + 16); ++r) step += row_cost(t.b, r, d_sum);
      if (steps > 0 && piece + step > wl) {
        give(piece);
        piece = 0;
        steps = 0;
      }
      piece += step;
      ++steps;
    }
    if (steps > 0) give(piece);
  }
  return loads;
}

void test_prefill_plan(const Layout& layout, const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k,
                       bool causal, int32_t row_block, int32_t workers) {
  const int32_t batch = static_cast<int32_t>(lens_q.size());
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int32_t b = 0; b < batch; ++b) {
    cu_q.push_back(cu_q.back() + lens_q[b]);
    cu_k.push_back(cu_k.back() + lens_k[b]);
  }
  const fdc::HeadLayoutView view = layout.view();
  const int64_t capacity = fdc::prefill_plan_capacity(cu_q.back(), batch, view.num_heads());
  std::vector<int32_t> plan(fdc::prefill_plan_size(workers, capacity), 777);
  std::vector<int64_t> ws(fdc::ceil_div(fdc::prefill_plan_workspace_bytes(capacity, workers), 8));
  const fdc::Status status = fdc::build_prefill_plan(cu_q.data(), cu_k.data(), batch, view, causal, row_block, workers,
                                                     capacity, plan.data(), ws.data());
  CHECK(status == fdc::Status::kOk, "prefill status %d", static_cast<int>(status));
  if (status != fdc::Status::kOk) return;
  const fdc::PrefillPlanView p{plan.data()};
  CHECK(p.num_records() <= capacity, "records %d > capacity %lld", p.num_records(), static_cast<long long>(capacity));

  std::map<std::tuple<int, int, int>, int> seen;
  std::vector<int64_t> loads(workers, 0);
  for (int32_t w = 0; w < workers; ++w) {
    for (int32_t r = p.worker_offsets()[w]; r < p.worker_offsets()[w + 1]; ++r) {
      const int32_t* rec = p.records() + 4 * r;
      const int32_t b = rec[0], h = rec[1];
      CHECK(rec[2] % 16 == 0 && (rec[3] % 16 == 0 || rec[3] == lens_q[b]), "piece [%d, %d) is not 16-row aligned",
            rec[2], rec[3]);
      loads[w] += view.d_sum(h / view.group) * fdc::visible_keys(rec[2], rec[3], lens_q[b], lens_k[b], causal);
      for (int32_t row = rec[2]; row < rec[3]; ++row) ++seen[{b, h, row}];
    }
  }
  int64_t rows = 0;
  for (int32_t b = 0; b < batch; ++b) rows += int64_t(lens_q[b]) * view.num_heads();
  CHECK(static_cast<int64_t>(seen.size()) == rows, "%zu rows covered of %lld", seen.size(),
        static_cast<long long>(rows));
  for (const auto& entry : seen) CHECK(entry.second == 1, "a query row covered %d times", entry.second);
  const std::vector<int64_t> expected = naive_prefill_loads(layout, cu_q, cu_k, causal, row_block, workers);
  CHECK(loads == expected, "prefill worker loads differ from the plain algorithm");
}

void test_visible_keys(std::mt19937& rng) {
  std::uniform_int_distribution<int> len(0, 70);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t s_q = len(rng), s_k = len(rng);
    const int64_t r0 = s_q ? rng() % (s_q + 1) : 0;
    const int64_t r1 = r0 + (s_q - r0 ? rng() % (s_q - r0 + 1) : 0);
    for (bool causal : {false, true}) {
      int64_t brute = 0;
      for (int64_t r = r0; r < r1; ++r) brute += causal ? std::clamp<int64_t>(r + s_k - s_q + 1, 0, s_k) : s_k;
      CHECK(fdc::visible_keys(r0, r1, s_q, s_k, causal) == brute, "visible_keys(%lld, %lld, %lld, %lld, %d)",
            static_cast<long long>(r0), static_cast<long long>(r1), static_cast<long long>(s_q),
            static_cast<long long>(s_k), causal);
    }
  }
}

void test_building_blocks(std::mt19937& rng) {
  std::vector<int64_t> cost(300);
  for (auto& c : cost) c = rng() % 7;
  std::vector<int32_t> order(cost.size()), scratch(cost.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  fdc::sort_by_cost_desc(order.data(), scratch.data(), cost.data(), static_cast<int32_t>(order.size()));
  for (size_t i = 1; i < order.size(); ++i) {
    CHECK(cost[order[i - 1]] > cost[order[i]] || (cost[order[i - 1]] == cost[order[i]] && order[i - 1] < order[i]),
          "sort is not a stable descending sort at %zu", i);
  }

  std::vector<int64_t> load(5);
  std::vector<int32_t> heap(5);
  fdc::WorkerPool pool(load.data(), heap.data(), 5);
  CHECK(pool.take(10) == 0 && pool.take(3) == 1 && pool.take(3) == 2 && pool.take(1) == 3 && pool.take(1) == 4,
        "first round goes to workers in index order");
  CHECK(pool.take(2) == 3, "least-loaded worker (3, load 1; 4 ties it and has the higher index)");

  const float lse[3] = {1.f, -INFINITY, 1.f + std::log(3.f)};
  float weight[3];
  const float total = fdc::merge_weights(lse, 3, weight);
  CHECK(std::fabs(weight[0] - 0.25f) < 1e-6f && weight[1] == 0.f && std::fabs(weight[2] - 0.75f) < 1e-6f,
        "merge weights %g %g %g", weight[0], weight[1], weight[2]);
  CHECK(std::fabs(total - (1.f + std::log(4.f))) < 1e-6f, "merged lse %g", total);
  const float empty[2] = {-INFINITY, -INFINITY};
  CHECK(fdc::merge_weights(empty, 2, weight) == -INFINITY && weight[0] == 0.f && weight[1] == 0.f,
        "all-empty merge gives zero weights");

  fdc::OnlineSoftmax softmax;
  CHECK(softmax.rescale_for(2.f) == 0.f && softmax.max == 2.f, "first block sets the max");
  softmax.sum = 1.f;
  const float factor = softmax.rescale_for(3.f);
  CHECK(std::fabs(factor - std::exp(-1.f)) < 1e-6f && std::fabs(softmax.sum - std::exp(-1.f)) < 1e-6f,
        "rescaling to a larger max");
}

// Task keys order by cost descending, then index ascending, and decode back; padding sorts last; worker keys order
// by load, then index; the bitonic network sorts like std::sort.
void test_device_keys(std::mt19937& rng) {
  const int64_t max_cost = int64_t(INT32_MAX) * (2 * fdc::kMaxHeadDim + 1);
  const int32_t max_index = int32_t(fdc::kMaxDevicePlanCapacity - 1);
  const int64_t costs[] = {1, 2, 17, 1000, max_cost - 1, max_cost};
  const int32_t indices[] = {0, 1, 5, max_index - 1, max_index};
  for (int64_t c1 : costs)
    for (int32_t i1 : indices) {
      const uint64_t k1 = fdc::pack_task_key(c1, i1);
      CHECK(fdc::task_key_cost(k1) == c1 && fdc::task_key_index(k1) == i1, "task key round trip");
      CHECK(k1 < fdc::kPaddingTaskKey, "padding above every task key");
      for (int64_t c2 : costs)
        for (int32_t i2 : indices) {
          const bool before = c1 > c2 || (c1 == c2 && i1 < i2);
          CHECK((k1 < fdc::pack_task_key(c2, i2)) == before, "task key order (%lld, %d) vs (%lld, %d)",
                static_cast<long long>(c1), i1, static_cast<long long>(c2), i2);
        }
    }
  const uint64_t loads[] = {0, 1, fdc::kRebaseLoad, uint64_t(1) << 44};
  const int32_t workers[] = {0, 1, fdc::kMaxDeviceWorkers - 1};
  for (uint64_t l1 : loads)
    for (int32_t w1 : workers) {
      const uint64_t k1 = fdc::pack_worker_key(l1, w1);
      CHECK(fdc::worker_key_load(k1) == l1 && fdc::worker_key_index(k1) == w1, "worker key round trip");
      CHECK(k1 < fdc::kNoWorkerKey, "absent workers above every worker key");
      for (uint64_t l2 : loads)
        for (int32_t w2 : workers)
          CHECK((k1 < fdc::pack_worker_key(l2, w2)) == (l1 < l2 || (l1 == l2 && w1 < w2)), "worker key order");
    }
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t size = int64_t(1) << (rng() % 12);
    std::vector<uint64_t> keys(size);
    for (auto& k : keys) k = rng() % (trial % 2 ? 8 : 1000000);  // odd trials: many equal keys
    std::vector<uint64_t> expected = keys;
    std::sort(expected.begin(), expected.end());
    for (int64_t span = 2; span <= size; span *= 2)
      for (int64_t stride = span / 2; stride > 0; stride /= 2)
        for (int64_t c = 0; c < size / 2; ++c) fdc::bitonic_compare_swap(keys.data(), c, stride, span);
    CHECK(keys == expected, "bitonic network of size %lld does not sort", static_cast<long long>(size));
  }
  const int32_t offsets[] = {0, 0, 3, 3, 3, 7, 8};  // pairs 0, 2, 3 are empty
  const int32_t owner[] = {1, 1, 1, 4, 4, 4, 4, 5};
  for (int32_t t = 0; t < 8; ++t)
    CHECK(fdc::decode_task_pair(offsets, 6, t) == owner[t], "task %d belongs to pair %d, not %d", t, owner[t],
          fdc::decode_task_pair(offsets, 6, t));
}

// The CUDA decode kernel's shared memory (fdc/decode_tiles.h), for every layout of widths 8..256 (qk and v), both
// cache element sizes (float32, half precision, a quantized cache's 1-byte codes with their scales), contiguous and
// paged caches and every group size's heads per pass, against each architecture's opt-in limit per block: the carve-up
// is sound (tiles hold what is staged and transposed, the reduction fits, regions stay 16-byte aligned, K rows hold
// whole score units, the bytes add up), and the layouts that must fit do: all of them on sm_80 (A100, 163 KiB) and
// sm_90 (H100/H200, 227 KiB); on the 99 KiB parts (sm_86, sm_89, sm_120) those with qk + v <= 336, paged or not.
void test_decode_shared_memory() {
  struct Arch {
    const char* name;
    int64_t limit;      // cudaDevAttrMaxSharedMemoryPerBlockOptin
    int32_t fits_upto;  // every layout with qk + v up to this fits
  };
  const Arch archs[] = {{"sm_80", 166912, 512}, {"sm_86/89/120", 101376, 336}, {"sm_90/100", 232448, 512}};
  for (const int32_t bytes : {1, 2, 4}) {
    const int64_t packet = fdc::decode_packet(bytes), keys = fdc::decode_tile_keys(bytes);
    for (const bool paged : {false, true}) {
      for (int32_t qk = 8; qk <= 256; qk += 8) {
        for (int32_t v = 8; v <= 256; v += 8) {
          for (const int32_t heads : {4, 8, 16}) {
            for (int32_t stages = paged ? 1 : 2; stages <= 2; ++stages) {
              const fdc::DecodeSharedLayout l = fdc::decode_shared_layout(bytes, qk, v, heads, paged, stages);
              const int64_t token_major = keys * (fdc::decode_padded_k_row(bytes, qk) + v);
              const int64_t dim_major = int64_t(qk + v) * fdc::decode_staged_row(bytes);
              const int64_t tiles = int64_t(stages) * l.stage_elems + l.compute_elems;
              const int64_t floats = int64_t(heads) * (qk + keys + 3) + (bytes == 1 ? 4 * keys : 0);
              CHECK(fdc::decode_padded_k_row(bytes, qk) >= qk &&
                        fdc::decode_padded_k_row(bytes, qk) % fdc::decode_score_unit(bytes) == 0 &&
                        fdc::decode_score_unit(bytes) * bytes % 8 == 0,
                    "bytes %d qk %d: a K row does not hold whole score units", bytes, qk);
              CHECK(l.stage_elems >= (paged ? dim_major : token_major) && l.compute_elems >= (paged ? token_major : 0),
                    "bytes %d qk %d v %d paged %d: the tiles do not hold a tile", bytes, qk, v, paged);
              CHECK(tiles * bytes >= int64_t(2) * fdc::kDecodeThreads * heads * 4,
                    "bytes %d qk %d v %d heads %d stages %d: the reduction does not fit", bytes, qk, v, heads, stages);
              CHECK(l.stage_elems % packet == 0 && l.compute_elems % packet == 0,
                    "bytes %d qk %d v %d: a region is not 16-byte aligned", bytes, qk, v);
              CHECK(l.bytes == tiles * bytes + floats * 4, "bytes %d qk %d v %d: the sizes do not add up", bytes, qk,
                    v);
            }
          }
          for (const Arch& arch : archs) {
            for (const int64_t group : {1, 4, 7, 8, 16, 32}) {
              const fdc::DecodeSharedLayout l =
                  fdc::choose_decode_shared_layout(bytes, qk, v, group, paged, arch.limit);
              if (qk + v <= arch.fits_upto) {
                CHECK(l.bytes <= arch.limit, "%s: bytes %d qk %d v %d group %lld paged %d needs %lld bytes", arch.name,
                      bytes, qk, v, static_cast<long long>(group), paged, static_cast<long long>(l.bytes));
              }
              if (l.bytes <= arch.limit) {
                CHECK(l.heads >= 4 && l.heads <= fdc::decode_heads_per_pass(group) && (l.stages == 2 || paged),
                      "%s: bytes %d qk %d v %d: %d heads, %d stages", arch.name, bytes, qk, v, l.heads, l.stages);
              }
            }
          }
        }
      }
    }
  }
  // On an H100 the widest paged heads keep every query head of a 16-group in one pass (one stage: two would need
  // 235,712 bytes), and heads up to 128 wide keep two stages.
  const fdc::DecodeSharedLayout widest = fdc::choose_decode_shared_layout(2, 256, 256, 16, true, 232448);
  CHECK(widest.heads == 16 && widest.stages == 1, "H100 paged bf16 256/256: %d heads, %d stages", widest.heads,
        widest.stages);
  const fdc::DecodeSharedLayout common = fdc::choose_decode_shared_layout(2, 128, 128, 16, true, 232448);
  CHECK(common.heads == 16 && common.stages == 2, "H100 paged bf16 128/128: %d heads, %d stages", common.heads,
        common.stages);
  // The case the one-stage layout exists for: an A100, paged bf16 qk 256 / v 128 (166,960 bytes with two stages).
  const fdc::DecodeSharedLayout a100 = fdc::choose_decode_shared_layout(2, 256, 128, 4, true, 166912);
  CHECK(a100.bytes <= 166912 && a100.stages == 1, "A100 paged bf16 256/128: %lld bytes, %d stages",
        static_cast<long long>(a100.bytes), a100.stages);
}

}  // namespace

// cut_rows: every request's keys from its first piece's start to its end covered exactly, in order, by pieces on a
// grid of one length from its window's page (base = s - s % quantum, s its first visible key): the first starting at
// the last multiple of `edge` past base at or before s, with visible = s, the others on the grid with visible = t0;
// that length the smallest multiple of the quantum reaching both kMinPieceRows and the keys from base over
// kPiecesPerThread pieces per thread; split_offsets counts each (request, KV head)'s pieces.
void test_cut_rows(const std::vector<int32_t>& lens, int64_t hkv, int64_t threads, int64_t quantum,
                   int64_t window_left = fdc::kNoWindow, int64_t edge = 1) {
  std::vector<int32_t> splits;
  const std::vector<fdc::RowPiece> pieces = fdc::cut_rows(lens, window_left, hkv, threads, quantum, edge, splits);
  int64_t total = 0;
  for (int32_t len : lens) total += len - first_visible_key(len, window_left) / quantum * quantum;
  int64_t length = quantum;
  while (length < fdc::kMinPieceRows || length * fdc::kPiecesPerThread * threads < total) length += quantum;
  CHECK(int64_t(splits.size()) == int64_t(lens.size()) * hkv + 1 && splits[0] == 0, "split_offsets size");
  size_t next = 0;
  for (int64_t b = 0; b < int64_t(lens.size()); ++b) {
    const int64_t visible = first_visible_key(lens[b], window_left), base = visible / quantum * quantum;
    const int64_t first = base + (visible - base) / edge * edge;
    int64_t t = first, index = 0;
    while (next < pieces.size() && pieces[next].b == b) {
      const fdc::RowPiece& p = pieces[next++];
      CHECK(p.t0 == t && p.index == index && p.t1 > p.t0 && p.visible == std::max(p.t0, visible),
            "request %lld: piece %lld is [%lld, %lld) visible from %lld", (long long)b, (long long)index,
            (long long)p.t0, (long long)p.t1, (long long)p.visible);
      CHECK(p.t1 == lens[b] || (p.t1 - base) % length == 0, "request %lld: a piece ends at %lld, off its grid",
            (long long)b, (long long)p.t1);
      CHECK(p.t1 - p.t0 <= length && (p.t1 - p.t0 == length || p.t1 == lens[b] || index == 0),
            "request %lld: a piece of %lld keys, not %lld", (long long)b, (long long)(p.t1 - p.t0), (long long)length);
      CHECK(p.visible - p.t0 < edge, "request %lld: %lld keys masked in a block of %lld", (long long)b,
            (long long)(p.visible - p.t0), (long long)edge);
      t = p.t1, ++index;
    }
    CHECK(t == std::max<int64_t>(first, lens[b]), "request %lld: pieces end at %lld of %d keys", (long long)b,
          (long long)t, lens[b]);
    for (int64_t j = 0; j < hkv; ++j)
      CHECK(splits[b * hkv + j + 1] - splits[b * hkv + j] == index, "request %lld head %lld: %d slots for %lld pieces",
            (long long)b, (long long)j, splits[b * hkv + j + 1] - splits[b * hkv + j], (long long)index);
  }
  CHECK(next == pieces.size(), "pieces of no request");
  CHECK(int64_t(pieces.size()) <= fdc::kPiecesPerThread * threads + int64_t(lens.size()), "%zu pieces for %lld threads",
        pieces.size(), (long long)threads);
}

// Windowed decode plans at their edges: windows shorter and longer than the request, window_left 0, starts off the
// 16-key grid, lengths 0 and 1; without a window the plan is the one of a window longer than every request.
void test_windowed_decode_plans(std::mt19937& rng) {
  const Layout fixed{{0, 64, 80}, {0, 32, 96}, 2};
  const std::vector<int32_t> lens = {100000, 3, 1, 7, 0, 2, 4096, 257};
  const int64_t windows[] = {0, 1, 2, 6, 15, 16, 17, 255, 256, 1000, 4095, 4096, 99998, 99999, 100000, INT32_MAX};
  for (const int64_t window : windows) {
    for (const int32_t workers : {1, 3, 16, 64}) test_decode_plan(fixed, lens, workers, window);
  }
  test_decode_plan(fixed, {1}, 2, 0);
  test_decode_plan(fixed, {0}, 2, 0);
  test_decode_plan(fixed, {0, 1, 0}, 5, 3);
  for (const int32_t workers : {1, 7, 40}) {
    CHECK(decode_plan_of(fixed, lens, workers, fdc::kNoWindow) == decode_plan_of(fixed, lens, workers, 99999),
          "a window as long as the longest request changes the plan (%d workers)", workers);
  }
  std::uniform_int_distribution<int> batch_size(0, 9), workers(1, 64);
  for (int trial = 0; trial < 600; ++trial) {  // capacity never exceeded, chunks as documented
    const Layout layout = random_layout(rng);
    std::vector<int32_t> cache(batch_size(rng));
    for (auto& len : cache) len = rng() % 4 == 0 ? int32_t(rng() % 70000) : int32_t(rng() % 700);
    const int64_t windows[] = {fdc::kNoWindow, 0, int64_t(rng() % 40), int64_t(rng() % 3000), int64_t(rng() % 70000)};
    test_decode_plan(layout, cache, workers(rng), windows[rng() % 5]);
  }
}

int main(int argc, char** argv) {
  seed = argc > 1 ? static_cast<unsigned>(std::strtoul(argv[1], nullptr, 10)) : std::random_device{}();
  std::printf("test_planners seed %u\n", seed);
  std::mt19937 rng(seed);
  test_building_blocks(rng);
  test_visible_keys(rng);
  test_decode_shared_memory();
  test_cut_rows({}, 3, 2, 1);
  test_cut_rows({0, 0}, 2, 4, 16);
  test_cut_rows({8192}, 3, 2, 1);  // SmolLM2's one long request on 2 threads
  test_cut_rows({100000, 3, 0, 257}, 8, 16, 128);
  test_cut_rows({8192, 1000, 1, 0}, 3, 2, 1, 1023);       // a window on a contiguous cache starts exactly
  test_cut_rows({8192, 1000, 1, 0}, 3, 2, 16, 1023, 16);  // 16-key pages: pieces start on the window's page
  test_cut_rows({8192, 1000, 1, 0}, 3, 2, 256, 0, 64);    // pages longer than a block: on its block of the page
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> lens(rng() % 12);
    for (auto& len : lens) len = rng() % 3 == 0 ? int32_t(rng() % 40000) : int32_t(rng() % 600);
    const int64_t quanta[] = {1, 16, 32, 100, 128, 256};
    const int64_t quantum = quanta[rng() % 6];
    const int64_t windows[] = {fdc::kNoWindow, 0, int64_t(rng() % 50), int64_t(rng() % 5000)};
    test_cut_rows(lens, 1 + rng() % 8, 1 + rng() % 64, quantum, windows[rng() % 4], 1 + rng() % quantum);
  }

  const Layout fixed{{0, 64, 80}, {0, 32, 96}, 2};
  test_decode_plan(fixed, {}, 4);                        // empty batch
  test_decode_plan(fixed, {0, 0, 0}, 3);                 // only empty requests
  test_decode_plan(fixed, {100000, 3, 1, 7, 0, 2}, 16);  // one huge request among short ones
  test_decode_plan(fixed, {5000}, 1);                    // one worker
  test_windowed_decode_plans(rng);
  test_device_keys(rng);
  test_prefill_plan(fixed, {}, {}, true, 64, 4);
  test_prefill_plan(fixed, {0, 1, 17}, {0, 1, 17}, true, 64, 200);  // more workers than rows
  test_prefill_plan(fixed, {40, 300}, {10, 900}, true, 16, 7);      // s_q > s_k and s_q < s_k
  test_prefill_plan(fixed, {513}, {513}, false, 128, 1);

  for (int trial = 0; trial < 300; ++trial) {  // LPT alone, on small task sets where the optimum is searchable
    std::vector<int64_t> costs(1 + rng() % 9);
    for (auto& c : costs) c = 1 + rng() % 20;
    const int32_t workers = 1 + rng() % 4;
    const std::vector<int64_t> loads = naive_lpt_loads(costs, workers);
    check_lpt_bounds(costs, *std::max_element(loads.begin(), loads.end()), workers);
  }

  std::uniform_int_distribution<int> batch_size(0, 7), workers(1, 40), coin(0, 1);
  const int32_t lengths[] = {0, 1, 2, 15, 16, 17, 64, 255, 256, 257, 1000, 4096, 30000};
  for (int trial = 0; trial < 400; ++trial) {
    const Layout layout = random_layout(rng);
    const int batch = batch_size(rng);
    std::vector<int32_t> lens_q, lens_k;
    for (int b = 0; b < batch; ++b) {
      lens_q.push_back(lengths[rng() % 11]);
      lens_k.push_back(coin(rng) ? lens_q.back() : lengths[rng() % 11]);
    }
    test_prefill_plan(layout, lens_q, lens_k, coin(rng), 16 * (1 + rng() % 8), workers(rng));
    std::vector<int32_t> cache;
    for (int b = 0; b < batch; ++b) cache.push_back(lengths[rng() % 13]);
    test_decode_plan(layout, cache, workers(rng));
  }
  std::printf("%d failed checks\n", failures);
  return std::min(failures, 255);
}
