// AVX-512 building blocks of the CPU kernels: lanes, masks, widening loads, the horizontal-sum trees, the 16 x 16
// transpose, the prefetch stream. The kernels are grouped by family beside it: dot products along rows
// (vec_avx512_rows.h), weighted sums along page columns (vec_avx512_columns.h), weighted row sums
// (vec_avx512_axpy.h) and the softmax pieces (vec_avx512_softmax.h). All are written with intrinsics in functions
// compiled for AVX-512 F/BW/VL/DQ (FDC_AVX512) or, for the bf16 products, AVX-512-BF16 (FDC_AVX512_BF16); an op calls
// them only where cpu_isa() (cpu_common.h) says the CPU has them. ATen's at::vec::Vectorized was the other
// candidate: its AVX-512 build is chosen by a compile-time macro for a whole translation unit and dispatched through
// DispatchStub, which torch does not export to extensions, so using it would mean compiling each kernel file once per
// ISA with its own flags, which setuptools' one-flag-set-per-extension build cannot express. Per-function target
// attributes give the same code.
//
// Why these kernels beat the portable ones in vec_math.cpp (on AVX-512 machines, bench/bench_ops.py): half-precision
// rows are widened in registers as they are read instead of through a float copy of the block; tails of widths and
// key counts are masked loads instead of scalar loops; 16 dot products finish together in one transpose-and-add tree;
// with AVX-512-BF16, bf16 keys and values are multiplied by vdpbf16ps, two products per lane and instruction, without
// widening (values against probabilities rounded to bf16).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define FDC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define FDC_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
// AVX-512 VNNI (vpdpwssd: int16 pairs multiplied and added into int32 lanes), on every CPU with AVX-512-BF16.
#define FDC_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

namespace fdc::cpu::avx512 {

// Lanes of one float register.
constexpr int64_t kLanes = 16;
// Bytes per cache line on the x86-64 CPUs these kernels run on.
constexpr int64_t kCacheLine = 64;

// Prefetches of the ranges of bytes a decode kernel will read next (the next block of keys), spread over the
// arithmetic on the current block: every kernel below that reads cache rows calls step() once per register it loads
// from the cache (for its first query head, where it re-reads rows for the others), and each step prefetches one
// cache line, the ranges taken in turns line by line (line 0 of each range, then line 1, ...), so that every range's
// stream is under way at once. A prefetch retires at once where a load that misses holds up retirement, and one per
// line loaded keeps the misses in flight without filling the miss buffers: in a C model of a block (160 KiB of
// 13 KB chunks shuffled over 400 MB, read ahead while 8 vdpbf16ps per line were computed on the block before, 2-core
// AMD EPYC), 19.3-19.6 GB/s per core against 10.4-10.7 with the block read ahead by loads first, and 21.7 with no
// memory traffic at all; bursts of 32 or more prefetches between the lines lost most of the gain. An empty stream
// (count 0) issues nothing. The kernels step a local copy and hand it back at their end: the compiler keeps a copy in
// registers, where their stores could alias the caller's.
struct PrefetchStream {
  const char* const* first = nullptr;  // (count) where each range starts
  const int64_t* bytes = nullptr;      // (count) its length
  int64_t count = 0;
  int64_t longest = 0;  // bytes of the longest range
  int64_t line = 0;     // offset of the line to prefetch next in every range still that long
  int64_t range = 0;    // the range whose line is next

  FDC_AVX512 inline void step() {
    if (line >= longest) return;
    if (line < bytes[range]) _mm_prefetch(first[range] + line, _MM_HINT_T0);
    if (++range == count) range = 0, line += kCacheLine;
  }
  // Steps until the first part / parts of the lines are prefetched: where the kernels loaded fewer registers than
  // there are lines ahead (narrow heads), each KV head's end catches up with its share.
  FDC_AVX512 inline void finish_share(int64_t part, int64_t parts) {
    const int64_t end = longest * part / parts;
    while (line < end) step();
  }
};

// Mask of the first min(count, 16) lanes.
FDC_AVX512 inline __mmask16 lanes_mask(int64_t count) {
  return count >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

// Mask of the first min(count, 32) bf16 elements of a register (count >= 0).
FDC_AVX512 inline __mmask32 pairs_mask(int64_t count) {
  return count >= 2 * kLanes ? __mmask32(0xFFFFFFFF) : __mmask32((uint64_t(1) << count) - 1);
}

// Mask of the first min(count, 64) bytes of a register (count >= 0).
FDC_AVX512 inline __mmask64 bytes_mask(int64_t count) {
  return count >= 64 ? ~__mmask64(0) : (__mmask64(1) << count) - 1;
}

// int4 codes (fdc/kv_format.h: column 2m in byte m's low nibble, 2m + 1 in its high one, two's complement) as int8
// codes, for the int8 kernels. A token-major row of `bytes` packed bytes to 2 * bytes codes in column order: each
// byte widened to a 16-bit lane whose low byte becomes the low nibble's code and high byte the high nibble's (both
// sign-extended by a shift up and an arithmetic shift down), so the lanes are the codes in order.
FDC_AVX512 inline void unpack_int4_row(const uint8_t* src, int64_t bytes, int8_t* out) {
  for (int64_t m = 0; m < bytes; m += 32) {
    const int64_t left = std::min<int64_t>(32, bytes - m);
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(static_cast<__mmask32>(bytes_mask(left)), src + m));
    const __m512i low = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(w, 12), 12), _mm512_set1_epi16(0xFF));
    const __m512i high = _mm512_slli_epi16(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 12), 8);
    _mm512_mask_storeu_epi8(out + 2 * m, bytes_mask(2 * left), _mm512_or_si512(low, high));
  }
}

// A dim-major page's byte row of n tokens (columns 2m and 2m + 1 of each) as two code rows of n: the low nibbles'
// codes to low_out, the high ones' to high_out, each nibble looked up in a 16-entry table (vpshufb).
FDC_AVX512 inline void unpack_int4_columns(const uint8_t* src, int64_t n, int8_t* low_out, int8_t* high_out) {
  const __m512i codes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t t = 0; t < n; t += 64) {
    const __mmask64 mask = bytes_mask(n - t);
    const __m512i b = _mm512_maskz_loadu_epi8(mask, src + t);
    _mm512_mask_storeu_epi8(low_out + t, mask, _mm512_shuffle_epi8(codes, _mm512_and_si512(b, nibble)));
    _mm512_mask_storeu_epi8(high_out + t, mask,
                            _mm512_shuffle_epi8(codes, _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble)));
  }
}

// 32 int8 codes of a quantized cache's token-major row, sign-extended to int16 in column order (the operand of
// vpdpwssd, whose int32 lane i is the pair of columns 2i and 2i + 1), columns x .. x + 31 of those in `columns` (the
// rest 0).
FDC_AVX512 inline __m512i load_codes_epi16(const int8_t* row, int64_t x, __mmask32 columns) {
  return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(columns, row + x));
}

// 16 bytes of int4 code pairs (those of `bytes`, the rest 0), byte i widened to int32 lane i with its low nibble's
// code sign-extended into the lane's low int16 and its high nibble's into the high one: lane i is the pair of byte i,
// as vpdpwssd takes it.
FDC_AVX512 inline __m512i load_nibble_pairs(const uint8_t* p, __mmask16 bytes) {
  const __m512i w = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(bytes, p));
  const __m512i low = _mm512_srai_epi32(_mm512_slli_epi32(w, 28), 28);
  const __m512i high = _mm512_slli_epi32(_mm512_srai_epi32(_mm512_slli_epi32(w, 24), 28), 16);
  return _mm512_mask_blend_epi16(0xAAAAAAAA, low, high);
}

// 32 bytes of int4 code pairs (those of `bytes`, the rest 0) as two registers of 32 int16 codes in byte order: the
// low nibbles' codes to `low`, the high ones' to `high` (each sign-extended by a shift up and an arithmetic shift
// down). For a dim-major int4 page's byte row these are 32 tokens of its two columns.
FDC_AVX512 inline void load_nibble_columns(const uint8_t* p, __mmask32 bytes, __m512i& low, __m512i& high) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(bytes, p));
  low = _mm512_srai_epi16(_mm512_slli_epi16(w, 12), 12);
  high = _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 12);
}

// 32 bytes of int4 code pairs (those of `bytes`; the rest read as byte 0) as one register of unsigned codes for
// vpdpbusd: bytes 0-31 (lanes 0-7) the low nibbles' codes, bytes 32-63 (lanes 8-15) the high ones', each code + 8
// (0 to 15: a two's-complement nibble with its sign bit flipped is its value plus 8).
FDC_AVX512 inline __m512i load_nibble_halves_u8(const uint8_t* p, __mmask32 bytes) {
  const __m256i x = _mm256_xor_si256(_mm256_maskz_loadu_epi8(bytes, p), _mm256_set1_epi8(static_cast<char>(0x88)));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i low = _mm256_and_si256(x, nibble), high = _mm256_and_si256(_mm256_srli_epi16(x, 4), nibble);
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

// 16 elements (those of `mask`, the rest 0) as float.
FDC_AVX512 inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
FDC_AVX512 inline __m512 load16(const c10::BFloat16* p, __mmask16 mask) {  // bf16 is the upper half of a float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
FDC_AVX512 inline __m512 load16(const c10::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}
// The codes of a quantized cache (fdc/kv_format.h), as float, unscaled.
FDC_AVX512 inline __m512 load16(const int8_t* p, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}
// e4m3 (sign, 4 exponent bits of bias 7, 3 mantissa bits) moved into float16's fields: magnitude bits << 7 put the
// exponent in float16's (bias 15) and the mantissa at its top, sign bit << 8 on float16's; the float16 is then the
// value times 2^-8, subnormals included (e4m3's m/8 * 2^-6 becomes float16's m/8 * 2^-14), so a multiply by 256
// after vcvtph2ps gives the value exactly. (Every code is finite here: appends never write e4m3fn's NaN, 0x7F.)
FDC_AVX512 inline __m512 load16(const c10::Float8_e4m3fn* p, __mmask16 mask) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mask, p));
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)), _mm512_set1_ps(256.f));
}

// 32 elements of a cache's row as bf16 bits (those of `mask`, the rest 0), the operand of vdpbf16ps: bf16 as stored,
// e4m3 codes converted exactly (every finite e4m3 value is a normal bf16; vdpbf16ps would read a subnormal as 0, so
// the 2^-8 shift of load16 cannot serve). A normal e4m3 (exponent e > 0, mantissa m) is bf16 with exponent e + 120 and
// m at the top of its mantissa: magnitude bits << 4, plus 120 << 7. A subnormal (e = 0: m * 2^-9) is looked up among
// the 8 values by vpermw, whose index is the word's low 5 bits, m when e = 0. Seven instructions per 32 codes where
// load16 takes eight per 16 and the products then take an FMA per 16 elements and head instead of a vdpbf16ps per 32.
FDC_AVX512 inline __m512i load32_bf16(const c10::BFloat16* p, __mmask32 mask) {
  return _mm512_maskz_loadu_epi16(mask, p);
}
FDC_AVX512 inline __m512i load32_bf16(const c10::Float8_e4m3fn* p, __mmask32 mask) {
  // bf16 bits of m * 2^-9 for m < 8: exponent 118 + floor(log2 m), the rest of m's bits below the leading one
  alignas(64) static constexpr uint16_t kSubnormals[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
  const __m512i s = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, p));  // bits 15..7: the sign
  const __m512i y = _mm512_slli_epi16(s, 4);  // bits 15..11 the sign, 10..7 the exponent, 6..4 the mantissa
  __m512i magnitude = _mm512_add_epi16(_mm512_and_si512(y, _mm512_set1_epi16(0x07F0)), _mm512_set1_epi16(0x3C00));
  const __mmask32 subnormal = _mm512_testn_epi16_mask(y, _mm512_set1_epi16(0x0780));
  magnitude = _mm512_mask_permutexvar_epi16(magnitude, subnormal, s, _mm512_load_si512(kSubnormals));
  return _mm512_ternarylogic_epi32(magnitude, y, _mm512_set1_epi16(int16_t(0x8000)), 0xF8);  // magnitude | sign
}

// The first three of sum16x16's four rounds: lane 4L + i of the first (n = 0) and second (n = 1) half holds the sum
// of v[8n + 4(L / 2) + i] over its 128-bit lanes 2(L % 2) and 2(L % 2) + 1 (L < 4, i < 4).
struct Halves {
  __m512 first, second;
};
FDC_AVX512 inline Halves sum16x16_halves(const __m512* v) {
  __m512 pairs[8];  // per 128-bit lane L: (v[2k] at 0 and 2, v[2k+1] at 1 and 3)
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  __m512 quads[4];  // per 128-bit lane L: the lane-L partial sums of v[4m], v[4m+1], v[4m+2], v[4m+3]
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    const __m512d a = _mm512_castps_pd(pairs[2 * m]), b = _mm512_castps_pd(pairs[2 * m + 1]);
    quads[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // 0x88 picks 128-bit lanes (0, 2) of each operand, 0xDD lanes (1, 3): adding them folds lane pairs.
  return {
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD)),
      _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD))};
}

// The 16 horizontal sums of v[0..15], lane k holding the sum of v[k]: four rounds of pairing and adding (30
// shuffles and 15 adds for 16 sums, against 16 separate reduction trees of 4 shuffles and 4 adds each).
FDC_AVX512 inline __m512 sum16x16(const __m512* v) {
  const Halves halves = sum16x16_halves(v);
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves.first, halves.second, 0x88),
                       _mm512_shuffle_f32x4(halves.first, halves.second, 0xDD));
}

// The 32 sums of the column pairs v[0..15] (v[k]: terms of column 2k in lanes 0-7, of column 2k + 1 in lanes 8-15):
// sums[n] lane c holds column 16n + c. sum16x16_halves leaves column 16n + 8(L / 2) + 2i + L % 2 in lane 4L + i of
// half n (its three rounds add 128-bit lanes 0 and 1, and 2 and 3); one permute per half puts them in order
// (checked lane by lane against the instructions' definitions before use).
FDC_AVX512 inline void sum_column_pairs(const __m512* v, __m512* sums) {
  alignas(64) static constexpr int32_t kOrder[kLanes] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
  const __m512i order = _mm512_load_si512(kOrder);
  const Halves halves = sum16x16_halves(v);
  sums[0] = _mm512_permutexvar_ps(order, halves.first);
  sums[1] = _mm512_permutexvar_ps(order, halves.second);
}

// Transposes 16 registers of 16 32-bit lanes in place: afterwards t[c] lane r holds what t[r] lane c held. 32-bit then
// 64-bit interleaves give, per 128-bit lane, 4 x 4 blocks; two rounds of 128-bit lane shuffles put the blocks in
// place (64 shuffles; checked lane by lane against the instructions' definitions before use). Always inlined: GCC
// kept it a call, through memory, inside the dot_rows kernels; inlined, bench_ops' layer (B=4 x 8K, 2-core AMD EPYC
// Zen 4, builds alternated) went from 1.99-2.05 to 1.88-1.89 ms (bf16), 1.91 to 1.70-1.75 (int8), 2.19-2.21
// to 2.07-2.08 (e4m3).
FDC_AVX512 inline __attribute__((always_inline)) void transpose16x16_epi32(__m512i* t) {
  __m512i pairs[16];  // pairs[2i] lane 4L + k: rows 2i, 2i + 1 at columns 4L, 4L + 1 (2i + 1: 4L + 2, 4L + 3)
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    pairs[2 * i] = _mm512_unpacklo_epi32(t[2 * i], t[2 * i + 1]);
    pairs[2 * i + 1] = _mm512_unpackhi_epi32(t[2 * i], t[2 * i + 1]);
  }
  __m512i quads[16];  // quads[4g + j] lane 4L + k: row 4g + k at column 4L + j
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    quads[4 * g] = _mm512_unpacklo_epi64(pairs[4 * g], pairs[4 * g + 2]);
    quads[4 * g + 1] = _mm512_unpackhi_epi64(pairs[4 * g], pairs[4 * g + 2]);
    quads[4 * g + 2] = _mm512_unpacklo_epi64(pairs[4 * g + 1], pairs[4 * g + 3]);
    quads[4 * g + 3] = _mm512_unpackhi_epi64(pairs[4 * g + 1], pairs[4 * g + 3]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // 128-bit lane L of quads[4g + j] becomes lane g of t[4L + j]
    const __m512i low01 = _mm512_shuffle_i32x4(quads[j], quads[4 + j], 0x44);
    const __m512i high01 = _mm512_shuffle_i32x4(quads[j], quads[4 + j], 0xEE);
    const __m512i low23 = _mm512_shuffle_i32x4(quads[8 + j], quads[12 + j], 0x44);
    const __m512i high23 = _mm512_shuffle_i32x4(quads[8 + j], quads[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(low01, low23, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(low01, low23, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(high01, high23, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(high01, high23, 0xDD);
  }
}

// f(std::integral_constant<int, count>{}) for a count of 1 to 4 (registers or heads of a tile as a template argument).
template <typename F>
inline void with_count_1_to_4(int64_t count, F&& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: TORCH_CHECK(false, "fdc: a tile of ", count, " registers or heads, not 1 to 4");
  }
}

// Calls tile(h0, std::integral_constant<int, heads>{}) for the query heads of `group` taken 8 at a time (h0 the
// first, heads = min(8, group - h0)): the dispatch of the kernels whose tiles take 1 to 8 heads as a template
// argument.
template <typename Tile>
inline void for_head_tiles_of_8(int64_t group, Tile&& tile) {
  for (int64_t h0 = 0; h0 < group; h0 += 8) {
    switch (std::min<int64_t>(8, group - h0)) {
      case 1: tile(h0, std::integral_constant<int, 1>{}); break;
      case 2: tile(h0, std::integral_constant<int, 2>{}); break;
      case 3: tile(h0, std::integral_constant<int, 3>{}); break;
      case 4: tile(h0, std::integral_constant<int, 4>{}); break;
      case 5: tile(h0, std::integral_constant<int, 5>{}); break;
      case 6: tile(h0, std::integral_constant<int, 6>{}); break;
      case 7: tile(h0, std::integral_constant<int, 7>{}); break;
      default: tile(h0, std::integral_constant<int, 8>{}); break;
    }
  }
}

}  // namespace fdc::cpu::avx512
