// What both ways of the CPU decode (csrc/cpu/decode_attention.cpp) share: the caches as views, the problem's
// constants, the per-task result and its partials. Included by decode_attention.cpp only.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <memory>
#include <type_traits>

#include "checks.h"
#include "cpu/cpu_common.h"
#include "cpu/vec_math.h"
#include "fdc/attention_variant.h"
#include "fdc/kv_format.h"
#include "fdc/softmax_merge.h"

// Internal linkage, as when this was part of decode_attention.cpp (the only file that includes it): the compiler may
// inline and specialise these functions for their one caller.
namespace fdc::cpu::decode {
namespace {

// The longest block of keys of a piece (run_piece_avx512), the scores' leading dimension there, a multiple of 32
// (exp_sum_to_bf16 fills whole 32-value chunks): reached by contiguous caches of narrow layers (contiguous_block_rows).
constexpr int64_t kMaxBlockKeys = 512;
// The longest block of keys of a piece of a paged cache (paged_block_keys), whose page runs a piece lists per block.
constexpr int64_t kMaxPagedBlockKeys = 128;

// Degree of the exp polynomial (vec_avx512.h exp16) of the AVX-512 kernels: half-precision outputs are rounded to 8
// (bf16) or 11 (fp16) significant bits, far coarser than degree 4's 5e-5 relative error; float32 keeps degree 6.
template <typename T>
constexpr int kExpDegree = std::is_same_v<T, float> ? 6 : 4;

// A block of a float matrix: element (r, c) at data[r * stride + c].
struct FloatRows {
  const float* data;
  int64_t stride;
};

// One cache (K or V): contiguous (B, S_max, stored) or paged (num_pages, stored, page_size) with a block table, the
// `stored` elements being the `width` data elements, then, for a quantized cache, one float32 scale per KV head. A
// column is a layout column; an element of T holds kColumnsPer<T> of them (two for int4), so a head's columns
// [col, col + dim) are elements [col / kColumnsPer<T>, ...).
template <typename T>
struct CacheView {
  const T* data;
  int64_t stride0;             // between requests (contiguous) or pages (paged)
  int64_t stride1;             // between rows (contiguous); unused when paged
  const int32_t* block_table;  // (B, max_pages) when paged, else nullptr
  int64_t max_pages;
  int64_t page_size;
  int64_t width;   // data elements of a row, or data element rows of a page
  int64_t stored;  // elements of a row, or element rows of a page: kv_stored_width

  bool paged() const { return block_table != nullptr; }

  // The scale of (key t of request b, KV head j) of a quantized cache; the next key's is scale_stride() floats on,
  // within a block (a page, when paged).
  const float* scales(int64_t b, int64_t t, int64_t j) const {
    static_assert(sizeof(T) == 1, "a quantized cache's elements are bytes");
    if (paged()) {
      const T* page = data + block_table[b * max_pages + t / page_size] * stride0;
      return reinterpret_cast<const float*>(page + kv_page_scale_offset(width, page_size, j, t % page_size));
    }
    return reinterpret_cast<const float*>(data + b * stride0 + t * stride1 + kv_row_scale_offset(width, j));
  }
  int64_t scale_stride() const { return paged() ? 1 : stride1 / kKvScaleBytes; }

  // The scales of keys [t0, t1) of request b, KV head j, into out[0 .. t1 - t0) (a block: within one page when paged).
  void gather_scales(int64_t b, int64_t t0, int64_t t1, int64_t j, float* out) const {
    const float* s = scales(b, t0, j);
    const int64_t step = scale_stride();
    for (int64_t t = 0; t < t1 - t0; ++t) out[t] = s[t * step];
  }

  // Calls f(r0, r1) for each run [r0, r1) of keys [t0, t1) that lies in one page, in order: one call for the whole
  // range when contiguous.
  template <typename F>
  void for_each_run(int64_t t0, int64_t t1, F&& f) const {
    for (int64_t r0 = t0, r1; r0 < t1; r0 = r1) {
      r1 = paged() ? std::min(t1, (r0 / page_size + 1) * page_size) : t1;
      f(r0, r1);
    }
  }

  // Asks for the memory of keys [t0, t1) (a run: within one page when paged), columns [col, col + dim), ahead of use.
  // Contiguous caches put every row of a wide layer on its own 4 KiB page, where hardware prefetchers stop, so without
  // this each row of a block waits on DRAM in turn.
  void prefetch(int64_t b, int64_t t0, int64_t t1, int64_t col, int64_t dim) const {
    constexpr int64_t kLine = 64;  // bytes per cache line
    col /= kColumnsPer<T>, dim /= kColumnsPer<T>;
    const int64_t runs = paged() ? dim : t1 - t0;
    const int64_t run_bytes = (paged() ? t1 - t0 : dim) * static_cast<int64_t>(sizeof(T));
    const char* first = reinterpret_cast<const char*>(
        paged() ? data + block_table[b * max_pages + t0 / page_size] * stride0 + col * page_size + t0 % page_size
                : data + b * stride0 + t0 * stride1 + col);
    const int64_t run_stride = static_cast<int64_t>(sizeof(T)) * (paged() ? page_size : stride1);
    for (int64_t r = 0; r < runs; ++r)
      for (int64_t byte = 0; byte < run_bytes; byte += kLine) __builtin_prefetch(first + r * run_stride + byte);
  }

  // Element (key t, column col) of request b: within a block (a page, when paged) keys follow each other stride1
  // elements apart (1 when paged), columns col_stride() apart.
  const T* at(int64_t b, int64_t t, int64_t col) const {
    col /= kColumnsPer<T>;
    return paged() ? data + block_table[b * max_pages + t / page_size] * stride0 + col * page_size + t % page_size
                   : data + b * stride0 + t * stride1 + col;
  }
  int64_t col_stride() const { return paged() ? page_size : 1; }

  // Keys [t0, t1) of request b, columns [col, col + dim) (KV head j's), as float: token-major (t1 - t0 rows of dim)
  // when contiguous, column-major (dim rows of t1 - t0 tokens) when paged, the page's own order. Float caches are
  // read in place; half-precision ones are widened into `scratch`, quantized ones widened and scaled. The keys are a
  // run (for_each_run): within one page when paged.
  FloatRows block(int64_t b, int64_t t0, int64_t t1, int64_t j, int64_t col, int64_t dim, float* scratch) const {
    const T* src = at(b, t0, col);
    int64_t src_stride, rows, cols;
    if (paged()) {
      src_stride = page_size, rows = dim, cols = t1 - t0;
    } else {
      src_stride = stride1, rows = t1 - t0, cols = dim;
    }
    if constexpr (std::is_same_v<T, float>) {
      return {src, src_stride};
    } else if constexpr (std::is_same_v<T, Int4Pair>) {  // column c's code is nibble c % 2 of element c / 2
      const float* s = scales(b, t0, j);
      const int64_t step = scale_stride();
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const Int4Pair pair = paged() ? src[(r / 2) * src_stride + c] : src[r * src_stride + c / 2];
          scratch[r * cols + c] = static_cast<float>(pair.code(paged() ? r : c)) * s[(paged() ? c : r) * step];
        }
      }
      return {scratch, cols};
    } else if constexpr (kQuantized<T>) {
      const float* s = scales(b, t0, j);
      const int64_t step = scale_stride();
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          scratch[r * cols + c] = to_float(src[r * src_stride + c]) * s[(paged() ? c : r) * step];
        }
      }
      return {scratch, cols};
    } else {
      rows_to_float(src, src_stride, rows, cols, scratch);
      return {scratch, cols};
    }
  }
};

// A float buffer of n elements left uninitialised: every user writes what it reads first (the tests pass with these
// buffers filled with NaN), and zero-filling the task scratch (136 KiB per call when it always held the two widened
// blocks) cost more than a short decode task's own work.
inline std::unique_ptr<float[]> uninitialized_floats(int64_t n) { return std::unique_ptr<float[]>(new float[n]); }

struct Problem {
  const checks::HostLayout* layout;
  float scale;
  const int32_t* split_offsets;  // (B * H_kv + 1) from the plan
  float* partial_out;            // (num_tasks, G, max_v_dim) for split requests
  float* partial_lse;            // (num_tasks, G)
  int64_t max_v_dim;
  float softcap;       // logit soft-capping of the scaled scores, 0 for none (fdc/attention_variant.h)
  const float* sinks;  // (H_kv * G) sink logits, one per query head; nullptr for none
};

// Writes one task's result: the normalised output of each of the G query heads (times its sink's sink_factor, when it
// has one), or, when its request is split into chunks, the (output, log-sum-exp) partial for merge_splits, which
// applies the sink after the merge. acc (G, d_v) holds the unnormalised sums.
template <typename T>
void finish_task(const int32_t* record, const Problem& pb, const float* acc, const OnlineSoftmax* softmax, T* out,
                 int64_t out_ld) {
  const checks::HostLayout& layout = *pb.layout;
  const int64_t hkv = layout.num_kv_heads(), group = layout.group;
  const int64_t b = record[0] / hkv, j = record[0] % hkv, chunk = record[1];
  const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
  const HeadLayoutView view = layout.view();
  const int64_t bj = b * hkv + j;
  const bool split = pb.split_offsets[bj + 1] - pb.split_offsets[bj] > 1;
  for (int64_t i = 0; i < group; ++i) {
    const float inv = softmax[i].inverse_sum();
    if (split) {
      const int64_t slot = pb.split_offsets[bj] + chunk;
      float* po = pb.partial_out + (slot * group + i) * pb.max_v_dim;
      for (int64_t c = 0; c < dv; ++c) po[c] = acc[i * dv + c] * inv;
      pb.partial_lse[slot * group + i] = softmax[i].lse();
    } else {
      const float normalise = pb.sinks == nullptr ? inv : inv * sink_factor(softmax[i].lse(), pb.sinks[j * group + i]);
      T* oi = out + b * out_ld + view.o_column(static_cast<int32_t>(j * group + i));
      for (int64_t c = 0; c < dv; ++c) oi[c] = static_cast<T>(acc[i * dv + c] * normalise);
    }
  }
}

}  // namespace
}  // namespace fdc::cpu::decode
