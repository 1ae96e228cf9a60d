// AVX-512 weighted row sums (vec_avx512.h says how these kernels are built): the value sums of a contiguous
// cache's token-major rows and the key scores of bf16 pages of 32 tokens or more, in float and, with
// AVX-512-BF16, bf16 pairs without widening.
#pragma once

#include "cpu/vec_avx512.h"
#include "cpu/vec_math.h"

namespace fdc::cpu::avx512 {

// acc[i * acc_ld + x] += sum_r w[i * w_ld + r] * rows[r * row_stride + x] for kHeads heads and kVecs registers of
// columns (the last one masked by `last`): all kHeads x kVecs accumulators stay in registers over a chunk of rows
// (kSumChunk), and each row's slice is loaded and widened once for all kHeads heads; each chunk's sums start from zero
// and are added to acc after it (cpu/vec_math.h, kSumChunk, says why).
template <typename T, int kHeads, int kVecs>
FDC_AVX512 void axpy_tile(const float* w, int64_t w_ld, const T* rows, int64_t row_stride, int64_t n, __mmask16 last,
                          float* acc, int64_t acc_ld, PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  __m512 sums[kHeads][kVecs];
  for (int64_t r0 = 0; r0 < n; r0 += kSumChunk) {
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) sums[h][v] = _mm512_setzero_ps();
    const int64_t r1 = std::min(n, r0 + kSumChunk);
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = rows + r * row_stride;
      __m512 x[kVecs];
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) {
        x[v] = load16(row + v * kLanes, v + 1 == kVecs ? last : __mmask16(0xFFFF));
        ahead.step();
      }
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        const __m512 weight = _mm512_set1_ps(w[h * w_ld + r]);
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) sums[h][v] = _mm512_fmadd_ps(weight, x[v], sums[h][v]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) {
        const __mmask16 mask = v + 1 == kVecs ? last : __mmask16(0xFFFF);
        float* a = acc + h * acc_ld + v * kLanes;
        _mm512_mask_storeu_ps(a, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, a), sums[h][v]));
      }
  }
  stream = ahead;
}

// Tiles are at most kTileHeads x kTileVecs registers: 16 accumulators, plus kTileVecs row registers and a broadcast
// weight, within the 32 registers.
constexpr int kTileHeads = 4, kTileVecs = 4;

template <typename T, int kHeads>
FDC_AVX512 void axpy_tile_vecs(int vecs, const float* w, int64_t w_ld, const T* rows, int64_t row_stride, int64_t n,
                               __mmask16 last, float* acc, int64_t acc_ld, PrefetchStream& ahead) {
  switch (vecs) {
    case 1: return axpy_tile<T, kHeads, 1>(w, w_ld, rows, row_stride, n, last, acc, acc_ld, ahead);
    case 2: return axpy_tile<T, kHeads, 2>(w, w_ld, rows, row_stride, n, last, acc, acc_ld, ahead);
    case 3: return axpy_tile<T, kHeads, 3>(w, w_ld, rows, row_stride, n, last, acc, acc_ld, ahead);
    case 4: return axpy_tile<T, kHeads, 4>(w, w_ld, rows, row_stride, n, last, acc, acc_ld, ahead);
    default: TORCH_CHECK(false, "fdc: axpy tile of ", vecs, " registers, expected 1 to ", kTileVecs);
  }
}

// The low and high 8 of 16 floats as doubles.
FDC_AVX512 inline __m512d widen_low(__m512 x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
FDC_AVX512 inline __m512d widen_high(__m512 x) {
  return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

// axpy_tile with float64 sums: the key scores of dim-major pages of float32 (or of int4 codes unpacked for float32
// queries), where a score is a sum over a head's dims in rows of tokens. In float every chunk of dims rounded the
// partial score, and the scores' errors, times the values, put the paged float32 decode up to 4.2 float32 ulps over
// twice torch's own error (whose matmul sums each score over more, shorter runs; 1 of 2400 soft-capped cases past the
// rule of tests/conftest.py); now 1.9 at most, in the time of the float sums (memory-bound; bench/results/ops/
// README.md, "Accuracy against torch"). Runs of kFloat64Chunk rows are summed in float, each run widened to two
// registers of 8 doubles per 16 columns and added to float64 sums, scaled and rounded once as acc is stored; so a tile
// has at most 2 registers of columns (8 float and 16 double accumulators for 4 heads).
template <typename T, int kHeads, int kVecs>
FDC_AVX512 void axpy_tile_f64(const float* w, int64_t w_ld, const T* rows, int64_t row_stride, int64_t n,
                              __mmask16 last, float* acc, int64_t acc_ld, PrefetchStream& stream, double scale) {
  PrefetchStream ahead = stream;
  const __m512d factor = _mm512_set1_pd(scale);
  __m512d low[kHeads][kVecs], high[kHeads][kVecs];
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) low[h][v] = high[h][v] = _mm512_setzero_pd();
  for (int64_t r0 = 0; r0 < n; r0 += kFloat64Chunk) {
    __m512 part[kHeads][kVecs];
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; ++v) part[h][v] = _mm512_setzero_ps();
    const int64_t r1 = std::min(n, r0 + kFloat64Chunk);
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = rows + r * row_stride;
      __m512 x[kVecs];
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; ++v) {
        x[v] = load16(row + v * kLanes, v + 1 == kVecs ? last : __mmask16(0xFFFF));
        ahead.step();
      }
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        const __m512 weight = _mm512_set1_ps(w[h * w_ld + r]);
#pragma GCC unroll 2
        for (int v = 0; v < kVecs; ++v) part[h][v] = _mm512_fmadd_ps(weight, x[v], part[h][v]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; ++v) {
        low[h][v] = _mm512_add_pd(low[h][v], widen_low(part[h][v]));
        high[h][v] = _mm512_add_pd(high[h][v], widen_high(part[h][v]));
      }
  }
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) {
      const __mmask16 mask = v + 1 == kVecs ? last : __mmask16(0xFFFF);
      float* a = acc + h * acc_ld + v * kLanes;
      const __m512 before = _mm512_maskz_loadu_ps(mask, a);
      const __m256 sum_low = _mm512_cvtpd_ps(_mm512_fmadd_pd(low[h][v], factor, widen_low(before)));
      const __m256 sum_high = _mm512_cvtpd_ps(_mm512_fmadd_pd(high[h][v], factor, widen_high(before)));
      const __m512 sums = _mm512_castpd_ps(
          _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(sum_low)), _mm256_castps_pd(sum_high), 1));
      _mm512_mask_storeu_ps(a, mask, sums);
    }
  stream = ahead;
}

template <typename T, int kHeads>
FDC_AVX512 void axpy_tile_f64_vecs(int vecs, const float* w, int64_t w_ld, const T* rows, int64_t row_stride, int64_t n,
                                   __mmask16 last, float* acc, int64_t acc_ld, PrefetchStream& ahead, double scale) {
  switch (vecs) {
    case 1: return axpy_tile_f64<T, kHeads, 1>(w, w_ld, rows, row_stride, n, last, acc, acc_ld, ahead, scale);
    case 2: return axpy_tile_f64<T, kHeads, 2>(w, w_ld, rows, row_stride, n, last, acc, acc_ld, ahead, scale);
    default: TORCH_CHECK(false, "fdc: float64 axpy tile of ", vecs, " registers, expected 1 or 2");
  }
}

// Weighted row sums: acc[i * acc_ld + x] += sum_r w[i * w_ld + r] * rows[r * row_stride + x] for i < group, r < n,
// x < len; in tiles of up to 4 heads x 64 columns, or, with kFloat64Sums, 4 heads x 32 columns summed in float64
// (axpy_tile_f64 says where) and multiplied by `scale` before they are rounded (the softmax scale: so a score is
// rounded once, not once as a sum and again as it is scaled).
template <bool kFloat64Sums = false, typename T>
FDC_AVX512 void axpy_rows(const float* w, int64_t w_ld, int64_t group, const T* rows, int64_t row_stride, int64_t n,
                          int64_t len, float* acc, int64_t acc_ld, PrefetchStream& ahead, double scale = 1.0) {
  constexpr int64_t kTileColumns = (kFloat64Sums ? 2 : kTileVecs) * kLanes;
  for (int64_t x0 = 0; x0 < len; x0 += kTileColumns) {
    const int64_t cols = std::min<int64_t>(kTileColumns, len - x0);
    const int vecs = static_cast<int>((cols + kLanes - 1) / kLanes);
    const __mmask16 last = lanes_mask(cols - (vecs - 1) * kLanes);
    for (int64_t h0 = 0; h0 < group; h0 += kTileHeads) {
      const int heads = static_cast<int>(std::min<int64_t>(kTileHeads, group - h0));
      const float* wh = w + h0 * w_ld;
      float* ah = acc + h0 * acc_ld + x0;
      const T* tile_rows = rows + x0;
      if constexpr (kFloat64Sums) {
        switch (heads) {
          case 1:
            axpy_tile_f64_vecs<T, 1>(vecs, wh, w_ld, tile_rows, row_stride, n, last, ah, acc_ld, ahead, scale);
            break;
          case 2:
            axpy_tile_f64_vecs<T, 2>(vecs, wh, w_ld, tile_rows, row_stride, n, last, ah, acc_ld, ahead, scale);
            break;
          case 3:
            axpy_tile_f64_vecs<T, 3>(vecs, wh, w_ld, tile_rows, row_stride, n, last, ah, acc_ld, ahead, scale);
            break;
          case 4:
            axpy_tile_f64_vecs<T, 4>(vecs, wh, w_ld, tile_rows, row_stride, n, last, ah, acc_ld, ahead, scale);
            break;
          default: TORCH_CHECK(false, "fdc: axpy tile of ", heads, " heads, expected 1 to ", kTileHeads);
        }
        continue;
      }
      switch (heads) {
        case 1: axpy_tile_vecs<T, 1>(vecs, wh, w_ld, tile_rows, row_stride, n, last, ah, acc_ld, ahead); break;
        case 2: axpy_tile_vecs<T, 2>(vecs, wh, w_ld, tile_rows, row_stride, n, last, ah, acc_ld, ahead); break;
        case 3: axpy_tile_vecs<T, 3>(vecs, wh, w_ld, tile_rows, row_stride, n, last, ah, acc_ld, ahead); break;
        case 4: axpy_tile_vecs<T, 4>(vecs, wh, w_ld, tile_rows, row_stride, n, last, ah, acc_ld, ahead); break;
        default: TORCH_CHECK(false, "fdc: axpy tile of ", heads, " heads, expected 1 to ", kTileHeads);
      }
    }
  }
}

// axpy_tile for bf16 rows (or e4m3 rows, as bf16 by load32_bf16) and bf16 weights, with AVX-512-BF16: rows r and r + 1
// are interleaved element by element (vpunpcklwd and vpunpckhwd, within each 128-bit lane), so one vdpbf16ps adds w[r]
// row_r + w[r + 1] row_{r + 1} to 16 columns, against two widenings and two FMAs per row in float. kChunks registers of
// 32 columns (the last masked by `last`) for kHeads heads; w holds each head's weights as bf16 bits, zero after n up to
// an even count, so the pair (w[r], w[r + 1]) is one 32-bit lane. The interleave leaves the columns of each 128-bit
// lane split in two: dword 4L + i of the first sum holds column 8L + i, of the second column 8L + 4 + i (L < 4, i < 4);
// they are put back in order once per tile.
template <int kHeads, int kChunks, typename Rows>
FDC_AVX512_BF16 void axpy_pairs_tile(const uint16_t* w, int64_t w_ld, const Rows* rows, int64_t row_stride, int64_t n,
                                     __mmask32 last, float* acc, int64_t acc_ld, PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  constexpr int64_t kPairs = 2 * kLanes;  // columns per register of bf16
  const auto chunk_mask = [last](int c) { return c + 1 == kChunks ? last : __mmask32(0xFFFFFFFF); };
  __m512 low[kHeads][kChunks], high[kHeads][kChunks];
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 2
    for (int c = 0; c < kChunks; ++c) low[h][c] = high[h][c] = _mm512_setzero_ps();
  for (int64_t r = 0; r < n; r += 2) {
    const Rows* row = rows + r * row_stride;
    __m512bh x_low[kChunks], x_high[kChunks];
#pragma GCC unroll 2
    for (int c = 0; c < kChunks; ++c) {
      const __mmask32 mask = chunk_mask(c);
      const __m512i a = load32_bf16(row + c * kPairs, mask);
      const __m512i b = load32_bf16(row + row_stride + c * kPairs, r + 1 < n ? mask : __mmask32(0));
      ahead.step();
      ahead.step();
      x_low[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      x_high[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      uint32_t pair;
      std::memcpy(&pair, w + h * w_ld + r, sizeof(pair));
      const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
#pragma GCC unroll 2
      for (int c = 0; c < kChunks; ++c) {
        low[h][c] = _mm512_dpbf16_ps(low[h][c], x_low[c], weights);
        high[h][c] = _mm512_dpbf16_ps(high[h][c], x_high[c], weights);
      }
    }
  }
  // Lane m of first (second): column m (16 + m), taken from `low` (index < 16) or `high` (index - 16).
  alignas(64) static constexpr int32_t kFirst[kLanes] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static constexpr int32_t kSecond[kLanes] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 2
    for (int c = 0; c < kChunks; ++c) {
      const __mmask32 mask = chunk_mask(c);
      float* a = acc + h * acc_ld + c * kPairs;
      const __mmask16 m0 = __mmask16(mask), m1 = __mmask16(mask >> kLanes);
      const __m512 cols0 = _mm512_permutex2var_ps(low[h][c], first, high[h][c]);
      const __m512 cols1 = _mm512_permutex2var_ps(low[h][c], second, high[h][c]);
      _mm512_mask_storeu_ps(a, m0, _mm512_add_ps(cols0, _mm512_maskz_loadu_ps(m0, a)));
      _mm512_mask_storeu_ps(a + kLanes, m1, _mm512_add_ps(cols1, _mm512_maskz_loadu_ps(m1, a + kLanes)));
    }
  stream = ahead;
}

// axpy_rows for bf16 (or e4m3) rows with bf16 weights (exp_sum_to_bf16, w_ld elements per head), by axpy_pairs_tile:
// tiles of up to 4 heads x 64 columns (16 accumulators, 4 interleaved row registers and a weight pair within the 32
// registers).
template <typename Rows>
FDC_AVX512_BF16 inline void axpy_rows_bf16(const uint16_t* w, int64_t w_ld, int64_t group, const Rows* rows,
                                           int64_t row_stride, int64_t n, int64_t len, float* acc, int64_t acc_ld,
                                           PrefetchStream& ahead) {
  constexpr int64_t kPairs = 2 * kLanes, kTileColumns = 2 * kPairs;
  for (int64_t x0 = 0; x0 < len; x0 += kTileColumns) {
    const int64_t cols = std::min(kTileColumns, len - x0);
    const int chunks = static_cast<int>((cols + kPairs - 1) / kPairs);
    const __mmask32 last = pairs_mask(cols - (chunks - 1) * kPairs);
    for (int64_t h0 = 0; h0 < group; h0 += 4) {
      const int heads = static_cast<int>(std::min<int64_t>(4, group - h0));
      const uint16_t* wh = w + h0 * w_ld;
      const Rows* r = rows + x0;
      float* ah = acc + h0 * acc_ld + x0;
      switch (heads * 2 + chunks - 1) {
        case 2: axpy_pairs_tile<1, 1>(wh, w_ld, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 3: axpy_pairs_tile<1, 2>(wh, w_ld, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 4: axpy_pairs_tile<2, 1>(wh, w_ld, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 5: axpy_pairs_tile<2, 2>(wh, w_ld, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 6: axpy_pairs_tile<3, 1>(wh, w_ld, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 7: axpy_pairs_tile<3, 2>(wh, w_ld, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 8: axpy_pairs_tile<4, 1>(wh, w_ld, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 9: axpy_pairs_tile<4, 2>(wh, w_ld, r, row_stride, n, last, ah, acc_ld, ahead); break;
        default: TORCH_CHECK(false, "fdc: bf16 axpy tile of ", heads, " heads and ", chunks, " registers");
      }
    }
  }
}

// axpy_pairs_tile for int8 rows (a quantized cache's value codes) and int16 weights, with AVX-512 VNNI: rows r and
// r + 1 are widened to int16 and interleaved as there, and one vpdpwssd adds w[r] row_r + w[r + 1] row_{r + 1} to 16
// columns' int32 sums exactly (|sum| <= 512 * 32767 * 127 < 2^31 for the n <= 512 keys of a block); the sums become
// float once, times each head's weight scale w_scale[h], and are added into acc in column order. w: each head's
// weights, zero after n up to an even count; rows point at the tile's first column, row_stride bytes apart.
template <int kHeads, int kChunks>
FDC_AVX512_VNNI void axpy_pairs_tile_s8(const int16_t* w, int64_t w_ld, const float* w_scale, const int8_t* rows,
                                        int64_t row_stride, int64_t n, __mmask32 last, float* acc, int64_t acc_ld,
                                        PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  constexpr int64_t kPairs = 2 * kLanes;  // columns per register of int16
  const auto chunk_mask = [last](int c) { return c + 1 == kChunks ? last : __mmask32(0xFFFFFFFF); };
  __m512i low[kHeads][kChunks], high[kHeads][kChunks];
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 2
    for (int c = 0; c < kChunks; ++c) low[h][c] = high[h][c] = _mm512_setzero_si512();
  for (int64_t r = 0; r < n; r += 2) {
    const int8_t* row = rows + r * row_stride;
    __m512i x_low[kChunks], x_high[kChunks];
#pragma GCC unroll 2
    for (int c = 0; c < kChunks; ++c) {
      const __mmask32 mask = chunk_mask(c);
      const __m512i a = load_codes_epi16(row, c * kPairs, mask);
      const __m512i b = load_codes_epi16(row + row_stride, c * kPairs, r + 1 < n ? mask : __mmask32(0));
      ahead.step();
      x_low[c] = _mm512_unpacklo_epi16(a, b);
      x_high[c] = _mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      int32_t pair;
      std::memcpy(&pair, w + h * w_ld + r, sizeof(pair));
      const __m512i weights = _mm512_set1_epi32(pair);
#pragma GCC unroll 2
      for (int c = 0; c < kChunks; ++c) {
        low[h][c] = _mm512_dpwssd_epi32(low[h][c], x_low[c], weights);
        high[h][c] = _mm512_dpwssd_epi32(high[h][c], x_high[c], weights);
      }
    }
  }
  // The column order of axpy_pairs_tile's interleave.
  alignas(64) static constexpr int32_t kFirst[kLanes] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static constexpr int32_t kSecond[kLanes] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) {
    const __m512 scale = _mm512_set1_ps(w_scale[h]);
#pragma GCC unroll 2
    for (int c = 0; c < kChunks; ++c) {
      const __mmask32 mask = chunk_mask(c);
      float* a = acc + h * acc_ld + c * kPairs;
      const __mmask16 m0 = __mmask16(mask), m1 = __mmask16(mask >> kLanes);
      const __m512 lo = _mm512_cvtepi32_ps(low[h][c]), hi = _mm512_cvtepi32_ps(high[h][c]);
      const __m512 cols0 = _mm512_permutex2var_ps(lo, first, hi), cols1 = _mm512_permutex2var_ps(lo, second, hi);
      _mm512_mask_storeu_ps(a, m0, _mm512_fmadd_ps(cols0, scale, _mm512_maskz_loadu_ps(m0, a)));
      _mm512_mask_storeu_ps(a + kLanes, m1, _mm512_fmadd_ps(cols1, scale, _mm512_maskz_loadu_ps(m1, a + kLanes)));
    }
  }
  stream = ahead;
}

// axpy_rows for int8 rows with int16 weights (w_ld elements per head, scaled by w_scale per head), by
// axpy_pairs_tile_s8: tiles of up to 4 heads x 64 columns. row_stride: bytes between rows.
FDC_AVX512_VNNI inline void axpy_rows_s8(const int16_t* w, int64_t w_ld, const float* w_scale, int64_t group,
                                         const int8_t* rows, int64_t row_stride, int64_t n, int64_t len, float* acc,
                                         int64_t acc_ld, PrefetchStream& ahead) {
  constexpr int64_t kPairs = 2 * kLanes, kTileColumns = 2 * kPairs;
  for (int64_t x0 = 0; x0 < len; x0 += kTileColumns) {
    const int64_t cols = std::min(kTileColumns, len - x0);
    const int chunks = static_cast<int>((cols + kPairs - 1) / kPairs);
    const __mmask32 last = pairs_mask(cols - (chunks - 1) * kPairs);
    for (int64_t h0 = 0; h0 < group; h0 += 4) {
      const int heads = static_cast<int>(std::min<int64_t>(4, group - h0));
      const int16_t* wh = w + h0 * w_ld;
      const float* sh = w_scale + h0;
      const int8_t* r = rows + x0;
      float* ah = acc + h0 * acc_ld + x0;
      switch (heads * 2 + chunks - 1) {
        case 2: axpy_pairs_tile_s8<1, 1>(wh, w_ld, sh, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 3: axpy_pairs_tile_s8<1, 2>(wh, w_ld, sh, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 4: axpy_pairs_tile_s8<2, 1>(wh, w_ld, sh, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 5: axpy_pairs_tile_s8<2, 2>(wh, w_ld, sh, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 6: axpy_pairs_tile_s8<3, 1>(wh, w_ld, sh, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 7: axpy_pairs_tile_s8<3, 2>(wh, w_ld, sh, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 8: axpy_pairs_tile_s8<4, 1>(wh, w_ld, sh, r, row_stride, n, last, ah, acc_ld, ahead); break;
        case 9: axpy_pairs_tile_s8<4, 2>(wh, w_ld, sh, r, row_stride, n, last, ah, acc_ld, ahead); break;
        default: TORCH_CHECK(false, "fdc: int8 axpy tile of ", heads, " heads and ", chunks, " registers");
      }
    }
  }
}

// axpy_pairs_tile_s8 for int4 rows (two codes per byte, column 2m in byte m's low nibble) and int16 weights, up to 64
// columns (len, even): rows r and r + 1's bytes are widened to int16 and interleaved (vpunpcklwd / vpunpckhwd: an
// int32 lane holds byte m of row r in its low half and byte m of row r + 1 in its high one), and two shifts per half
// sign-extend the low or the high nibble in place, which makes the pair (row r, row r + 1) of column 2m, or of
// column 2m + 1, that vpdpwssd takes against the weight pair (w[r], w[r + 1]): 12 instructions per 64 columns and
// two rows, where widening each row's pairs first (load_codes_epi16) and interleaving them took 28. The sums are
// exact (|sum| <= 256 * 2 * 32767 * 8 < 2^31 for the <= 512 keys of a block), become float once, times w_scale[h],
// and are put back in column order once per block. w: each head's weights, zero after n up to an even count.
template <int kHeads>
FDC_AVX512_VNNI void axpy_nibble_pairs_tile(const int16_t* w, int64_t w_ld, const float* w_scale, const uint8_t* rows,
                                            int64_t row_stride, int64_t n, int64_t len, float* acc, int64_t acc_ld,
                                            PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  const __mmask32 bytes = pairs_mask(len / 2);
  // sums[h][k]: int32 lane 4 L + i (L = 0..3, i = 0..3) holds column 16 L + 2 i (k = 0), 16 L + 2 i + 1 (k = 1),
  // 16 L + 8 + 2 i (k = 2) or 16 L + 9 + 2 i (k = 3)
  __m512i sums[kHeads][4];
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) sums[h][k] = _mm512_setzero_si512();
  for (int64_t r = 0; r < n; r += 2) {
    const uint8_t* row = rows + r * row_stride;
    const __m512i a = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(bytes, row));
    ahead.step();
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(r + 1 < n ? bytes : __mmask32(0), row + row_stride));
    ahead.step();
    const __m512i first = _mm512_unpacklo_epi16(a, b), second = _mm512_unpackhi_epi16(a, b);
    const __m512i x[4] = {
        _mm512_srai_epi16(_mm512_slli_epi16(first, 12), 12), _mm512_srai_epi16(_mm512_slli_epi16(first, 8), 12),
        _mm512_srai_epi16(_mm512_slli_epi16(second, 12), 12), _mm512_srai_epi16(_mm512_slli_epi16(second, 8), 12)};
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      int32_t pair;
      std::memcpy(&pair, w + h * w_ld + r, sizeof(pair));
      const __m512i weights = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) sums[h][k] = _mm512_dpwssd_epi32(sums[h][k], x[k], weights);
    }
  }
  // Column 16 o + d of the output: e = d % 8 is sums[h][2 * (d / 8) + e % 2]'s lane 4 o + e / 2.
  alignas(64) static constexpr int32_t kOrder[4][kLanes] = {
      {0, 16, 1, 17, 2, 18, 3, 19, 0, 16, 1, 17, 2, 18, 3, 19},
      {4, 20, 5, 21, 6, 22, 7, 23, 4, 20, 5, 21, 6, 22, 7, 23},
      {8, 24, 9, 25, 10, 26, 11, 27, 8, 24, 9, 25, 10, 26, 11, 27},
      {12, 28, 13, 29, 14, 30, 15, 31, 12, 28, 13, 29, 14, 30, 15, 31}};
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) {
    const __m512 scale = _mm512_set1_ps(w_scale[h]);
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {
      if (o * kLanes >= len) break;
      const __m512i order = _mm512_load_si512(kOrder[o]);
      const __m512i columns =
          _mm512_mask_blend_epi32(__mmask16(0xFF00), _mm512_permutex2var_epi32(sums[h][0], order, sums[h][1]),
                                  _mm512_permutex2var_epi32(sums[h][2], order, sums[h][3]));
      const __mmask16 mask = lanes_mask(len - o * kLanes);
      float* a = acc + h * acc_ld + o * kLanes;
      _mm512_mask_storeu_ps(a, mask,
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(columns), scale, _mm512_maskz_loadu_ps(mask, a)));
    }
  }
  stream = ahead;
}

// axpy_rows for int4 rows (row_stride bytes apart) with int16 weights (w_ld elements per head, scaled by w_scale per
// head), by axpy_nibble_pairs_tile: tiles of up to 4 heads x 64 columns.
FDC_AVX512_VNNI inline void axpy_rows_s4(const int16_t* w, int64_t w_ld, const float* w_scale, int64_t group,
                                         const uint8_t* rows, int64_t row_stride, int64_t n, int64_t len, float* acc,
                                         int64_t acc_ld, PrefetchStream& ahead) {
  constexpr int64_t kTileColumns = 4 * kLanes;
  for (int64_t x0 = 0; x0 < len; x0 += kTileColumns) {
    const int64_t cols = std::min(kTileColumns, len - x0);
    for (int64_t h0 = 0; h0 < group; h0 += 4) {
      with_count_1_to_4(std::min<int64_t>(4, group - h0), [&](auto heads) {
        axpy_nibble_pairs_tile<decltype(heads)::value>(w + h0 * w_ld, w_ld, w_scale + h0, rows + x0 / 2, row_stride, n,
                                                       cols, acc + h0 * acc_ld + x0, acc_ld, ahead);
      });
    }
  }
}

// Scores of one run of a dim-major int4 page (byte row m holds columns 2m and 2m + 1 of each token, low nibble
// first; rows row_stride bytes apart) against kHeads int16 query rows, with AVX-512 VNNI: byte t of a row becomes
// int32 lane t with its two codes as the lane's int16 pair (load_nibble_pairs), so one vpdpwssd with the head's
// query pair (q[2m], q[2m + 1]) broadcast adds both columns' products to 16 tokens' exact int32 sums
// (|sum| <= 256 * 32767 * 8 < 2^31 for a head of at most 256 dims), with no unpacked copy of the codes. The sums
// become float once, times each head's query scale w_scale[h]: acc[h * acc_ld + t] += w_scale[h] * sum_c
// w[h * w_ld + c] * code(c, t) for t < len, len <= 16 kChunks. dim is even; lanes past len load zeros.
template <int kHeads, int kChunks>
FDC_AVX512_VNNI void axpy_nibble_rows_tile(const int16_t* w, int64_t w_ld, const float* w_scale, const uint8_t* rows,
                                           int64_t row_stride, int64_t dim, int64_t len, float* acc, int64_t acc_ld,
                                           PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  __mmask16 masks[kChunks];
#pragma GCC unroll 4
  for (int c = 0; c < kChunks; ++c) masks[c] = lanes_mask(len - c * kLanes);
  __m512i sums[kHeads][kChunks];
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 4
    for (int c = 0; c < kChunks; ++c) sums[h][c] = _mm512_setzero_si512();
  for (int64_t m = 0; m < dim / 2; ++m) {
    const uint8_t* row = rows + m * row_stride;
    __m512i x[kChunks];
#pragma GCC unroll 4
    for (int c = 0; c < kChunks; ++c) {
      x[c] = load_nibble_pairs(row + c * kLanes, masks[c]);
      ahead.step();
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      int32_t pair;
      std::memcpy(&pair, w + h * w_ld + 2 * m, sizeof(pair));
      const __m512i q = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int c = 0; c < kChunks; ++c) sums[h][c] = _mm512_dpwssd_epi32(sums[h][c], x[c], q);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) {
    const __m512 scale = _mm512_set1_ps(w_scale[h]);
#pragma GCC unroll 4
    for (int c = 0; c < kChunks; ++c) {
      float* a = acc + h * acc_ld + c * kLanes;
      _mm512_mask_storeu_ps(a, masks[c],
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[h][c]), scale, _mm512_maskz_loadu_ps(masks[c], a)));
    }
  }
  stream = ahead;
}

// axpy_nibble_rows_tile over a run of any length and `group` query heads: tiles of up to 4 heads x 64 tokens.
FDC_AVX512_VNNI inline void axpy_nibble_rows(const int16_t* w, int64_t w_ld, const float* w_scale, int64_t group,
                                             const uint8_t* rows, int64_t row_stride, int64_t dim, int64_t len,
                                             float* acc, int64_t acc_ld, PrefetchStream& ahead) {
  constexpr int64_t kTileTokens = 4 * kLanes;
  for (int64_t t0 = 0; t0 < len; t0 += kTileTokens) {
    const int64_t tokens = std::min(kTileTokens, len - t0);
    for (int64_t h0 = 0; h0 < group; h0 += 4) {
      with_count_1_to_4(std::min<int64_t>(4, group - h0), [&](auto heads) {
        with_count_1_to_4((tokens + kLanes - 1) / kLanes, [&](auto chunks) {
          axpy_nibble_rows_tile<decltype(heads)::value, decltype(chunks)::value>(w + h0 * w_ld, w_ld, w_scale + h0,
                                                                                 rows + t0, row_stride, dim, tokens,
                                                                                 acc + h0 * acc_ld + t0, acc_ld, ahead);
        });
      });
    }
  }
}

// Interleaves two rows of bf16 values into VNNI pairs: out[2 x] = a[x], out[2 x + 1] = b[x] for x < width, where
// a[x] and b[x] count as 0 for x >= n (b may be null: all 0); width is a multiple of 32.
FDC_AVX512 inline void interleave_pairs(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n, int64_t width,
                                        c10::BFloat16* out) {
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t x = 0; x < width; x += 32) {
    const __mmask32 mask = n - x >= 32 ? ~__mmask32(0) : n > x ? (__mmask32(1) << (n - x)) - 1 : 0;
    const __m512i va = _mm512_maskz_loadu_epi16(mask, a + x);
    const __m512i vb = b ? _mm512_maskz_loadu_epi16(mask, b + x) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + 2 * x, _mm512_permutex2var_epi16(va, low, vb));
    _mm512_storeu_si512(out + 2 * x + 32, _mm512_permutex2var_epi16(va, high, vb));
  }
}

}  // namespace fdc::cpu::avx512
