// fdc::decode_attention on CUDA: a persistent kernel that executes a decode plan (include/fdc/decode_plan.h), one
// CTA per plan worker walking its task list, then a combine kernel that merges split chunks by log-sum-exp.
//
// A task is (request b, KV head j with its G query heads, keys [kv_start, kv_end)). The CTA streams the chunk's
// K and V rows through shared memory in tiles of kTileKeys keys with cp.async (16-byte copies, the next tile in
// flight while the current one is computed), so every cached byte is read from global memory once for all G query
// heads. Per tile: scores for every (query head, key) from the tile in shared memory, an online-softmax update in
// fp32, and the probability-weighted value rows accumulated in registers.
//
// Variants (fdc/attention_variant.h): a sliding window is the plan's (its tasks cover the visible keys only, so no
// key before the window is read beyond the lead keys of the first tile on a paged cache, fewer than a 16-byte packet's
// elements, which are masked);
// soft-capping applies to each score as it is written, before the mask; a sink scales each query head's normalised
// output by sink_factor of its log-sum-exp, in the attention kernel for an unsplit request and in the combine kernel,
// after the merge, for a split one.
//
// Shared-memory tiles are token-major ([key][dim]). Contiguous caches are token-major already; paged caches store
// pages dim-major ((num_pages, width, page_size), head_layout.h), so their tiles arrive dim-major and are transposed
// in shared memory before use: one compute path for both layouts.
//
// Quantized caches (fdc/kv_format.h; int8 and float8 e4m3fn, with float16 or bfloat16 queries) run the same kernel on
// their one-byte codes: tiles of codes (contiguous rows copied 4 bytes at a time, as a row of codes and 4-byte scales
// is only 4-byte aligned) with each tile's key and value scales beside them, every code turned into a float where the
// float cache's element is (fdc::cuda::code_to_float), the key scale applied to the key's score and the value scale to
// its probability. int4 caches and float32 queries over a quantized cache have no CUDA kernel and are refused.
//
// Nothing here reads a device value on the host: lengths, the plan and the block table are read by the kernels, so
// plan + attention can be captured in a CUDA graph. A value the kernels find invalid (a plan whose planner reported
// a bad length, a plan made for other shapes, a record past its request's length or the cache capacity, a block
// table entry outside the pages) never leads to an out-of-bounds access: the outputs it affects are NaN.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda_common.cuh"
#include "cuda/decode_kernels.cuh"
#include "cuda/generated/decode_instantiations.h"

namespace fdc::cuda {
namespace {

using decode::DecodeArgs;
using decode::kMaxKvHeads;
using decode::kThreads;
using decode::launch_layout;
using decode::plan_is_usable;

// One CTA per (request, KV head): zeros for an empty request, the log-sum-exp merge of a split one, NaN everywhere
// if the plan cannot be used. Unsplit requests were written by the attention kernel.
template <typename T, typename C>
__global__ void __launch_bounds__(kThreads) decode_combine_kernel(const __grid_constant__ DecodeArgs<T, C> a) {
  const int bj = blockIdx.x;
  const int64_t b = bj / a.num_kv_heads;
  const int j = bj % a.num_kv_heads;
  const int dv = a.v_offsets[j + 1] - a.v_offsets[j];
  T* out = a.out + b * a.out_stride + int64_t(a.group) * a.v_offsets[j];
  if (!plan_is_usable(a)) {
    for (int e = threadIdx.x; e < a.group * dv; e += kThreads) out[e] = from_float<T>(NAN);
    return;
  }
  const DecodePlanView plan{a.plan};
  const int first = plan.split_offsets()[bj], count = plan.split_offsets()[bj + 1] - first;
  if (count == 1) return;
  for (int e = threadIdx.x; e < a.group * dv; e += kThreads) {
    const int h = e / dv, c = e % dv;
    if (count <= 0 || first < 0 || first + count > a.plan_capacity) {
      // No chunk: an empty request, unless the plan was made for other lengths.
      out[e] = from_float<T>(count == 0 && a.cache_seqlens[b] == 0 ? 0.f : NAN);
      continue;
    }
    const float* lse = a.partial_lse + int64_t(first) * a.group + h;
    float lse_max = -INFINITY;
    bool poisoned = false;
    for (int s = 0; s < count; ++s) {
      const float l = lse[int64_t(s) * a.group];
      poisoned |= isnan(l);
      lse_max = fmaxf(lse_max, l);
    }
    float weight_sum = 0.f, value = 0.f;
    if (lse_max != -INFINITY) {
      for (int s = 0; s < count; ++s) {
        const float weight = __expf(lse[int64_t(s) * a.group] - lse_max);
        weight_sum += weight;
        value += weight * a.partial_out[((int64_t(first) + s) * a.group + h) * a.max_v_dim + c];
      }
    }
    float merged = weight_sum > 0.f ? value / weight_sum : 0.f;
    // The merged log-sum-exp is lse_max + log(weight_sum); with no key seen, merged is 0 and stays 0.
    if (a.sinks != nullptr && weight_sum > 0.f) {
      merged *= sink_factor(lse_max + logf(weight_sum), a.sinks[int64_t(j) * a.group + h]);
    }
    out[e] = from_float<T>(poisoned ? NAN : merged);
  }
}

// The plan's worker count, from its size alone (decode_plan_size is affine in N), so no header is read on the host.
int64_t plan_workers_from_size(const char* op, int64_t plan_size, int64_t batch, int64_t num_kv_heads) {
  const int64_t fixed = decode_plan_size(batch, num_kv_heads, 0);
  const int64_t per_worker = decode_plan_size(batch, num_kv_heads, 1) - fixed;
  const int64_t workers = (plan_size - fixed) / per_worker;
  FDC_CHECK(workers >= 1 && fixed + workers * per_worker == plan_size, op, "plan has ", plan_size,
            " entries, which is no decode plan size for B=", batch, ", H_kv=", num_kv_heads,
            ": make the plan with fdc::decode_plan for these shapes");
  return workers;
}

}  // namespace

// q (B, G * W_qk); caches contiguous (B, S_max, W) or paged (num_pages, W, page_size) -> (B, G * W_v).
at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
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
  checks::check_cuda_cache_format(op, cache.format, "k_cache", k_cache, "q", q);
  const int64_t batch = inputs.batch;
  checks::check_int32_vector(op, "cache_seqlens", cache_seqlens, batch);
  checks::check_same_device(op, "cache_seqlens", cache_seqlens, "q", q);
  checks::check_vector_aligned(op, "k_cache", k_cache, block_table.has_value());
  checks::check_vector_aligned(op, "v_cache", v_cache, block_table.has_value());
  const c10::cuda::CUDAGuard guard(q.device());

  const at::Tensor seqlens = cache_seqlens.contiguous();  // the kernels index it as a plain array
  const int64_t hkv = layout.num_kv_heads();
  FDC_CHECK(hkv <= kMaxKvHeads, op, "the CUDA kernel takes at most ", kMaxKvHeads, " KV heads but qk_offsets has ",
            hkv);
  at::Tensor schedule;
  if (plan) {
    checks::check_plan_tensor(op, *plan, q, kDecodeHeader);
    schedule = *plan;
  } else {
    schedule = decode_plan_cuda(seqlens, qk_offsets, v_offsets, group, std::nullopt, window_left);
  }
  const int64_t workers = plan_workers_from_size(op, schedule.size(0), batch, hkv);

  at::Tensor out = at::empty({batch, group * layout.v_width()}, q.options());
  if (batch == 0) return out;
  const int max_v_dim = layout.max_v_dim();
  int max_qk_dim = 0;
  for (int64_t j = 0; j < hkv; ++j) max_qk_dim = std::max(max_qk_dim, layout.qk_offsets[j + 1] - layout.qk_offsets[j]);
  const int64_t plan_capacity = decode_plan_capacity(batch, hkv, workers);
  const auto float_opts = q.options().dtype(at::kFloat);
  const at::Tensor partial_out = at::empty({plan_capacity, group, max_v_dim}, float_opts);
  const at::Tensor partial_lse = at::empty({plan_capacity, group}, float_opts);
  const at::Tensor qc = checks::unit_last_stride(q);
  const at::Tensor table = block_table ? block_table->contiguous() : at::Tensor();
  const bool paged = block_table.has_value();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  // T: q's dtype; C: the caches' elements, T or a quantized cache's one-byte codes.
  const auto run = [&]<typename T, typename C>() {
    DecodeArgs<T, C> args{};
    args.q = qc.data_ptr<T>();
    args.k_cache = static_cast<const C*>(k_cache.data_ptr());
    args.v_cache = static_cast<const C*>(v_cache.data_ptr());
    args.cache_seqlens = seqlens.data_ptr<int32_t>();
    args.block_table = paged ? table.data_ptr<int32_t>() : nullptr;
    args.plan = schedule.data_ptr<int32_t>();
    std::copy(layout.qk_offsets.begin(), layout.qk_offsets.end(), args.qk_offsets);
    std::copy(layout.v_offsets.begin(), layout.v_offsets.end(), args.v_offsets);
    args.out = out.data_ptr<T>();
    args.partial_out = partial_out.data_ptr<float>();
    args.partial_lse = partial_lse.data_ptr<float>();
    args.q_stride = qc.stride(0);
    args.out_stride = out.stride(0);
    args.k_stride0 = k_cache.stride(0);
    args.k_stride1 = paged ? 0 : k_cache.stride(1);
    args.v_stride0 = v_cache.stride(0);
    args.v_stride1 = paged ? 0 : v_cache.stride(1);
    args.capacity = cache.capacity;
    args.page_size = cache.paged.page_size;
    args.max_pages = cache.paged.max_pages;
    args.num_pages = cache.paged.num_pages;
    args.batch = static_cast<int32_t>(batch);
    args.num_kv_heads = static_cast<int32_t>(hkv);
    args.group = static_cast<int32_t>(group);
    args.num_workers = static_cast<int32_t>(workers);
    args.plan_capacity = static_cast<int32_t>(plan_capacity);
    args.max_v_dim = max_v_dim;
    args.scale = static_cast<float>(scale);
    args.window_left = variant.window_left;
    args.softcap = variant.softcap;
    args.format = cache.format;
    args.sinks = variant.sink_logits();
    args.max_qk_dim = max_qk_dim;
    // Query heads per pass (groups over 16 take several passes) and staging tiles, as many as the device's shared
    // memory allows: fdc/decode_tiles.h.
    const int64_t smem_limit = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
    const DecodeSharedLayout smem =
        choose_decode_shared_layout(sizeof(C), max_qk_dim, max_v_dim, group, paged, smem_limit);
    FDC_CHECK(smem.bytes <= smem_limit, op, "heads of widths up to ", max_qk_dim, " (qk) and ", max_v_dim, " (v) in ",
              c10::toString(k_cache.scalar_type()), paged ? " on a paged cache" : "", " need ", smem.bytes,
              " bytes of shared memory per CTA but the device allows ", smem_limit);
    args.stages = smem.stages;
    args.stage_elems = smem.stage_elems;
    args.compute_elems = smem.compute_elems;
    switch (smem.heads) {
      case 4: check_launch(launch_layout<T, C, 4>(args, paged, smem.bytes, stream), op, smem.bytes); break;
      case 8: check_launch(launch_layout<T, C, 8>(args, paged, smem.bytes, stream), op, smem.bytes); break;
      case 16: check_launch(launch_layout<T, C, 16>(args, paged, smem.bytes, stream), op, smem.bytes); break;
      default: FDC_CHECK(false, op, "no kernel for ", smem.heads, " query heads per pass");
    }
    decode_combine_kernel<T, C><<<static_cast<unsigned>(batch * hkv), kThreads, 0, stream>>>(args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // Quantized caches: the codes' kernels exist for half-precision queries (float32 ones were refused by
  // check_cuda_cache_format); T is a template parameter here so that no float32 one is instantiated.
  const auto run_codes = [&]<typename T>() {
    if constexpr (std::is_same_v<T, float>) {
      TORCH_INTERNAL_ASSERT(false, "fdc::decode_attention: float32 queries over a quantized cache were let through");
    } else {
      run.template operator()<T, uint8_t>();
    }
  };
  FDC_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fdc::decode_attention", [&] {
    if (cache.format == KvFormat::kFloat) {
      run.template operator()<scalar_t, scalar_t>();
    } else {
      run_codes.template operator()<scalar_t>();
    }
  });
  return out;
}

}  // namespace fdc::cuda

TORCH_LIBRARY_IMPL(fdc, CUDA, m) { m.impl("decode_attention", &fdc::cuda::decode_attention_cuda); }
