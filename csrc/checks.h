// The one place input validation lives, shared by the CPU and CUDA implementations of every op.
// Every message starts with the op name and names the argument: "fdc::decode_attention: k_cache must be ...".
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fdc/attention_variant.h"
#include "fdc/common.h"
#include "fdc/decode_plan.h"
#include "fdc/decode_plan_device.h"
#include "fdc/head_layout.h"
#include "fdc/kv_format.h"
#include "fdc/prefill_plan.h"

#define FDC_CHECK(cond, op, ...) TORCH_CHECK(cond, "fdc::", op, ": ", __VA_ARGS__)

namespace fdc::checks {

// A validated head layout, copied to host memory (the offsets always live on the CPU: they are static metadata of a
// layer, read on the host to size outputs without a device round trip).
struct HostLayout {
  std::vector<int32_t> qk_offsets;  // (H_kv + 1)
  std::vector<int32_t> v_offsets;   // (H_kv + 1), empty for ops that take only qk offsets
  int32_t group = 1;

  int32_t num_kv_heads() const { return static_cast<int32_t>(qk_offsets.size()) - 1; }
  int32_t num_heads() const { return num_kv_heads() * group; }
  int32_t qk_width() const { return qk_offsets.back(); }
  int32_t v_width() const { return v_offsets.back(); }
  int32_t max_v_dim() const {
    int32_t m = 0;
    for (size_t j = 0; j + 1 < v_offsets.size(); ++j) m = std::max(m, v_offsets[j + 1] - v_offsets[j]);
    return m;
  }
  HeadLayoutView view() const {
    return HeadLayoutView{qk_offsets.data(), v_offsets.empty() ? qk_offsets.data() : v_offsets.data(), num_kv_heads(),
                          group};
  }
};

inline const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

// A floating-point activation or cache tensor: float32, float16 or bfloat16, of the given rank.
inline void check_float(const char* op, const char* name, const at::Tensor& t, int64_t ndim) {
  FDC_CHECK(t.defined(), op, name, " must be a tensor but got None");
  FDC_CHECK(t.dim() == ndim, op, name, " must have ", ndim, " dimensions but got shape ", t.sizes());
  const auto st = t.scalar_type();
  FDC_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, op, name,
            " must be float32, float16 or bfloat16 but got ", dtype_name(st));
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                             const at::Tensor& ref) {
  FDC_CHECK(t.scalar_type() == ref.scalar_type(), op, name, " must have the dtype of ", ref_name, " (",
            dtype_name(ref.scalar_type()), ") but got ", dtype_name(t.scalar_type()));
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                              const at::Tensor& ref) {
  FDC_CHECK(t.device() == ref.device(), op, name, " must be on the device of ", ref_name, " (", ref.device(),
            ") but is on ", t.device());
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected) {
  FDC_CHECK(t.sizes() == expected, op, name, " must have shape ", expected, " but got ", t.sizes());
}

inline void check_int32_vector(const char* op, const char* name, const at::Tensor& t, int64_t length) {
  FDC_CHECK(t.defined(), op, name, " must be a tensor but got None");
  FDC_CHECK(t.scalar_type() == at::kInt, op, name, " must be int32 but got ", dtype_name(t.scalar_type()));
  FDC_CHECK(t.dim() == 1, op, name, " must be 1-D but got shape ", t.sizes());
  if (length >= 0) FDC_CHECK(t.size(0) == length, op, name, " must have length ", length, " but got ", t.size(0));
}

// A caller's output/cache tensor written in place cannot be copied to fix its layout: rows must be unit-stride.
inline void check_unit_last_stride(const char* op, const char* name, const at::Tensor& t) {
  FDC_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, op, name,
            " must have unit stride in its last dimension but got strides ", t.strides());
}

// Returns t if its rows are unit-stride (any other strides are fine for the kernels), else a contiguous copy.
inline at::Tensor unit_last_stride(const at::Tensor& t) {
  return (t.stride(-1) == 1 || t.size(-1) <= 1) ? t : t.contiguous();
}

// t as float32, and t on the CPU: t itself when it already is (no dispatcher call; at::Tensor::to goes through
// the dispatcher even when it has nothing to do, about 1 us per call, and a decode step makes a dozen per layer).
inline at::Tensor as_float(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); }
inline at::Tensor on_cpu(const at::Tensor& t) { return t.device().is_cpu() ? t : t.to(at::kCPU); }

inline std::vector<int32_t> read_offsets(const char* op, const char* name, const at::Tensor& offsets) {
  check_int32_vector(op, name, offsets, -1);
  FDC_CHECK(offsets.device().is_cpu(), op, name, " must be a CPU tensor (head layouts are host metadata) but is on ",
            offsets.device());
  FDC_CHECK(offsets.size(0) >= 2, op, name, " must have at least 2 entries (H_kv + 1) but got ", offsets.size(0));
  const at::Tensor c = offsets.contiguous();
  std::vector<int32_t> v(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.size(0));
  FDC_CHECK(v[0] == 0, op, name, " must start at 0 but got ", v[0]);
  for (size_t j = 0; j + 1 < v.size(); ++j) {
    const int32_t width = v[j + 1] - v[j];
    FDC_CHECK(width > 0, op, name, " must be strictly increasing but entry ", j + 1, " (", v[j + 1],
              ") is not above entry ", j, " (", v[j], ")");
    FDC_CHECK(width % kDimMultiple == 0, op, name, " widths must be multiples of ", kDimMultiple, " but head ", j,
              " has width ", width);
    FDC_CHECK(width <= kMaxHeadDim, op, name, " widths must be at most ", kMaxHeadDim, " but head ", j, " has width ",
              width);
  }
  return v;
}

inline void check_group(const char* op, int64_t group) {
  FDC_CHECK(group >= 1, op, "group must be at least 1 but got ", group);
}

// Reads and validates qk_offsets (and v_offsets, when given) and the group size.
inline HostLayout read_layout(const char* op, const at::Tensor& qk_offsets, const at::Tensor* v_offsets,
                              int64_t group) {
  check_group(op, group);
  HostLayout layout;
  layout.group = static_cast<int32_t>(group);
  layout.qk_offsets = read_offsets(op, "qk_offsets", qk_offsets);
  if (v_offsets != nullptr) {
    layout.v_offsets = read_offsets(op, "v_offsets", *v_offsets);
    FDC_CHECK(layout.v_offsets.size() == layout.qk_offsets.size(), op,
              "v_offsets must have the length of qk_offsets (H_kv + 1 = ", layout.qk_offsets.size(), ") but got ",
              layout.v_offsets.size());
  }
  return layout;
}

// A packed tensor's last dimension must equal the layout width; a mismatch also catches a group that does not
// divide the head count of the caller's projection.
inline void check_width(const char* op, const char* name, const at::Tensor& t, int64_t width, const char* formula) {
  FDC_CHECK(t.size(-1) == width, op, name, " must have ", width, " columns (", formula, ") but got shape ", t.sizes());
}

// cu_seqlens: int32 (B + 1), non-decreasing, cu[0] >= 0, cu[B] <= total rows. Values are read on the host: callers
// pass CPU tensors to CPU kernels; device kernels validate on the device.
inline std::vector<int32_t> read_cu_seqlens(const char* op, const char* name, const at::Tensor& cu, int64_t batch,
                                            int64_t total_rows, const char* rows_name) {
  check_int32_vector(op, name, cu, batch < 0 ? -1 : batch + 1);
  FDC_CHECK(cu.size(0) >= 1, op, name, " must have at least 1 entry (B + 1) but got 0");
  const at::Tensor c = on_cpu(cu).contiguous();
  std::vector<int32_t> v(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.size(0));
  FDC_CHECK(v[0] >= 0, op, name, " must start at a non-negative row but got ", v[0]);
  for (size_t b = 0; b + 1 < v.size(); ++b) {
    FDC_CHECK(v[b + 1] >= v[b], op, name, " must be non-decreasing but entry ", b + 1, " (", v[b + 1],
              ") is below entry ", b, " (", v[b], ")");
  }
  FDC_CHECK(v.back() <= total_rows, op, name, " must end at most at the ", total_rows, " rows of ", rows_name,
            " but ends at ", v.back());
  return v;
}

// cache_seqlens: int32 (B), each in [0, capacity].
inline std::vector<int32_t> read_cache_seqlens(const char* op, const at::Tensor& seqlens, int64_t batch,
                                               int64_t capacity) {
  check_int32_vector(op, "cache_seqlens", seqlens, batch);
  const at::Tensor c = on_cpu(seqlens).contiguous();
  std::vector<int32_t> v(c.data_ptr<int32_t>(), c.data_ptr<int32_t>() + c.size(0));
  for (size_t b = 0; b < v.size(); ++b) {
    FDC_CHECK(v[b] >= 0, op, "cache_seqlens must be non-negative but entry ", b, " is ", v[b]);
    FDC_CHECK(v[b] <= capacity, op, "cache_seqlens must be at most the cache capacity ", capacity, " but entry ", b,
              " is ", v[b]);
  }
  return v;
}

inline void check_scale(const char* op, double scale) {
  FDC_CHECK(std::isfinite(scale) && scale > 0, op, "scale must be a positive finite number but got ", scale);
}

// A tensor a CUDA kernel reads or writes: on a CUDA device (the dispatcher picks the CUDA kernel when any argument
// is a CUDA tensor, so the others must be checked).
inline void check_cuda_tensor(const char* op, const char* name, const at::Tensor& t) {
  FDC_CHECK(t.is_cuda(), op, name, " must be a CUDA tensor but is on ", t.device());
}

// The device decode planner's limits (include/fdc/decode_plan_device.h): the KV heads' d_sum travel in kernel
// parameters, the worker loads in one warp's registers, task indices in 23 bits of a sort key.
inline void check_device_decode_plan(const char* op, int64_t batch, int64_t num_kv_heads, int64_t num_workers) {
  FDC_CHECK(num_kv_heads <= kMaxDevicePlanHeads, op, "qk_offsets must describe at most ", kMaxDevicePlanHeads,
            " KV heads on CUDA but describes ", num_kv_heads);
  FDC_CHECK(num_workers <= kMaxDeviceWorkers, op, "num_workers must be at most ", kMaxDeviceWorkers,
            " on CUDA but got ", num_workers);
  const int64_t capacity = decode_plan_capacity(batch, num_kv_heads, num_workers);
  FDC_CHECK(capacity <= kMaxDevicePlanCapacity, op, "cache_seqlens is too long on CUDA: B * H_kv + ", kChunksPerWorker,
            " * num_workers must be at most ", kMaxDevicePlanCapacity, " but is ", capacity, " (B=", batch,
            ", H_kv=", num_kv_heads, ", num_workers=", num_workers, ")");
}

inline int32_t read_num_workers(const char* op, std::optional<int64_t> num_workers, int64_t backend_default) {
  const int64_t n = num_workers.value_or(backend_default);
  FDC_CHECK(n >= 1 && n <= (1 << 20), op, "num_workers must be in [1, 2^20] but got ", n);
  return static_cast<int32_t>(n);
}

// Block-table entries are read lazily by kernels; this checks the ones a request will touch, pages
// [first_page, end_page) of its row `row` (request batch_index).
inline void check_block_table_entries(const char* op, const int32_t* row, int64_t batch_index, int64_t first_page,
                                      int64_t end_page, int64_t num_pages) {
  for (int64_t p = first_page; p < end_page; ++p) {
    FDC_CHECK(row[p] >= 0 && row[p] < num_pages, op, "block_table[", batch_index, "][", p, "] = ", row[p],
              " is not a page index in [0, ", num_pages, ")");
  }
}

// A paged cache: block_table int32 (B, max_pages), caches (num_pages, width, page_size) with contiguous pages.
struct PagedCache {
  int64_t page_size = 0;
  int64_t max_pages = 0;
  int64_t num_pages = 0;
};

// k_width and v_width: the byte or element rows of a page (kv_stored_width); k_name and v_name: the caches' argument
// names in the op's messages.
inline PagedCache check_paged(const char* op, const at::Tensor& block_table, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, int64_t batch, int64_t k_width, int64_t v_width,
                              const char* k_name = "k_cache", const char* v_name = "v_cache") {
  FDC_CHECK(block_table.scalar_type() == at::kInt, op, "block_table must be int32 but got ",
            dtype_name(block_table.scalar_type()));
  FDC_CHECK(block_table.dim() == 2 && block_table.size(0) == batch, op, "block_table must have shape (B=", batch,
            ", max_pages) but got ", block_table.sizes());
  check_same_device(op, "block_table", block_table, k_name, k_cache);
  FDC_CHECK(k_cache.dim() == 3 && k_cache.size(1) == k_width, op, k_name, " must have shape (num_pages, ", k_width,
            ", page_size) with a block_table but got ", k_cache.sizes());
  FDC_CHECK(v_cache.dim() == 3 && v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == v_width &&
                v_cache.size(2) == k_cache.size(2),
            op, v_name, " must have shape (", k_cache.size(0), ", ", v_width, ", ", k_cache.size(2),
            ") with a block_table but got ", v_cache.sizes());
  FDC_CHECK(k_cache.size(2) >= 1, op, "page_size (", k_name, ".size(2)) must be at least 1 but got ", k_cache.size(2));
  FDC_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2) && v_cache.stride(2) == 1 &&
                v_cache.stride(1) == v_cache.size(2),
            op, "paged ", k_name, " and ", v_name, " must have contiguous pages but got strides ", k_cache.strides(),
            " and ", v_cache.strides());
  PagedCache paged;
  paged.page_size = k_cache.size(2);
  paged.max_pages = block_table.size(1);
  paged.num_pages = k_cache.size(0);
  return paged;
}

// A validated K/V cache pair (check_cache).
struct CacheShape {
  PagedCache paged;
  int64_t capacity = 0;
  KvFormat format = KvFormat::kFloat;
};

// Quantized cache dtypes (fdc/kv_format.h): int8, float8_e4m3fn, and uint8 holding int4 codes two per byte.
inline bool is_quantized_cache_dtype(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kByte;
}
// The format of a cache of dtype t: int8, float8_e4m3fn, int4 (uint8), or any other (float) dtype.
inline KvFormat kv_format_of(at::ScalarType t) {
  switch (t) {
    case at::kChar: return KvFormat::kInt8;
    case at::kFloat8_e4m3fn: return KvFormat::kFp8E4M3;
    case at::kByte: return KvFormat::kInt4;
    default: return KvFormat::kFloat;
  }
}
// A quantized cache dtype as torch spells it in Python, with what it holds.
inline const char* quantized_name(at::ScalarType t) {
  return t == at::kChar ? "int8" : t == at::kByte ? "uint8: int4 codes, two per byte" : "float8_e4m3fn";
}

// The storage of a K/V cache pair whose activations (`activation_name`: q, or the new rows k) have dtype
// `activation`: that dtype, or a quantized format (fdc/kv_format.h): int8, float8_e4m3fn or int4 (uint8).
inline KvFormat check_cache_dtype(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  at::ScalarType activation, const char* activation_name) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"k_cache", k_cache}, {"v_cache", v_cache}}) {
    FDC_CHECK(t.defined(), op, name, " must be a tensor but got None");
    FDC_CHECK(t.dim() == 3, op, name, " must have 3 dimensions but got shape ", t.sizes());
  }
  const at::ScalarType st = k_cache.scalar_type();
  FDC_CHECK(st == activation || is_quantized_cache_dtype(st), op, "k_cache must have the dtype of ", activation_name,
            " (", dtype_name(activation),
            "), or be int8, float8_e4m3fn or uint8 (int4 codes two per byte): a quantized cache, but got ",
            dtype_name(st));
  check_same_dtype(op, "v_cache", v_cache, "k_cache", k_cache);
  check_same_device(op, "v_cache", v_cache, "k_cache", k_cache);
  return kv_format_of(st);
}

// A quantized cache's float32 scales need 4-byte alignment: its start and its strides between requests (or pages) and
// rows; a page starts its scales at width * page_size bytes (width / 2 for int4), a multiple of 4, and a row at width
// (width / 2), also one.
inline void check_scale_alignment(const char* op, const char* name, const at::Tensor& t, bool paged) {
  FDC_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % kKvScaleBytes == 0 && t.stride(0) % kKvScaleBytes == 0 &&
                (paged || t.stride(1) % kKvScaleBytes == 0),
            op, name, " is a quantized cache, whose float32 scales need 4-byte alignment: its start and strides ",
            t.strides(), " must be multiples of 4 bytes");
}

// A K/V cache pair for activations of dtype `activation` (check_cache_dtype), contiguous (B, S_max, width) with
// unit-stride rows, or paged (num_pages, width, page_size) with a block table, width being kv_stored_width of the
// layout's: the data columns, then a quantized cache's float32 scales, which must lie on 4-byte boundaries. Returns
// the paging (page_size 0 when contiguous), the rows each request can hold and the format.
inline CacheShape check_cache(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const std::optional<at::Tensor>& block_table, int64_t batch, const HostLayout& layout,
                              at::ScalarType activation, const char* activation_name) {
  CacheShape shape;
  shape.format = check_cache_dtype(op, k_cache, v_cache, activation, activation_name);
  const int64_t heads = layout.num_kv_heads();
  const int64_t k_width = kv_stored_width(layout.qk_width(), heads, shape.format);
  const int64_t v_width = kv_stored_width(layout.v_width(), heads, shape.format);
  if (shape.format != KvFormat::kFloat) {
    check_scale_alignment(op, "k_cache", k_cache, block_table.has_value());
    check_scale_alignment(op, "v_cache", v_cache, block_table.has_value());
  }
  if (block_table) {
    shape.paged = check_paged(op, *block_table, k_cache, v_cache, batch, k_width, v_width);
    shape.capacity = shape.paged.max_pages * shape.paged.page_size;
    return shape;
  }
  const char* scales = shape.format == KvFormat::kFloat ? ""
                       : shape.format == KvFormat::kInt4
                           ? " (the data columns two per byte, then 4 bytes of scale per KV head)"
                           : " (the data columns, then 4 bytes of scale per KV head)";
  FDC_CHECK(k_cache.size(0) == batch && k_cache.size(2) == k_width, op, "k_cache must have shape (B=", batch,
            ", S_max, ", k_width, ")", scales, " but got ", k_cache.sizes());
  FDC_CHECK(v_cache.size(0) == batch && v_cache.size(1) == k_cache.size(1) && v_cache.size(2) == v_width, op,
            "v_cache must have shape (", batch, ", ", k_cache.size(1), ", ", v_width, ")", scales, " but got ",
            v_cache.sizes());
  check_unit_last_stride(op, "k_cache", k_cache);
  check_unit_last_stride(op, "v_cache", v_cache);
  shape.capacity = k_cache.size(1);
  return shape;
}

// The caches the CUDA kernels take (decode_attention, append_kv, prefill_attention's pages): float caches, and int8
// and float8_e4m3fn caches with float16 or bfloat16 `activations` (q, or the rows appended); int4 caches have no CUDA
// kernel yet. `cache` (named `cache_name`) is the key cache, of format `format`.
inline void check_cuda_cache_format(const char* op, KvFormat format, const char* cache_name, const at::Tensor& cache,
                                    const char* activations_name, const at::Tensor& activations) {
  if (format == KvFormat::kFloat) return;
  FDC_CHECK(format != KvFormat::kInt4, op, cache_name, " is an int4 cache (", quantized_name(cache.scalar_type()),
            "), which the CUDA ", op, " does not take yet: use an int8 or float8_e4m3fn cache on CUDA");
  FDC_CHECK(activations.scalar_type() != at::kFloat, op, activations_name, " is float32, but the CUDA ", op,
            " takes a quantized cache (", quantized_name(cache.scalar_type()), ") with float16 or bfloat16 ",
            activations_name, " only");
}

// A sliding window's width (include/fdc/attention_variant.h): -1 for none, else the keys a query sees before its own
// position; int32 like every position the kernels and planners handle.
inline void check_window(const char* op, int64_t window_left) {
  FDC_CHECK(window_left >= kNoWindow && window_left <= INT32_MAX, op,
            "window_left must be -1 (no window) or a key count in [0, 2**31) but got ", window_left);
}

// prefill_attention's inputs: q (T_q, G * W_qk) and keys and values of q's dtype and device, either packed rows
// k (T_k, W_qk), v (T_k, W_v) or, with a block_table (B, max_pages), a paged cache k (num_pages, W_qk, page_size),
// v (num_pages, W_v, page_size) holding each request's keys at positions [0, s_k) (check_paged); the boundaries
// cu_seqlens_q and cu_seqlens_k (B + 1), read on the host; the scale. For a paged cache, every block-table entry of a
// page holding a key some query sees (from the first query's window start on) must name a page of the pool.
struct PrefillInputs {
  HostLayout layout;
  int64_t batch = 0;
  std::vector<int32_t> cu_q, cu_k;
  PagedCache paged;                    // page_size 0 when k and v are packed rows
  at::Tensor block_table;              // contiguous, on k's device; undefined when packed
  KvFormat format = KvFormat::kFloat;  // a paged cache may be quantized (fdc/kv_format.h)
  bool is_paged() const { return paged.page_size > 0; }
};

// The first key of request b that some query of it sees: the first query's window start.
inline int64_t prefill_first_key(int64_t s_q, int64_t s_k, int64_t window_left) {
  return window_start(s_k - s_q, window_left);
}

inline PrefillInputs check_prefill_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                          const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group,
                                          double scale, const std::optional<at::Tensor>& block_table,
                                          int64_t window_left) {
  PrefillInputs in;
  check_window(op, window_left);  // the block-table entries checked below depend on it
  in.layout = read_layout(op, qk_offsets, &v_offsets, group);
  check_float(op, "q", q, 2);
  if (k.defined() && is_quantized_cache_dtype(k.scalar_type())) {
    FDC_CHECK(block_table.has_value(), op, "k is quantized (", quantized_name(k.scalar_type()),
              "): quantized keys are read from a paged cache (block_table), packed rows must be float32, float16 or "
              "bfloat16");
    FDC_CHECK(v.defined() && v.dim() == 3, op, "v must be a paged cache (num_pages, width, page_size) beside k");
    check_same_dtype(op, "v", v, "k", k);
    in.format = kv_format_of(k.scalar_type());
    check_scale_alignment(op, "k", k, true);
    check_scale_alignment(op, "v", v, true);
  } else {
    check_float(op, "k", k, block_table ? 3 : 2);
    check_float(op, "v", v, block_table ? 3 : 2);
    check_same_dtype(op, "k", k, "q", q);
    check_same_dtype(op, "v", v, "q", q);
  }
  check_same_device(op, "k", k, "q", q);
  check_same_device(op, "v", v, "q", q);
  check_width(op, "q", q, group * in.layout.qk_width(), "group * qk_offsets[-1]");
  check_scale(op, scale);
  check_int32_vector(op, "cu_seqlens_q", cu_seqlens_q, -1);
  in.batch = cu_seqlens_q.size(0) - 1;
  in.cu_q = read_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, in.batch, q.size(0), "q");
  if (!block_table) {
    check_width(op, "k", k, in.layout.qk_width(), "qk_offsets[-1]");
    check_width(op, "v", v, in.layout.v_width(), "v_offsets[-1]");
    FDC_CHECK(v.size(0) == k.size(0), op, "v must have the ", k.size(0), " rows of k but got shape ", v.sizes());
    in.cu_k = read_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, in.batch, k.size(0), "k");
    return in;
  }
  const int64_t heads = in.layout.num_kv_heads();
  in.paged = check_paged(op, *block_table, k, v, in.batch, kv_stored_width(in.layout.qk_width(), heads, in.format),
                         kv_stored_width(in.layout.v_width(), heads, in.format), "k", "v");
  const int64_t capacity = in.paged.max_pages * in.paged.page_size;
  in.cu_k = read_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, in.batch, INT32_MAX, "a paged cache");
  in.block_table = block_table->contiguous();
  const at::Tensor table = on_cpu(in.block_table);
  for (int64_t b = 0; b < in.batch; ++b) {
    const int64_t s_q = in.cu_q[b + 1] - in.cu_q[b], s_k = in.cu_k[b + 1] - in.cu_k[b];
    FDC_CHECK(s_k <= capacity, op, "request ", b, " has ", s_k, " keys (cu_seqlens_k) but its block_table row holds ",
              capacity, " (", in.paged.max_pages, " pages of ", in.paged.page_size, ")");
    if (s_q == 0 || s_k == 0) continue;
    check_block_table_entries(op, table.data_ptr<int32_t>() + b * in.paged.max_pages, b,
                              prefill_first_key(s_q, s_k, window_left) / in.paged.page_size,
                              ceil_div(s_k, in.paged.page_size), in.paged.num_pages);
  }
  return in;
}

// decode_attention's tensors: q (B, G * W_qk) and a K/V cache pair on q's device, of its dtype or quantized
// (check_cache), and the scale. Returns the validated layout and the cache's shape; cache_seqlens is read by each
// backend.
struct DecodeInputs {
  HostLayout layout;
  int64_t batch = 0;
  CacheShape cache;
};

inline DecodeInputs check_decode_inputs(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                        const at::Tensor& v_cache, const at::Tensor& qk_offsets,
                                        const at::Tensor& v_offsets, int64_t group, double scale,
                                        const std::optional<at::Tensor>& block_table) {
  DecodeInputs inputs;
  inputs.layout = read_layout(op, qk_offsets, &v_offsets, group);
  check_float(op, "q", q, 2);
  check_same_device(op, "k_cache", k_cache, "q", q);
  check_width(op, "q", q, group * inputs.layout.qk_width(), "group * qk_offsets[-1]");
  check_scale(op, scale);
  inputs.batch = q.size(0);
  inputs.cache = check_cache(op, k_cache, v_cache, block_table, inputs.batch, inputs.layout, q.scalar_type(), "q");
  return inputs;
}

// window_scores' inputs, all on the CPU: q (T, G * W_qk) and k_cache (B, S, W_qk) float (any of the three dtypes
// each: a quantized cache is dequantized by its caller), cu_seqlens_q (B + 1) and cache_seqlens (B) read on the host,
// each request's query count at most its length (its queries are its cache's last tokens); window in [1, 2^20];
// softcap as for attention; temperature positive; noise_state, when given, int64 (B, 4).
struct WindowScoresInputs {
  HostLayout layout;
  std::vector<int32_t> cu_seqlens_q;
  std::vector<int32_t> cache_seqlens;
  std::vector<std::array<uint64_t, 4>> noise_state;  // empty without noise
};

inline WindowScoresInputs check_window_scores_inputs(const char* op, const at::Tensor& q,
                                                     const at::Tensor& cu_seqlens_q, const at::Tensor& k_cache,
                                                     const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets,
                                                     int64_t group, double scale, int64_t window, double softcap,
                                                     const std::optional<at::Tensor>& noise_state, double temperature) {
  WindowScoresInputs inputs;
  inputs.layout = read_layout(op, qk_offsets, nullptr, group);
  check_float(op, "q", q, 2);
  check_float(op, "k_cache", k_cache, 3);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q},
                                {"cu_seqlens_q", &cu_seqlens_q},
                                {"k_cache", &k_cache},
                                {"cache_seqlens", &cache_seqlens}}) {
    FDC_CHECK(t->device().is_cpu(), op, name, " must be on the CPU but is on ", t->device());
  }
  check_width(op, "q", q, group * inputs.layout.qk_width(), "group * qk_offsets[-1]");
  check_width(op, "k_cache", k_cache, inputs.layout.qk_width(), "qk_offsets[-1]");
  check_scale(op, scale);
  FDC_CHECK(window >= 1 && window <= (1 << 20), op, "window must be in [1, 2**20] queries but got ", window);
  FDC_CHECK(std::isfinite(softcap) && softcap >= 0, op,
            "softcap must be 0 (no capping) or a positive finite number but got ", softcap);
  FDC_CHECK(std::isfinite(temperature) && temperature > 0, op, "temperature must be a positive finite number but got ",
            temperature);
  const int64_t batch = k_cache.size(0);
  inputs.cu_seqlens_q = read_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, batch, q.size(0), "q");
  inputs.cache_seqlens = read_cache_seqlens(op, cache_seqlens, batch, k_cache.size(1));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t count = inputs.cu_seqlens_q[b + 1] - inputs.cu_seqlens_q[b];
    FDC_CHECK(count <= inputs.cache_seqlens[b], op, "the queries of request ", b, " (", count,
              ") must be its last cached tokens, but cache_seqlens[", b, "] is ", inputs.cache_seqlens[b]);
  }
  if (noise_state.has_value()) {
    const at::Tensor& state = *noise_state;
    FDC_CHECK(state.scalar_type() == at::kLong && state.device().is_cpu(), op,
              "noise_state must be an int64 CPU tensor but got ", dtype_name(state.scalar_type()), " on ",
              state.device());
    check_shape(op, "noise_state", state, {batch, 4});
    const at::Tensor words = state.contiguous();
    const int64_t* w = words.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      inputs.noise_state.push_back({static_cast<uint64_t>(w[4 * b]), static_cast<uint64_t>(w[4 * b + 1]),
                                    static_cast<uint64_t>(w[4 * b + 2]), static_cast<uint64_t>(w[4 * b + 3])});
    }
  }
  return inputs;
}

// The attention variants an attention op was given (include/fdc/attention_variant.h), validated.
struct AttentionVariant {
  int64_t window_left = kNoWindow;
  float softcap = 0.f;
  at::Tensor sinks;  // (H_kv * G) float32 contiguous on q's device, one logit per query head; undefined when none

  const float* sink_logits() const { return sinks.defined() ? sinks.data_ptr<float>() : nullptr; }
};

// window_left (check_window), softcap (finite, >= 0; 0 for none) and sinks (a float32 vector of one logit per query
// head h = j * G + i, on q's device, or none).
inline AttentionVariant check_attention_variant(const char* op, int64_t window_left, double softcap,
                                                const std::optional<at::Tensor>& sinks, const at::Tensor& q,
                                                int64_t num_query_heads) {
  check_window(op, window_left);
  FDC_CHECK(std::isfinite(softcap) && softcap >= 0, op,
            "softcap must be 0 (no capping) or a positive finite number but got ", softcap);
  AttentionVariant variant;
  variant.window_left = window_left;
  variant.softcap = static_cast<float>(softcap);
  if (sinks) {
    FDC_CHECK(sinks->scalar_type() == at::kFloat, op, "sinks must be float32 but got ",
              dtype_name(sinks->scalar_type()));
    check_same_device(op, "sinks", *sinks, "q", q);
    check_shape(op, "sinks", *sinks, {num_query_heads});
    variant.sinks = sinks->contiguous();
  }
  return variant;
}

// The CUDA kernels read caches in 16-byte packets: the data must start 16-byte aligned, and a contiguous cache's
// request and row strides (a paged cache's page stride, when pages hold whole packets) must be multiples of 16 bytes.
// A quantized cache (one-byte codes) is read and written 4 bytes at a time where its rows are (codes, then 4-byte
// scales: only 4-byte aligned) and its scales are, in 16-byte packets where its pages hold whole ones: it must start
// 16-byte aligned with strides that are multiples of 4 bytes (a page stride of 16 when pages hold whole packets).
inline void check_vector_aligned(const char* op, const char* name, const at::Tensor& cache, bool paged) {
  if (cache.element_size() == 1) {
    const int64_t page_unit = paged && cache.size(2) % 16 == 0 ? 16 : 4;
    const bool strides_ok =
        paged ? cache.stride(0) % page_unit == 0 : (cache.stride(0) % 4 == 0 && cache.stride(1) % 4 == 0);
    FDC_CHECK(reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0 && strides_ok, op, name,
              " (a quantized cache) must start at a 16-byte aligned address with strides that are multiples of ",
              paged ? page_unit : 4, " bytes but got strides ", cache.strides(), " at offset ", cache.storage_offset());
    return;
  }
  const int64_t packet = 16 / static_cast<int64_t>(cache.element_size());
  // Pages that do not hold whole packets are read element by element: no alignment needed.
  if (paged && cache.size(2) % packet != 0) return;
  const bool strides_ok =
      paged ? cache.stride(0) % packet == 0 : (cache.stride(0) % packet == 0 && cache.stride(1) % packet == 0);
  FDC_CHECK(reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0 && strides_ok, op, name,
            " must start at a 16-byte aligned address with strides that are multiples of 16 bytes (", packet,
            " elements) but got strides ", cache.strides(), " at offset ", cache.storage_offset());
}

// The argument checks of append_kv that need no tensor's values: layout, dtypes, devices, widths, the metadata
// vectors' dtype and length, the cache shapes. The CPU op then reads and checks the values; the CUDA op never does
// (a host read would synchronise the stream and break CUDA-graph capture), its kernel skips what it cannot place.
// Shapes: caches (B, S_max, W) or paged (num_pages, W, page_size), k (T, qk_offsets[-1]), v (T, v_offsets[-1]),
// cu_seqlens (B + 1), cache_seqlens (B), block_table (B, max_pages).
struct AppendShape {
  HostLayout layout;
  int64_t batch = 0;
  CacheShape cache;
};

inline AppendShape check_append_kv(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                                   const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets,
                                   const at::Tensor& v_offsets, const std::optional<at::Tensor>& block_table) {
  AppendShape shape;
  shape.layout = read_layout(op, qk_offsets, &v_offsets, 1);
  check_float(op, "k", k, 2);
  check_float(op, "v", v, 2);
  if (k_cache.defined() && !is_quantized_cache_dtype(k_cache.scalar_type())) {
    check_same_dtype(op, "k", k, "k_cache", k_cache);
  }
  check_same_dtype(op, "v", v, "k", k);
  check_same_device(op, "k", k, "k_cache", k_cache);
  check_same_device(op, "v", v, "k_cache", k_cache);
  check_width(op, "k", k, shape.layout.qk_width(), "qk_offsets[-1]");
  check_width(op, "v", v, shape.layout.v_width(), "v_offsets[-1]");
  FDC_CHECK(v.size(0) == k.size(0), op, "v must have the ", k.size(0), " rows of k but got shape ", v.sizes());
  check_int32_vector(op, "cache_seqlens", cache_seqlens, -1);
  shape.batch = cache_seqlens.size(0);
  check_int32_vector(op, "cu_seqlens", cu_seqlens, shape.batch + 1);
  shape.cache = check_cache(op, k_cache, v_cache, block_table, shape.batch, shape.layout, k.scalar_type(), "k");
  return shape;
}

// rotate_compress and rope_rotate_compress: x (T, G * H_kv, D) and rot (H_kv, D, R_max >= every qk width), one
// float dtype and device.
struct RotateShape {
  HostLayout layout;
  int64_t tokens = 0;    // T
  int64_t head_dim = 0;  // D
  int32_t max_dim = 0;   // widest head of the layout
};

// out_width, when the caller gives it, must be the output's columns group * qk_offsets[-1] (a compiled graph's fixed
// shape; fdc_ops/ops.py says why it exists).
inline RotateShape check_rotate_compress(const char* op, const at::Tensor& x, const at::Tensor& rot,
                                         const at::Tensor& qk_offsets, int64_t group,
                                         std::optional<int64_t> out_width) {
  check_float(op, "x", x, 3);
  check_float(op, "rot", rot, 3);
  check_same_dtype(op, "rot", rot, "x", x);
  check_same_device(op, "rot", rot, "x", x);
  RotateShape shape;
  shape.layout = read_layout(op, qk_offsets, nullptr, group);
  const int64_t hkv = shape.layout.num_kv_heads();
  shape.tokens = x.size(0);
  shape.head_dim = x.size(2);
  FDC_CHECK(x.size(1) == group * hkv, op, "x must have group * H_kv = ", group, " * ", hkv, " = ", group * hkv,
            " heads in dimension 1 but got shape ", x.sizes());
  for (int64_t j = 0; j < hkv; ++j) {
    shape.max_dim = std::max(shape.max_dim, shape.layout.qk_offsets[j + 1] - shape.layout.qk_offsets[j]);
  }
  FDC_CHECK(rot.size(0) == hkv && rot.size(1) == shape.head_dim && rot.size(2) >= shape.max_dim, op,
            "rot must have shape (H_kv=", hkv, ", D=", shape.head_dim, ", R_max>=", shape.max_dim, ") but got ",
            rot.sizes());
  const int64_t width = group * shape.layout.qk_width();
  FDC_CHECK(!out_width || *out_width == width, op, "out_width must be group * qk_offsets[-1] = ", group, " * ",
            shape.layout.qk_width(), " = ", width, " but got ", out_width.value_or(width));
  return shape;
}

// rope_rotate_compress: cos and sin (T, rotary_dim) in x's dtype and on x's device, rotary_dim even and in [2, D].
// Returns rotary_dim.
inline int64_t check_rope_tables(const char* op, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& x) {
  check_float(op, "cos", cos, 2);
  check_float(op, "sin", sin, 2);
  check_same_dtype(op, "cos", cos, "x", x);
  check_same_dtype(op, "sin", sin, "x", x);
  check_same_device(op, "cos", cos, "x", x);
  check_same_device(op, "sin", sin, "x", x);
  const int64_t rotary_dim = cos.size(1);
  FDC_CHECK(cos.size(0) == x.size(0), op, "cos must have the T=", x.size(0), " rows of x but got shape ", cos.sizes());
  FDC_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= x.size(2), op,
            "cos must have an even number of columns (rotary_dim) in [2, D=", x.size(2), "] but got shape ",
            cos.sizes());
  check_shape(op, "sin", sin, cos.sizes());
  return rotary_dim;
}

}  // namespace fdc::checks

namespace fdc::checks {

inline void check_plan_tensor(const char* op, const at::Tensor& plan, const at::Tensor& data, int64_t min_size) {
  check_int32_vector(op, "plan", plan, -1);
  check_same_device(op, "plan", plan, "the attention inputs", data);
  FDC_CHECK(plan.is_contiguous(), op, "plan must be contiguous");
  FDC_CHECK(plan.size(0) >= min_size, op, "plan must have at least ", min_size, " entries but got ", plan.size(0));
}

// A decode plan must come from fdc::decode_plan for the same batch, KV heads and group. `header` is the plan's
// first kDecodeHeader entries, read on the host.
inline void check_decode_plan_header(const char* op, const int32_t* header, int64_t plan_size, int64_t batch,
                                     const HostLayout& layout) {
  FDC_CHECK(header[0] == kDecodePlanTag, op, "plan is not a decode plan (made by fdc::decode_plan)");
  FDC_CHECK(header[1] == batch && header[2] == layout.num_kv_heads() && header[6] == layout.group, op,
            "plan was made for B=", header[1], ", H_kv=", header[2], ", group=", header[6],
            " but the inputs have B=", batch, ", H_kv=", layout.num_kv_heads(), ", group=", layout.group);
  FDC_CHECK(header[7] == 0, op, "plan records a planner failure: ", status_message(static_cast<Status>(header[7])));
  FDC_CHECK(header[3] >= 1 && plan_size == decode_plan_size(batch, layout.num_kv_heads(), header[3]), op, "plan has ",
            plan_size, " entries, which does not match its own header (", header[3], " workers)");
}

// A prefill plan must come from fdc::prefill_plan for the same batch, heads, group and causal flag.
inline void check_prefill_plan_header(const char* op, const int32_t* header, int64_t plan_size, int64_t batch,
                                      const HostLayout& layout, bool causal) {
  FDC_CHECK(header[0] == kPrefillPlanTag, op, "plan is not a prefill plan (made by fdc::prefill_plan)");
  FDC_CHECK(header[1] == batch && header[2] == layout.num_heads() && header[7] == layout.group, op,
            "plan was made for B=", header[1], ", H=", header[2], ", group=", header[7],
            " but the inputs have B=", batch, ", H=", layout.num_heads(), ", group=", layout.group);
  FDC_CHECK((header[5] != 0) == causal, op, "plan was made with causal=", header[5] != 0 ? "True" : "False",
            " but causal=", causal ? "True" : "False");
  FDC_CHECK(header[3] >= 1 && header[4] >= 0 && plan_size == prefill_plan_size(header[3], header[4]), op, "plan has ",
            plan_size, " entries, which does not match its own header (", header[3], " workers, ", header[4],
            " records)");
}

// A plan from the caller must describe exactly these sequences: every record in range, and the rows of each
// (sequence, head) split into records exactly once (no row computed twice, none left out), whatever the order.
inline void check_prefill_plan_records(const char* op, const PrefillPlanView& plan, const std::vector<int32_t>& cu_q) {
  const int64_t heads = plan.num_heads(), batch = plan.batch();
  const int32_t* workers = plan.worker_offsets();
  FDC_CHECK(workers[0] == 0 && workers[plan.num_workers()] == plan.num_records(), op,
            "plan is corrupt: its record counts disagree");
  std::vector<std::array<int64_t, 3>> spans;  // (sequence * heads + head, row_start, row_end) of every record
  spans.reserve(plan.num_records());
  for (int64_t i = 0; i < plan.num_records(); ++i) {
    const int32_t* rec = plan.records() + i * kPrefillRecordFields;
    FDC_CHECK(rec[0] >= 0 && rec[0] < batch && rec[1] >= 0 && rec[1] < heads, op, "plan record ", i, " names sequence ",
              rec[0], ", head ", rec[1], " outside the batch");
    const int64_t s_q = cu_q[rec[0] + 1] - cu_q[rec[0]];
    FDC_CHECK(rec[2] >= 0 && rec[2] < rec[3] && rec[3] <= s_q, op, "plan record ", i, " (rows ", rec[2], "..", rec[3],
              " of sequence ", rec[0], " with ", s_q,
              " queries) does not fit cu_seqlens_q: make the plan "
              "from the same cu_seqlens");
    spans.push_back({rec[0] * heads + rec[1], rec[2], rec[3]});
  }
  std::sort(spans.begin(), spans.end());
  size_t next = 0;
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    const int64_t b = bh / heads, h = bh % heads, s_q = cu_q[b + 1] - cu_q[b];
    int64_t covered = 0;  // rows [0, covered) of (b, h) are in exactly one record so far
    for (; next < spans.size() && spans[next][0] == bh; ++next) {
      FDC_CHECK(spans[next][1] <= covered, op, "plan leaves rows ", covered, "..", spans[next][1], " of sequence ", b,
                ", head ", h, " to no record: make the plan from the same cu_seqlens");
      FDC_CHECK(spans[next][1] == covered, op, "plan computes rows ", spans[next][1], "..",
                std::min(covered, spans[next][2]), " of sequence ", b, ", head ", h,
                " in two records: make the plan with prefill_plan");
      covered = spans[next][2];
    }
    FDC_CHECK(covered == s_q, op, "plan covers rows 0..", covered, " of sequence ", b, ", head ", h, " but it has ",
              s_q, " queries: make the plan from the same cu_seqlens");
  }
}

}  // namespace fdc::checks
