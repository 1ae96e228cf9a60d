// fdc::append_kv on the CPU: copies each request's new K/V rows after its current cache rows, quantizing them into
// an int8, float8_e4m3fn or int4 cache (fdc/kv_format.h). Every destination is validated before the first write, so a
// bad request leaves the caches untouched.
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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

// The code of x / scale (q, computed in float32): rounded to the nearest code, ties to even, within the format's range.
inline int8_t encode(float q, int8_t*) { return static_cast<int8_t>(std::nearbyint(std::clamp(q, -127.f, 127.f))); }
inline c10::Float8_e4m3fn encode(float q, c10::Float8_e4m3fn*) {
  return c10::Float8_e4m3fn(std::clamp(q, -448.f, 448.f));
}
inline int8_t encode(float q, Int4Pair*) { return static_cast<int8_t>(std::nearbyint(std::clamp(q, -7.f, 7.f))); }

// One row of `src` quantized (fdc/kv_format.h): KV head j's columns [offsets[j], offsets[j + 1]) to codes, element
// c / kColumnsPer<C> of them at codes[element * code_stride] (int4: two columns per byte), its scale (largest
// magnitude / kv_code_max) to scales[j * scale_stride]. A head holding a non-finite value gets a NaN scale (every
// element it gives back is NaN) and zero codes; an all-zero head scale 0.
template <typename C, typename T>
void quantize_row(const T* src, const int32_t* offsets, int64_t heads, KvFormat format, C* codes, int64_t code_stride,
                  float* scales, int64_t scale_stride) {
  const float code_max = kv_code_max(format);
  for (int64_t j = 0; j < heads; ++j) {
    float largest = 0.f;
    bool finite = true;
    for (int64_t c = offsets[j]; c < offsets[j + 1]; ++c) {
      const float x = to_float(src[c]);
      finite = finite && std::isfinite(x);
      largest = std::max(largest, std::abs(x));
    }
    const float scale = finite ? largest / code_max : std::numeric_limits<float>::quiet_NaN();
    scales[j * scale_stride] = scale;
    const bool codes_of_zero = !finite || scale == 0.f;  // scale 0: all zeros, or magnitudes below 7 * 2^-149
    const auto code = [&](int64_t c) {
      return codes_of_zero ? decltype(encode(0.f, static_cast<C*>(nullptr)))(0)
                           : encode(to_float(src[c]) / scale, static_cast<C*>(nullptr));
    };
    if constexpr (std::is_same_v<C, Int4Pair>) {
      for (int64_t c = offsets[j]; c < offsets[j + 1]; c += 2) {
        const uint8_t low = static_cast<uint8_t>(code(c)) & 0x0F, high = static_cast<uint8_t>(code(c + 1)) << 4;
        codes[(c / 2) * code_stride] = Int4Pair{static_cast<uint8_t>(low | high)};
      }
    } else {
      for (int64_t c = offsets[j]; c < offsets[j + 1]; ++c) codes[c * code_stride] = code(c);
    }
  }
}

// Rows quantized into an int8, float8_e4m3fn or int4 cache, each request's (contiguous) or each page run's (paged) rows
// by one task: a row's codes and scales (the data columns, then the scales: fdc/kv_format.h) are written together.
void append_quantized(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                      const std::vector<int32_t>& cu, const std::vector<int32_t>& pos,
                      const std::vector<int32_t>& table, const checks::AppendShape& shape) {
  const checks::HostLayout& layout = shape.layout;
  const KvFormat format = shape.cache.format;
  const int64_t heads = layout.num_kv_heads(), batch = shape.batch;
  const int64_t page_size = shape.cache.paged.page_size;
  const bool paged = page_size > 0;
  // (request, first new row, cache position, rows): a request's new rows, or those of one page run when paged.
  struct Run {
    int64_t b, row, t, n;
  };
  std::vector<Run> runs;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = pos[b], end = pos[b] + cu[b + 1] - cu[b]; t < end;) {
      const int64_t n = paged ? std::min(end - t, page_size - t % page_size) : end - t;
      runs.push_back({b, cu[b] + t - pos[b], t, n});
      t += n;
    }
  }
  const auto write = [&]<typename C, typename T>(at::Tensor& cache, const at::Tensor& rows, const int32_t* offsets,
                                                 int64_t layout_width, const Run& run) {
    const int64_t width = layout_width / kColumnsPer<C>;  // data elements of a row, or byte rows of a page
    C* base = reinterpret_cast<C*>(cache.data_ptr());
    const T* src = rows.data_ptr<T>() + run.row * rows.stride(0);
    for (int64_t i = 0; i < run.n; ++i, src += rows.stride(0)) {
      const int64_t t = run.t + i;
      if (paged) {
        C* page = base + table[run.b * shape.cache.paged.max_pages + t / page_size] * cache.stride(0);
        quantize_row(src, offsets, heads, format, page + t % page_size, page_size,
                     reinterpret_cast<float*>(page + kv_page_scale_offset(width, page_size, 0, t % page_size)),
                     page_size);
      } else {
        C* row = base + run.b * cache.stride(0) + t * cache.stride(1);
        quantize_row(src, offsets, heads, format, row, 1, reinterpret_cast<float*>(row + kv_row_scale_offset(width, 0)),
                     1);
      }
    }
  };
  FDC_DISPATCH_FLOAT_TYPES(k.scalar_type(), "fdc::append_kv", [&] {
    const auto run_all = [&]<typename C>() {
      at::parallel_for(0, int64_t(runs.size()), 1, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          write.template operator()<C, scalar_t>(k_cache, k, layout.qk_offsets.data(), layout.qk_width(), runs[r]);
          write.template operator()<C, scalar_t>(v_cache, v, layout.v_offsets.data(), layout.v_width(), runs[r]);
        }
      });
    };
    switch (format) {
      case KvFormat::kInt8: run_all.template operator()<int8_t>(); break;
      case KvFormat::kFp8E4M3: run_all.template operator()<c10::Float8_e4m3fn>(); break;
      case KvFormat::kInt4: run_all.template operator()<Int4Pair>(); break;
      case KvFormat::kFloat: TORCH_INTERNAL_ASSERT(false, "fdc::append_kv: a float cache is not quantized");
    }
  });
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
  if (shape.cache.format != KvFormat::kFloat) {
    append_quantized(k_cache, v_cache, kc, vc, cu, pos, table, shape);
    return;
  }
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
