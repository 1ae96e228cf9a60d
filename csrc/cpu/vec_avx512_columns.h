// AVX-512 weighted sums along the token runs of dim-major pages (vec_avx512.h says how these kernels are built):
// the value sums of a paged cache, in float and, with AVX-512-BF16, bf16 without widening; int8 pages by VNNI.
#pragma once

#include "cpu/vec_avx512.h"

namespace fdc::cpu::avx512 {

// The end of a dot_columns tile: sums[h * kCols + c] (16 lanes each) reduced and added to acc[h * acc_ld + c0 + c]
// for the tile's columns below dim, by one sum16x16.
template <int kHeads, int kCols>
FDC_AVX512 inline void add_column_sums(const __m512* sums, int64_t c0, int64_t dim, float* acc, int64_t acc_ld) {
  const __m512 total = sum16x16(sums);  // lane h * kCols + c: head h, column c0 + c
  const __mmask16 store = lanes_mask(std::min<int64_t>(kCols, dim - c0));
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) {
    const __m512 part =
        _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(h * kCols)),
                              total);
    float* a = acc + h * acc_ld + c0;
    _mm512_mask_storeu_ps(a, store, _mm512_add_ps(part, _mm512_maskz_loadu_ps(store, a)));
  }
}

// dot_columns for kHeads query heads and kCols columns from c0 (kHeads * kCols <= 16 accumulators): each 16 tokens of
// a column are loaded and widened once for all the tile's heads, and the tile's accumulators are reduced together,
// once per block, by one sum16x16.
template <typename T, int kHeads, int kCols>
FDC_AVX512 void dot_columns_tile(const float* p, int64_t p_ld, const T* const* runs, const int64_t* first,
                                 const int64_t* len, int64_t count, int64_t col_stride, int64_t c0, int64_t dim,
                                 float* acc, int64_t acc_ld, PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  static_assert(kHeads * kCols <= kLanes);
  __m512 sums[kLanes];
#pragma GCC unroll 16
  for (int k = 0; k < kLanes; ++k) sums[k] = _mm512_setzero_ps();
  for (int64_t s = 0; s < count; ++s) {
    const T* col[kCols];  // a short last tile repeats the final column and stores only the real ones
#pragma GCC unroll 16
    for (int c = 0; c < kCols; ++c) col[c] = runs[s] + std::min<int64_t>(c0 + c, dim - 1) * col_stride;
    const float* ps = p + first[s];
    for (int64_t t = 0; t < len[s]; t += kLanes) {
      const __mmask16 mask = lanes_mask(len[s] - t);
      __m512 x[kCols];
#pragma GCC unroll 16
      for (int c = 0; c < kCols; ++c) {
        x[c] = load16(col[c] + t, mask);
        ahead.step();
      }
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        const __m512 w = _mm512_maskz_loadu_ps(mask, ps + h * p_ld + t);
#pragma GCC unroll 16
        for (int c = 0; c < kCols; ++c) sums[h * kCols + c] = _mm512_fmadd_ps(w, x[c], sums[h * kCols + c]);
      }
    }
  }
  __m512 reduced[kLanes];  // a copy: with `sums` itself passed on, GCC stored every accumulator on each pass
#pragma GCC unroll 16
  for (int k = 0; k < kLanes; ++k) reduced[k] = sums[k];
  add_column_sums<kHeads, kCols>(reduced, c0, dim, acc, acc_ld);
  stream = ahead;
}

// dot_columns_tile for bf16 (or e4m3, load32_bf16) pages and weights rounded to bf16 (exp_sum_to_bf16), with
// AVX-512-BF16: 32 tokens of a column per load, and one vdpbf16ps per head multiplies them by the head's 32 weights and
// adds the products in pairs into 16 lanes, where dot_columns_tile widens 16 tokens per load and takes an FMA per 16.
// Reduced the same way, once per block.
template <int kHeads, int kCols, typename Rows>
FDC_AVX512_BF16 void dot_columns_tile_bf16(const uint16_t* p, int64_t p_ld, const Rows* const* runs,
                                           const int64_t* first, const int64_t* len, int64_t count, int64_t col_stride,
                                           int64_t c0, int64_t dim, float* acc, int64_t acc_ld,
                                           PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  static_assert(kHeads * kCols <= kLanes);
  constexpr int64_t kPairs = 2 * kLanes;  // bf16 elements per register
  __m512 sums[kLanes];
#pragma GCC unroll 16
  for (int k = 0; k < kLanes; ++k) sums[k] = _mm512_setzero_ps();
  for (int64_t s = 0; s < count; ++s) {
    const Rows* col[kCols];  // a short last tile repeats the final column and stores only the real ones
#pragma GCC unroll 16
    for (int c = 0; c < kCols; ++c) col[c] = runs[s] + std::min<int64_t>(c0 + c, dim - 1) * col_stride;
    const uint16_t* ps = p + first[s];
    for (int64_t t = 0; t < len[s]; t += kPairs) {
      const __mmask32 mask = pairs_mask(len[s] - t);
      __m512bh x[kCols];
#pragma GCC unroll 16
      for (int c = 0; c < kCols; ++c) {
        x[c] = (__m512bh)load32_bf16(col[c] + t, mask);
        ahead.step();
      }
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(mask, ps + h * p_ld + t);
#pragma GCC unroll 16
        for (int c = 0; c < kCols; ++c) sums[h * kCols + c] = _mm512_dpbf16_ps(sums[h * kCols + c], x[c], w);
      }
    }
  }
  __m512 reduced[kLanes];  // a copy: with `sums` itself passed on, GCC stored every accumulator on each pass
#pragma GCC unroll 16
  for (int k = 0; k < kLanes; ++k) reduced[k] = sums[k];
  add_column_sums<kHeads, kCols>(reduced, c0, dim, acc, acc_ld);
  stream = ahead;
}

// One tile of dot_columns, by the weights' type.
template <int kHeads, int kCols, typename T>
FDC_AVX512 inline void column_tile(const float* p, int64_t p_ld, const T* const* runs, const int64_t* first,
                                   const int64_t* len, int64_t count, int64_t col_stride, int64_t c0, int64_t dim,
                                   float* acc, int64_t acc_ld, PrefetchStream& ahead) {
  dot_columns_tile<T, kHeads, kCols>(p, p_ld, runs, first, len, count, col_stride, c0, dim, acc, acc_ld, ahead);
}
template <int kHeads, int kCols, typename Rows>
FDC_AVX512 inline void column_tile(const uint16_t* p, int64_t p_ld, const Rows* const* runs, const int64_t* first,
                                   const int64_t* len, int64_t count, int64_t col_stride, int64_t c0, int64_t dim,
                                   float* acc, int64_t acc_ld, PrefetchStream& ahead) {
  dot_columns_tile_bf16<kHeads, kCols>(p, p_ld, runs, first, len, count, col_stride, c0, dim, acc, acc_ld, ahead);
}

// Weighted sums along the token runs of dim-major pages, for a block of keys spread over `count` runs (one per page it
// touches): acc[i * acc_ld + c] += sum_s sum_{t < len[s]} p[i * p_ld + first[s] + t] * runs[s][c * col_stride + t]
// for i < group, c < dim (run s: len[s] consecutive tokens of one page, the block's keys first[s] onwards; column c
// of it col_stride elements after column c - 1). Query heads go four at a time in tiles of 4 columns (8 columns for a
// pair, 16 for a single head), so the horizontal sums cost one sum16x16 per 16 outputs and block, however many
// pages the block spans. dot_rows over each run instead re-widened every column for each query head and reduced
// each page's 16 x 16 products by a sum16x16 of its own.
// p holds float weights, or bf16 weights (exp_sum_to_bf16) for bf16 pages on a CPU with AVX-512-BF16
// (dot_columns_tile_bf16).
template <typename W, typename T>
FDC_AVX512 void dot_columns(const W* p, int64_t p_ld, int64_t group, const T* const* runs, const int64_t* first,
                            const int64_t* len, int64_t count, int64_t col_stride, int64_t dim, float* acc,
                            int64_t acc_ld, PrefetchStream& ahead) {
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    const int64_t heads = std::min<int64_t>(4, group - h0);
    const W* ph = p + h0 * p_ld;
    float* ah = acc + h0 * acc_ld;
    const int64_t cols = heads == 1 ? 16 : heads == 2 ? 8 : 4;
    for (int64_t c0 = 0; c0 < dim; c0 += cols) {
      switch (heads) {
        case 1: column_tile<1, 16>(ph, p_ld, runs, first, len, count, col_stride, c0, dim, ah, acc_ld, ahead); break;
        case 2: column_tile<2, 8>(ph, p_ld, runs, first, len, count, col_stride, c0, dim, ah, acc_ld, ahead); break;
        case 3: column_tile<3, 4>(ph, p_ld, runs, first, len, count, col_stride, c0, dim, ah, acc_ld, ahead); break;
        default: column_tile<4, 4>(ph, p_ld, runs, first, len, count, col_stride, c0, dim, ah, acc_ld, ahead); break;
      }
    }
  }
}

// dot_columns_tile for int8 pages (a quantized cache's value codes) against int16 weights, with AVX-512 VNNI: 32
// tokens of a column widened to int16 per load, and one vpdpwssd per head multiplies them by the head's 32 weights and
// adds the products in pairs into 16 int32 lanes, exactly (|lane| <= 512 * 32767 * 127 < 2^31 for the <= 512 keys of
// a block), where dot_columns_tile widens 16 codes per load to float and takes an FMA per 16. The sums become float
// once, times each head's weight scale p_scale[h], and are reduced as dot_columns_tile's. Codes: int8_t pages, or
// uint8_t pages of int4 codes (byte row m holding columns 2m and 2m + 1, low nibble first), whose byte rows give
// two columns' 32 tokens per load (load_nibble_columns): c0 is then even, and runs point at byte row 0.
template <int kHeads, int kCols, typename Codes>
FDC_AVX512_VNNI void dot_columns_tile_s8(const int16_t* p, int64_t p_ld, const float* p_scale, const Codes* const* runs,
                                         const int64_t* first, const int64_t* len, int64_t count, int64_t col_stride,
                                         int64_t c0, int64_t dim, float* acc, int64_t acc_ld, PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  static_assert(kHeads * kCols <= kLanes);
  constexpr bool kInt4 = std::is_same_v<Codes, uint8_t>;
  static_assert(!kInt4 || kCols % 2 == 0, "int4 columns come in byte rows of two");
  constexpr int kLoads = kInt4 ? kCols / 2 : kCols;  // column (int8) or byte row (int4) per load
  constexpr int64_t kPairs = 2 * kLanes;             // int16 elements per register
  __m512i sums[kLanes];
#pragma GCC unroll 16
  for (int k = 0; k < kLanes; ++k) sums[k] = _mm512_setzero_si512();
  for (int64_t s = 0; s < count; ++s) {
    const Codes* col[kLoads];  // a short last tile repeats the final column (pair) and stores only the real ones
#pragma GCC unroll 16
    for (int c = 0; c < kLoads; ++c) {
      col[c] = kInt4 ? runs[s] + std::min<int64_t>(c0 / 2 + c, dim / 2 - 1) * col_stride
                     : runs[s] + std::min<int64_t>(c0 + c, dim - 1) * col_stride;
    }
    const int16_t* ps = p + first[s];
    for (int64_t t = 0; t < len[s]; t += kPairs) {
      const __mmask32 mask = pairs_mask(len[s] - t);
      __m512i x[kCols];
#pragma GCC unroll 16
      for (int c = 0; c < kLoads; ++c) {
        if constexpr (kInt4) {
          load_nibble_columns(col[c] + t, mask, x[2 * c], x[2 * c + 1]);
        } else {
          x[c] = load_codes_epi16(col[c], t, mask);
        }
        ahead.step();
      }
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        const __m512i w = _mm512_maskz_loadu_epi16(mask, ps + h * p_ld + t);
#pragma GCC unroll 16
        for (int c = 0; c < kCols; ++c) sums[h * kCols + c] = _mm512_dpwssd_epi32(sums[h * kCols + c], x[c], w);
      }
    }
  }
  __m512 reduced[kLanes];
#pragma GCC unroll 16
  for (int k = 0; k < kLanes; ++k) {
    const float scale = k < kHeads * kCols ? p_scale[k / kCols] : 0.f;
    reduced[k] = _mm512_mul_ps(_mm512_cvtepi32_ps(sums[k]), _mm512_set1_ps(scale));
  }
  add_column_sums<kHeads, kCols>(reduced, c0, dim, acc, acc_ld);
  stream = ahead;
}

// dot_columns (its contract) for int8 (or int4: Codes uint8_t) pages and int16 weights (quantize_weights_int16: p_ld
// elements per head, head h's weights p_scale[h] times its codes), by dot_columns_tile_s8, tiled as dot_columns.
template <typename Codes>
FDC_AVX512_VNNI inline void dot_columns_s8(const int16_t* p, int64_t p_ld, const float* p_scale, int64_t group,
                                           const Codes* const* runs, const int64_t* first, const int64_t* len,
                                           int64_t count, int64_t col_stride, int64_t dim, float* acc, int64_t acc_ld,
                                           PrefetchStream& ahead) {
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    const int64_t heads = std::min<int64_t>(4, group - h0);
    const int16_t* ph = p + h0 * p_ld;
    const float* sh = p_scale + h0;
    float* ah = acc + h0 * acc_ld;
    const int64_t cols = heads == 1 ? 16 : heads == 2 ? 8 : 4;
    for (int64_t c0 = 0; c0 < dim; c0 += cols) {
      switch (heads) {
        case 1:
          dot_columns_tile_s8<1, 16>(ph, p_ld, sh, runs, first, len, count, col_stride, c0, dim, ah, acc_ld, ahead);
          break;
        case 2:
          dot_columns_tile_s8<2, 8>(ph, p_ld, sh, runs, first, len, count, col_stride, c0, dim, ah, acc_ld, ahead);
          break;
        case 3:
          dot_columns_tile_s8<3, 4>(ph, p_ld, sh, runs, first, len, count, col_stride, c0, dim, ah, acc_ld, ahead);
          break;
        default:
          dot_columns_tile_s8<4, 4>(ph, p_ld, sh, runs, first, len, count, col_stride, c0, dim, ah, acc_ld, ahead);
          break;
      }
    }
  }
}

// dot_columns for bf16 pages of 16 tokens and weights rounded to bf16 (exp_sum_to_bf16), with AVX-512-BF16: two
// columns of a page (32 bytes each, back to back) in one load, against the run's 16 weights in both halves of a
// register, so one vdpbf16ps per head adds two tokens' products of each column into each lane, and a register is
// full where a 16-token column alone fills half of one (dot_columns_tile_bf16 on 16-token pages lost to widening).
// kHeads x kPairs accumulators of column pairs, reduced once per block by sum_column_pairs. The slots of a short
// run are zeroed as the columns are loaded, so whatever they hold (NaN) meets the weights after the run (the next
// run's probabilities, or exp_sum_to_bf16's zeros) as zero.
template <int kHeads, int kPairs, typename Rows>
FDC_AVX512_BF16 void dot_columns_page16_tile_bf16(const uint16_t* p, int64_t p_ld, const Rows* const* runs,
                                                  const int64_t* first, const int64_t* len, int64_t count, int64_t c0,
                                                  int64_t dim, float* acc, int64_t acc_ld, PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  static_assert(kHeads * kPairs <= kLanes);
  constexpr int64_t kTokens = 16, kCols = 2 * kPairs;
  __m512 sums[kLanes];
#pragma GCC unroll 16
  for (int k = 0; k < kLanes; ++k) sums[k] = _mm512_setzero_ps();
  for (int64_t s = 0; s < count; ++s) {
    const __mmask32 tokens = lanes_mask(len[s]), mask = tokens | (tokens << kTokens);  // the run's slots, both halves
    __m512bh x[kPairs];  // a short last tile repeats the final pair and stores only the real columns
#pragma GCC unroll 8
    for (int q = 0; q < kPairs; ++q) {
      x[q] = (__m512bh)load32_bf16(runs[s] + std::min<int64_t>(c0 + 2 * q, dim - 2) * kTokens, mask);
      ahead.step();
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      const __m256i w16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + h * p_ld + first[s]));
      const __m512bh w = (__m512bh)_mm512_broadcast_i64x4(w16);
#pragma GCC unroll 8
      for (int q = 0; q < kPairs; ++q) sums[h * kPairs + q] = _mm512_dpbf16_ps(sums[h * kPairs + q], x[q], w);
    }
  }
  alignas(64) float total[2 * kLanes];  // h * kCols + c: head h, column c0 + c
  __m512 columns[2];
  __m512 reduced[kLanes];  // a copy: with `sums` itself passed on, GCC stored every accumulator on each pass
#pragma GCC unroll 16
  for (int k = 0; k < kLanes; ++k) reduced[k] = sums[k];
  sum_column_pairs(reduced, columns);
  _mm512_store_ps(total, columns[0]);
  _mm512_store_ps(total + kLanes, columns[1]);
  const __mmask16 store = lanes_mask(std::min<int64_t>(kCols, dim - c0));
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) {
    float* a = acc + h * acc_ld + c0;
    const __m512 part = _mm512_maskz_loadu_ps(store, total + h * kCols);
    _mm512_mask_storeu_ps(a, store, _mm512_add_ps(part, _mm512_maskz_loadu_ps(store, a)));
  }
  stream = ahead;
}

// dot_columns (its contract, col_stride 16) for bf16 (or e4m3) pages of 16 tokens, by dot_columns_page16_tile_bf16:
// query heads four at a time, in tiles of 16 columns for one or two heads and 8 for three or four (at most 16
// accumulators, the pairs and a weight register within the 32 registers).
template <typename Rows>
FDC_AVX512_BF16 inline void dot_columns_page16_bf16(const uint16_t* p, int64_t p_ld, int64_t group,
                                                    const Rows* const* runs, const int64_t* first, const int64_t* len,
                                                    int64_t count, int64_t dim, float* acc, int64_t acc_ld,
                                                    PrefetchStream& ahead) {
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    const int64_t heads = std::min<int64_t>(4, group - h0);
    const uint16_t* ph = p + h0 * p_ld;
    float* ah = acc + h0 * acc_ld;
    const int64_t cols = heads <= 2 ? 16 : 8;
    for (int64_t c0 = 0; c0 < dim; c0 += cols) {
      switch (heads) {
        case 1:
          dot_columns_page16_tile_bf16<1, 8>(ph, p_ld, runs, first, len, count, c0, dim, ah, acc_ld, ahead);
          break;
        case 2:
          dot_columns_page16_tile_bf16<2, 8>(ph, p_ld, runs, first, len, count, c0, dim, ah, acc_ld, ahead);
          break;
        case 3:
          dot_columns_page16_tile_bf16<3, 4>(ph, p_ld, runs, first, len, count, c0, dim, ah, acc_ld, ahead);
          break;
        default:
          dot_columns_page16_tile_bf16<4, 4>(ph, p_ld, runs, first, len, count, c0, dim, ah, acc_ld, ahead);
          break;
      }
    }
  }
}

}  // namespace fdc::cpu::avx512
