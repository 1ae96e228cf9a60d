// Tests of the prefill planner's sliding window (include/fdc/prefill_plan.h): the closed-form cost against counting
// the keys each row sees one by one, the windowed plan against the documented algorithm done plainly with that
// count, exact coverage of the rows, and window_left = kNoWindow (or a window longer than every sequence) giving the
// unwindowed plan integer for integer. Fresh random cases from a seeded generator (the seed is printed; pass one as
// argv[1] to replay). Exit code = number of failed checks (capped at 255).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "fdc/attention_variant.h"
#include "fdc/head_layout.h"
#include "fdc/prefill_plan.h"

#include "test_support.h"

using fdc_test::failures;
using fdc_test::Layout;
using fdc_test::random_layout;
using fdc_test::seed;

namespace {

// Keys row r of a sequence (s_q queries, s_k keys) sees, counted one by one from the definition
// (include/fdc/attention_variant.h): key t is visible when t <= p (causal only) and t >= p - window_left (window
// only), p = r + s_k - s_q.
int64_t count_visible(int64_t r, int64_t s_q, int64_t s_k, bool causal, int64_t window_left) {
  const int64_t p = r + s_k - s_q;
  int64_t count = 0;
  for (int64_t t = 0; t < s_k; ++t) count += (!causal || t <= p) && (window_left < 0 || t >= p - window_left);
  return count;
}

void test_visible_keys(std::mt19937& rng) {
  std::uniform_int_distribution<int> len(0, 70), window(-1, 80);
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t s_q = len(rng), s_k = len(rng), window_left = trial % 5 == 0 ? 0 : window(rng);
    const int64_t r0 = s_q ? rng() % (s_q + 1) : 0;
    const int64_t r1 = r0 + (s_q - r0 ? rng() % (s_q - r0 + 1) : 0);
    for (bool causal : {false, true}) {
      int64_t brute = 0;
      for (int64_t r = r0; r < r1; ++r) brute += count_visible(r, s_q, s_k, causal, window_left);
      CHECK(fdc::visible_keys(r0, r1, s_q, s_k, causal, window_left) == brute,
            "visible_keys(%lld, %lld, %lld, %lld, %d, %lld)", (long long)r0, (long long)r1, (long long)s_q,
            (long long)s_k, causal, (long long)window_left);
    }
  }
  // Positions and windows near the int32 limits: the closed form stays exact in int64.
  const int64_t big = INT32_MAX;
  CHECK(fdc::visible_keys(0, 1, 1, big, true, big) == big, "one row seeing every one of 2^31 - 1 keys");
  CHECK(fdc::visible_keys(0, 1, 1, big, true, 0) == 1, "window 0: only the query's own key");
  CHECK(fdc::visible_keys(0, 1, 1, big, false, 9) == 10, "non-causal: the 10 keys from p - 9 to the last");
}

// The plan's algorithm (the file comment of prefill_plan.h) done plainly, with row costs counted one by one: the load
// each worker ends with.
std::vector<int64_t> naive_loads(const Layout& layout, const std::vector<int32_t>& cu_q,
                                 const std::vector<int32_t>& cu_k, bool causal, int64_t window_left, int32_t row_block,
                                 int32_t workers) {
  const fdc::HeadLayoutView view = layout.view();
  auto rows_cost = [&](int32_t b, int64_t r0, int64_t r1, int64_t d_sum) {
    int64_t cost = 0;
    for (int64_t r = r0; r < r1; ++r)
      cost += d_sum * count_visible(r, cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], causal, window_left);
    return cost;
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
        const int64_t r1 = std::min(s_q, r0 + rows);
        tasks.push_back({b, h, r0, r1, rows_cost(b, r0, r1, d_sum)});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::vector<int64_t> loads(workers, 0);
  auto give = [&](int64_t cost) { *std::min_element(loads.begin(), loads.end()) += cost; };
  const size_t full = tasks.size() / workers * workers;
  int64_t last = 0;
  for (size_t i = 0; i < tasks.size(); ++i) (i < full ? give(tasks[i].cost) : void(last += tasks[i].cost));
  const int64_t wl = (last + workers - 1) / workers;
  for (size_t i = full; i < tasks.size(); ++i) {
    const Task& t = tasks[i];
    const int64_t d_sum = view.d_sum(t.h / view.group);
    int64_t piece = 0, steps = 0;
    for (int64_t r0 = t.r0; r0 < t.r1; r0 += 16) {
      const int64_t step = rows_cost(t.b, r0, std::min(t.r1, r0 + 16), d_sum);
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

std::vector<int32_t> build(const Layout& layout, const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_k,
                           bool causal, int64_t window_left, int32_t row_block, int32_t workers) {
  const int32_t batch = static_cast<int32_t>(cu_q.size()) - 1;
  const fdc::HeadLayoutView view = layout.view();
  const int64_t capacity = fdc::prefill_plan_capacity(cu_q.back(), batch, view.num_heads());
  std::vector<int32_t> plan(fdc::prefill_plan_size(workers, capacity), 777);
  std::vector<int64_t> ws(fdc::ceil_div(fdc::prefill_plan_workspace_bytes(capacity, workers), 8));
  const fdc::Status status = fdc::build_prefill_plan(cu_q.data(), cu_k.data(), batch, view, causal, row_block, workers,
                                                     capacity, plan.data(), ws.data(), window_left);
  CHECK(status == fdc::Status::kOk, "prefill status %d", static_cast<int>(status));
  if (status != fdc::Status::kOk) return {};
  plan.resize(fdc::prefill_plan_size(workers, fdc::PrefillPlanView{plan.data()}.num_records()));
  return plan;
}

void test_windowed_plan(const Layout& layout, const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k,
                        bool causal, int64_t window_left, int32_t row_block, int32_t workers) {
  const int32_t batch = static_cast<int32_t>(lens_q.size());
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int32_t b = 0; b < batch; ++b) {
    cu_q.push_back(cu_q.back() + lens_q[b]);
    cu_k.push_back(cu_k.back() + lens_k[b]);
  }
  const std::vector<int32_t> plan = build(layout, cu_q, cu_k, causal, window_left, row_block, workers);
  if (plan.empty()) return;
  const fdc::HeadLayoutView view = layout.view();
  const fdc::PrefillPlanView p{plan.data()};
  std::map<std::tuple<int, int, int>, int> seen;
  std::vector<int64_t> loads(workers, 0);
  for (int32_t w = 0; w < workers; ++w) {
    for (int32_t r = p.worker_offsets()[w]; r < p.worker_offsets()[w + 1]; ++r) {
      const int32_t* rec = p.records() + fdc::kPrefillRecordFields * r;
      const int32_t b = rec[0], h = rec[1];
      loads[w] +=
          view.d_sum(h / view.group) * fdc::visible_keys(rec[2], rec[3], lens_q[b], lens_k[b], causal, window_left);
      for (int32_t row = rec[2]; row < rec[3]; ++row) ++seen[{b, h, row}];
    }
  }
  int64_t rows = 0;
  for (int32_t b = 0; b < batch; ++b) rows += int64_t(lens_q[b]) * view.num_heads();
  CHECK(static_cast<int64_t>(seen.size()) == rows, "%zu rows covered of %lld", seen.size(), (long long)rows);
  for (const auto& entry : seen) CHECK(entry.second == 1, "a query row covered %d times", entry.second);
  CHECK(loads == naive_loads(layout, cu_q, cu_k, causal, window_left, row_block, workers),
        "window %lld: worker loads differ from the plain algorithm", (long long)window_left);

  // Without a window, and with one no row's position reaches past (a window of max s_k - 1 keys or more), the plan
  // is the unwindowed one, integer for integer.
  const std::vector<int32_t> unwindowed = build(layout, cu_q, cu_k, causal, fdc::kNoWindow, row_block, workers);
  const int32_t longest = batch ? *std::max_element(lens_k.begin(), lens_k.end()) : 0;
  CHECK(build(layout, cu_q, cu_k, causal, std::max(0, longest - 1), row_block, workers) == unwindowed,
        "a window covering every key changed the plan");
  const int64_t capacity = fdc::prefill_plan_capacity(cu_q.back(), batch, view.num_heads());
  std::vector<int32_t> by_default(fdc::prefill_plan_size(workers, capacity), 777);
  std::vector<int64_t> ws(fdc::ceil_div(fdc::prefill_plan_workspace_bytes(capacity, workers), 8));
  fdc::build_prefill_plan(cu_q.data(), cu_k.data(), batch, view, causal, row_block, workers, capacity,
                          by_default.data(), ws.data());
  by_default.resize(unwindowed.size());
  CHECK(by_default == unwindowed, "window_left's default is not kNoWindow");
}

}  // namespace

int main(int argc, char** argv) {
  seed = argc > 1 ? static_cast<unsigned>(std::strtoul(argv[1], nullptr, 10)) : std::random_device{}();
  std::printf("test_prefill_window seed %u\n", seed);
  std::mt19937 rng(seed);
  test_visible_keys(rng);

  const Layout fixed{{0, 64, 80}, {0, 32, 96}, 2};
  test_windowed_plan(fixed, {}, {}, true, 5, 64, 4);
  test_windowed_plan(fixed, {4096}, {4096}, true, 511, 64, 2);          // a 4K prompt under a 512-key window
  test_windowed_plan(fixed, {40, 300}, {10, 900}, true, 0, 16, 7);      // s_q > s_k and s_q < s_k, the query alone
  test_windowed_plan(fixed, {513, 7}, {513, 700}, false, 100, 128, 3);  // non-causal: keys after p stay visible

  std::uniform_int_distribution<int> batch_size(0, 6), workers(1, 24), length(0, 700), window(0, 300);
  const int32_t row_blocks[] = {16, 64, 256};
  for (int trial = 0; trial < 120; ++trial) {
    const Layout layout = random_layout(rng, 6, 6);
    std::vector<int32_t> lens_q(batch_size(rng)), lens_k(lens_q.size());
    for (size_t b = 0; b < lens_q.size(); ++b) {
      lens_q[b] = length(rng);
      lens_k[b] = rng() % 3 == 0 ? lens_q[b] + length(rng) : lens_q[b];  // some with a cached prefix
    }
    test_windowed_plan(layout, lens_q, lens_k, rng() % 2 == 0, window(rng), row_blocks[rng() % 3], workers(rng));
  }
  std::printf("test_prefill_window: %d failures\n", failures);
  return std::min(failures, 255);
}
