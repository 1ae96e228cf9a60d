// fdc::decode_attention on the CPU: executes a decode plan (include/fdc/decode_plan.h) with one at::parallel_for
// worker per plan worker. A task reads its chunk's K/V rows of one KV head once for all G query heads, block by
// block: the block is widened to float once (read in place for float caches), scored, folded into an online softmax
// and accumulated, each product in the cache's own memory order (dot products along token-major rows, weighted row
// sums along the token runs of dim-major pages). Chunks of a split request leave (output, log-sum-exp) partials
// that a second pass merges.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/vec_math.h"
#include "fdc/decode_plan.h"
#include "fdc/softmax_merge.h"

namespace fdc::cpu {
namespace {

// Keys per block: G x 64 scores plus one 64 x 256 key and one 64 x 256 value block in float (136 KiB at most) stay
// in L2 between the block's scores, its softmax update and its value accumulation.
constexpr int64_t kKeyBlock = 64;

// A block of a float matrix: element (r, c) at data[r * stride + c].
struct FloatRows {
  const float* data;
  int64_t stride;
};

// One cache (K or V): contiguous (B, S_max, width) or paged (num_pages, width, page_size) with a block table.
template <typename T>
struct CacheView {
  const T* data;
  int64_t stride0;             // between requests (contiguous) or pages (paged)
  int64_t stride1;             // between rows (contiguous); unused when paged
  const int32_t* block_table;  // (B, max_pages) when paged, else nullptr
  int64_t max_pages;
  int64_t page_size;

  bool paged() const { return block_table != nullptr; }

  // End of the block starting at t0: kKeyBlock keys, cut at the chunk end and, when paged, at the page end.
  int64_t block_end(int64_t t0, int64_t chunk_end) const {
    int64_t end = std::min(chunk_end, t0 + kKeyBlock);
    if (paged()) end = std::min(end, (t0 / page_size + 1) * page_size);
    return end;
  }

  // Asks for the memory of keys [t0, t1), columns [col, col + dim), ahead of use. Contiguous caches put every row
  // of a wide layer on its own 4 KiB page, where hardware prefetchers stop, so without this each row of a block
  // waits on DRAM in turn.
  void prefetch(int64_t b, int64_t t0, int64_t t1, int64_t col, int64_t dim) const {
    constexpr int64_t kLine = 64;  // bytes per cache line
    const int64_t runs = paged() ? dim : t1 - t0;
    const int64_t run_bytes = (paged() ? t1 - t0 : dim) * static_cast<int64_t>(sizeof(T));
    const char* first = reinterpret_cast<const char*>(
        paged() ? data + block_table[b * max_pages + t0 / page_size] * stride0 + col * page_size + t0 % page_size
                : data + b * stride0 + t0 * stride1 + col);
    const int64_t run_stride = static_cast<int64_t>(sizeof(T)) * (paged() ? page_size : stride1);
    for (int64_t r = 0; r < runs; ++r)
      for (int64_t byte = 0; byte < run_bytes; byte += kLine) __builtin_prefetch(first + r * run_stride + byte);
  }

  // Keys [t0, t1) of request b, columns [col, col + dim), as float: token-major (t1 - t0 rows of dim) when
  // contiguous, column-major (dim rows of t1 - t0 tokens) when paged, the page's own order. Float caches are read
  // in place; half-precision ones are widened into `scratch`.
  FloatRows block(int64_t b, int64_t t0, int64_t t1, int64_t col, int64_t dim, float* scratch) const {
    const T* src;
    int64_t src_stride, rows, cols;
    if (paged()) {
      src = data + block_table[b * max_pages + t0 / page_size] * stride0 + col * page_size + t0 % page_size;
      src_stride = page_size, rows = dim, cols = t1 - t0;
    } else {
      src = data + b * stride0 + t0 * stride1 + col;
      src_stride = stride1, rows = t1 - t0, cols = dim;
    }
    if constexpr (std::is_same_v<T, float>) {
      return {src, src_stride};
    } else {
      rows_to_float(src, src_stride, rows, cols, scratch);
      return {scratch, cols};
    }
  }
};

// Per-thread scratch of one task.
struct TaskScratch {
  std::vector<float> q, k, v, scores, acc;
  explicit TaskScratch(int64_t group)
      : q(group * kMaxHeadDim), k(kMaxHeadDim * kKeyBlock), v(kKeyBlock * kMaxHeadDim), scores(group * kKeyBlock),
        acc(group * kMaxHeadDim) {}
};

struct Problem {
  const checks::HostLayout* layout;
  float scale;
  const int32_t* split_offsets;  // (B * H_kv + 1) from the plan
  float* partial_out;            // (num_tasks, G, max_v_dim) for split requests
  float* partial_lse;            // (num_tasks, G)
  int64_t max_v_dim;
};

// Runs one plan record: request b, KV head j, keys [kv_start, kv_end), for the G query heads of j at once.
template <typename T>
void run_task(const int32_t* record, const Problem& pb, const T* q, int64_t q_ld, const CacheView<T>& kc,
              const CacheView<T>& vc, T* out, int64_t out_ld, TaskScratch& ws) {
  const checks::HostLayout& layout = *pb.layout;
  const int64_t hkv = layout.num_kv_heads(), group = layout.group;
  const int64_t b = record[0] / hkv, j = record[0] % hkv, chunk = record[1];
  const int64_t kv_start = record[2], kv_end = record[3];
  const int64_t dq = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
  const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
  const HeadLayoutView view = layout.view();

  for (int64_t i = 0; i < group; ++i) {
    const T* qi = q + b * q_ld + view.q_column(static_cast<int32_t>(j * group + i));
    for (int64_t c = 0; c < dq; ++c) ws.q[i * dq + c] = to_float(qi[c]) * pb.scale;
  }
  std::fill(ws.acc.begin(), ws.acc.begin() + group * dv, 0.f);
  std::vector<OnlineSoftmax> softmax(group);
  float* scores = ws.scores.data();

  for (int64_t t0 = kv_start; t0 < kv_end;) {
    const int64_t t1 = kc.block_end(t0, kv_end), n = t1 - t0;
    if (t1 < kv_end) {
      const int64_t t2 = kc.block_end(t1, kv_end);
      kc.prefetch(b, t1, t2, layout.qk_offsets[j], dq);
      vc.prefetch(b, t1, t2, layout.v_offsets[j], dv);
    }
    const FloatRows keys = kc.block(b, t0, t1, layout.qk_offsets[j], dq, ws.k.data());
    if (kc.paged()) {  // keys are dq rows of n tokens: scores = Q K, a weighted sum of key rows
      std::fill(scores, scores + group * kKeyBlock, 0.f);
      axpy_rows(ws.q.data(), dq, group, keys.data, keys.stride, dq, n, scores, kKeyBlock);
    } else {  // keys are n rows of dq: one dot product per (query head, key)
      dot_rows(ws.q.data(), dq, group, keys.data, keys.stride, n, dq, scores, kKeyBlock, false);
    }
    for (int64_t i = 0; i < group; ++i) {
      float* si = scores + i * kKeyBlock;
      const float factor = softmax[i].rescale_for(max_of(si, n));
      if (factor != 1.f) scale_in_place(ws.acc.data() + i * dv, dv, factor);
      softmax[i].sum += exp_and_sum(si, n, 1.f, softmax[i].max);
    }
    const FloatRows values = vc.block(b, t0, t1, layout.v_offsets[j], dv, ws.v.data());
    if (vc.paged()) {  // values are dv rows of n tokens: acc[i][c] += p_i . V[c]
      dot_rows(scores, kKeyBlock, group, values.data, values.stride, dv, n, ws.acc.data(), dv, true);
    } else {  // values are n rows of dv: acc_i += sum_t p_i[t] V[t]
      axpy_rows(scores, kKeyBlock, group, values.data, values.stride, n, dv, ws.acc.data(), dv);
    }
    t0 = t1;
  }

  const int64_t bj = b * hkv + j;
  const bool split = pb.split_offsets[bj + 1] - pb.split_offsets[bj] > 1;
  for (int64_t i = 0; i < group; ++i) {
    const float inv = softmax[i].inverse_sum();
    if (split) {
      const int64_t slot = pb.split_offsets[bj] + chunk;
      float* po = pb.partial_out + (slot * group + i) * pb.max_v_dim;
      for (int64_t c = 0; c < dv; ++c) po[c] = ws.acc[i * dv + c] * inv;
      pb.partial_lse[slot * group + i] = softmax[i].lse();
    } else {
      T* oi = out + b * out_ld + view.o_column(static_cast<int32_t>(j * group + i));
      for (int64_t c = 0; c < dv; ++c) oi[c] = static_cast<T>(ws.acc[i * dv + c] * inv);
    }
  }
}

// Merges the partials of every split (request, KV head) by log-sum-exp into the output.
template <typename T>
void merge_splits(const Problem& pb, int64_t batch, T* out, int64_t out_ld) {
  const checks::HostLayout& layout = *pb.layout;
  const int64_t hkv = layout.num_kv_heads(), group = layout.group;
  const HeadLayoutView view = layout.view();
  at::parallel_for(0, batch * hkv, 1, [&](int64_t bj0, int64_t bj1) {
    std::vector<float> lse, weight;
    for (int64_t bj = bj0; bj < bj1; ++bj) {
      const int64_t first = pb.split_offsets[bj], count = pb.split_offsets[bj + 1] - first;
      if (count <= 1) continue;
      const int64_t b = bj / hkv, j = bj % hkv;
      const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
      lse.resize(count);
      weight.resize(count);
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t s = 0; s < count; ++s) lse[s] = pb.partial_lse[(first + s) * group + i];
        merge_weights(lse.data(), static_cast<int32_t>(count), weight.data());
        T* oi = out + b * out_ld + view.o_column(static_cast<int32_t>(j * group + i));
        for (int64_t c = 0; c < dv; ++c) {
          float sum = 0.f;
          for (int64_t s = 0; s < count; ++s) sum += weight[s] * pb.partial_out[((first + s) * group + i) * pb.max_v_dim + c];
          oi[c] = static_cast<T>(sum);
        }
      }
    }
  });
}

// A plan from the caller must describe exactly these lengths: every record in range, chunks numbered within their
// (request, head), and the keys of each (request, head) covered in total exactly once.
void check_plan_records(const char* op, const DecodePlanView& plan, const std::vector<int32_t>& seqlens) {
  const int64_t hkv = plan.num_kv_heads(), pairs = int64_t(plan.batch()) * hkv;
  const int32_t* split = plan.split_offsets();
  const int32_t* workers = plan.worker_offsets();
  FDC_CHECK(split[0] == 0 && split[pairs] == plan.num_tasks() && plan.num_tasks() <= plan.capacity() &&
                workers[0] == 0 && workers[plan.num_workers()] == plan.num_tasks(),
            op, "plan is corrupt: its task counts disagree");
  std::vector<int64_t> covered(pairs, 0);
  for (int64_t r = 0; r < plan.num_tasks(); ++r) {
    const int32_t* rec = plan.records() + r * kDecodeRecordFields;
    FDC_CHECK(rec[0] >= 0 && rec[0] < pairs, op, "plan record ", r, " names (request, head) ", rec[0],
              " outside the batch");
    const int64_t b = rec[0] / hkv;
    FDC_CHECK(rec[1] >= 0 && rec[1] < split[rec[0] + 1] - split[rec[0]] && rec[2] >= 0 && rec[2] < rec[3] &&
                  rec[3] <= seqlens[b],
              op, "plan record ", r, " (keys ", rec[2], "..", rec[3], " of request ", b, " of length ", seqlens[b],
              ") does not fit cache_seqlens: make the plan from the same cache_seqlens");
    covered[rec[0]] += rec[3] - rec[2];
  }
  for (int64_t bj = 0; bj < pairs; ++bj) {
    FDC_CHECK(covered[bj] == seqlens[bj / hkv], op, "plan covers ", covered[bj], " keys of request ", bj / hkv,
              " but cache_seqlens says ", seqlens[bj / hkv], ": make the plan from the same cache_seqlens");
  }
}

}  // namespace

// q (B, G * W_qk); caches contiguous (B, S_max, W) or paged (num_pages, W, page_size) -> (B, G * W_v).
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets,
                                const at::Tensor& v_offsets, int64_t group, double scale,
                                const std::optional<at::Tensor>& plan, const std::optional<at::Tensor>& block_table) {
  const char* op = "decode_attention";
  const checks::DecodeInputs inputs =
      checks::check_decode_inputs(op, q, k_cache, v_cache, qk_offsets, v_offsets, group, scale, block_table);
  const checks::HostLayout& layout = inputs.layout;
  const checks::CacheShape& cache = inputs.cache;
  const int64_t batch = inputs.batch;
  const checks::PagedCache& paged = cache.paged;
  const int64_t capacity = cache.capacity;
  const at::Tensor table = block_table ? block_table->contiguous() : at::Tensor();
  const std::vector<int32_t> seqlens = checks::read_cache_seqlens(op, cache_seqlens, batch, capacity);
  if (block_table) {
    for (int64_t b = 0; b < batch; ++b) {
      checks::check_block_table_entries(op, table.data_ptr<int32_t>() + b * paged.max_pages, b,
                                        ceil_div(seqlens[b], paged.page_size), paged.num_pages);
    }
  }

  at::Tensor schedule;
  if (plan) {
    checks::check_plan_tensor(op, *plan, q, kDecodeHeader);
    schedule = *plan;
    checks::check_decode_plan_header(op, schedule.data_ptr<int32_t>(), schedule.size(0), batch, layout);
  } else {
    schedule = decode_plan_cpu(cache_seqlens, qk_offsets, v_offsets, group, std::nullopt);
  }
  const DecodePlanView view{schedule.data_ptr<int32_t>()};
  check_plan_records(op, view, seqlens);

  const at::Tensor qc = checks::unit_last_stride(q);
  at::Tensor out = at::zeros({batch, group * layout.v_width()}, q.options());
  const int64_t max_v_dim = layout.max_v_dim();
  std::vector<float> partial_out(int64_t(view.num_tasks()) * group * max_v_dim);
  std::vector<float> partial_lse(int64_t(view.num_tasks()) * group);
  const Problem pb{&layout, static_cast<float>(scale), view.split_offsets(), partial_out.data(),
                   partial_lse.data(), max_v_dim};

  FDC_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fdc::decode_attention", [&] {
    const int32_t* bt = block_table ? table.data_ptr<int32_t>() : nullptr;
    const CacheView<scalar_t> kview{k_cache.data_ptr<scalar_t>(), k_cache.stride(0),
                                    block_table ? 0 : k_cache.stride(1), bt, paged.max_pages, paged.page_size};
    const CacheView<scalar_t> vview{v_cache.data_ptr<scalar_t>(), v_cache.stride(0),
                                    block_table ? 0 : v_cache.stride(1), bt, paged.max_pages, paged.page_size};
    scalar_t* op_out = out.data_ptr<scalar_t>();
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    at::parallel_for(0, view.num_workers(), 1, [&](int64_t w0, int64_t w1) {
      TaskScratch ws(group);
      for (int64_t w = w0; w < w1; ++w) {
        for (int64_t r = view.worker_offsets()[w]; r < view.worker_offsets()[w + 1]; ++r) {
          run_task(view.records() + r * kDecodeRecordFields, pb, qp, qc.stride(0), kview, vview, op_out,
                   out.stride(0), ws);
        }
      }
    });
    merge_splits(pb, batch, op_out, out.stride(0));
  });
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("decode_attention", &fdc::cpu::decode_attention_cpu); }
