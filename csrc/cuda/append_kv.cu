// fdc::append_kv on CUDA: copies each request's new K/V rows after its current cache rows, bit for bit, or quantizes
// them into an int8 or float8 e4m3fn cache (fdc/kv_format.h) exactly as the CPU kernel does: per (row, KV head) a
// scale of the head's largest magnitude over the format's largest code (NaN if the head holds a non-finite value, 0 if
// it is all zeros; zero codes for both) and each code the nearest to x / scale, ties to even. int4 caches have no CUDA
// kernel yet (refused).
//
// Nothing here reads cu_seqlens, cache_seqlens or block_table on the host: that would synchronise the stream and
// make a decode step impossible to capture in a CUDA graph. The host checks what shapes, dtypes and devices tell;
// the kernels find each row's request and destination on the device and skip what they cannot place:
//   - request b writes nothing unless 0 <= cu_seqlens[b] <= cu_seqlens[b+1] <= T, cache_seqlens[b] >= 0 and
//     cache_seqlens[b] + (cu_seqlens[b+1] - cu_seqlens[b]) <= capacity (all or nothing per request);
//   - in a paged cache, a row whose block_table entry is outside [0, num_pages) is not written;
//   - rows of k/v outside [cu_seqlens[0], cu_seqlens[B]) are not written.
// A row's request is found by binary search over cu_seqlens; if cu_seqlens is not non-decreasing the rows written
// are unspecified, but every write still lands inside the caches.
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "cuda/cuda_common.cuh"
#include "fdc/kv_format.h"

namespace fdc::cuda {
namespace {

// Rows of the contiguous-cache kernel per CTA: one warp copies one row (a width of at most H_kv * 256 elements,
// a few 16-byte packets per lane), 8 warps keep 256 threads per CTA.
constexpr int kAppendWarps = 8;
// KV heads a quantizing launch takes: each head's columns travel in the kernel's parameters (two tables of 257 int32,
// within the 4 KiB parameter limit), as in the decode kernel.
constexpr int kMaxQuantizedKvHeads = 256;
// Tiles of the paged kernel: 32 rows x 32 columns through shared memory, read row-major (coalesced along a row of
// k) and written column by column (coalesced along the page's token axis); 32 x 8 threads, 4 rows or columns each.
constexpr int kPagedTile = 32;
constexpr int kPagedThreadRows = 8;

// The requests' metadata, all on the device. capacity is the rows a request can hold (S_max, or
// max_pages * page_size when paged).
struct AppendRequests {
  const int32_t* cu_seqlens;     // (B + 1)
  const int32_t* cache_seqlens;  // (B)
  const int32_t* block_table;    // (B, max_pages), null for a contiguous cache
  int64_t block_table_stride;    // elements between requests of block_table
  int32_t batch;                 // B
  int64_t rows;                  // T, rows of k and v
  int64_t capacity;
  int64_t page_size;  // 0 for a contiguous cache
  int64_t num_pages;
};

// One of the two copies of a launch (blockIdx.z: 0 = keys, 1 = values), elements as raw bits of their size.
template <typename Bits>
struct AppendTarget {
  const Bits* src;        // (T, width), unit-stride rows
  int64_t src_stride;     // elements between rows of src
  Bits* cache;            // (B, S_max, width) or (num_pages, width, page_size)
  int64_t cache_stride0;  // elements between requests (contiguous) or pages (paged)
  int64_t cache_stride1;  // elements between positions (contiguous); page_size when paged
  int32_t width;          // columns: qk_offsets[-1] or v_offsets[-1]
};

// Where row `row` of k/v goes: the request and its cache position (contiguous), or its page and slot (paged).
// `valid` is false when the row must not be written (see the top of this file).
struct Destination {
  bool valid = false;
  int64_t index0 = 0;    // index along the cache's first dimension: the request (contiguous) or the page (paged)
  int64_t position = 0;  // the row in the request's cache (contiguous) or the slot in the page (paged)
};

__device__ Destination locate(const AppendRequests& q, int64_t row) {
  Destination dest;
  if (q.batch <= 0 || row < 0 || row >= q.rows) return dest;
  // The last request b in [0, B) with cu_seqlens[b] <= row.
  int32_t lo = 0, hi = q.batch - 1;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (q.cu_seqlens[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int64_t begin = q.cu_seqlens[lo], end = q.cu_seqlens[lo + 1], start = q.cache_seqlens[lo];
  if (begin < 0 || end > q.rows || begin > end || row < begin || row >= end) return dest;
  if (start < 0 || start + (end - begin) > q.capacity) return dest;
  const int64_t position = start + (row - begin);
  if (q.block_table == nullptr) {
    dest.valid = true;
    dest.index0 = lo;
    dest.position = position;
    return dest;
  }
  const int64_t page = q.block_table[lo * q.block_table_stride + position / q.page_size];
  if (page < 0 || page >= q.num_pages) return dest;
  dest.valid = true;
  dest.index0 = page;
  dest.position = position % q.page_size;
  return dest;
}

// Contiguous caches: warp w of the CTA copies row blockIdx.x * kAppendWarps + w of keys (blockIdx.z 0) or values
// (1), in 16-byte packets when kVector (the host checked alignment), else element by element.
template <typename Bits, bool kVector>
__global__ void __launch_bounds__(kAppendWarps * 32)
    append_contiguous_kernel(const __grid_constant__ AppendRequests q, const __grid_constant__ AppendTarget<Bits> k,
                             const __grid_constant__ AppendTarget<Bits> v) {
  const AppendTarget<Bits>& t = blockIdx.z == 0 ? k : v;
  const int64_t row = int64_t(blockIdx.x) * kAppendWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const Destination dest = locate(q, row);
  if (!dest.valid) return;
  const Bits* src = t.src + row * t.src_stride;
  Bits* dst = t.cache + dest.index0 * t.cache_stride0 + dest.position * t.cache_stride1;
  if constexpr (kVector) {
    constexpr int kPack = 16 / static_cast<int>(sizeof(Bits));
    for (int32_t c = lane * kPack; c < t.width; c += 32 * kPack) {
      *reinterpret_cast<uint4*>(dst + c) = __ldg(reinterpret_cast<const uint4*>(src + c));
    }
  } else {
    for (int32_t c = lane; c < t.width; c += 32) dst[c] = src[c];
  }
}

// Paged caches (num_pages, width, page_size): a 32 x 32 tile of rows x columns of keys (blockIdx.z 0) or values (1)
// is read along rows of src and written along the token axis of the pages, where consecutive rows of a request
// are consecutive slots.
template <typename Bits>
__global__ void __launch_bounds__(kPagedTile* kPagedThreadRows)
    append_paged_kernel(const __grid_constant__ AppendRequests q, const __grid_constant__ AppendTarget<Bits> k,
                        const __grid_constant__ AppendTarget<Bits> v) {
  const AppendTarget<Bits>& t = blockIdx.z == 0 ? k : v;
  const int64_t row0 = int64_t(blockIdx.x) * kPagedTile;
  const int32_t column0 = blockIdx.y * kPagedTile;
  if (column0 >= t.width) return;  // the narrower of keys and values has fewer column tiles: the whole CTA leaves
  // One element of padding per line: the column-wise reads of the write phase hit 32 different banks.
  __shared__ Bits tile[kPagedTile][kPagedTile + 1];
  for (int r = threadIdx.y; r < kPagedTile; r += kPagedThreadRows) {
    const int64_t row = row0 + r;
    const int32_t column = column0 + threadIdx.x;
    if (row < q.rows && column < t.width) tile[r][threadIdx.x] = t.src[row * t.src_stride + column];
  }
  __syncthreads();
  const Destination dest = locate(q, row0 + threadIdx.x);
  if (!dest.valid) return;
  Bits* page = t.cache + dest.index0 * t.cache_stride0 + dest.position;
  for (int c = threadIdx.y; c < kPagedTile; c += kPagedThreadRows) {
    const int32_t column = column0 + c;
    if (column < t.width) page[int64_t(column) * t.cache_stride1] = tile[threadIdx.x][c];
  }
}

// One of the two quantizations of a launch (blockIdx.z: 0 = keys, 1 = values): rows of T into one-byte codes and a
// float32 scale per KV head (fdc/kv_format.h).
template <typename T>
struct QuantizeTarget {
  const T* src;           // (T, width), unit-stride rows
  int64_t src_stride;     // elements between rows of src
  uint8_t* cache;         // contiguous (B, S_max, width + 4 H_kv) or paged (num_pages, width + 4 H_kv, page_size) bytes
  int64_t cache_stride0;  // bytes between requests (contiguous) or pages (paged)
  int64_t cache_stride1;  // bytes between positions (contiguous); page_size when paged
  int32_t width;          // columns (= code bytes of a row): qk_offsets[-1] or v_offsets[-1]
  int32_t offsets[kMaxQuantizedKvHeads + 1];  // (H_kv + 1) prefix sums of the head widths
};

// Quantizing appends: warp w of the CTA writes row blockIdx.x * kAppendWarps + w of keys (blockIdx.z 0) or values
// (1), one KV head after another: the lanes take the head's columns, agree on its largest magnitude and whether it is
// finite by shuffles, then write its codes and its scale. A contiguous row is (codes, scales); a page is (code byte
// rows, then H_kv runs of page_size scales), each code at its column's byte row and the row's slot.
template <typename T>
__global__ void __launch_bounds__(kAppendWarps * 32)
    append_quantized_kernel(const __grid_constant__ AppendRequests q, const __grid_constant__ QuantizeTarget<T> k,
                            const __grid_constant__ QuantizeTarget<T> v, int32_t num_kv_heads, KvFormat format) {
  const QuantizeTarget<T>& t = blockIdx.z == 0 ? k : v;
  const int64_t row = int64_t(blockIdx.x) * kAppendWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const Destination dest = locate(q, row);
  if (!dest.valid) return;
  const T* src = t.src + row * t.src_stride;
  // Column c's code at codes[c * stride], KV head j's scale at scales[j * stride] (4-byte aligned:
  // check_vector_aligned): a contiguous row holds both side by side, a page one byte row per column and then one run
  // of page_size scales per KV head.
  uint8_t* const first = t.cache + dest.index0 * t.cache_stride0;  // the request's rows, or the page
  const bool paged = q.block_table != nullptr;
  uint8_t* const codes = first + (paged ? dest.position : dest.position * t.cache_stride1);
  float* const scales =
      reinterpret_cast<float*>(paged ? first + kv_page_scale_offset(t.width, q.page_size, 0, dest.position)
                                     : codes + kv_row_scale_offset(t.width, 0));
  const int64_t stride = paged ? q.page_size : 1;
  const float code_max = kv_code_max(format);
  for (int j = 0; j < num_kv_heads; ++j) {
    const int c0 = t.offsets[j], c1 = t.offsets[j + 1];
    float largest = 0.f;
    bool finite = true;
    for (int c = c0 + lane; c < c1; c += 32) {
      const float x = to_float(src[c]);
      finite = finite && isfinite(x);
      largest = fmaxf(largest, fabsf(x));
    }
    finite = __all_sync(0xffffffffu, finite);
#pragma unroll
    for (int m = 16; m > 0; m /= 2) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, m));
    const float scale = finite ? __fdiv_rn(largest, code_max) : NAN;
    const bool codes_of_zero = !finite || scale == 0.f;  // scale 0: all zeros, or magnitudes below code_max * 2^-149
    for (int c = c0 + lane; c < c1; c += 32) {
      codes[c * stride] = codes_of_zero ? uint8_t(0) : float_to_code(__fdiv_rn(to_float(src[c]), scale), format);
    }
    if (lane == 0) scales[j * stride] = scale;
  }
}

// src (T, width) with unit-stride rows; cache (B, S_max, width) or (num_pages, width, page_size).
template <typename Bits>
AppendTarget<Bits> target(const at::Tensor& src, at::Tensor& cache, int64_t width) {
  AppendTarget<Bits> t;
  t.src = static_cast<const Bits*>(src.data_ptr());
  t.src_stride = src.stride(0);
  t.cache = static_cast<Bits*>(cache.data_ptr());
  t.cache_stride0 = cache.stride(0);
  t.cache_stride1 = cache.stride(1);
  t.width = static_cast<int32_t>(width);
  return t;
}

// src (T, width) with unit-stride rows; a quantized cache (B, S_max, width + 4 H_kv) or (num_pages, width + 4 H_kv,
// page_size) of one-byte codes; offsets (H_kv + 1) the layout's prefix sums.
template <typename T>
QuantizeTarget<T> quantize_target(const at::Tensor& src, at::Tensor& cache, const std::vector<int32_t>& offsets) {
  QuantizeTarget<T> t;
  t.src = static_cast<const T*>(src.data_ptr());
  t.src_stride = src.stride(0);
  t.cache = static_cast<uint8_t*>(cache.data_ptr());
  t.cache_stride0 = cache.stride(0);
  t.cache_stride1 = cache.stride(1);
  t.width = offsets.back();
  std::copy(offsets.begin(), offsets.end(), t.offsets);
  return t;
}

template <typename Bits>
bool vectorizable(const AppendTarget<Bits>& t) {
  constexpr int64_t kPack = 16 / sizeof(Bits);
  return is_aligned16(t.src) && is_aligned16(t.cache) && t.src_stride % kPack == 0 && t.cache_stride0 % kPack == 0 &&
         t.cache_stride1 % kPack == 0 && t.width % kPack == 0;
}

template <typename Bits>
void launch_append(const AppendRequests& q, const AppendTarget<Bits>& k, const AppendTarget<Bits>& v, bool paged,
                   cudaStream_t stream) {
  if (paged) {
    const dim3 grid(static_cast<uint32_t>(ceil_div(q.rows, kPagedTile)),
                    static_cast<uint32_t>(ceil_div(std::max(k.width, v.width), kPagedTile)), 2);
    append_paged_kernel<Bits><<<grid, dim3(kPagedTile, kPagedThreadRows), 0, stream>>>(q, k, v);
  } else {
    const dim3 grid(static_cast<uint32_t>(ceil_div(q.rows, kAppendWarps)), 1, 2);
    if (vectorizable(k) && vectorizable(v)) {
      append_contiguous_kernel<Bits, true><<<grid, kAppendWarps * 32, 0, stream>>>(q, k, v);
    } else {
      append_contiguous_kernel<Bits, false><<<grid, kAppendWarps * 32, 0, stream>>>(q, k, v);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// k_cache, v_cache (B, S_max, W) or paged (num_pages, W, page_size), written in place; k (T, qk_offsets[-1]),
// v (T, v_offsets[-1]); cu_seqlens (B + 1), cache_seqlens (B) and block_table (B, max_pages) int32 on the caches'
// device; qk_offsets, v_offsets (H_kv + 1) int32 on the CPU.
void append_kv_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& cu_seqlens, const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets,
                    const at::Tensor& v_offsets, const std::optional<at::Tensor>& block_table) {
  const char* op = "append_kv";
  const checks::AppendShape shape = checks::check_append_kv(op, k_cache, v_cache, k, v, cu_seqlens, cache_seqlens,
                                                            qk_offsets, v_offsets, block_table);
  checks::check_cuda_cache_format(op, shape.cache.format, "k_cache", k_cache, "k", k);
  checks::check_cuda_tensor(op, "k_cache", k_cache);
  const bool quantized = shape.cache.format != KvFormat::kFloat;
  if (quantized) {
    checks::check_vector_aligned(op, "k_cache", k_cache, block_table.has_value());
    checks::check_vector_aligned(op, "v_cache", v_cache, block_table.has_value());
    FDC_CHECK(shape.layout.num_kv_heads() <= kMaxQuantizedKvHeads, op, "the CUDA kernel quantizes at most ",
              kMaxQuantizedKvHeads, " KV heads but qk_offsets has ", shape.layout.num_kv_heads());
  }
  checks::check_same_device(op, "cu_seqlens", cu_seqlens, "k_cache", k_cache);
  checks::check_same_device(op, "cache_seqlens", cache_seqlens, "k_cache", k_cache);
  const int64_t rows = k.size(0);
  FDC_CHECK(ceil_div(rows, kAppendWarps) <= INT32_MAX, op, "k has ", rows, " rows, more than one launch can cover");
  if (rows == 0 || shape.batch == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());

  const at::Tensor cu = cu_seqlens.contiguous();
  const at::Tensor seqlens = cache_seqlens.contiguous();
  const bool paged = block_table.has_value();
  const at::Tensor table = paged ? checks::unit_last_stride(*block_table) : at::Tensor();
  AppendRequests q;
  q.cu_seqlens = cu.data_ptr<int32_t>();
  q.cache_seqlens = seqlens.data_ptr<int32_t>();
  q.block_table = paged ? table.data_ptr<int32_t>() : nullptr;
  q.block_table_stride = paged ? table.stride(0) : 0;
  q.batch = static_cast<int32_t>(shape.batch);
  q.rows = rows;
  q.capacity = shape.cache.capacity;
  q.page_size = shape.cache.paged.page_size;
  q.num_pages = shape.cache.paged.num_pages;

  const at::Tensor k_rows = checks::unit_last_stride(k);
  const at::Tensor v_rows = checks::unit_last_stride(v);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (quantized) {
    // Rows of half precision (float32 ones were refused by check_cuda_cache_format); T is a template parameter here so
    // that no float32 kernel is instantiated.
    const auto quantize = [&]<typename T>() {
      if constexpr (std::is_same_v<T, float>) {
        TORCH_INTERNAL_ASSERT(false, "fdc::append_kv: float32 rows into a quantized cache were let through");
      } else {
        const dim3 grid(static_cast<uint32_t>(ceil_div(rows, kAppendWarps)), 1, 2);
        append_quantized_kernel<T><<<grid, kAppendWarps * 32, 0, stream>>>(
            q, quantize_target<T>(k_rows, k_cache, shape.layout.qk_offsets),
            quantize_target<T>(v_rows, v_cache, shape.layout.v_offsets),
            static_cast<int32_t>(shape.layout.num_kv_heads()), shape.cache.format);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    };
    FDC_DISPATCH_FLOAT_TYPES(k.scalar_type(), "fdc::append_kv", [&] { quantize.template operator()<scalar_t>(); });
    return;
  }
  // A copy moves bits: 2-byte types (float16, bfloat16) and 4-byte float32 share the kernels of their size.
  switch (k_cache.element_size()) {
    case 2:
      launch_append<uint16_t>(q, target<uint16_t>(k_rows, k_cache, shape.layout.qk_width()),
                              target<uint16_t>(v_rows, v_cache, shape.layout.v_width()), paged, stream);
      break;
    case 4:
      launch_append<uint32_t>(q, target<uint32_t>(k_rows, k_cache, shape.layout.qk_width()),
                              target<uint32_t>(v_rows, v_cache, shape.layout.v_width()), paged, stream);
      break;
    default: FDC_CHECK(false, op, "k_cache elements of ", k_cache.element_size(), " bytes have no copy kernel");
  }
}

}  // namespace fdc::cuda

TORCH_LIBRARY_IMPL(fdc, CUDA, m) { m.impl("append_kv", &fdc::cuda::append_kv_cuda); }
