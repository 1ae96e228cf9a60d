// AVX-512 dot products along rows (vec_avx512.h says how these kernels are built): the key scores of a contiguous
// cache's token-major rows, in float and, with AVX-512-BF16, bf16 without widening; and the key scores of dim-major
// bf16 pages of 16 tokens.
#pragma once

#include "cpu/vec_avx512.h"

namespace fdc::cpu::avx512 {

// Rows of a group of keys, row k at at(k): from one pointer and the stride (StridedRows), or through a table that
// repeats the last real row of a short group (RowTable).
template <typename T>
struct StridedRows {
  const T* first;
  int64_t stride;
  const T* at(int64_t k) const { return first + k * stride; }
};
template <typename T>
struct RowTable {
  const T* row[kLanes];
  RowTable(const T* first, int64_t stride, int64_t n) {
    for (int64_t k = 0; k < kLanes; ++k) row[k] = first + std::min<int64_t>(k, n - 1) * stride;
  }
  const T* at(int64_t k) const { return row[k]; }
};

// acc[8 * h + k] += a_h * row k0 + k (16 columns from x, `mask`) for rows k < 8 and the query heads h < kHeads (1 or
// 2): each row register is loaded once for both heads.
template <int kHeads, typename Rows>
FDC_AVX512 inline void fma_8_rows(__m512* acc, const __m512* a, const Rows& rows, int64_t k0, int64_t x,
                                  __mmask16 mask) {
#pragma GCC unroll 2
  for (int k1 = 0; k1 < 8; k1 += 4) {  // 4 row registers, then their FMAs: 9-15% faster than row by row (G = 2, 4)
    __m512 row[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) row[k] = load16(rows.at(k0 + k1 + k) + x, mask);
#pragma GCC unroll 2
    for (int h = 0; h < kHeads; ++h)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[8 * h + k1 + k] = _mm512_fmadd_ps(a[h], row[k], acc[8 * h + k1 + k]);
  }
}

// The dot products of one query head `a` (len = full + the lanes of `tail`) with 16 rows, lane k holding row k's.
template <typename Rows>
FDC_AVX512 inline __m512 dot_16_rows(const float* a, const Rows& rows, int64_t full, __mmask16 tail) {
  __m512 acc[kLanes];
#pragma GCC unroll 16
  for (int k = 0; k < kLanes; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t x = 0; x < full; x += kLanes) {
    const __m512 av = _mm512_loadu_ps(a + x);
    fma_8_rows<1>(acc, &av, rows, 0, x, 0xFFFF);
    fma_8_rows<1>(acc + 8, &av, rows, 8, x, 0xFFFF);
  }
  if (tail) {
    const __m512 av = _mm512_maskz_loadu_ps(tail, a + full);
    fma_8_rows<1>(acc, &av, rows, 0, full, tail);
    fma_8_rows<1>(acc + 8, &av, rows, 8, full, tail);
  }
  return sum16x16(acc);
}

// Dot products along rows: out[i * out_ld + r] = sum_x a[i * a_ld + x] * rows[r * row_stride + x] for
// i < group, r < n, x < len. Query heads in pairs against 8 rows at a time (16 accumulators, each row register loaded
// once for both heads; sum16x16 finishes the pair's 16 scores together), a last odd head against 16 rows, rows short
// of a group through a RowTable. Whole groups are addressed from one pointer and the stride: the earlier kernel's
// table of 16 row pointers for every group did not fit beside the accumulators, so GCC kept the pointers in vector
// registers and spilled accumulators inside the column loop. In a microbenchmark of one block in cache (96 rows, 2-core
// AMD EPYC), ns per FMA with the table / now: 0.64 / 0.51 for 1 query head per KV head, 0.53 / 0.34 for 2, 0.48 / 0.34
// for 3, 0.44 / 0.26 for 4 (axpy_rows: 0.14-0.38).
template <typename T>
FDC_AVX512 void dot_rows(const float* a, int64_t a_ld, int64_t group, const T* rows, int64_t row_stride, int64_t n,
                         int64_t len, float* out, int64_t out_ld) {
  const int64_t full = len / kLanes * kLanes;
  const __mmask16 tail = lanes_mask(len - full);
  const int64_t pairs = group / 2 * 2, rows_of_pairs = n / 8 * 8;
  for (int64_t r0 = 0; r0 < rows_of_pairs && pairs > 0; r0 += 8) {
    const T* first = rows + r0 * row_stride;
    for (int64_t i = 0; i < pairs; i += 2) {
      const float* ai = a + i * a_ld;
      __m512 acc[kLanes], av[2];
#pragma GCC unroll 16
      for (int k = 0; k < kLanes; ++k) acc[k] = _mm512_setzero_ps();
      const StridedRows<T> eight{first, row_stride};
      for (int64_t x = 0; x < full; x += kLanes) {
        av[0] = _mm512_loadu_ps(ai + x), av[1] = _mm512_loadu_ps(ai + a_ld + x);
        fma_8_rows<2>(acc, av, eight, 0, x, 0xFFFF);
      }
      if (tail) {
        av[0] = _mm512_maskz_loadu_ps(tail, ai + full), av[1] = _mm512_maskz_loadu_ps(tail, ai + a_ld + full);
        fma_8_rows<2>(acc, av, eight, 0, full, tail);
      }
      const __m512 sums = sum16x16(acc);  // lanes 0-7: head i's 8 rows, 8-15: head i + 1's
      _mm256_storeu_ps(out + i * out_ld + r0, _mm512_castps512_ps256(sums));
      _mm256_storeu_ps(out + (i + 1) * out_ld + r0,
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1)));
    }
  }
  if (pairs > 0 && rows_of_pairs < n) {  // fewer than 8 rows left
    const RowTable<T> short_group(rows + rows_of_pairs * row_stride, row_stride, n - rows_of_pairs);
    for (int64_t i = 0; i < pairs; ++i) {
      _mm512_mask_storeu_ps(out + i * out_ld + rows_of_pairs, lanes_mask(n - rows_of_pairs),
                            dot_16_rows(a + i * a_ld, short_group, full, tail));
    }
  }
  if (pairs == group) return;
  const float* last = a + pairs * a_ld;  // the odd head
  float* last_out = out + pairs * out_ld;
  const int64_t rows_of_16 = n / kLanes * kLanes;
  for (int64_t r0 = 0; r0 < rows_of_16; r0 += kLanes) {
    _mm512_storeu_ps(last_out + r0, dot_16_rows(last, StridedRows<T>{rows + r0 * row_stride, row_stride}, full, tail));
  }
  if (rows_of_16 < n) {
    _mm512_mask_storeu_ps(
        last_out + rows_of_16, lanes_mask(n - rows_of_16),
        dot_16_rows(last, RowTable<T>(rows + rows_of_16 * row_stride, row_stride, n - rows_of_16), full, tail));
  }
}

// dot_rows_bf16 for up to 16 rows and kHeads query heads, lanes holding rows: each 32 columns of the 16 rows
// are transposed in registers (transpose16x16_epi32) so register p holds column pair p of every row, and vdpbf16ps with
// a query's pair broadcast adds it to 16 rows' scores at once. The transpose serves every head and no horizontal sum is
// left. len is even.
template <int kHeads, typename Rows>
FDC_AVX512_BF16 void dot_rows_bf16_lanes(const uint16_t* a, int64_t a_ld, const Rows* const* row, int64_t len,
                                         __mmask16 store, float* out, int64_t out_ld, PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  constexpr int64_t kPairs = 2 * kLanes;  // bf16 elements per register
  // kSets accumulators per head, taking column pairs in turns: one per head made each head's 16 vdpbf16ps of a
  // register a chain of dependent adds, so with 4 heads the latency (not the throughput) of vdpbf16ps set the pace.
  // With 8 chains on the 2-core AMD EPYC (bench_ops' layer, bf16, B=1 x 16K, in L3): 0.60-0.65 -> 0.49-0.55 ms,
  // SmolLM2's 30-layer bf16 step at 4K (3 heads, width 64) 3.5-3.7 -> 2.2-2.8 ms; 12 chains were no better.
  constexpr int kSets = kHeads >= 8 ? 1 : 8 / kHeads;
  __m512 acc[kSets][kHeads];
#pragma GCC unroll 8
  for (int s = 0; s < kSets; ++s)
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) acc[s][h] = _mm512_setzero_ps();
  for (int64_t x = 0; x < len; x += kPairs) {
    const int64_t cols = std::min(kPairs, len - x);
    const __mmask32 mask = pairs_mask(cols);
    __m512i t[kLanes];
#pragma GCC unroll 16
    for (int k = 0; k < kLanes; ++k) {
      t[k] = load32_bf16(row[k] + x, mask);
      ahead.step();
    }
    transpose16x16_epi32(t);
#pragma GCC unroll 16
    for (int p = 0; p < kLanes; ++p) {
      if (2 * p >= cols) break;
#pragma GCC unroll 8
      for (int h = 0; h < kHeads; ++h) {
        uint32_t pair;
        std::memcpy(&pair, a + h * a_ld + x + 2 * p, sizeof(pair));
        acc[p % kSets][h] = _mm512_dpbf16_ps(acc[p % kSets][h], (__m512bh)t[p],
                                             (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair)));
      }
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) {
    __m512 sum = acc[0][h];
#pragma GCC unroll 8
    for (int s = 1; s < kSets; ++s) sum = _mm512_add_ps(sum, acc[s][h]);
    _mm512_mask_storeu_ps(out + h * out_ld, store, sum);
  }
  stream = ahead;
}

// dot_rows for bf16 `a` (raw bits, a_ld elements apart) and bf16 rows (or e4m3 rows, load32_bf16), with AVX-512-BF16:
// vdpbf16ps multiplies 32 bf16 pairs exactly and adds them into 16 float lanes, so rows are never widened; out is
// overwritten. By dot_rows_bf16_lanes: 16 rows at a time (a short last group repeats its final row and stores only the
// real ones), query heads 8 at a time (at most 8 accumulators beside the 16 transposed registers). Per 16 rows and 32
// columns the transpose pays 16 loads and 64 shuffles once for all heads. The form with lanes holding columns (16 loads
// per head, then a 16 x 16 reduction of each head's accumulators: 30 shuffles and 15 adds per 16 rows) was faster for 1
// and 2 query heads per KV head while the transposed form kept one accumulator chain per head; with its 8 chains
// (dot_rows_bf16_lanes) the transposed form won there too, on the 2-core AMD EPYC (bench_ops' layer, builds alternated
// process by process): 2 heads B=8 x 16K 5.9-6.1 against 6.6-6.7 ms, B=4 x 8K 0.94-1.01 against 1.02-1.05; 1 head
// B=8 x 16K 5.8-6.0 against 6.3-6.6, B=4 x 8K within noise. So it is the only form.
template <typename Rows>
FDC_AVX512_BF16 inline void dot_rows_bf16(const uint16_t* a, int64_t a_ld, int64_t group, const Rows* rows,
                                          int64_t row_stride, int64_t n, int64_t len, float* out, int64_t out_ld,
                                          PrefetchStream& ahead) {
  for (int64_t r0 = 0; r0 < n; r0 += kLanes) {
    const Rows* row[kLanes];
    for (int64_t k = 0; k < kLanes; ++k) row[k] = rows + std::min(r0 + k, n - 1) * row_stride;
    const __mmask16 store = lanes_mask(n - r0);
    for_head_tiles_of_8(group, [&](int64_t h0, auto heads) {
      dot_rows_bf16_lanes<decltype(heads)::value>(a + h0 * a_ld, a_ld, row, len, store, out + h0 * out_ld + r0, out_ld,
                                                  ahead);
    });
  }
}

// dot_rows_bf16_lanes' transposed form for integer rows (a quantized cache's key codes: int8, or int4 two per byte)
// against 14-bit queries split into two int8 parts, with AVX-512 VNNI's vpdpbusd. The codes are made unsigned as they
// are loaded (int8: code + 128, 64 bytes a register; int4: load_nibble_halves_u8, code + 8, a row's 32 bytes a
// register, lanes 0-7 the low nibbles' codes and lanes 8-15 the high ones'), and after the transpose one vpdpbusd
// with 4 codes of a query part broadcast adds 4 exact products to 16 rows' int32 sums. A query code q = 128 a + b
// (a in [-127, 127], b in [-64, 63]) takes two vpdpbusd per 4 columns, as many as vpdpwssd on int16 codes, but the
// codes are never widened (int8: 1 instruction per 64 codes instead of a widening per 32; int4: 5 per 64 instead of
// 6 per 32) and a 16 x 16 transpose serves 64 columns instead of 32. a: each query head's parts (a_ld apart), per
// register of the row 128 of them, lane L's 4 a-parts at 4 L and its 4 b-parts at 64 + 4 L (int8: the columns in
// order; int4: the 32 even columns, then the 32 odd ones; split_queries_int14), zero past the head's width;
// offsets[h]: the offset (128 or 8) x the sum of head h's q, which the unsigned codes added. out[h * out_ld + r] =
// sum_c q_h[c] * code(row r, column c), exactly (|128 A| <= 128 * 256 * 255 * 127 < 2^31), overwritten; bytes: the
// head's bytes per row (int8: dim; int4: dim / 2; a multiple of 4).
template <int kHeads, typename Codes>
FDC_AVX512_VNNI void dot_rows_busd_lanes(const int8_t* a, int64_t a_ld, const int32_t* offsets, const Codes* const* row,
                                         int64_t bytes, __mmask16 store, float* out, int64_t out_ld,
                                         PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  constexpr bool kInt4 = std::is_same_v<Codes, uint8_t>;
  constexpr int64_t kBytes = kInt4 ? 32 : 64;          // row bytes per register
  constexpr int kSets = kHeads >= 4 ? 1 : 4 / kHeads;  // chains per head and part: 8 for the tile in all
  __m512i high[kSets][kHeads], low[kSets][kHeads];
#pragma GCC unroll 4
  for (int s = 0; s < kSets; ++s)
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) high[s][h] = low[s][h] = _mm512_setzero_si512();
  for (int64_t x = 0; x < bytes; x += kBytes) {
    const int64_t used = std::min(kBytes, bytes - x);
    __m512i t[kLanes];
#pragma GCC unroll 16
    for (int k = 0; k < kLanes; ++k) {
      if constexpr (kInt4) {
        t[k] = load_nibble_halves_u8(row[k] + x, pairs_mask(used));
      } else {
        t[k] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes_mask(used), row[k] + x),
                                _mm512_set1_epi8(static_cast<char>(0x80)));
      }
      ahead.step();
    }
    transpose16x16_epi32(t);
    const int8_t* ax = a + (x / kBytes) * 128;  // the 128 query parts of this register
#pragma GCC unroll 16
    for (int p = 0; p < kLanes; ++p) {
      if (4 * (kInt4 ? p % 8 : p) >= used) continue;  // a lane past the head's bytes
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        int32_t upper, lower;
        std::memcpy(&upper, ax + h * a_ld + 4 * p, sizeof(upper));
        std::memcpy(&lower, ax + h * a_ld + 64 + 4 * p, sizeof(lower));
        high[p % kSets][h] = _mm512_dpbusd_epi32(high[p % kSets][h], t[p], _mm512_set1_epi32(upper));
        low[p % kSets][h] = _mm512_dpbusd_epi32(low[p % kSets][h], t[p], _mm512_set1_epi32(lower));
      }
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < kHeads; ++h) {
    __m512i hi = high[0][h], lo = low[0][h];
#pragma GCC unroll 4
    for (int s = 1; s < kSets; ++s) hi = _mm512_add_epi32(hi, high[s][h]), lo = _mm512_add_epi32(lo, low[s][h]);
    const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo), _mm512_set1_epi32(offsets[h]));
    _mm512_mask_storeu_ps(out + h * out_ld, store, _mm512_cvtepi32_ps(sum));
  }
  stream = ahead;
}

// dot_rows for split 14-bit queries (in dot_rows_busd_lanes' order) and integer rows (int8_t, or uint8_t holding
// int4 pairs) by dot_rows_busd_lanes: 16 rows at a time (a short last group repeats its final row and stores only
// the real ones), query heads 4 at a time. row_stride: bytes between rows.
template <typename Codes>
FDC_AVX512_VNNI inline void dot_rows_busd(const int8_t* a, int64_t a_ld, const int32_t* offsets, int64_t group,
                                          const Codes* rows, int64_t row_stride, int64_t n, int64_t bytes, float* out,
                                          int64_t out_ld, PrefetchStream& ahead) {
  for (int64_t r0 = 0; r0 < n; r0 += kLanes) {
    const Codes* row[kLanes];
    for (int64_t k = 0; k < kLanes; ++k) row[k] = rows + std::min(r0 + k, n - 1) * row_stride;
    const __mmask16 store = lanes_mask(n - r0);
    for (int64_t h0 = 0; h0 < group; h0 += 4) {
      with_count_1_to_4(std::min<int64_t>(4, group - h0), [&](auto heads) {
        dot_rows_busd_lanes<decltype(heads)::value>(a + h0 * a_ld, a_ld, offsets + h0, row, bytes, store,
                                                    out + h0 * out_ld + r0, out_ld, ahead);
      });
    }
  }
}

// Scores of one run of a dim-major bf16 (or e4m3) page of 16 tokens (each column's 16 tokens take 32 bytes, columns
// back to back) against kHeads bf16 query rows, with AVX-512-BF16: columns c and c + 1 are one 64-byte load,
// interleaved token by token (vpermw), so one vdpbf16ps with a head's query pair (q[c], q[c + 1]) broadcast adds both
// columns' products to the 16 tokens' scores, where axpy_rows widens each column and takes an FMA per column and head.
// out[h * out_ld + t] = sum_c a[h * a_ld + c] * run[c * 16 + t] for h < kHeads, t < len (overwritten); the run
// starts at its page's first token, dim is even. Lane t only ever meets token t, so unused slots of a short run,
// whatever they hold, stay in the lanes that are not stored.
template <int kHeads, typename Rows>
FDC_AVX512_BF16 void dot_page16_bf16_tile(const uint16_t* a, int64_t a_ld, const Rows* run, int64_t dim, int64_t len,
                                          float* out, int64_t out_ld, PrefetchStream& stream) {
  PrefetchStream ahead = stream;
  constexpr int64_t kTokens = 16;
  // word 2t of the interleaved register: token t of the first column; word 2t + 1: token t of the second
  alignas(64) static constexpr uint16_t kInterleave[2 * kTokens] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                                    21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                                    11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  __m512 sums[kHeads];
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) sums[h] = _mm512_setzero_ps();
  for (int64_t c = 0; c < dim; c += 2) {
    const __m512bh x = (__m512bh)_mm512_permutexvar_epi16(interleave, load32_bf16(run + c * kTokens, ~__mmask32(0)));
    ahead.step();
#pragma GCC unroll 8
    for (int h = 0; h < kHeads; ++h) {
      uint32_t pair;
      std::memcpy(&pair, a + h * a_ld + c, sizeof(pair));
      sums[h] = _mm512_dpbf16_ps(sums[h], x, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair)));
    }
  }
  const __mmask16 store = lanes_mask(len);
#pragma GCC unroll 8
  for (int h = 0; h < kHeads; ++h) _mm512_mask_storeu_ps(out + h * out_ld, store, sums[h]);
  stream = ahead;
}

// dot_page16_bf16_tile for `group` query heads, 8 at a time (8 accumulators, the columns and a query pair within
// the 32 registers).
template <typename Rows>
FDC_AVX512_BF16 inline void dot_page16_bf16(const uint16_t* a, int64_t a_ld, int64_t group, const Rows* run,
                                            int64_t dim, int64_t len, float* out, int64_t out_ld,
                                            PrefetchStream& ahead) {
  for_head_tiles_of_8(group, [&](int64_t h0, auto heads) {
    dot_page16_bf16_tile<decltype(heads)::value>(a + h0 * a_ld, a_ld, run, dim, len, out + h0 * out_ld, out_ld, ahead);
  });
}

}  // namespace fdc::cpu::avx512
