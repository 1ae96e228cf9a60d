// fdc::decode_attention on the CPU. Two ways to the same result, chosen by cpu_isa():
// - AVX-512 (run_piece_avx512 in decode_avx512.h, its read-ahead in decode_read_ahead.h): requests are cut into pieces
//   of keys, and a piece reads its keys' K/V block by block, whole (every KV head's columns: a contiguous cache's
//   rows, a paged cache's pages), scoring every KV head's G query heads on a block while it is in cache; the plan,
//   when passed, is checked but the pieces are the CPU's own (include/fdc/decode_pieces.h says why);
// - the portable kernels (run_task, here): one at::parallel_for worker per plan worker, each task reading its chunk's
//   K/V rows of one KV head once for all G query heads, block by block, half-precision blocks widened to float first.
// Both compute each product in the cache's own memory order (dot products along token-major rows, weighted row sums
// along the token runs of dim-major pages). Requests split into several chunks or pieces leave (output, log-sum-exp)
// partials that a second pass (merge_splits, here) merges.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/decode_avx512.h"
#include "cpu/decode_common.h"
#include "cpu/decode_read_ahead.h"
#include "cpu/vec_math.h"
#include "fdc/decode_pieces.h"
#include "fdc/decode_plan.h"
#include "fdc/softmax_merge.h"

namespace fdc::cpu {
namespace {

// The pieces shared with the AVX-512 way (decode_common.h, decode_read_ahead.h, decode_avx512.h).
using namespace fdc::cpu::decode;

// Keys per block of the portable task kernel (run_task): a whole page at vLLM's CPU page size, so a KV head's block of
// a dim-major page is one contiguous run; best of those measured (bench/results/ops/README.md, "CPU decode").
constexpr int64_t kTaskKeyBlock = 128;

// Per-thread scratch of run_task: the queries, the key and value blocks widened to float (`widen`: half-precision
// caches; float ones are read in place), the scores and the accumulator.
struct TaskScratch {
  std::unique_ptr<float[]> q, k, v, scores, acc;
  TaskScratch(int64_t group, bool widen)
      : q(uninitialized_floats(group * kMaxHeadDim)),
        k(widen ? uninitialized_floats(kMaxHeadDim * kTaskKeyBlock) : nullptr),
        v(widen ? uninitialized_floats(kTaskKeyBlock * kMaxHeadDim) : nullptr),
        scores(uninitialized_floats(group * kTaskKeyBlock)), acc(uninitialized_floats(group * kMaxHeadDim)) {}
};

// Runs one plan record: request b, KV head j, keys [kv_start, kv_end), for the G query heads of j at once. T: q's
// dtype, C: the caches' (T, or a quantized format's codes, dequantized as blocks are widened).
template <typename T, typename C>
void run_task(const int32_t* record, const Problem& pb, const T* q, int64_t q_ld, const CacheView<C>& kc,
              const CacheView<C>& vc, T* out, int64_t out_ld, TaskScratch& ws) {
  const checks::HostLayout& layout = *pb.layout;
  const int64_t hkv = layout.num_kv_heads(), group = layout.group;
  const int64_t b = record[0] / hkv, j = record[0] % hkv;
  const int64_t kv_start = record[2], kv_end = record[3];
  const int64_t dq = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
  const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
  const HeadLayoutView view = layout.view();

  for (int64_t i = 0; i < group; ++i) {
    const T* qi = q + b * q_ld + view.q_column(static_cast<int32_t>(j * group + i));
    for (int64_t c = 0; c < dq; ++c) ws.q[i * dq + c] = to_float(qi[c]) * pb.scale;
  }
  std::fill(ws.acc.get(), ws.acc.get() + group * dv, 0.f);
  std::vector<OnlineSoftmax> softmax(group);
  float* scores = ws.scores.get();

  // Blocks of kTaskKeyBlock keys whatever the page size, each a run of keys per page it spans: every block's softmax
  // takes its exps in one pass, and short pages add to the scores and the accumulator run by run in the block's order.
  // (One page per block made the softmax's running sum and its rescaling a step per key with 1-token pages: 2.7x
  // torch's float32 error.)
  for (int64_t t0 = kv_start, t1; t0 < kv_end; t0 = t1) {
    t1 = std::min(kv_end, t0 + kTaskKeyBlock);
    const int64_t n = t1 - t0;
    const int64_t next_end = std::min(kv_end, t1 + kTaskKeyBlock);
    kc.for_each_run(t1, next_end, [&](int64_t r0, int64_t r1) {
      kc.prefetch(b, r0, r1, layout.qk_offsets[j], dq);
      vc.prefetch(b, r0, r1, layout.v_offsets[j], dv);
    });
    if (kc.paged()) std::fill(scores, scores + group * kTaskKeyBlock, 0.f);
    kc.for_each_run(t0, t1, [&](int64_t r0, int64_t r1) {
      const FloatRows keys = kc.block(b, r0, r1, j, layout.qk_offsets[j], dq, ws.k.get());
      constexpr bool kFloat64Scores = std::is_same_v<T, float>;  // vec_math.h, dot_rows_f64, says why
      if (kc.paged()) {  // keys are dq rows of the run's tokens: scores = Q K, a weighted sum of key rows
        if constexpr (kFloat64Scores) {
          axpy_rows_f64(ws.q.get(), dq, group, keys.data, keys.stride, dq, r1 - r0, scores + (r0 - t0), kTaskKeyBlock);
        } else {
          axpy_rows(ws.q.get(), dq, group, keys.data, keys.stride, dq, r1 - r0, scores + (r0 - t0), kTaskKeyBlock);
        }
      } else if constexpr (kFloat64Scores) {  // keys are the run's rows of dq: a dot product per (head, key)
        dot_rows_f64(ws.q.get(), dq, group, keys.data, keys.stride, r1 - r0, dq, scores + (r0 - t0), kTaskKeyBlock);
      } else {
        dot_rows(ws.q.get(), dq, group, keys.data, keys.stride, r1 - r0, dq, scores + (r0 - t0), kTaskKeyBlock, false);
      }
    });
    for (int64_t i = 0; i < group; ++i) {
      float* si = scores + i * kTaskKeyBlock;
      if (pb.softcap > 0.f) soft_cap_scores(si, n, 1.f, pb.softcap);  // the queries carry the scale
      const float factor = softmax[i].rescale_for(max_of(si, n));
      if (factor != 1.f) scale_in_place(ws.acc.get() + i * dv, dv, factor);
      softmax[i].sum += exp_and_sum(si, n, 1.f, softmax[i].max);
    }
    vc.for_each_run(t0, t1, [&](int64_t r0, int64_t r1) {
      const FloatRows values = vc.block(b, r0, r1, j, layout.v_offsets[j], dv, ws.v.get());
      const float* p = scores + (r0 - t0);
      if (vc.paged()) {  // values are dv rows of the run's tokens: acc[i][c] += p_i . V[c]
        dot_rows(p, kTaskKeyBlock, group, values.data, values.stride, dv, r1 - r0, ws.acc.get(), dv, true);
      } else {  // values are the run's rows of dv: acc_i += sum_t p_i[t] V[t]
        axpy_rows(p, kTaskKeyBlock, group, values.data, values.stride, r1 - r0, dv, ws.acc.get(), dv);
      }
    });
  }

  finish_task(record, pb, ws.acc.get(), softmax.data(), out, out_ld);
}

// Merges the partials of every split (request, KV head) by log-sum-exp into the output, times each query head's
// sink_factor of the merged log-sum-exp when it has a sink.
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
        const float merged_lse = merge_weights(lse.data(), static_cast<int32_t>(count), weight.data());
        if (pb.sinks != nullptr) {
          const float sink = sink_factor(merged_lse, pb.sinks[j * group + i]);
          for (int64_t s = 0; s < count; ++s) weight[s] *= sink;
        }
        T* oi = out + b * out_ld + view.o_column(static_cast<int32_t>(j * group + i));
        for (int64_t c = 0; c < dv; ++c) {
          float sum = 0.f;
          for (int64_t s = 0; s < count; ++s)
            sum += weight[s] * pb.partial_out[((first + s) * group + i) * pb.max_v_dim + c];
          oi[c] = static_cast<T>(sum);
        }
      }
    }
  });
}

// A plan from the caller must describe exactly these lengths and this window: every record within its request's
// visible keys [decode_window_start(length, window_left), length), chunks numbered within their (request, head), and
// the visible keys of each (request, head) covered in total exactly once.
void check_plan_records(const char* op, const DecodePlanView& plan, const std::vector<int32_t>& seqlens,
                        int64_t window_left) {
  const int64_t hkv = plan.num_kv_heads(), pairs = int64_t(plan.batch()) * hkv;
  const int32_t* split = plan.split_offsets();
  const int32_t* workers = plan.worker_offsets();
  FDC_CHECK(split[0] == 0 && split[pairs] == plan.num_tasks() && plan.num_tasks() <= plan.capacity() &&
                workers[0] == 0 && workers[plan.num_workers()] == plan.num_tasks(),
            op, "plan is corrupt: its task counts disagree");
  std::vector<int64_t> first_visible(plan.batch());
  for (int64_t b = 0; b < plan.batch(); ++b) first_visible[b] = decode_window_start(seqlens[b], window_left);
  std::vector<int64_t> covered(pairs, 0);
  for (int64_t r = 0; r < plan.num_tasks(); ++r) {
    const int32_t* rec = plan.records() + r * kDecodeRecordFields;
    FDC_CHECK(rec[0] >= 0 && rec[0] < pairs, op, "plan record ", r, " names (request, head) ", rec[0],
              " outside the batch");
    const int64_t b = rec[0] / hkv;
    FDC_CHECK(rec[1] >= 0 && rec[1] < split[rec[0] + 1] - split[rec[0]] && rec[2] >= first_visible[b] &&
                  rec[2] < rec[3] && rec[3] <= seqlens[b],
              op, "plan record ", r, " (keys ", rec[2], "..", rec[3], " of request ", b, " of length ", seqlens[b],
              ") is not within its visible keys ", first_visible[b], "..", seqlens[b], " (window_left ", window_left,
              "): make the plan from the same cache_seqlens and window_left");
    covered[rec[0]] += rec[3] - rec[2];
  }
  for (int64_t bj = 0; bj < pairs; ++bj) {
    const int64_t b = bj / hkv, visible = seqlens[b] - first_visible[b];
    FDC_CHECK(covered[bj] == visible, op, "plan covers ", covered[bj], " keys of request ", b, " but it sees ", visible,
              " (cache_seqlens ", seqlens[b], ", window_left ", window_left,
              "): make the plan from the same cache_seqlens and window_left");
  }
}

}  // namespace

// q (B, G * W_qk); caches contiguous (B, S_max, W) or paged (num_pages, W, page_size) -> (B, G * W_v).
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets,
                                const at::Tensor& v_offsets, int64_t group, double scale,
                                const std::optional<at::Tensor>& plan, const std::optional<at::Tensor>& block_table,
                                int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks) {
  const char* op = "decode_attention";
  const checks::DecodeInputs inputs =
      checks::check_decode_inputs(op, q, k_cache, v_cache, qk_offsets, v_offsets, group, scale, block_table);
  const checks::HostLayout& layout = inputs.layout;
  const checks::AttentionVariant variant =
      checks::check_attention_variant(op, window_left, softcap, sinks, q, layout.num_heads());
  const checks::CacheShape& cache = inputs.cache;
  const KvFormat cache_format = cache.format;
  const int64_t batch = inputs.batch;
  const checks::PagedCache& paged = cache.paged;
  const int64_t capacity = cache.capacity;
  const at::Tensor table = block_table ? block_table->contiguous() : at::Tensor();
  const std::vector<int32_t> seqlens = checks::read_cache_seqlens(op, cache_seqlens, batch, capacity);
  if (block_table) {
    for (int64_t b = 0; b < batch; ++b) {
      checks::check_block_table_entries(op, table.data_ptr<int32_t>() + b * paged.max_pages, b,
                                        decode_window_start(seqlens[b], variant.window_left) / paged.page_size,
                                        ceil_div(seqlens[b], paged.page_size), paged.num_pages);
    }
  }

  const CpuIsa isa = cpu_isa(op);
  // On AVX-512 every block of keys is read once for all KV heads (run_piece_avx512); a caller's plan is still checked
  // against cache_seqlens, and decides the work of the portable kernels. A sliding window over a paged cache takes
  // the portable kernels: pieces start on a block of the window's first page, whose keys before the window would be
  // read with weight 0, and a non-finite value there (a slot nobody wrote) would reach the output, while the
  // portable tasks start at the window's first key.
  const bool by_pieces = isa != CpuIsa::kPortable && !(block_table && window_left != kNoWindow);
  at::Tensor schedule;
  if (plan) {
    checks::check_plan_tensor(op, *plan, q, kDecodeHeader);
    schedule = *plan;
    checks::check_decode_plan_header(op, schedule.data_ptr<int32_t>(), schedule.size(0), batch, layout);
    check_plan_records(op, DecodePlanView{schedule.data_ptr<int32_t>()}, seqlens, window_left);
  } else if (!by_pieces) {
    schedule = decode_plan_cpu(cache_seqlens, qk_offsets, v_offsets, group, std::nullopt, window_left);
  }

  const at::Tensor qc = checks::unit_last_stride(q);
  // Every output row is written by its request's tasks, or by merge_splits, except the rows of empty requests, which
  // are zeros.
  at::Tensor out = at::empty({batch, group * layout.v_width()}, q.options());
  for (int64_t b = 0; b < batch; ++b) {
    if (seqlens[b] == 0) out[b].zero_();
  }
  const int64_t max_v_dim = layout.max_v_dim(), hkv = layout.num_kv_heads();
  // Products without widening the cache's elements to float, as run_piece_avx512 chooses them: vdpbf16ps on bf16
  // rows and on e4m3 codes converted to bf16 (bf16 queries), vpdpwssd on int8 and int4 codes (half-precision queries).
  const bool unwidened =
      isa == CpuIsa::kAvx512Bf16 && (cache_format == KvFormat::kFloat     ? k_cache.scalar_type() == at::kBFloat16
                                     : cache_format == KvFormat::kFp8E4M3 ? q.scalar_type() == at::kBFloat16
                                                                          : q.scalar_type() != at::kFloat);
  const ReadAhead way = read_ahead_for(op, block_table.has_value(), unwidened);
  // A windowed request's first piece of a paged cache starts on the kernel's block (within its page) that holds the
  // window's first key, whose earlier keys it masks; a contiguous one starts exactly there (cut_rows).
  const int64_t edge =
      block_table ? std::min(paged.page_size, paged_block_keys(way, paged.page_size, k_cache.element_size())) : 1;
  std::vector<int32_t> piece_splits;
  const std::vector<RowPiece> pieces = by_pieces ? cut_rows(seqlens, window_left, hkv, at::get_num_threads(),
                                                            block_table ? paged.page_size : 1, edge, piece_splits)
                                                 : std::vector<RowPiece>{};
  const DecodePlanView view{by_pieces ? nullptr : schedule.data_ptr<int32_t>()};
  const int64_t slots = by_pieces ? piece_splits.back() : view.num_tasks();
  // Only split (request, KV head) pairs write and read their slots here.
  const std::unique_ptr<float[]> partial_out = uninitialized_floats(slots * group * max_v_dim);
  const std::unique_ptr<float[]> partial_lse = uninitialized_floats(slots * group);
  const int32_t* splits = by_pieces ? piece_splits.data() : view.split_offsets();  // (B * H_kv + 1)
  const Problem pb{.layout = &layout,
                   .scale = static_cast<float>(scale),
                   .split_offsets = splits,
                   .partial_out = partial_out.get(),
                   .partial_lse = partial_lse.get(),
                   .max_v_dim = max_v_dim,
                   .softcap = variant.softcap,
                   .sinks = variant.sink_logits()};

  const auto run = [&]<typename T, typename C>() {
    const int32_t* bt = block_table ? table.data_ptr<int32_t>() : nullptr;
    const auto view_of = [&](const at::Tensor& cache, int64_t width) {
      const int64_t row_stride = block_table ? 0 : cache.stride(1);
      return CacheView<C>{static_cast<const C*>(cache.data_ptr()),
                          cache.stride(0),
                          row_stride,
                          bt,
                          paged.max_pages,
                          paged.page_size,
                          width / kColumnsPer<C>,
                          kv_stored_width(width, hkv, cache_format)};
    };
    const CacheView<C> kview = view_of(k_cache, layout.qk_width()), vview = view_of(v_cache, layout.v_width());
    T* op_out = out.data_ptr<T>();
    const T* qp = qc.data_ptr<T>();
    if (by_pieces) {
      at::parallel_for(0, int64_t(pieces.size()), 1, [&](int64_t p0, int64_t p1) {
        RowScratch ws(group, layout.qk_offsets[hkv], layout.v_offsets[hkv], hkv, kQuantized<C>,
                      std::is_same_v<C, Int4Pair>);
        for (int64_t p = p0; p < p1; ++p) {
          run_piece_avx512(pieces[p], pb, qp, qc.stride(0), kview, vview, op_out, out.stride(0), ws,
                           isa == CpuIsa::kAvx512Bf16, way, p + 1 < p1 ? &pieces[p + 1] : nullptr);
        }
      });
    } else {
      at::parallel_for(0, view.num_workers(), 1, [&](int64_t w0, int64_t w1) {
        TaskScratch ws(group, !std::is_same_v<C, float>);
        for (int64_t w = w0; w < w1; ++w) {
          for (int64_t r = view.worker_offsets()[w]; r < view.worker_offsets()[w + 1]; ++r) {
            const int32_t* record = view.records() + r * kDecodeRecordFields;
            run_task(record, pb, qp, qc.stride(0), kview, vview, op_out, out.stride(0), ws);
          }
        }
      });
    }
    merge_splits(pb, batch, op_out, out.stride(0));
  };
  FDC_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fdc::decode_attention", [&] {
    switch (cache_format) {
      case KvFormat::kInt8: run.template operator()<scalar_t, int8_t>(); break;
      case KvFormat::kFp8E4M3: run.template operator()<scalar_t, c10::Float8_e4m3fn>(); break;
      case KvFormat::kInt4: run.template operator()<scalar_t, Int4Pair>(); break;
      case KvFormat::kFloat: run.template operator()<scalar_t, scalar_t>(); break;
    }
  });
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("decode_attention", &fdc::cpu::decode_attention_cpu); }
