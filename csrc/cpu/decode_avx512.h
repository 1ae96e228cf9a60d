// The CPU decode's AVX-512 way: one piece of keys of a request (include/fdc/decode_pieces.h) read block by block,
// whole, every KV head's query heads scored and accumulated on a block while it is in cache. Included by
// decode_attention.cpp only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu/decode_common.h"
#include "cpu/decode_read_ahead.h"
#include "cpu/vec_avx512.h"
#include "cpu/vec_avx512_axpy.h"
#include "cpu/vec_avx512_columns.h"
#include "cpu/vec_avx512_rows.h"
#include "cpu/vec_avx512_softmax.h"
#include "fdc/decode_pieces.h"

// Internal linkage, as when this was part of decode_attention.cpp (the only file that includes it): the compiler may
// inline and specialise these functions for their one caller.
namespace fdc::cpu::decode {
namespace {

// Per-thread state of run_piece_avx512: queries as float (G * W_qk, q's own order), the unnormalised outputs
// (G * W_v, the output's order), one online softmax per query head, the scores of one block for one KV head, a
// quantized cache's scales of one block (H_kv runs of kMaxBlockKeys: every KV head's for contiguous rows, gathered
// once per block; the first run only for pages; none for a float cache), and an int4 cache's codes of one block for one
// KV head unpacked to int8.
struct RowScratch {
  std::vector<float> q, acc, scores, key_scales, value_scales;
  std::vector<uint16_t> weights_bf16;  // scores' probabilities rounded to bf16, for axpy_rows_bf16
  std::vector<int16_t> q_int16;        // int8 pages' keys (axpy_rows_s8): q as int16, q = q_int16 * q_scale
  std::vector<float> q_scale;          // (H_kv * G)
  std::vector<int8_t> q_parts;         // integer rows (dot_rows_busd): q as two int8 parts, 2 kMaxHeadDim per head
  std::vector<int32_t> q_offsets;      // (H_kv * G): the codes' unsigned offset x each query head's sum
  std::vector<int16_t> weights_int16;  // int8 values (axpy_rows_s8, pages dot_columns_s8): w = w_int16 * w_scale
  std::vector<float> w_scale;          // (G)
  std::vector<OnlineSoftmax> softmax;
  std::unique_ptr<int8_t[]> key_codes, value_codes;  // int4 caches: (kMaxBlockKeys * kMaxHeadDim), written first
  RowScratch(int64_t group, int64_t qk_width, int64_t v_width, int64_t kv_heads, bool quantized, bool int4)
      : q(group * qk_width), acc(group * v_width), scores(group * kMaxBlockKeys),
        key_scales(quantized ? kv_heads * kMaxBlockKeys : 0),
        // q_int16: two codes spare, since a head of odd width's last pair load reads one code past it (multiplied by 0)
        value_scales(quantized ? kv_heads * kMaxBlockKeys : 0), weights_bf16(group * kMaxBlockKeys),
        q_int16(group * qk_width + 2), q_scale(kv_heads * group), q_parts(kv_heads * group * 2 * kMaxHeadDim),
        q_offsets(kv_heads * group), weights_int16(group * (kMaxBlockKeys + 1)), w_scale(group),
        softmax(kv_heads * group), key_codes(int4 ? new int8_t[kMaxBlockKeys * kMaxHeadDim] : nullptr),
        value_codes(int4 ? new int8_t[kMaxBlockKeys * kMaxHeadDim] : nullptr) {}
};

// An int4 cache's codes (fdc/kv_format.h) of one KV head in one block, unpacked to int8 for the int8 kernels: n
// token-major rows of dim codes (from rows `stride` bytes apart) into out (n x dim), or, paged, the block's runs of
// dim-major pages (dim / 2 byte rows, page_size apart, of each run's tokens) into out (dim rows of n, the block's
// token order).
FDC_AVX512 inline void unpack_int4_block(const Int4Pair* rows, int64_t stride, int64_t n, int64_t dim, int8_t* out) {
  for (int64_t t = 0; t < n; ++t) {
    avx512::unpack_int4_row(reinterpret_cast<const uint8_t*>(rows + t * stride), dim / 2, out + t * dim);
  }
}

// An integer cache's codes as the bytes its kernels read: int8 codes, or int4 codes two per byte.
inline const int8_t* int_bytes(const int8_t* codes) { return codes; }
inline const uint8_t* int_bytes(const Int4Pair* codes) { return reinterpret_cast<const uint8_t*>(codes); }

template <typename Runs>
FDC_AVX512 inline void unpack_int4_runs(const Runs& runs, const Int4Pair* const* starts, int64_t col, int64_t page_size,
                                        int64_t n, int64_t dim, int8_t* out) {
  for (int64_t s = 0; s < runs.count; ++s) {
    const uint8_t* run = reinterpret_cast<const uint8_t*>(starts[s] + (col / 2) * page_size);
    for (int64_t m = 0; m < dim / 2; ++m) {
      avx512::unpack_int4_columns(run + m * page_size, runs.len[s], out + 2 * m * n + runs.first[s],
                                  out + (2 * m + 1) * n + runs.first[s]);
    }
  }
}

// rows[i * ld + t] *= factors[t] (times row_factors[i] when given) for i < count, t < n.
FDC_AVX512 inline void scale_columns(float* rows, int64_t ld, int64_t count, const float* factors, int64_t n,
                                     const float* row_factors = nullptr) {
  for (int64_t i = 0; i < count; ++i) {
    float* row = rows + i * ld;
    const __m512 row_factor = _mm512_set1_ps(row_factors == nullptr ? 1.f : row_factors[i]);
    for (int64_t t = 0; t < n; t += avx512::kLanes) {
      const __mmask16 mask = avx512::lanes_mask(n - t);
      const __m512 factor = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, factors + t), row_factor);
      _mm512_mask_storeu_ps(row + t, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + t), factor));
    }
  }
}

// The largest magnitude of x[0 .. n) (0 when n is 0), or NaN where a value is not finite.
FDC_AVX512 inline float largest_magnitude(const float* x, int64_t n) {
  constexpr int kNonFinite = 0x99;  // vfpclassps: quiet or signalling NaN, +inf or -inf
  __m512 largest = _mm512_setzero_ps();
  __mmask16 non_finite = 0;
  for (int64_t c = 0; c < n; c += avx512::kLanes) {
    const __m512 v = _mm512_maskz_loadu_ps(avx512::lanes_mask(n - c), x + c);
    non_finite |= _mm512_fpclass_ps_mask(v, kNonFinite);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(v));
  }
  return non_finite != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(largest);
}

// The weights of one block (count rows of n, ld apart; non-negative: probabilities times value scales) as int16 codes,
// w = code * w_scale[i], w_scale[i] = row i's largest / 32767 (15 bits of the largest weight; the products are exact
// in axpy_rows_s8), each row zero-padded to an even length; a row holding a non-finite weight (a NaN value scale)
// gets a NaN scale, so its output is NaN as the float products would make it.
FDC_AVX512 inline void quantize_weights_int16(const float* w, int64_t ld, int64_t count, int64_t n, int16_t* codes,
                                              int64_t codes_ld, float* w_scale) {
  for (int64_t i = 0; i < count; ++i) {
    const float* row = w + i * ld;
    const float top = largest_magnitude(row, n);  // NaN where a weight is not finite
    w_scale[i] = top / 32767.f;
    const __m512 inverse = _mm512_set1_ps(top > 0.f ? 32767.f / top : 0.f);
    int16_t* out = codes + i * codes_ld;
    for (int64_t t = 0; t < n; t += avx512::kLanes) {  // round to nearest even (MXCSR's default), saturated
      const __mmask16 mask = avx512::lanes_mask(n - t);
      const __m512i code = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + t), inverse));
      _mm256_mask_storeu_epi16(out + t, mask, _mm512_cvtsepi32_epi16(code));
    }
    out[n] = 0;
  }
}

// The scale of a query head's dim values x for integer codes of at most largest_code in magnitude: the largest
// magnitude / largest_code (0 for an all-zero head), NaN where a value is not finite.
FDC_AVX512 inline float query_scale(const float* x, int64_t dim, float largest_code) {
  return largest_magnitude(x, dim) / largest_code;
}

// A query head's codes round(x / scale) (to nearest even, MXCSR's default, as std::nearbyint), clamped to
// [-largest, largest], 16 columns at a time: take(c, codes, mask) gets columns [c, c + 16) in lanes 0-15, zero past
// dim. scale > 0 and finite.
template <typename Take>
FDC_AVX512 inline void for_query_codes(const float* x, int64_t dim, float scale, int32_t largest, Take&& take) {
  const __m512 divisor = _mm512_set1_ps(scale);
  const __m512i high = _mm512_set1_epi32(largest), low = _mm512_set1_epi32(-largest);
  for (int64_t c = 0; c < dim; c += avx512::kLanes) {
    const __mmask16 mask = avx512::lanes_mask(dim - c);
    const __m512i code = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(mask, x + c), divisor));
    take(c, _mm512_maskz_mov_epi32(mask, _mm512_max_epi32(_mm512_min_epi32(code, high), low)), mask);
  }
}

// Each query head's dim columns of q (G * W_qk floats, query head h = j * G + i at G * offsets[j] + i * dim[j]) as
// int16 codes q_int16 = round(q / q_scale), q_scale = the head's largest magnitude / 32767 (0 for an all-zero head):
// 15 bits, far finer than the integer pages' keys they meet (axpy_rows_s8, axpy_nibble_rows). A head holding a
// non-finite value gets a NaN scale (its scores are NaN, as the float products would make them) and zero codes.
FDC_AVX512 inline void quantize_queries_int16(const float* q, const checks::HostLayout& layout, int16_t* q_int16,
                                              float* q_scale) {
  const int64_t group = layout.group;
  for (int64_t j = 0; j < layout.num_kv_heads(); ++j) {
    const int64_t dim = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
    for (int64_t i = 0; i < group; ++i) {
      const int64_t first = group * layout.qk_offsets[j] + i * dim;
      const float scale = query_scale(q + first, dim, 32767.f);
      q_scale[j * group + i] = scale;
      int16_t* codes = q_int16 + first;
      if (!(scale > 0.f)) {
        std::fill(codes, codes + dim, int16_t(0));
        continue;
      }
      for_query_codes(q + first, dim, scale, 32767, [&](int64_t c, __m512i code, __mmask16 mask) FDC_AVX512 {
        _mm256_mask_storeu_epi16(codes + c, mask, _mm512_cvtepi32_epi16(code));
      });
    }
  }
}

// Each query head's dim columns of q (as quantize_queries_int16 reads them) as 14-bit codes for the integer rows'
// vpdpbusd (dot_rows_busd), q = code * q_scale, q_scale = the head's largest magnitude / 16256, each code split into
// int8 parts code = 128 a + b (a = floor((code + 64) / 128) in [-127, 127], b in [-64, 63]): query head h = j * G +
// i's parts at q_parts + h * 2 kMaxHeadDim, 128 per 64 columns, the 64 a-parts first, then the 64 b-parts, each 64 in
// the order of a register of the codes (int8: the columns'; int4: the 32 even columns', then the 32 odd ones'), zero
// past the head; offsets[h] = the codes' unsigned offset (128 for int8, 8 for int4) x the sum of the head's codes.
// 14 bits, finer than the half-precision queries themselves near a head's largest; a head holding a non-finite value
// gets a NaN scale and zero codes. 16 columns at a time (a scalar loop with a division per column took 3-4% of an
// int8 decode's samples in perf, at bench_ops' layer B=4 x 2K).
FDC_AVX512 inline void split_queries_int14(const float* q, const checks::HostLayout& layout, bool int4, int8_t* q_parts,
                                           int32_t* offsets, float* q_scale) {
  constexpr int32_t kLargest = 127 * 128;  // a code's largest magnitude: a stays within int8 after rounding
  // int4: lanes 0-7 of a 16-column group's evens and odds (permutex2var over two groups: 32 columns)
  alignas(64) static constexpr int32_t kEven[avx512::kLanes] = {0,  2,  4,  6,  8,  10, 12, 14,
                                                                16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static constexpr int32_t kOdd[avx512::kLanes] = {1,  3,  5,  7,  9,  11, 13, 15,
                                                               17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i even = _mm512_load_si512(kEven), odd = _mm512_load_si512(kOdd);
  const int64_t group = layout.group;
  for (int64_t j = 0; j < layout.num_kv_heads(); ++j) {
    const int64_t dim = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
    for (int64_t i = 0; i < group; ++i) {
      const float* qh = q + group * layout.qk_offsets[j] + i * dim;
      const int64_t h = j * group + i;
      const float scale = query_scale(qh, dim, kLargest);
      q_scale[h] = scale;
      int8_t* parts = q_parts + h * 2 * kMaxHeadDim;
      std::fill(parts, parts + 2 * kMaxHeadDim, int8_t(0));
      offsets[h] = 0;
      if (!(scale > 0.f)) continue;
      __m512i sum = _mm512_setzero_si512(), previous = _mm512_setzero_si512();
      // The a- and b-parts of 16 codes (their columns' lanes) to bytes at `at` of the 64-column block holding c.
      const auto store = [&](int64_t c, int64_t at, __m512i code, __mmask16 mask) FDC_AVX512 {
        const __m512i upper = _mm512_srai_epi32(_mm512_add_epi32(code, _mm512_set1_epi32(64)), 7);  // floor
        int8_t* block = parts + (c / 64) * 128;
        _mm512_mask_cvtepi32_storeu_epi8(block + at, mask, upper);
        _mm512_mask_cvtepi32_storeu_epi8(block + 64 + at, mask, _mm512_sub_epi32(code, _mm512_slli_epi32(upper, 7)));
      };
      for_query_codes(qh, dim, scale, kLargest, [&](int64_t c, __m512i code, __mmask16 mask) FDC_AVX512 {
        sum = _mm512_add_epi32(sum, code);
        if (!int4) return store(c, c % 64, code, mask);
        // int4: columns 2m and 2m + 1 of a 64-column block at m and 32 + m; taken 32 columns (two groups) at a time
        if (c % 32 == 0 && c + avx512::kLanes < dim) {
          previous = code;
          return;
        }
        const __m512i first = c % 32 == 0 ? code : previous, second = c % 32 == 0 ? _mm512_setzero_si512() : code;
        const int64_t c0 = c - c % 32, half = (c0 % 64) / 2;
        store(c0, half, _mm512_permutex2var_epi32(first, even, second), 0xFFFF);
        store(c0, 32 + half, _mm512_permutex2var_epi32(first, odd, second), 0xFFFF);
      });
      offsets[h] = (int4 ? 8 : 128) * _mm512_reduce_add_epi32(sum);
    }
  }
}

// A contiguous quantized cache's scales of keys [t0, t0 + n) of request b, every KV head's: head j's n scales at out
// + j * ld. A row's scales follow its codes, the heads' side by side, so 16 rows' scales of up to 16 heads
// are 16 loads and one transpose in registers. Gathering each head's scales in turn took a strided scalar load per
// key and head, which perf put at 30% of run_piece's own samples (int8 rows, bench_ops' layer at B=4 x 2K).
template <typename C>
FDC_AVX512 inline void row_scales(const CacheView<C>& cache, int64_t b, int64_t t0, int64_t n, int64_t heads,
                                  float* out, int64_t ld) {
  const float* first = cache.scales(b, t0, 0);
  const int64_t step = cache.scale_stride();
  for (int64_t h0 = 0; h0 < heads; h0 += avx512::kLanes) {
    const __mmask16 columns = avx512::lanes_mask(heads - h0);
    const int64_t count = std::min<int64_t>(avx512::kLanes, heads - h0);
    for (int64_t r0 = 0; r0 < n; r0 += avx512::kLanes) {
      __m512i t[avx512::kLanes];
#pragma GCC unroll 16
      for (int64_t k = 0; k < avx512::kLanes; ++k) {
        const int64_t r = std::min(r0 + k, n - 1);  // a short last group repeats its final row (not stored)
        t[k] = _mm512_castps_si512(_mm512_maskz_loadu_ps(columns, first + r * step + h0));
      }
      avx512::transpose16x16_epi32(t);
      const __mmask16 rows = avx512::lanes_mask(n - r0);
      for (int64_t h = 0; h < count; ++h)
        _mm512_mask_storeu_ps(out + (h0 + h) * ld + r0, rows, _mm512_castsi512_ps(t[h]));
    }
  }
}

// A paged quantized cache's scales of keys [t0, t0 + n) of request b, KV head j, into out: its page runs'.
template <typename C>
inline void page_scales(const CacheView<C>& cache, const PageRuns<C>& runs, int64_t b, int64_t t0, int64_t j,
                        float* out) {
  for (int64_t s = 0; s < runs.count; ++s) {
    const int64_t first = t0 + runs.first[s];
    cache.gather_scales(b, first, first + runs.len[s], j, out + runs.first[s]);
  }
}

// One piece on AVX-512: blocks of contiguous_block_rows keys of a contiguous cache or paged_block_keys of a paged one
// (the runs of every page the block touches), each scored and accumulated for every KV head in turn, so a block (whole
// rows of a contiguous cache, runs of pages' columns) is read once for all heads. The next block is read ahead as the
// CPU's ReadAhead says: by a PrefetchStream that the kernels step through as they load the current block (each KV
// head's end catching up with its share), or by prefetcht1, its j-th share before KV head j. With AVX-512-BF16, bf16
// keys and values are multiplied without widening (dot_rows_bf16, axpy_rows_bf16). Products follow the cache's memory
// order: dot products along token-major rows, weighted row sums along a dim-major page's token runs. T: q's and the
// output's dtype; C: the caches', T or a quantized format's codes (fdc/kv_format.h), whose products are those of the
// codes: a key's scores are scaled by its scale after them, and each probability is scaled by its value's scale before
// the value sums.
template <typename T, typename C>
FDC_AVX512 void run_piece_avx512(const RowPiece& piece, const Problem& pb, const T* q, int64_t q_ld,
                                 const CacheView<C>& kc, const CacheView<C>& vc, T* out, int64_t out_ld, RowScratch& ws,
                                 bool bf16_dot, ReadAhead way, const RowPiece* following) {
  static_assert(std::is_same_v<T, C> || kQuantized<C>, "a float cache has q's dtype");
  const checks::HostLayout& layout = *pb.layout;
  const int64_t hkv = layout.num_kv_heads(), group = layout.group, b = piece.b;
  const int64_t qk_width = layout.qk_offsets[hkv];
  // Columns of a row (contiguous) or rows of a page (paged), with a quantized cache's scales: what is read ahead.
  const int64_t k_stored = kc.stored, v_stored = vc.stored;
  const T* qb = q + b * q_ld;
  // float32 queries: the key scores come out scaled, so each is rounded about once, not as a sum and again as it is
  // scaled: a paged score is summed in float64 and scaled there (avx512::axpy_tile_f64 says why), a contiguous float32
  // row's takes the queries scaled, as the portable kernel does (not a quantized row's, whose scores are scaled by
  // the keys' scales after them: there scaled queries, rounded once more, cost accuracy).
  constexpr bool kFloat64Scores = std::is_same_v<T, float>;
  const bool scaled_queries = kFloat64Scores && !kc.paged() && std::is_same_v<C, float>;
  const bool scaled = kFloat64Scores && (kc.paged() || scaled_queries);
  const float query_scale = scaled_queries ? pb.scale : 1.f;
  for (int64_t c = 0; c < group * qk_width; ++c) ws.q[c] = to_float(qb[c]) * query_scale;
  // Integer rows of a contiguous cache with half-precision queries: the scores by vpdpbusd, four exact products per
  // lane and instruction, on the codes made unsigned as they are loaded (never widened) against the queries as 14-bit
  // codes split in two int8 parts (dot_rows_busd); the value sums by vpdpwssd against the weights as int16 codes
  // (int8: axpy_rows_s8, rows widened to int16 and interleaved in pairs; int4: axpy_rows_s4, two rows' bytes
  // interleaved and each nibble sign-extended in place). The queries' 14 bits and the weights' 15 are finer than
  // half-precision queries (8 or 11 bits) and than the bf16 weights of the bf16 path; float32 queries keep the float
  // products, as the tests hold them to float32's accuracy. Widening each int8 code to float took an FMA per product
  // and head: 1.08-1.13x the bf16 cache's speed against 1.32-1.33x by vpdpwssd on both sides (bench_ops --phase
  // quantized, B=4 x 8K and B=8 x 16K, bf16, 2-core Intel Xeon); bench/results/ops/README.md has the steps since.
  //
  // int8 pages (dim-major) take int16 queries and weights: a page's columns are its rows for the key scores
  // (axpy_rows_s8, two columns interleaved per vpdpwssd, as the bf16 pages' axpy_rows_bf16), and its token runs are
  // paired along the tokens for the value sums (dot_columns_s8). int4 pages too, read packed: a byte row's byte is one
  // token's pair of columns, the int16 pair vpdpwssd takes against a query pair (axpy_nibble_rows), and 32 bytes of it
  // are two columns' 32 tokens for the value sums (dot_columns_s8 on uint8_t codes). Where the int8 kernels widen codes
  // to float (float32 queries), int4 codes are unpacked to int8 per KV head and block first (unpack_int4_block,
  // unpack_int4_runs).
  //
  // e4m3 codes with bf16 queries take the bf16 cache's kernels (vdpbf16ps on bf16 pairs), each register of codes
  // converted to bf16 exactly as it is loaded (load32_bf16), the weights rounded to bf16 after their value scales;
  // widening to float took an FMA per 16 products and head (bench/results/ops/README.md, "Quantized caches").
  constexpr bool kInt4 = std::is_same_v<C, Int4Pair>;
  constexpr bool kIntCodes = std::is_same_v<C, int8_t> || kInt4;
  const bool integer_rows = kIntCodes && !std::is_same_v<T, float> && bf16_dot && !kc.paged();
  const bool integer_pages = kIntCodes && !std::is_same_v<T, float> && bf16_dot && kc.paged();
  constexpr bool kBf16Cache = std::is_same_v<C, c10::BFloat16>;
  constexpr bool kE4m3 = std::is_same_v<C, c10::Float8_e4m3fn>;
  constexpr bool kBf16Rows = kBf16Cache || (kE4m3 && std::is_same_v<T, c10::BFloat16>);  // rows for vdpbf16ps
  const bool bf16_rows = kBf16Rows && bf16_dot;
  if (integer_rows) {
    split_queries_int14(ws.q.data(), layout, kInt4, ws.q_parts.data(), ws.q_offsets.data(), ws.q_scale.data());
  } else if (integer_pages) {
    quantize_queries_int16(ws.q.data(), layout, ws.q_int16.data(), ws.q_scale.data());
  }
  std::fill(ws.acc.begin(), ws.acc.end(), 0.f);
  std::fill(ws.softmax.begin(), ws.softmax.end(), OnlineSoftmax{});
  float* scores = ws.scores.data();

  const auto block_keys = [&](const RowPiece& of) {
    return kc.paged() ? paged_block_keys(way, kc.page_size, int64_t(sizeof(C)))
                      : contiguous_block_rows(way, (k_stored + v_stored) * int64_t(sizeof(C)), of.t1 - of.t0);
  };
  const int64_t rows = block_keys(piece);
  const int64_t col_stride = kc.col_stride();
  // Value sums over bf16 pages by vdpbf16ps (dot_columns_tile_bf16) where a page's column fills a 32-token register,
  // and for 16-token pages two columns per register (dot_columns_page16_bf16); pages of 17 to 31 tokens keep
  // widening, whose cost their half-filled registers would exceed (bench/results/ops/README.md, "CPU decode").
  const bool bf16_pages = bf16_rows && vc.paged() && (vc.page_size >= 32 || vc.page_size == 16);
  // Key scores of bf16 pages without widening: pages of 32 tokens or more by axpy_rows_bf16 (two columns interleaved,
  // one vdpbf16ps per pair of columns and head), pages of 16 by dot_page16_bf16 (two columns in one load); both
  // faster than widening (bench/results/ops/README.md, "CPU decode"). The runs of a 16-token page start at its
  // first token: pieces start at page starts (cut_rows) and blocks are whole pages (paged_block_keys).
  const bool bf16_key_pages = bf16_rows && kc.paged();
  const bool bf16_weights = vc.paged() ? bf16_pages : bf16_rows;
  PageRuns<C> runs[2];  // paged: the block's and the next block's runs, by turns
  if (kc.paged()) runs[0].assign(kc, vc, b, piece.t0, std::min(piece.t1, piece.t0 + rows));
  const C* run_values[kMaxPagedBlockKeys];         // one KV head's value columns in each run of the block
  const uint8_t* value_bytes[kMaxPagedBlockKeys];  // int4 pages: one KV head's first value byte row in each run
  BlockBytes<2 * kMaxPagedBlockKeys> next_bytes;   // kStream: the next block's ranges
  for (int64_t t0 = piece.t0, turn = 0; t0 < piece.t1; turn ^= 1) {
    const int64_t t1 = std::min(piece.t1, t0 + rows), n = t1 - t0;
    // The block read ahead: the piece's next, or after its last the first block of the piece this thread runs next
    // (`following`), so that only a thread's first piece starts on a block nobody asked for.
    int64_t next_b = b, next_t0 = t1, next = std::min(piece.t1, t1 + rows) - t1;
    if (next == 0 && following != nullptr) {
      next_b = following->b, next_t0 = following->t0;
      next = std::min(following->t1 - following->t0, block_keys(*following));
    }
    const PageRuns<C>& here = runs[turn];
    PageRuns<C>& ahead = runs[turn ^ 1];
    if (kc.paged()) ahead.assign(kc, vc, next_b, next_t0, next_t0 + next);
    next_bytes.count = 0;
    if (way != ReadAhead::kPrefetchL2 && next > 0) {
      if (kc.paged()) {
        next_bytes.add_runs(ahead, kc.page_size, k_stored, v_stored);
        if (way == ReadAhead::kLoads) read_ahead_interleaved(next_bytes);
      } else if (way == ReadAhead::kLoads) {
        BlockBytes<2> rows_ahead;
        rows_ahead.add_rows(kc, next_b, next_t0, next, k_stored);
        rows_ahead.add_rows(vc, next_b, next_t0, next, v_stored);
        read_ahead_interleaved(rows_ahead);
      } else {
        next_bytes.add_rows(kc, next_b, next_t0, next, k_stored);
        next_bytes.add_rows(vc, next_b, next_t0, next, v_stored);
      }
    }
    avx512::PrefetchStream stream = way == ReadAhead::kStream ? next_bytes.stream() : avx512::PrefetchStream{};
    // Keys before the sliding window that this block reads (its first block's, cut_rows): fewer than the block holds,
    // so its largest score is finite, and their -inf scores give weights of exactly 0.
    const int64_t masked = std::max<int64_t>(0, piece.visible - t0);
    if constexpr (kQuantized<C>) {
      if (!kc.paged()) {
        row_scales(kc, b, t0, n, hkv, ws.key_scales.data(), kMaxBlockKeys);
        row_scales(vc, b, t0, n, hkv, ws.value_scales.data(), kMaxBlockKeys);
      }
    }
    for (int64_t j = 0; j < hkv; ++j) {
      if (way == ReadAhead::kPrefetchL2) {
        if (kc.paged()) {
          prefetch_runs_share(ahead, kc.page_size, k_stored, v_stored, j, hkv);
        } else {
          prefetch_rows_share(kc, kc.at(next_b, next_t0, 0), next, j, hkv);
          prefetch_rows_share(vc, vc.at(next_b, next_t0, 0), next, j, hkv);
        }
      }
      const int64_t k_col = layout.qk_offsets[j], v_col = layout.v_offsets[j];
      const int64_t dq = layout.qk_offsets[j + 1] - k_col, dv = layout.v_offsets[j + 1] - v_col;
      float* acc = ws.acc.data() + group * v_col;
      OnlineSoftmax* softmax = ws.softmax.data() + j * group;
      const float* qj = ws.q.data() + group * k_col;  // the G query heads of KV head j, dq apart
      if (kc.paged()) {  // each run's keys are dq columns of consecutive tokens: scores = sum_c q[c] K[c]
        for (int64_t i = 0; i < group; ++i) std::fill(scores + i * kMaxBlockKeys, scores + i * kMaxBlockKeys + n, 0.f);
        const uint16_t* q_bf16 = reinterpret_cast<const uint16_t*>(qb + group * k_col);  // read as bf16 only
        if constexpr (kInt4) {
          if (integer_pages) {  // each run's byte rows read packed (axpy_nibble_rows)
            for (int64_t s = 0; s < here.count; ++s) {
              value_bytes[s] = int_bytes(here.v[s] + (v_col / 2) * col_stride);
              avx512::axpy_nibble_rows(ws.q_int16.data() + group * k_col, dq, ws.q_scale.data() + j * group, group,
                                       int_bytes(here.k[s] + (k_col / 2) * col_stride), col_stride, dq, here.len[s],
                                       scores + here.first[s], kMaxBlockKeys, stream);
            }
          } else {  // float32 queries: the block's codes as dq rows of n, one product over all runs, in float64 sums
            unpack_int4_runs(here, here.k, k_col, kc.page_size, n, dq, ws.key_codes.get());
            avx512::axpy_rows<kFloat64Scores>(qj, dq, group, ws.key_codes.get(), n, dq, n, scores, kMaxBlockKeys,
                                              stream, pb.scale);
          }
        } else {
          for (int64_t s = 0; s < here.count; ++s) {
            run_values[s] = here.v[s] + v_col * col_stride;
            const C* keys = here.k[s] + k_col * col_stride;
            float* run_scores = scores + here.first[s];
            if constexpr (std::is_same_v<C, int8_t>) {
              if (integer_pages) {  // scores of the run's tokens, the query scales applied
                avx512::axpy_rows_s8(ws.q_int16.data() + group * k_col, dq, ws.q_scale.data() + j * group, group, keys,
                                     col_stride, dq, here.len[s], run_scores, kMaxBlockKeys, stream);
                continue;
              }
            }
            if constexpr (kBf16Rows) {
              if (bf16_key_pages && kc.page_size == 16) {
                avx512::dot_page16_bf16(q_bf16, dq, group, keys, dq, here.len[s], run_scores, kMaxBlockKeys, stream);
                continue;
              }
              if (bf16_key_pages) {
                avx512::axpy_rows_bf16(q_bf16, dq, group, keys, col_stride, dq, here.len[s], run_scores, kMaxBlockKeys,
                                       stream);
                continue;
              }
            }
            // float32 queries: the scores summed in float64 (axpy_tile_f64 says why)
            avx512::axpy_rows<kFloat64Scores>(qj, dq, group, keys, col_stride, dq, here.len[s], run_scores,
                                              kMaxBlockKeys, stream, pb.scale);
          }
        }
      } else {  // keys are n rows of dq: one dot product per (query head, key)
        const C* keys = kc.at(b, t0, k_col);
        if constexpr (kIntCodes) {
          if (integer_rows) {
            avx512::dot_rows_busd(ws.q_parts.data() + j * group * 2 * kMaxHeadDim, 2 * kMaxHeadDim,
                                  ws.q_offsets.data() + j * group, group, int_bytes(keys), kc.stride1, n,
                                  kInt4 ? dq / 2 : dq, scores, kMaxBlockKeys, stream);
          } else {
            const int8_t* codes = reinterpret_cast<const int8_t*>(keys);
            int64_t codes_stride = kc.stride1;
            if constexpr (kInt4) {
              unpack_int4_block(keys, kc.stride1, n, dq, ws.key_codes.get());
              codes = ws.key_codes.get(), codes_stride = dq;
            }
            avx512::dot_rows(qj, dq, group, codes, codes_stride, n, dq, scores, kMaxBlockKeys);
          }
        } else if constexpr (kBf16Rows) {
          if (bf16_rows) {
            avx512::dot_rows_bf16(reinterpret_cast<const uint16_t*>(qb + group * k_col), dq, group, keys, kc.stride1, n,
                                  dq, scores, kMaxBlockKeys, stream);
          } else {
            avx512::dot_rows(qj, dq, group, keys, kc.stride1, n, dq, scores, kMaxBlockKeys);
          }
        } else {
          avx512::dot_rows(qj, dq, group, keys, kc.stride1, n, dq, scores, kMaxBlockKeys);
        }
      }
      // A quantized cache's scales of this KV head in this block: gathered above for contiguous rows.
      float* const key_scales = kQuantized<C> ? ws.key_scales.data() + (kc.paged() ? 0 : j * kMaxBlockKeys) : nullptr;
      float* const value_scales =
          kQuantized<C> ? ws.value_scales.data() + (vc.paged() ? 0 : j * kMaxBlockKeys) : nullptr;
      if constexpr (kQuantized<C>) {
        if (kc.paged()) page_scales(kc, here, b, t0, j, key_scales);
        scale_columns(scores, kMaxBlockKeys, group, key_scales, n,
                      integer_rows ? ws.q_scale.data() + j * group : nullptr);
      }
      uint16_t* const weights = ws.weights_bf16.data();
      const float* weight_factors = nullptr;  // the value scales, where the exps are rounded to bf16 weights with them
      if constexpr (kQuantized<C>) {          // the masked keys' scales may be stale, their weights are 0
        if (vc.paged()) page_scales(vc, here, b, t0, j, value_scales);
        std::fill(value_scales, value_scales + masked, 0.f);
        if (bf16_weights) weight_factors = value_scales;
      }
      // The scores are divided by pb.scale, which the exps multiply in, unless capped (soft_cap_scores scales them) or
      // scaled already (float32 queries, above).
      const float score_scale = pb.softcap > 0.f || scaled ? 1.f : pb.scale;
      for (int64_t i = 0; i < group; ++i) {
        float* si = scores + i * kMaxBlockKeys;
        if (pb.softcap > 0.f) soft_cap_scores(si + masked, n - masked, scaled ? 1.f : pb.scale, pb.softcap);
        if (masked > 0) std::fill(si, si + masked, -INFINITY);
        const float factor = softmax[i].rescale_for(avx512::max_of(si, n) * score_scale);
        if (factor != 1.f) avx512::scale_in_place(acc + i * dv, dv, factor);
        // Where the value products take bf16 weights, the exps are rounded as they are made (exp2_for_bf16, one
        // pass, not a pass of their own: measured in bench/results/ops/README.md, "CPU decode").
        if (bf16_weights) {
          softmax[i].sum += avx512::exp_sum_to_bf16<true>(si, n, score_scale, softmax[i].max,
                                                          reinterpret_cast<c10::BFloat16*>(weights + i * kMaxBlockKeys),
                                                          weight_factors);
        } else {
          softmax[i].sum += avx512::exp_and_sum<kExpDegree<T>>(si, n, score_scale, softmax[i].max);
        }
      }
      if (kQuantized<C> && !bf16_weights) {  // weights of the codes
        scale_columns(scores, kMaxBlockKeys, group, value_scales, n);
        if (integer_rows || integer_pages) {  // the weights as int16 codes for the vpdpwssd value sums
          quantize_weights_int16(scores, kMaxBlockKeys, group, n, ws.weights_int16.data(), kMaxBlockKeys + 1,
                                 ws.w_scale.data());
        }
      }
      if (vc.paged()) {  // each run's values are dv columns of consecutive tokens: acc[i][c] += p_i . V[c]
        if constexpr (kInt4) {
          if (integer_pages) {  // each run's byte rows read packed (load_nibble_columns)
            avx512::dot_columns_s8(ws.weights_int16.data(), kMaxBlockKeys + 1, ws.w_scale.data(), group, value_bytes,
                                   here.first, here.len, here.count, col_stride, dv, acc, dv, stream);
          } else {  // float32 queries: the block's codes as dv rows of n, one run
            unpack_int4_runs(here, here.v, v_col, vc.page_size, n, dv, ws.value_codes.get());
            const int8_t* codes[1] = {ws.value_codes.get()};
            const int64_t first[1] = {0}, len[1] = {n};
            avx512::dot_columns(scores, kMaxBlockKeys, group, codes, first, len, 1, n, dv, acc, dv, stream);
          }
        } else if (integer_pages) {
          if constexpr (std::is_same_v<C, int8_t>) {
            avx512::dot_columns_s8(ws.weights_int16.data(), kMaxBlockKeys + 1, ws.w_scale.data(), group, run_values,
                                   here.first, here.len, here.count, col_stride, dv, acc, dv, stream);
          }
        } else if (bf16_pages) {
          if constexpr (kBf16Rows) {
            if (vc.page_size == 16) {
              avx512::dot_columns_page16_bf16(weights, kMaxBlockKeys, group, run_values, here.first, here.len,
                                              here.count, dv, acc, dv, stream);
            } else {
              avx512::dot_columns(weights, kMaxBlockKeys, group, run_values, here.first, here.len, here.count,
                                  col_stride, dv, acc, dv, stream);
            }
          }
        } else {
          avx512::dot_columns(scores, kMaxBlockKeys, group, run_values, here.first, here.len, here.count, col_stride,
                              dv, acc, dv, stream);
        }
      } else if constexpr (kIntCodes) {  // values are n rows of dv: acc_i += sum_t p_i[t] V[t]
        if (integer_rows) {
          if constexpr (kInt4) {
            avx512::axpy_rows_s4(ws.weights_int16.data(), kMaxBlockKeys + 1, ws.w_scale.data(), group,
                                 int_bytes(vc.at(b, t0, v_col)), vc.stride1, n, dv, acc, dv, stream);
          } else {
            avx512::axpy_rows_s8(ws.weights_int16.data(), kMaxBlockKeys + 1, ws.w_scale.data(), group,
                                 vc.at(b, t0, v_col), vc.stride1, n, dv, acc, dv, stream);
          }
        } else {
          const int8_t* codes = reinterpret_cast<const int8_t*>(vc.at(b, t0, v_col));
          int64_t codes_stride = vc.stride1;
          if constexpr (kInt4) {
            unpack_int4_block(vc.at(b, t0, v_col), vc.stride1, n, dv, ws.value_codes.get());
            codes = ws.value_codes.get(), codes_stride = dv;
          }
          avx512::axpy_rows(scores, kMaxBlockKeys, group, codes, codes_stride, n, dv, acc, dv, stream);
        }
      } else if constexpr (kBf16Rows) {  // values are n rows of dv: acc_i += sum_t p_i[t] V[t]
        if (bf16_rows) {
          avx512::axpy_rows_bf16(weights, kMaxBlockKeys, group, vc.at(b, t0, v_col), vc.stride1, n, dv, acc, dv,
                                 stream);
        } else {
          avx512::axpy_rows(scores, kMaxBlockKeys, group, vc.at(b, t0, v_col), vc.stride1, n, dv, acc, dv, stream);
        }
      } else {
        avx512::axpy_rows(scores, kMaxBlockKeys, group, vc.at(b, t0, v_col), vc.stride1, n, dv, acc, dv, stream);
      }
      stream.finish_share(j + 1, hkv);
    }
    t0 = t1;
  }
  for (int64_t j = 0; j < hkv; ++j) {
    const int32_t record[kDecodeRecordFields] = {static_cast<int32_t>(b * hkv + j), static_cast<int32_t>(piece.index),
                                                 static_cast<int32_t>(piece.t0), static_cast<int32_t>(piece.t1)};
    finish_task(record, pb, ws.acc.data() + group * layout.v_offsets[j], ws.softmax.data() + j * group, out, out_ld);
  }
}

}  // namespace
}  // namespace fdc::cpu::decode
