// fdc::append_kv on the CPU: copies each request's new K/V rows after its current cache rows. Every destination is
// validated before the first write, so a bad request leaves the caches untouched.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "cpu/cpu_common.h"

namespace fdc::cpu {
namespace {

// Copies rows [row0, row0 + n) of src (T, width) to positions [pos0, pos0 + n) of one request's contiguous cache.
template <typename T>
void append_contiguous(const T* src, int64_t src_ld, T* cache, int64_t cache_ld, int64_t width, int64_t n) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(cache + i * cache_ld, src + i * src_ld, width * sizeof(T));
}

// Scatters row `src` (width) to position `slot` of a dim-major page (width, page_size).
template <typename T>
void append_paged_row(const T* src, T* page, int64_t width, int64_t page_size, int64_t slot) {
  for (int64_t c = 0; c < width; ++c) page[c * page_size + slot] = src[c];
}

}  // namespace

void append_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& cu_seqlens, const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets,
                   const at::Tensor& v_offsets, const std::optional<at::Tensor>& block_table) {
  const char* op = "append_kv";
  const checks::AppendShape shape = checks::check_append_kv(op, k_cache, v_cache, k, v, cu_seqlens, cache_seqlens,
                                                            qk_offsets, v_offsets, block_table);
  const checks::HostLayout& layout = shape.layout;
  const int64_t batch = shape.batch;
  const std::vector<int32_t> cu = checks::read_cu_seqlens(op, "cu_seqlens", cu_seqlens, batch, k.size(0), "k");
  const checks::PagedCache& paged = shape.cache.paged;
  const int64_t capacity = shape.cache.capacity;
  std::vector<int32_t> table;
  if (block_table) {
    const at::Tensor t = block_table->contiguous();
    table.assign(t.data_ptr<int32_t>(), t.data_ptr<int32_t>() + t.numel());
  }
  const std::vector<int32_t> pos = checks::read_cache_seqlens(op, cache_seqlens, batch, capacity);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t end = int64_t(pos[b]) + cu[b + 1] - cu[b];
    FDC_CHECK(end <= capacity, op, "request ", b, " would grow to ", end, " rows (cache_seqlens ", pos[b], " + ",
              cu[b + 1] - cu[b], " new) past the cache capacity ", capacity, "; nothing was written");
    if (block_table && end > pos[b]) {
      const int64_t first = pos[b] / paged.page_size, last = (end - 1) / paged.page_size;
      checks::check_block_table_entries(op, table.data() + b * paged.max_pages + first, b, last - first + 1,
                                        paged.num_pages);
    }
  }

  const at::Tensor kc = checks::unit_last_stride(k);
  const at::Tensor vc = checks::unit_last_stride(v);
  FDC_DISPATCH_FLOAT_TYPES(k_cache.scalar_type(), "fdc::append_kv", [&] {
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    scalar_t* kcp = k_cache.data_ptr<scalar_t>();
    scalar_t* vcp = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = cu[b + 1] - cu[b];
        if (!block_table) {
          append_contiguous(kp + cu[b] * kc.stride(0), kc.stride(0),
                            kcp + b * k_cache.stride(0) + pos[b] * k_cache.stride(1), k_cache.stride(1),
                            layout.qk_width(), n);
          append_contiguous(vp + cu[b] * vc.stride(0), vc.stride(0),
                            vcp + b * v_cache.stride(0) + pos[b] * v_cache.stride(1), v_cache.stride(1),
                            layout.v_width(), n);
          continue;
        }
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = pos[b] + i;
          const int64_t page = table[b * paged.max_pages + t / paged.page_size], slot = t % paged.page_size;
          append_paged_row(kp + (cu[b] + i) * kc.stride(0), kcp + page * k_cache.stride(0), layout.qk_width(),
                           paged.page_size, slot);
          append_paged_row(vp + (cu[b] + i) * vc.stride(0), vcp + page * v_cache.stride(0), layout.v_width(),
                           paged.page_size, slot);
        }
      }
    });
  });
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("append_kv", &fdc::cpu::append_kv_cpu); }
