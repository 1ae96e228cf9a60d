// The sliding window in the device decode planner's formulation (include/fdc/decode_plan_device.h, run on the GPU by
// csrc/cuda/decode_plan.cu): the windowed chunking written out plainly from its specification and compared with
// decode_chunk_count / decode_chunk_keys, and the device algorithm run sequentially with those helpers compared with
// the host planner (include/fdc/decode_plan.h, build_decode_plan with window_left) integer for integer, with and
// without windows. Fresh random cases from a seeded generator (the seed is printed; pass one as argv[1] to replay),
// plus fixed edge cases around kChunkAlign and the chunk length. Exit code = number of failed checks (capped at 255).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "fdc/attention_variant.h"
#include "fdc/decode_plan.h"
#include "fdc/decode_plan_device.h"
#include "fdc/head_layout.h"

#include "test_support.h"

using fdc_test::failures;
using fdc_test::Layout;
using fdc_test::random_layout;
using fdc_test::seed;

namespace {

// The windowed chunking as the specification states it, for one request of `length` keys and a chunk length:
// s = the window start, base = s rounded down to kChunkAlign, ceil((length - s) / chunk_len) chunks, chunk c over
// [c == 0 ? s : base + c * L, c == last ? length : base + (c + 1) * L). Checked against the helpers, and for the
// properties the kernels rely on: the chunks tile [s, length) exactly, none is empty, every one but the first starts
// on a multiple of kChunkAlign, the count is within the capacity bound, and without a window they are the unwindowed
// chunks [c * L, min(length, (c + 1) * L)).
void test_chunking(int64_t length, int64_t window_left, int64_t chunk_len) {
  const int64_t s = window_left < 0 ? 0 : std::max<int64_t>(0, length - 1 - window_left);
  CHECK(fdc::decode_window_start(length, window_left) == s, "window start of %lld keys, window %lld",
        static_cast<long long>(length), static_cast<long long>(window_left));
  CHECK(fdc::decode_visible_keys(length, window_left) == length - s, "visible keys");
  const int64_t base = s / fdc::kChunkAlign * fdc::kChunkAlign;
  const int64_t count = length == 0 ? 0 : (length - s + chunk_len - 1) / chunk_len;
  CHECK(fdc::decode_chunk_count(length, window_left, chunk_len) == count, "%lld chunks for %lld keys, window %lld",
        static_cast<long long>(fdc::decode_chunk_count(length, window_left, chunk_len)), static_cast<long long>(length),
        static_cast<long long>(window_left));
  int64_t next = s;
  for (int64_t c = 0; c < count; ++c) {
    const int64_t start = c == 0 ? s : base + c * chunk_len;
    const int64_t end = c == count - 1 ? length : base + (c + 1) * chunk_len;
    const fdc::KeyRange keys = fdc::decode_chunk_keys(length, window_left, chunk_len, c, count);
    CHECK(keys.start == start && keys.end == end, "chunk %lld: [%lld, %lld), expected [%lld, %lld)",
          static_cast<long long>(c), static_cast<long long>(keys.start), static_cast<long long>(keys.end),
          static_cast<long long>(start), static_cast<long long>(end));
    CHECK(start == next && end > start, "chunk %lld of [%lld, %lld) does not follow on at %lld or is empty",
          static_cast<long long>(c), static_cast<long long>(start), static_cast<long long>(end),
          static_cast<long long>(next));
    CHECK(c == 0 || start % fdc::kChunkAlign == 0, "chunk %lld starts at %lld", static_cast<long long>(c),
          static_cast<long long>(start));
    CHECK(end - start <= chunk_len + fdc::kChunkAlign - 1, "chunk %lld has %lld keys for a length of %lld",
          static_cast<long long>(c), static_cast<long long>(end - start), static_cast<long long>(chunk_len));
    if (window_left < 0)
      CHECK(start == c * chunk_len && end == std::min(length, (c + 1) * chunk_len), "unwindowed chunk %lld",
            static_cast<long long>(c));
    next = end;
  }
  CHECK(next == (count == 0 ? s : length), "chunks end at %lld of %lld keys", static_cast<long long>(next),
        static_cast<long long>(length));
}

// The device planner's algorithm (csrc/cuda/decode_plan.cu) run sequentially with its helpers: visible-key total,
// chunk counts and their scan, task keys, the bitonic network, worker keys with rebasing, ranks per worker, records
// recomputed from the split offsets. *rebases counts the load rebasings.
std::vector<int32_t> device_plan(const Layout& layout, const std::vector<int32_t>& lens, int32_t workers,
                                 int64_t window_left, int* rebases) {
  const fdc::HeadLayoutView view = layout.view();
  const int32_t batch = static_cast<int32_t>(lens.size());
  const int32_t hkv = view.num_kv_heads;
  const int32_t pairs = batch * hkv;
  const int64_t capacity = fdc::decode_plan_capacity(batch, hkv, workers);
  std::vector<int16_t> d_sum(hkv);
  int64_t d_sum_total = 0, visible_total = 0;
  for (int32_t j = 0; j < hkv; ++j) {
    d_sum[j] = static_cast<int16_t>(view.d_sum(j));
    d_sum_total += d_sum[j];
  }
  for (int32_t s : lens) visible_total += fdc::decode_visible_keys(s, window_left);
  const int64_t target = fdc::decode_chunk_target(visible_total * d_sum_total, workers);

  std::vector<int32_t> plan(fdc::decode_plan_size(batch, hkv, workers), 12345);
  int32_t* split = plan.data() + fdc::kDecodeHeader;
  int32_t* worker_offsets = split + pairs + 1;
  int32_t* records = worker_offsets + workers + 1;
  split[0] = 0;
  for (int32_t p = 0; p < pairs; ++p)
    split[p + 1] = split[p] + static_cast<int32_t>(fdc::decode_chunk_count(
                                  lens[p / hkv], window_left, fdc::decode_chunk_len(target, d_sum[p % hkv])));
  const int32_t n = split[pairs];
  CHECK(n <= capacity, "%d tasks over capacity %lld", n, static_cast<long long>(capacity));
  const int32_t header[fdc::kDecodeHeader] = {
      fdc::kDecodePlanTag, batch, hkv, workers, static_cast<int32_t>(capacity), n, view.group, 0};
  std::copy(header, header + fdc::kDecodeHeader, plan.begin());

  const int64_t size = n > 0 ? fdc::next_pow2(n) : 0;
  std::vector<uint64_t> keys(size, fdc::kPaddingTaskKey);
  for (int32_t t = 0; t < n; ++t)
    keys[t] = fdc::pack_task_key(
        fdc::decode_task(t, split, lens.data(), batch, hkv, d_sum.data(), target, window_left).cost, t);
  for (int64_t span = 2; span <= size; span *= 2)
    for (int64_t stride = span / 2; stride > 0; stride /= 2)
      for (int64_t c = 0; c < size / 2; ++c) fdc::bitonic_compare_swap(keys.data(), c, stride, span);

  std::vector<uint64_t> worker_key(workers);
  std::vector<int32_t> count(workers, 0), placement(2 * int64_t(n));
  const int32_t first = std::min(n, workers);
  for (int32_t w = 0; w < workers; ++w) {
    worker_key[w] = fdc::pack_worker_key(w < first ? fdc::task_key_cost(keys[w]) : 0, w);
    if (w < first) {
      count[w] = 1;
      placement[2 * w] = w;
      placement[2 * w + 1] = 0;
    }
  }
  *rebases = 0;
  for (int32_t i = first; i < n; ++i) {
    const uint64_t best = *std::min_element(worker_key.begin(), worker_key.end());
    const int32_t w = fdc::worker_key_index(best);
    worker_key[w] += uint64_t(fdc::task_key_cost(keys[i])) << fdc::kWorkerBits;
    placement[2 * i] = w;
    placement[2 * i + 1] = count[w]++;
    const uint64_t base = fdc::worker_key_load(best);
    if (base >= fdc::kRebaseLoad) {
      ++*rebases;
      for (uint64_t& key : worker_key) key -= base << fdc::kWorkerBits;
    }
  }
  worker_offsets[0] = 0;
  for (int32_t w = 0; w < workers; ++w) worker_offsets[w + 1] = worker_offsets[w] + count[w];
  for (int32_t i = 0; i < n; ++i) {
    const fdc::DecodeTask task = fdc::decode_task(fdc::task_key_index(keys[i]), split, lens.data(), batch, hkv,
                                                  d_sum.data(), target, window_left);
    int32_t* record = records + 4 * int64_t(worker_offsets[placement[2 * i]] + placement[2 * i + 1]);
    record[0] = task.pair;
    record[1] = task.chunk;
    record[2] = task.kv_start;
    record[3] = task.kv_end;
  }
  for (int64_t i = 4 * int64_t(n); i < 4 * capacity; ++i) records[i] = -1;
  return plan;
}

// The device formulation gives the host planner's plan integer for integer, and the plan covers each request's
// window exactly once: what the attention kernels check record by record (first chunk at the window start, later
// ones on kChunkAlign, last at the length). Returns the device formulation's rebase count.
int test_same_plan(const Layout& layout, const std::vector<int32_t>& lens, int32_t workers, int64_t window_left) {
  const int32_t batch = static_cast<int32_t>(lens.size());
  const int32_t hkv = static_cast<int32_t>(layout.qk.size()) - 1;
  std::vector<int32_t> host(fdc::decode_plan_size(batch, hkv, workers), 12345);
  std::vector<int64_t> ws(fdc::ceil_div(fdc::decode_plan_workspace_bytes(batch, hkv, workers), 8));
  const fdc::Status status =
      fdc::build_decode_plan(lens.data(), batch, layout.view(), workers, host.data(), ws.data(), window_left);
  CHECK(status == fdc::Status::kOk, "host planner status %d", static_cast<int>(status));
  int rebases = 0;
  const std::vector<int32_t> device = device_plan(layout, lens, workers, window_left, &rebases);
  size_t first_difference = 0;
  while (first_difference < host.size() && host[first_difference] == device[first_difference]) ++first_difference;
  CHECK(first_difference == host.size(),
        "device formulation differs from the host plan at entry %zu of %zu (B=%d, H_kv=%d, N=%d, window %lld)",
        first_difference, host.size(), batch, hkv, workers, static_cast<long long>(window_left));

  const fdc::DecodePlanView plan{device.data()};
  std::vector<int64_t> covered(int64_t(batch) * hkv, 0);
  for (int32_t r = 0; r < plan.num_tasks(); ++r) {
    const int32_t* rec = plan.records() + 4 * r;
    const int32_t length = lens[rec[0] / hkv];
    const int32_t chunks = plan.split_offsets()[rec[0] + 1] - plan.split_offsets()[rec[0]];
    const int64_t first_key = fdc::decode_window_start(length, window_left);
    const bool starts_ok = rec[1] == 0 ? rec[2] == first_key : (rec[2] > first_key && rec[2] % fdc::kChunkAlign == 0);
    CHECK(starts_ok && rec[2] < rec[3] && (rec[1] != chunks - 1 || rec[3] == length),
          "record (%d, %d, %d, %d) of a request of %d keys, window %lld", rec[0], rec[1], rec[2], rec[3], length,
          static_cast<long long>(window_left));
    covered[rec[0]] += rec[3] - rec[2];
  }
  for (int32_t p = 0; p < batch * hkv; ++p)
    CHECK(covered[p] == fdc::decode_visible_keys(lens[p / hkv], window_left), "pair %d covers %lld keys", p,
          static_cast<long long>(covered[p]));
  return rebases;
}

}  // namespace

int main(int argc, char** argv) {
  seed = argc > 1 ? static_cast<unsigned>(std::strtoul(argv[1], nullptr, 10)) : std::random_device{}();
  std::printf("test_device_window seed %u\n", seed);
  std::mt19937 rng(seed);

  // Window starts on, just before and just after kChunkAlign boundaries, windows shorter and longer than a chunk.
  const int64_t lengths[] = {0, 1, 2, 15, 16, 17, 31, 32, 33, 255, 256, 257, 271, 272, 273, 1000, 4097, 100000};
  const int64_t windows[] = {fdc::kNoWindow, 0, 1, 14, 15, 16, 17, 254, 255, 256, 257, 270, 271, 1000, 99999};
  const int64_t chunk_lens[] = {256, 272, 4096};
  for (int64_t length : lengths)
    for (int64_t window : windows)
      for (int64_t chunk_len : chunk_lens) test_chunking(length, window, chunk_len);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t length = rng() % 3 == 0 ? rng() % 200000 : rng() % 2000;
    const int64_t window = rng() % 4 == 0 ? fdc::kNoWindow : int64_t(rng() % 3000);
    test_chunking(length, window, 256 + 16 * int64_t(rng() % 64));
  }

  const Layout fixed{{0, 64, 80}, {0, 32, 96}, 2};
  for (int64_t window : windows) {
    test_same_plan(fixed, {}, 4, window);
    test_same_plan(fixed, {0, 0, 0}, 3, window);
    test_same_plan(fixed, {100000, 3, 1, 7, 0, 2, 273}, 16, window);
    test_same_plan(fixed, {5000, 17, 4097}, 1, window);
  }
  {
    // Lengths near INT32_MAX on one or two workers, without a window or with one of most of them: loads pass
    // kRebaseLoad, so the rebasing path runs.
    const Layout wide{{0, 256, 512}, {0, 256, 512}, 1};
    const std::vector<int32_t> huge(6, INT32_MAX - 5);
    CHECK(test_same_plan(wide, huge, 1, fdc::kNoWindow) > 0, "the huge-length case did not rebase");
    CHECK(test_same_plan(wide, huge, 2, fdc::kNoWindow) > 0, "the huge-length case did not rebase");
    CHECK(test_same_plan(wide, huge, 1, INT32_MAX - 1000) > 0, "the huge windowed case did not rebase");
    test_same_plan(wide, huge, 2, 12345);
  }
  const int32_t lens_pool[] = {0, 1, 2, 15, 16, 17, 64, 255, 256, 257, 1000, 4096, 30000};
  const int32_t device_workers[] = {1, 7, 132, 264, 1024};
  for (int trial = 0; trial < 300; ++trial) {
    const Layout layout = random_layout(rng);
    std::vector<int32_t> lens(rng() % 300);
    for (auto& s : lens) s = rng() % 2 ? lens_pool[rng() % 13] : lens_pool[rng() % 5];
    if (!lens.empty() && rng() % 2) lens[rng() % lens.size()] = 100000;
    const int64_t window = rng() % 4 == 0 ? fdc::kNoWindow : int64_t(rng() % (rng() % 2 ? 40 : 5000));
    test_same_plan(layout, lens, device_workers[rng() % 5], window);
  }
  std::printf("%d failed checks\n", failures);
  return std::min(failures, 255);
}
