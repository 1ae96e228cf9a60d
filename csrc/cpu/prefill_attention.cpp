// fdc::prefill_attention on the CPU: executes a prefill plan (include/fdc/prefill_plan.h) with one
// at::parallel_for worker per plan worker. A record's rows are processed in tiles of kRowTile rows against key
// tiles of kKeyTile keys with an online softmax (FlashAttention's loop); both products of a tile are float32 BLAS
// calls (at::mm_out / at::addmm_out, single-threaded inside the parallel region) on views of the packed,
// row-strided head slices, so no head is ever padded or copied.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/vec_math.h"
#include "fdc/prefill_plan.h"
#include "fdc/softmax_merge.h"

namespace fdc::cpu {
namespace {

// Rows and keys per tile: each BLAS call costs a few microseconds of tensor bookkeeping, so a tile must carry
// enough work (128 x 512 x d) to hide it; the 128 x 512 score tile and the 128 x 256 accumulator (384 KiB) still
// stay in L2.
constexpr int64_t kRowTile = 128;
constexpr int64_t kKeyTile = 512;

// Float32 q, k, v: row-strided, unit column stride.
struct Operands {
  at::Tensor q, k, v;
};

struct TileScratch {
  at::Tensor scores = at::empty({kRowTile, kKeyTile}, at::kFloat);
  at::Tensor acc = at::empty({kRowTile, kMaxHeadDim}, at::kFloat);
  std::vector<OnlineSoftmax> softmax = std::vector<OnlineSoftmax>(kRowTile);
};

// Rows [a, a + m) of sequence b for query head h (rows counted from the sequence start), written to out.
template <typename T>
void run_row_tile(const Operands& x, const checks::HostLayout& layout, const HeadLayoutView& view, int64_t h,
                  int64_t q_start, int64_t k_start, int64_t s_q, int64_t s_k, int64_t a, int64_t m, bool causal,
                  float scale, T* out, int64_t out_ld, TileScratch& ws) {
  const int64_t j = h / layout.group;
  const int64_t dq = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
  const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
  // Key i + shift is the last one row i sees (causal, bottom-right aligned).
  const int64_t shift = s_k - s_q;
  const int64_t keys_end = causal ? std::clamp<int64_t>(a + m + shift, 0, s_k) : s_k;
  T* out_rows = out + (q_start + a) * out_ld + view.o_column(static_cast<int32_t>(h));
  if (keys_end == 0) return;  // no row of the tile sees a key: the zero-initialised output stands

  const at::Tensor q_tile = x.q.narrow(0, q_start + a, m).narrow(1, view.q_column(static_cast<int32_t>(h)), dq);
  const at::Tensor k_head = x.k.narrow(0, k_start, keys_end).narrow(1, layout.qk_offsets[j], dq);
  const at::Tensor v_head = x.v.narrow(0, k_start, keys_end).narrow(1, layout.v_offsets[j], dv);
  at::Tensor acc = ws.acc.narrow(0, 0, m).narrow(1, 0, dv);  // (m, dv), row stride kMaxHeadDim
  acc.zero_();
  float* acc_data = acc.data_ptr<float>();
  std::fill(ws.softmax.begin(), ws.softmax.begin() + m, OnlineSoftmax{});

  for (int64_t c0 = 0; c0 < keys_end; c0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, keys_end - c0);
    at::Tensor scores = ws.scores.narrow(0, 0, m).narrow(1, 0, n);  // (m, n), row stride kKeyTile
    at::mm_out(scores, q_tile, k_head.narrow(0, c0, n).t());
    float* score_data = scores.data_ptr<float>();
    for (int64_t r = 0; r < m; ++r) {
      float* s = score_data + r * kKeyTile;
      const int64_t visible = causal ? std::clamp<int64_t>(a + r + shift + 1 - c0, 0, n) : n;
      OnlineSoftmax& sm = ws.softmax[r];
      const float factor = sm.rescale_for(max_of(s, visible) * scale);
      if (factor != 1.f) scale_in_place(acc_data + r * kMaxHeadDim, dv, factor);
      std::fill(s + visible, s + n, 0.f);
      if (sm.max == -INFINITY) {
        std::fill(s, s + visible, 0.f);
        continue;
      }
      sm.sum += exp_and_sum(s, visible, scale, sm.max);
    }
    acc.addmm_(scores, v_head.narrow(0, c0, n));
  }
  for (int64_t r = 0; r < m; ++r) {
    const float inv = ws.softmax[r].inverse_sum();
    for (int64_t c = 0; c < dv; ++c) out_rows[r * out_ld + c] = static_cast<T>(acc_data[r * kMaxHeadDim + c] * inv);
  }
}

}  // namespace

// q (T_q, G * W_qk), k (T_k, W_qk), v (T_k, W_v) -> (T_q, G * W_v).
at::Tensor prefill_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                 const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group, double scale,
                                 bool causal, const std::optional<at::Tensor>& plan) {
  const char* op = "prefill_attention";
  const checks::HostLayout layout = checks::check_prefill_inputs(op, q, k, v, qk_offsets, v_offsets, group, scale);
  checks::check_int32_vector(op, "cu_seqlens_q", cu_seqlens_q, -1);
  const int64_t batch = cu_seqlens_q.size(0) - 1;
  const std::vector<int32_t> cu_q = checks::read_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, batch, q.size(0), "q");
  const std::vector<int32_t> cu_k = checks::read_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, batch, k.size(0), "k");

  at::Tensor schedule;
  if (plan) {
    checks::check_plan_tensor(op, *plan, q, kPrefillHeader);
    schedule = *plan;
    checks::check_prefill_plan_header(op, schedule.data_ptr<int32_t>(), schedule.size(0), batch, layout, causal);
  } else {
    schedule = prefill_plan_cpu(cu_seqlens_q, cu_seqlens_k, qk_offsets, v_offsets, group, causal, std::nullopt,
                                kDefaultRowBlock);
  }
  const PrefillPlanView view{schedule.data_ptr<int32_t>()};
  checks::check_prefill_plan_records(op, view, cu_q);

  // Float32 operands with unit column stride (float32 row-strided inputs are used in place).
  const at::Tensor qf = checks::unit_last_stride(q.to(at::kFloat));
  const at::Tensor kf = checks::unit_last_stride(k.to(at::kFloat));
  const at::Tensor vf = checks::unit_last_stride(v.to(at::kFloat));
  const Operands x{qf, kf, vf};
  at::Tensor out = at::zeros({q.size(0), group * layout.v_width()}, q.options());
  const HeadLayoutView head_view = layout.view();

  FDC_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fdc::prefill_attention", [&] {
    scalar_t* out_data = out.data_ptr<scalar_t>();
    at::parallel_for(0, view.num_workers(), 1, [&](int64_t w0, int64_t w1) {
      TileScratch ws;
      for (int64_t w = w0; w < w1; ++w) {
        for (int64_t r = view.worker_offsets()[w]; r < view.worker_offsets()[w + 1]; ++r) {
          const int32_t* rec = view.records() + r * kPrefillRecordFields;
          const int64_t b = rec[0];
          const int64_t s_q = cu_q[b + 1] - cu_q[b], s_k = cu_k[b + 1] - cu_k[b];
          for (int64_t a = rec[2]; a < rec[3]; a += kRowTile) {
            run_row_tile(x, layout, head_view, rec[1], cu_q[b], cu_k[b], s_q, s_k, a,
                         std::min<int64_t>(kRowTile, rec[3] - a), causal, static_cast<float>(scale), out_data,
                         out.stride(0), ws);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("prefill_attention", &fdc::cpu::prefill_attention_cpu); }
