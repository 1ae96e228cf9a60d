// fdc::prefill_attention on CUDA: a persistent kernel that executes a prefill plan (include/fdc/prefill_plan.h),
// one CTA per plan worker walking its records, FlashAttention-2's loop on tensor cores for fp16/bf16 and a plain
// fp32 kernel for float32 inputs.
//
// Heads of different widths in one launch. No public kernel takes per-head (d_qk, d_v) in one call, so this one
// reads each record's widths from the layout (kernel parameters) and pads compute, never memory: a head's width is
// rounded up to the m16n8k16 product's k (16) for QK^T and n (8) for PV inside shared memory and registers, with
// zeros in the padding. Kernels are compiled for three width buckets (the layout's widest head rounded up to 64,
// 128 or 256), which size the register accumulators; narrower heads of the same layout skip the unused k- and
// n-steps at run time. Row-block rescaling (narrow heads get more rows per record) is the planner's: a record's
// rows run as consecutive base tiles of kRowsPerCta rows, each against all the keys it sees, so a record of a
// narrow head is several base tiles, looped over inside the task (B_c stays fixed per
// bucket because the tile sizes already fit registers and shared memory at every width).
//
// Tensor-core path, per CTA of 4 warps and per base tile: each warp owns 16 query rows, keeps its Q fragments in
// registers, and for every key tile of kKeys keys (K and V rows streamed into shared memory by cp.async, the next
// tile in flight while this one is computed): S = Q K^T (fp32), causal / length mask, online softmax in fp32 with
// exp2, P converted to the input dtype in registers, O += P V with V fragments by ldmatrix.trans.
//
// Variants (fdc/attention_variant.h): with a sliding window a base tile's key loop starts at its first row's window
// (earlier key tiles are never loaded) and each row masks the keys outside its own window, so only tiles at the
// window's edge are partly masked; soft-capping applies to the scores before the mask; a sink scales each row's
// normalised output by sink_factor of the row's log-sum-exp.
//
// Paged keys and values (a block_table): k (num_pages, W_qk, page_size) and v (num_pages, W_v, page_size) are read in
// place, key t of sequence b at slot t % page_size of page block_table[b][t / page_size] (prefill_kernels.cuh,
// key_offset). Only keys some row of a tile sees are addressed, so the block-table entries and pages before the first
// query's window and past the last key are never read. The tensor-core kernel loads a paged tile with plain loads
// (a page's column holds consecutive keys, so a warp reads one column's slots), not cp.async: no 16-byte alignment
// is needed, and that tile's loads do not overlap the previous tile's compute.
//
// Quantized pages (int8 or float8 e4m3 codes with a float32 scale per token and KV head, fdc/kv_format.h), what a
// chunked prefill's later chunks and a prefix-cache hit read in vLLM with kv_cache_dtype int8 or fp8: the same plain
// loads take each key's codes and its scale, and store code x scale as fp16 / bf16 in the shared-memory tile (one key
// tile of 32 or 64 keys at a time, never a full-precision copy of the cache), so the tensor-core loop is unchanged.
// int4 pages and float32 queries over codes are refused (check_cuda_cache_format).
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "cuda/cuda_common.cuh"
#include "cuda/generated/prefill_instantiations.h"
#include "cuda/prefill_kernels.cuh"

namespace fdc::cuda {
namespace {

using prefill::first_key_seen;
using prefill::key_offset;
using prefill::keys_seen;
using prefill::kLog2e;
using prefill::kMaxKvHeads;
using prefill::kThreads;
using prefill::kWarps;
using prefill::launch_mma;
using prefill::PrefillArgs;
using prefill::read_record;
using prefill::RecordView;
using prefill::row_normaliser;

// Float32 path: exact fp32 arithmetic on CUDA cores (tensor cores would round the inputs to tf32). One warp per
// query row; the lanes take 32 keys at a time, so K rows are read by independent lanes and V rows by the warp (each
// lane finds its key's V row, and the warp takes the offsets by shuffles).

__global__ void __launch_bounds__(kThreads) prefill_fp32_kernel(const __grid_constant__ PrefillArgs<float> a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const PrefillPlanView plan{a.plan};
  const int first = plan.worker_offsets()[blockIdx.x], last = plan.worker_offsets()[blockIdx.x + 1];
  constexpr int kColsPerLane = kMaxHeadDim / 32;
  for (int ri = first; ri < last; ++ri) {
    const RecordView r = read_record(a, plan.records() + int64_t(ri) * kPrefillRecordFields);
    for (int row = r.row_start + warp; row < r.row_end; row += kWarps) {
      const int keys_end = keys_seen(r, row + 1, a.causal);
      const int keys_begin = first_key_seen(r, row, a.window_left);
      if (keys_end <= keys_begin) continue;
      const float* q = a.q + (r.q_row0 + row) * a.q_stride + r.q_col;
      const float* k_cols = a.k + r.k_col * a.col_stride;
      const float* v_cols = a.v + r.v_col * a.col_stride;
      float acc[kColsPerLane];
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) acc[c] = 0.f;
      float row_max = -INFINITY, row_sum = 0.f;
      for (int k0 = keys_begin; k0 < keys_end; k0 += 32) {
        const int key = k0 + lane;
        float score = -INFINITY;
        int64_t v_offset = 0;  // of this lane's key, read by the whole warp below
        if (key < keys_end) {
          const float* k_row = k_cols + key_offset(a, r, key, a.k_stride);
          float dot = 0.f;
          for (int c = 0; c < r.dq; ++c) dot += q[c] * k_row[c * a.col_stride];
          score = a.softcap > 0.f ? soft_cap(dot * a.scale, a.softcap) * kLog2e : dot * a.scale_log2;
          v_offset = key_offset(a, r, key, a.v_stride);
        }
        float tile_max = score;
#pragma unroll
        for (int m = 16; m > 0; m /= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, m));
        const float new_max = fmaxf(row_max, tile_max);  // finite: key k0 < keys_end is visible
        const float factor = row_max == -INFINITY ? 0.f : exp2f(row_max - new_max);
        row_max = new_max;
        const float p = exp2f(score - new_max);
        float tile_sum = p;
#pragma unroll
        for (int m = 16; m > 0; m /= 2) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, m);
        row_sum = row_sum * factor + tile_sum;
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) acc[c] *= factor;
        const int keys = min(32, keys_end - k0);
        for (int k = 0; k < keys; ++k) {
          const float pk = __shfl_sync(0xffffffffu, p, k);
          const float* v_row = v_cols + __shfl_sync(0xffffffffu, v_offset, k);
#pragma unroll
          for (int c = 0; c < kColsPerLane; ++c) {
            if (lane + 32 * c < r.dv) acc[c] += pk * v_row[(lane + 32 * c) * a.col_stride];
          }
        }
      }
      float* out = a.out + (r.q_row0 + row) * a.out_stride + r.o_col;
      const float inv = row_normaliser(row_max, row_sum, a.sinks, r.h);
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) {
        if (lane + 32 * c < r.dv) out[lane + 32 * c] = acc[c] * inv;
      }
    }
  }
}

// t if its rows can be read in 16-byte packets (aligned start, row stride a multiple of 16 bytes, unit column
// stride), else a copy into a fresh allocation: the caching allocator's blocks start 512-byte aligned and every packed
// width is a multiple of 8 elements, so the copy's rows are whole packets. Not t.contiguous(): a contiguous tensor at
// a misaligned address (buf[1:].view(...)) would come back as itself, and the kernel's cp.async would fault. k and v
// are read-only inputs, and the copy costs O(T) against O(T^2) attention.
at::Tensor packet_rows(const at::Tensor& t) {
  const int64_t packet = 16 / static_cast<int64_t>(t.element_size());
  const bool aligned =
      (t.stride(-1) == 1 || t.size(-1) <= 1) && t.stride(0) % packet == 0 && is_aligned16(t.data_ptr());
  if (aligned) return t;
  at::Tensor copy = at::empty(t.sizes(), t.options());
  copy.copy_(t);
  return copy;
}

// Float32 runs the exact kernel; fp16/bf16 the tensor-core kernel of the layout's width bucket (max_dim: the
// widest head, qk rounded up to 16).
template <typename T>
void launch_prefill(const PrefillArgs<T>& args, int workers, int max_dim, cudaStream_t stream) {
  if constexpr (std::is_same_v<T, float>) {
    prefill_fp32_kernel<<<workers, kThreads, 0, stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else if (max_dim <= 64) {
    check_launch(launch_mma<T, 64>(args, workers, stream));
  } else if (max_dim <= 128) {
    check_launch(launch_mma<T, 128>(args, workers, stream));
  } else if (max_dim <= 256) {
    check_launch(launch_mma<T, 256>(args, workers, stream));
  } else {
    FDC_CHECK(false, "prefill_attention", "no CUDA kernel for heads ", max_dim, " wide (at most ", kMaxHeadDim, ")");
  }
}

}  // namespace

// q (T_q, G * W_qk), k (T_k, W_qk), v (T_k, W_v) -> (T_q, G * W_v); or k (num_pages, W_qk, page_size),
// v (num_pages, W_v, page_size) with block_table (B, max_pages).
at::Tensor prefill_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group,
                                  double scale, bool causal, const std::optional<at::Tensor>& plan, int64_t window_left,
                                  double softcap, const std::optional<at::Tensor>& sinks,
                                  const std::optional<at::Tensor>& block_table) {
  const char* op = "prefill_attention";
  // Prefill reads its boundaries on the host (a plan's size depends on them, so no prefill is graph-captured):
  // they are validated here with the CPU op's messages, and so are a paged cache's block-table entries and a
  // caller's plan, record by record. Without a plan, the cached host and device copies of the planner's plan are
  // used as they are: no copy either way.
  const checks::PrefillInputs in = checks::check_prefill_inputs(op, q, k, v, cu_seqlens_q, cu_seqlens_k, qk_offsets,
                                                                v_offsets, group, scale, block_table, window_left);
  checks::check_cuda_cache_format(op, in.format, "k", k, "q", q);
  const checks::HostLayout& layout = in.layout;
  const checks::AttentionVariant variant =
      checks::check_attention_variant(op, window_left, softcap, sinks, q, layout.num_heads());
  // The kernels read the boundaries on the device too (check_prefill_inputs reads them from any device).
  checks::check_same_device(op, "cu_seqlens_q", cu_seqlens_q, "q", q);
  checks::check_same_device(op, "cu_seqlens_k", cu_seqlens_k, "q", q);
  const int64_t hkv = layout.num_kv_heads();
  FDC_CHECK(hkv <= kMaxKvHeads, op, "the CUDA kernel takes at most ", kMaxKvHeads, " KV heads but qk_offsets has ",
            hkv);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t batch = in.batch;
  const std::vector<int32_t>& cu_q = in.cu_q;
  const std::vector<int32_t>& cu_k = in.cu_k;
  at::Tensor schedule, host_plan;
  if (plan) {
    checks::check_plan_tensor(op, *plan, q, kPrefillHeader);
    schedule = *plan;
    host_plan = schedule.to(at::kCPU);
    checks::check_prefill_plan_header(op, host_plan.data_ptr<int32_t>(), host_plan.size(0), batch, layout, causal);
    checks::check_prefill_plan_records(op, PrefillPlanView{host_plan.data_ptr<int32_t>()}, cu_q);
  } else {
    const PrefillPlans plans = cached_prefill_plan(cu_q, cu_k, qk_offsets, v_offsets, group, causal, num_sms(),
                                                   kDefaultRowBlock, window_left, q.device());
    schedule = plans.device;
    host_plan = plans.host;
    // The cache may drop this plan while the kernel below still reads it; its memory must not be handed out on the
    // stream it was made on before this stream's work is done.
    schedule.record_stream(at::cuda::getCurrentCUDAStream());
  }
  const PrefillPlanView view{host_plan.data_ptr<int32_t>()};

  at::Tensor out = at::zeros({q.size(0), group * layout.v_width()}, q.options());
  if (view.num_records() == 0) return out;
  const at::Tensor qc = checks::unit_last_stride(q);
  // A paged cache is read in place (check_paged: contiguous pages) by plain loads that need no alignment; packed rows
  // go through packet_rows for the 16-byte cp.async loads.
  const at::Tensor kc = in.is_paged() ? k : packet_rows(k);
  const at::Tensor vc = in.is_paged() ? v : packet_rows(v);
  const at::Tensor cu_q_dev = cu_seqlens_q.contiguous();
  const at::Tensor cu_k_dev = cu_seqlens_k.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  int max_dim = 0;
  for (int64_t j = 0; j < hkv; ++j) {
    max_dim = std::max({max_dim, (layout.qk_offsets[j + 1] - layout.qk_offsets[j] + 15) / 16 * 16,
                        layout.v_offsets[j + 1] - layout.v_offsets[j]});
  }

  FDC_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fdc::prefill_attention", [&] {
    PrefillArgs<scalar_t> args{};
    args.q = qc.data_ptr<scalar_t>();
    args.format = in.format;
    if (in.format == KvFormat::kFloat) {
      args.k = kc.data_ptr<scalar_t>();
      args.v = vc.data_ptr<scalar_t>();
    } else {  // int8 or e4m3 pages (check_cuda_cache_format: fp16 or bf16 q, so the tensor-core kernel), as bytes
      args.k_codes = static_cast<const uint8_t*>(kc.data_ptr());
      args.v_codes = static_cast<const uint8_t*>(vc.data_ptr());
    }
    args.cu_q = cu_q_dev.data_ptr<int32_t>();
    args.cu_k = cu_k_dev.data_ptr<int32_t>();
    args.plan = schedule.data_ptr<int32_t>();
    args.out = out.data_ptr<scalar_t>();
    args.q_stride = qc.stride(0);
    args.k_stride = kc.stride(0);
    args.v_stride = vc.stride(0);
    args.out_stride = out.stride(0);
    args.col_stride = 1;  // packed rows; args{} left block_table null
    if (in.is_paged()) {
      args.block_table = in.block_table.data_ptr<int32_t>();
      args.max_pages = in.paged.max_pages;
      args.page_size = in.paged.page_size;
      args.col_stride = in.paged.page_size;
    }
    args.scale_log2 = static_cast<float>(scale * M_LOG2E);
    args.scale = static_cast<float>(scale);
    args.softcap = variant.softcap;
    args.sinks = variant.sink_logits();
    args.window_left = static_cast<int32_t>(variant.window_left);
    args.group = static_cast<int32_t>(group);
    args.num_kv_heads = static_cast<int32_t>(hkv);
    args.causal = causal;
    std::copy(layout.qk_offsets.begin(), layout.qk_offsets.end(), args.qk_offsets);
    std::copy(layout.v_offsets.begin(), layout.v_offsets.end(), args.v_offsets);
    launch_prefill(args, view.num_workers(), max_dim, stream);
  });
  return out;
}

}  // namespace fdc::cuda

TORCH_LIBRARY_IMPL(fdc, CUDA, m) { m.impl("prefill_attention", &fdc::cuda::prefill_attention_cuda); }
