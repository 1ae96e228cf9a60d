// fdc::window_scores on the CPU: the attention each cached key receives from the last `window` queries of a call
// (token eviction's scores, fdc_ops/eviction.py), in one pass per row block: logits, optional Gumbel noise, the
// softmax and its sum over the window's rows, never materialising the (rows x keys) probabilities of all heads.
// Three phases: each request's noise bits (sequential per request: the generator has no jump), each (request, KV
// head)'s keys transposed to float columns, then row blocks in parallel, each summing into its own partial row, which
// a last pass adds up in a fixed order (the result does not depend on the thread count).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/vec_math.h"

namespace fdc::cpu {
namespace {

// numpy's SFC64 bit generator (Chris Doty-Humphrey's Small Fast Chaotic PRNG, 64-bit), continued from a state that
// numpy.random.SFC64(seed).state gives: the same words as its random_raw(), so a request's noise here equals the one
// fdc_ops.eviction.uniforms draws from noise_stream(seed) on the host.
struct Sfc64 {
  uint64_t a, b, c, counter;
  uint64_t next() {
    const uint64_t out = a + b + counter++;
    a = b ^ (b >> 11);
    b = c + (c << 3);
    c = ((c << 24) | (c >> 40)) + out;
    return out;
  }
};

// Query rows per task: 16 rows' logits of a 32K-token prompt are 2 MiB of scratch, and a SmolLM2 layer's 3 KV heads x
// 96 window rows make 18 tasks, which 2 threads share within one task's time.
constexpr int64_t kTaskRows = 16;

// Keys per slice of the logits: a slice's transposed keys (dim x 128 floats, 16 KiB at dim 32) stay in L1 for every
// row of a task, where a row at a time streamed a head's whole transposed keys (256 KiB at 2K tokens) from L2.
constexpr int64_t kKeySlice = 128;

// The leading dimension of n keys transposed: n rounded up to 16 floats (whole lines), plus 16 or 32 so that it is
// never a multiple of 1024 floats: dims 4 KiB apart share one L1 set (a 2048-key stride put all 32 dims of a key in
// one set, and the transposition took as long as the logits).
inline int64_t transposed_stride(int64_t n) {
  const int64_t padded = (n + 15) / 16 * 16 + 16;
  return padded % 1024 == 0 ? padded + 16 : padded;
}

// Copies key columns [0, dim) of rows [0, n) (row stride `ld`) into dim rows of `out_ld` floats: the logits of a
// block of query rows are then row-times-matrix products along contiguous keys (axpy_rows). 16 keys at a time, so
// that each dim's 16 values are stored as one 64-byte line: a store per element into 32 lines took half the logits'
// time.
template <typename T>
void transpose_keys(const T* keys, int64_t ld, int64_t n, int64_t dim, float* out, int64_t out_ld) {
  constexpr int64_t kKeys = 16;
  for (int64_t s0 = 0; s0 < n; s0 += kKeys) {
    const int64_t count = std::min(kKeys, n - s0);
    for (int64_t d = 0; d < dim; ++d) {
      float* o = out + d * out_ld + s0;
      for (int64_t s = 0; s < count; ++s) o[s] = to_float(keys[(s0 + s) * ld + d]);
    }
  }
}

// Scoring rows [row0, row0 + rows) of one request and KV head, scaled, as float rows of `dim` columns: row
// r = g * taken + i is query head g's query i of the `taken` scoring ones, q's row last_row - taken + 1 + i, whose
// head columns start at `column` + g * dim.
template <typename T>
void gather_queries(const T* q, int64_t q_ld, int64_t last_row, int64_t taken, int64_t column, int64_t dim,
                    int64_t row0, int64_t rows, float scale, float* out) {
  for (int64_t r = row0; r < row0 + rows; ++r) {
    const T* row = q + (last_row - taken + 1 + r % taken) * q_ld + column + (r / taken) * dim;
    float* o = out + (r - row0) * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = scale * to_float(row[d]);
  }
}

struct Task {
  int64_t b, j, row0, rows;  // request, KV head, the first of its scoring rows (g * taken + i) and their count
};

}  // namespace

// q (T, G * W) float32/float16/bfloat16 packed queries of the call; cu_seqlens_q (B + 1) int32; k_cache (B, S, W)
// float32/float16/bfloat16 packed keys, request b's first cache_seqlens[b] rows valid; cache_seqlens (B) int32, each
// at least its request's query count (the call's queries are its cache's last tokens); qk_offsets (H_kv + 1) int32;
// noise_state (B, 4) int64 SFC64 states or none. Returns (B, H_kv, S) float32.
at::Tensor window_scores_cpu(const at::Tensor& q, const at::Tensor& cu_seqlens_q, const at::Tensor& k_cache,
                             const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets, int64_t group, double scale,
                             int64_t window, double softcap, const std::optional<at::Tensor>& noise_state,
                             double temperature) {
  const char* op = "window_scores";
  const checks::WindowScoresInputs inputs = checks::check_window_scores_inputs(
      op, q, cu_seqlens_q, k_cache, cache_seqlens, qk_offsets, group, scale, window, softcap, noise_state, temperature);
  const checks::HostLayout& layout = inputs.layout;
  const std::vector<int32_t>& cu = inputs.cu_seqlens_q;
  const std::vector<int32_t>& lengths = inputs.cache_seqlens;
  const int64_t batch = k_cache.size(0), capacity = k_cache.size(1);
  std::vector<Sfc64> streams;
  for (const auto& state : inputs.noise_state) streams.push_back(Sfc64{state[0], state[1], state[2], state[3]});

  const int64_t heads = layout.num_kv_heads(), width = layout.qk_width();
  at::Tensor scores = at::zeros({batch, heads, capacity}, k_cache.options().dtype(at::kFloat));
  const at::Tensor queries = checks::unit_last_stride(q);
  const at::Tensor keys = checks::unit_last_stride(k_cache);

  // Each request's noise: per KV head in order, G * window * length uniforms (the window's every step, scoring or
  // not, as the host's draws run), two per 64-bit word, the low half first; an odd count leaves a word's high half.
  std::vector<int64_t> noise_start(batch + 1, 0);
  std::vector<int64_t> head_stride(batch, 0);
  for (int64_t b = 0; b < batch; ++b) {
    head_stride[b] = streams.empty() ? 0 : 2 * ((group * window * lengths[b] + 1) / 2);
    noise_start[b + 1] = noise_start[b] + heads * head_stride[b];
  }
  const std::unique_ptr<uint32_t[]> noise(new uint32_t[noise_start[batch]]);  // every entry is written below
  at::parallel_for(0, streams.empty() ? 0 : batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint32_t* halves = noise.get() + noise_start[b];
      Sfc64 stream = streams[b];  // a local copy stays in registers; the vector's element was reloaded every word
      for (int64_t i = 0, n = noise_start[b + 1] - noise_start[b]; i < n; i += 2) {
        const uint64_t word = stream.next();
        std::memcpy(halves + i, &word, sizeof(word));  // little-endian: the low half first, as numpy's view gives
      }
    }
  });

  // Keys transposed, request b's head j at key_start[b] + offsets[j] * transposed_stride(length).
  std::vector<int64_t> key_start(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) key_start[b + 1] = key_start[b] + width * transposed_stride(lengths[b]);
  const std::unique_ptr<float[]> columns(new float[key_start[batch]]);  // the padding past each length is never read
  std::vector<Task> tasks;
  std::vector<int64_t> pair_tasks(batch * heads + 1, 0);  // (request, KV head) p's tasks: [pair_tasks[p], [p + 1])
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t taken = std::min<int64_t>(window, cu[b + 1] - cu[b]);
    for (int64_t j = 0; j < heads; ++j) {
      pair_tasks[b * heads + j] = static_cast<int64_t>(tasks.size());
      for (int64_t r = 0; r < group * taken; r += kTaskRows) {
        tasks.push_back({b, j, r, std::min(kTaskRows, group * taken - r)});
      }
    }
  }
  const int64_t tasks_count = static_cast<int64_t>(tasks.size());
  pair_tasks[batch * heads] = tasks_count;
  std::vector<int64_t> partial_start(tasks_count + 1, 0);
  for (int64_t t = 0; t < tasks_count; ++t) partial_start[t + 1] = partial_start[t] + lengths[tasks[t].b];
  std::vector<float> partials(partial_start[tasks_count], 0.f);

  FDC_DISPATCH_FLOAT_TYPES(k_cache.scalar_type(), "fdc::window_scores", [&] {
    using K = scalar_t;
    const K* k = keys.data_ptr<K>();
    const int64_t k_batch = keys.stride(0), k_row = keys.stride(1);
    at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t b = p / heads, j = p % heads, lo = layout.qk_offsets[j];
        const int64_t stride = transposed_stride(lengths[b]);
        transpose_keys(k + b * k_batch + lo, k_row, lengths[b], layout.qk_offsets[j + 1] - lo,
                       columns.get() + key_start[b] + lo * stride, stride);
      }
    });
  });

  FDC_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fdc::window_scores", [&] {
    using Q = scalar_t;
    const Q* qs = queries.data_ptr<Q>();
    const int64_t q_ld = queries.stride(0);
    const float inverse_temperature = static_cast<float>(1.0 / temperature);
    at::parallel_for(0, tasks_count, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> rows, logits;
      for (int64_t t = begin; t < end; ++t) {
        const Task& task = tasks[t];
        const int64_t b = task.b, j = task.j, length = lengths[b];
        const int64_t lo = layout.qk_offsets[j], dim = layout.qk_offsets[j + 1] - lo;
        const int64_t taken = std::min<int64_t>(window, cu[b + 1] - cu[b]);
        rows.resize(task.rows * dim);
        gather_queries(qs, q_ld, cu[b + 1] - 1, taken, group * lo, dim, task.row0, task.rows, static_cast<float>(scale),
                       rows.data());
        // Row r (query i = r % taken of the scoring ones, at position length - taken + i) sees keys
        // [0, length - taken + i]; the block's logits span its widest row.
        int64_t widest = 0;
        for (int64_t r = task.row0; r < task.row0 + task.rows; ++r) {
          widest = std::max(widest, length - taken + r % taken + 1);
        }
        logits.assign(task.rows * widest, 0.f);
        const int64_t stride = transposed_stride(length);
        const float* head_keys = columns.get() + key_start[b] + lo * stride;
        for (int64_t s0 = 0; s0 < widest; s0 += kKeySlice) {
          axpy_rows(rows.data(), dim, task.rows, head_keys + s0, stride, dim, std::min(kKeySlice, widest - s0),
                    logits.data() + s0, widest);
        }
        float* partial = partials.data() + partial_start[t];
        for (int64_t r = task.row0; r < task.row0 + task.rows; ++r) {
          const int64_t visible = length - taken + r % taken + 1;
          float* x = logits.data() + (r - task.row0) * widest;
          if (softcap > 0) soft_cap_scores(x, visible, 1.f, static_cast<float>(softcap));
          const float top = max_of(x, visible);
          float total;
          if (streams.empty()) {
            total = exp_and_sum(x, visible, inverse_temperature, top * inverse_temperature);
          } else {
            const int64_t g = r / taken, step = window - taken + r % taken;
            const uint32_t* bits = noise.get() + noise_start[b] + j * head_stride[b] + (g * window + step) * length;
            total = gumbel_exp_and_sum(x, bits, visible, top, inverse_temperature);
          }
          add_scaled(partial, x, visible, 1.f / std::max(total, 1e-30f));
        }
      }
    });
  });

  float* out = scores.data_ptr<float>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t t = pair_tasks[p]; t < pair_tasks[p + 1]; ++t) {
        add_scaled(out + p * capacity, partials.data() + partial_start[t], lengths[tasks[t].b], 1.f);
      }
    }
  });
  return scores;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("window_scores", &fdc::cpu::window_scores_cpu); }
