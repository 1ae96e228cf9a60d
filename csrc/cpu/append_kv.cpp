// fdc::append_kv on the CPU: copies each request's new K/V rows after its current cache rows. Every destination is
// validated before the first write, so a bad request leaves the caches untouched.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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

// Columns per task of the paged copy: 16 float32 columns are one 64-byte line of each source row, so a task reads
// whole lines of its rows and writes 16 runs of consecutive slots, one per column of the dim-major page.
constexpr int64_t kColumnTile = 16;

// n consecutive new rows of one request that land in one page: source rows [row, row + n), slots [slot, slot + n).
struct PageRun {
  int64_t row, page, slot, n;
};

// Columns [c0, c1) of rows src[0 .. n) (row stride src_ld) to slots [slot, slot + n) of a dim-major page
// (width, page_size): row by row, each row's columns to their own runs, so every column's run is written in order.
template <typename T>
void append_paged_tile(const T* src, int64_t src_ld, T* page, int64_t page_size, int64_t slot, int64_t n, int64_t c0,
                       int64_t c1) {
  for (int64_t i = 0; i < n; ++i) {
    const T* row = src + i * src_ld;
    T* dst = page + slot + i;
    for (int64_t c = c0; c < c1; ++c) dst[c * page_size] = row[c];
  }
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
      checks::check_block_table_entries(op, table.data() + b * paged.max_pages, b, first, last + 1, paged.num_pages);
    }
  }

  const at::Tensor kc = checks::unit_last_stride(k);
  const at::Tensor vc = checks::unit_last_stride(v);
  FDC_DISPATCH_FLOAT_TYPES(k_cache.scalar_type(), "fdc::append_kv", [&] {
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    scalar_t* kcp = k_cache.data_ptr<scalar_t>();
    scalar_t* vcp = v_cache.data_ptr<scalar_t>();
    if (!block_table) {
      at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n = cu[b + 1] - cu[b];
          append_contiguous(kp + cu[b] * kc.stride(0), kc.stride(0),
                            kcp + b * k_cache.stride(0) + pos[b] * k_cache.stride(1), k_cache.stride(1),
                            layout.qk_width(), n);
          append_contiguous(vp + cu[b] * vc.stride(0), vc.stride(0),
                            vcp + b * v_cache.stride(0) + pos[b] * v_cache.stride(1), v_cache.stride(1),
                            layout.v_width(), n);
        }
      });
      return;
    }
    // Paged: a page stores each column's slots contiguously, so rows are copied a page run and a column tile at a
    // time (a transpose) rather than row by row (which wrote one cache line per column for every row). Tasks are
    // (column tile, run), tile-major, so each thread gets a share of every run's columns: a prompt's runs and the
    // single-row runs of decodes in one step are spread over all threads alike.
    std::vector<PageRun> runs;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = pos[b], end = pos[b] + cu[b + 1] - cu[b]; t < end;) {
        const int64_t slot = t % paged.page_size, n = std::min(end - t, paged.page_size - slot);
        runs.push_back({cu[b] + t - pos[b], table[b * paged.max_pages + t / paged.page_size], slot, n});
        t += n;
      }
    }
    const int64_t num_runs = static_cast<int64_t>(runs.size());
    const int64_t k_tiles = (layout.qk_width() + kColumnTile - 1) / kColumnTile;
    const int64_t tiles = k_tiles + (layout.v_width() + kColumnTile - 1) / kColumnTile;
    at::parallel_for(0, tiles * num_runs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t tile = task / num_runs;
        const PageRun& run = runs[task % num_runs];
        if (tile < k_tiles) {
          const int64_t c0 = tile * kColumnTile, c1 = std::min<int64_t>(c0 + kColumnTile, layout.qk_width());
          append_paged_tile(kp + run.row * kc.stride(0), kc.stride(0), kcp + run.page * k_cache.stride(0),
                            paged.page_size, run.slot, run.n, c0, c1);
        } else {
          const int64_t c0 = (tile - k_tiles) * kColumnTile, c1 = std::min<int64_t>(c0 + kColumnTile, layout.v_width());
          append_paged_tile(vp + run.row * vc.stride(0), vc.stride(0), vcp + run.page * v_cache.stride(0),
                            paged.page_size, run.slot, run.n, c0, c1);
        }
      }
    });
  });
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("append_kv", &fdc::cpu::append_kv_cpu); }
