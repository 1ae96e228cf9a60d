#include "cpu/vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string_view>

#include "cpu/cpu_common.h"
#include "fdc/attention_variant.h"
#include "fdc/float_math.h"

namespace fdc::cpu {
namespace {

// Reductions keep kLanes independent partial results, which the compiler maps to vector lanes without having to
// reassociate a single running sum (it may not, without -ffast-math); 16 covers two AVX2 registers.
constexpr int64_t kLanes = 16;

// log(x) for positive normal x, to about 1 ulp: x = 2^e m with m in [sqrt(1/2), sqrt(2)), so t = m - 1 is exact and
// small; log(1 + t) = t - t^2 / 2 + t^3 P(t) with P the degree-8 minimax polynomial of Cephes' logf, and e ln2 added
// in two parts (ln2 = 0.693359375 - 2.12194440e-4, the first exact times any e). Branch-free, so a loop over it
// vectorises.
[[gnu::always_inline]] inline float log_approx(float x) {
  constexpr float kSqrt2 = 1.41421356f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  const int32_t bits = __builtin_bit_cast(int32_t, x);
  const float m = __builtin_bit_cast(float, (bits & 0x007fffff) | 0x3f800000);  // [1, 2)
  const bool high = m > kSqrt2;
  const float e = static_cast<float>((bits >> 23) - 127 + (high ? 1 : 0));
  const float t = (high ? 0.5f * m : m) - 1.f;
  const float t2 = t * t;
  float p = 7.0376836292e-2f;
  p = p * t - 1.1514610310e-1f;
  p = p * t + 1.1676998740e-1f;
  p = p * t - 1.2420140846e-1f;
  p = p * t + 1.4249322787e-1f;
  p = p * t - 1.6668057665e-1f;
  p = p * t + 2.0000714765e-1f;
  p = p * t - 2.4999993993e-1f;
  p = p * t + 3.3333331174e-1f;
  const float y = t * t2 * p + e * kLn2Lo - 0.5f * t2;
  return (t + y) + e * kLn2Hi;
}

// -log u for Keyformer's uniform u = (bits >> 8) * 2^-24, clamped as the composed scoring clamps it.
[[gnu::always_inline]] inline float negative_log_uniform(uint32_t bits) {
  constexpr float kStep = 5.9604644775390625e-8f;  // 2^-24
  float u = static_cast<float>(static_cast<int32_t>(bits >> 8)) * kStep;
  u = u < 1e-20f ? 1e-20f : u;
  u = u > 1.f - 1e-7f ? 1.f - 1e-7f : u;
  return -log_approx(u);
}

}  // namespace

CpuIsa cpu_isa(const char* op) {
#if defined(__GNUC__) && defined(__x86_64__)
  static const CpuIsa detected = [] {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))) {
      return CpuIsa::kPortable;
    }
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") ? CpuIsa::kAvx512Bf16
                                                                                        : CpuIsa::kAvx512;
  }();
#else
  const CpuIsa detected = CpuIsa::kPortable;
#endif
  const char* cap = std::getenv("FDC_CPU_ISA");
  if (cap == nullptr || *cap == '\0') return detected;
  const std::string_view name(cap);
  CpuIsa wanted;
  if (name == "portable") {
    wanted = CpuIsa::kPortable;
  } else if (name == "avx512") {
    wanted = CpuIsa::kAvx512;
  } else if (name == "avx512bf16") {
    wanted = CpuIsa::kAvx512Bf16;
  } else {
    TORCH_CHECK(false, "fdc::", op, ": FDC_CPU_ISA must be portable, avx512 or avx512bf16 but is '", name, "'");
  }
  return std::min(wanted, detected);
}

FDC_CPU_SIMD float exp_and_sum(float* x, int64_t n, float scale, float shift) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      x[i + l] = exp_approx(x[i + l] * scale - shift);
      lanes[l] += x[i + l];
    }
  }
  for (; i < n; ++i) {
    x[i] = exp_approx(x[i] * scale - shift);
    lanes[0] += x[i];
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

FDC_CPU_SIMD_WIDE void soft_cap_scores(float* x, int64_t n, float scale, float softcap) {
  for (int64_t i = 0; i < n; ++i) x[i] = soft_cap(x[i] * scale, softcap);
}

FDC_CPU_SIMD void scale_in_place(float* x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

FDC_CPU_SIMD void add_scaled(float* acc, const float* x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) acc[i] += factor * x[i];
}

FDC_CPU_SIMD_WIDE float gumbel_exp_and_sum(float* x, const uint32_t* bits, int64_t n, float shift,
                                           float inverse_temperature) {
  float lanes[kLanes] = {};
  const bool unit = inverse_temperature == 1.f;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    if (unit) {
      for (int64_t l = 0; l < kLanes; ++l) {
        x[i + l] = exp_approx(x[i + l] - shift) / negative_log_uniform(bits[i + l]);
        lanes[l] += x[i + l];
      }
    } else {
      for (int64_t l = 0; l < kLanes; ++l) {
        x[i + l] =
            exp_approx(((x[i + l] - shift) - log_approx(negative_log_uniform(bits[i + l]))) * inverse_temperature);
        lanes[l] += x[i + l];
      }
    }
  }
  for (; i < n; ++i) {
    const float noise = negative_log_uniform(bits[i]);
    x[i] = unit ? exp_approx(x[i] - shift) / noise
                : exp_approx(((x[i] - shift) - log_approx(noise)) * inverse_temperature);
    lanes[0] += x[i];
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

namespace {

// Eight floats, one AVX2 register (two SSE registers in the baseline clone): GCC's vector extension, so the
// register blocking below is explicit rather than left to the auto-vectoriser.
using f32x8 = float __attribute__((vector_size(32)));
constexpr int64_t kVec = 8;

[[gnu::always_inline]] inline f32x8 load8(const float* p) {
  f32x8 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

[[gnu::always_inline]] inline void store8(float* p, f32x8 v) { __builtin_memcpy(p, &v, sizeof(v)); }

[[gnu::always_inline]] inline float sum8(f32x8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Loads 8 consecutive elements as float: bfloat16 by a 16-bit shift (it is the upper half of a float32), float16
// through the compiler's _Float16 (F16C's vcvtph2ps in the AVX2 clone).
[[gnu::always_inline]] inline f32x8 load8(const c10::BFloat16* p) {
  using u16x8 = uint16_t __attribute__((vector_size(16)));
  using u32x8 = uint32_t __attribute__((vector_size(32)));
  u16x8 h;
  __builtin_memcpy(&h, p, sizeof(h));
  return reinterpret_cast<f32x8>(__builtin_convertvector(h, u32x8) << 16);
}

[[gnu::always_inline]] inline f32x8 load8(const c10::Half* p) {
  using f16x8 = _Float16 __attribute__((vector_size(16)));
  f16x8 h;
  __builtin_memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, f32x8);
}

[[gnu::always_inline]] inline float load1(const c10::BFloat16* p) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(p->x) << 16);
}
[[gnu::always_inline]] inline float load1(const c10::Half* p) {
  return static_cast<float>(__builtin_bit_cast(_Float16, p->x));
}

// The eight horizontal sums of v[0..7] as one vector: three rounds of pairing lanes and adding, instead of a
// separate shuffle-and-add tree per vector.
[[gnu::always_inline]] inline f32x8 sum8x8(const f32x8* v) {
  f32x8 pairs[4];
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    pairs[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(v[2 * k], v[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  const f32x8 quads0 = __builtin_shufflevector(pairs[0], pairs[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                       __builtin_shufflevector(pairs[0], pairs[1], 2, 3, 10, 11, 6, 7, 14, 15);
  const f32x8 quads1 = __builtin_shufflevector(pairs[2], pairs[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                       __builtin_shufflevector(pairs[2], pairs[3], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(quads0, quads1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(quads0, quads1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// out[k] = a . rows[k] for kRows rows (8 or 1), 8 columns at a time with one accumulator per row: the chains are
// independent, so consecutive FMAs do not wait on each other, each chunk of `a` is loaded once for all rows, and
// with 8 rows the final sums come out together (sum8x8).
template <int kRows>
[[gnu::always_inline]] inline void dot_block(const float* a, const float* row, int64_t row_stride, int64_t dim,
                                             float* out) {
  f32x8 acc[kRows] = {};
  const int64_t dim8 = dim / kVec * kVec;
  for (int64_t c = 0; c < dim8; c += kVec) {
    const f32x8 av = load8(a + c);
#pragma GCC unroll 8
    for (int k = 0; k < kRows; ++k) acc[k] += av * load8(row + k * row_stride + c);
  }
  float tails[kRows] = {};
  for (int64_t c = dim8; c < dim; ++c) {
#pragma GCC unroll 8
    for (int k = 0; k < kRows; ++k) tails[k] += a[c] * row[k * row_stride + c];
  }
  if constexpr (kRows == 8) {
    f32x8 tail;
    __builtin_memcpy(&tail, tails, sizeof(tail));
    store8(out, sum8x8(acc) + tail);
  } else {
    for (int k = 0; k < kRows; ++k) out[k] = sum8(acc[k]) + tails[k];
  }
}

[[gnu::always_inline]] inline f32x8 splat8(float x) { return f32x8{x, x, x, x, x, x, x, x}; }

// acc[0, 8 * kVecs) += sum_r w[r] * rows[r * row_stride + (0, 8 * kVecs)]: kVecs accumulators held in registers
// across a chunk of rows (kSumChunk), so kVecs independent FMA chains hide latency; each chunk's sums start from zero
// and are added to acc after it (vec_math.h, kSumChunk, says why).
template <int kVecs>
[[gnu::always_inline]] inline void axpy_slice(const float* w, const float* rows, int64_t row_stride, int64_t n,
                                              float* acc) {
  for (int64_t r0 = 0; r0 < n; r0 += kSumChunk) {
    f32x8 slice[kVecs] = {};
    const int64_t r1 = std::min(n, r0 + kSumChunk);
    for (int64_t r = r0; r < r1; ++r) {
      const f32x8 weight = splat8(w[r]);
      const float* row = rows + r * row_stride;
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) slice[v] += weight * load8(row + v * kVec);
    }
#pragma GCC unroll 8
    for (int v = 0; v < kVecs; ++v) store8(acc + v * kVec, load8(acc + v * kVec) + slice[v]);
  }
}

// Four doubles, one AVX2 register: the float64 sums of dot_rows_f64 and axpy_rows_f64.
using f64x4 = double __attribute__((vector_size(32)));

[[gnu::always_inline]] inline f64x4 low4(f32x8 v) {
  return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1, 2, 3), f64x4);
}
[[gnu::always_inline]] inline f64x4 high4(f32x8 v) {
  return __builtin_convertvector(__builtin_shufflevector(v, v, 4, 5, 6, 7), f64x4);
}

// out[k] = a . rows[k] for kRows rows (8 or 1) as dot_block computes it, 8 columns at a time in a float accumulator
// per row, but the 8 lanes (and the columns after the last 8) added in float64 and rounded once (dot_rows_f64 says
// why).
template <int kRows>
[[gnu::always_inline]] inline void dot_block_f64(const float* a, const float* row, int64_t row_stride, int64_t dim,
                                                 float* out) {
  f32x8 acc[kRows] = {};
  const int64_t dim8 = dim / kVec * kVec;
  for (int64_t c = 0; c < dim8; c += kVec) {
    const f32x8 av = load8(a + c);
#pragma GCC unroll 8
    for (int k = 0; k < kRows; ++k) acc[k] += av * load8(row + k * row_stride + c);
  }
  f64x4 total[kRows];
  double tails[kRows] = {};
#pragma GCC unroll 8
  for (int k = 0; k < kRows; ++k) total[k] = low4(acc[k]) + high4(acc[k]);
  for (int64_t c = dim8; c < dim; ++c) {
#pragma GCC unroll 8
    for (int k = 0; k < kRows; ++k) tails[k] += double(a[c]) * double(row[k * row_stride + c]);
  }
  if constexpr (kRows % 4 == 0) {  // each four horizontal sums as one vector, as sum8x8 does for floats
#pragma GCC unroll 2
    for (int k = 0; k < kRows; k += 4) {
      const f64x4 halves01 = __builtin_shufflevector(total[k], total[k + 1], 0, 4, 2, 6) +
                             __builtin_shufflevector(total[k], total[k + 1], 1, 5, 3, 7);
      const f64x4 halves23 = __builtin_shufflevector(total[k + 2], total[k + 3], 0, 4, 2, 6) +
                             __builtin_shufflevector(total[k + 2], total[k + 3], 1, 5, 3, 7);
      f64x4 tail;
      __builtin_memcpy(&tail, tails + k, sizeof(tail));
      const f64x4 sums = __builtin_shufflevector(halves01, halves23, 0, 1, 4, 5) +
                         __builtin_shufflevector(halves01, halves23, 2, 3, 6, 7) + tail;
      using f32x4 = float __attribute__((vector_size(16)));
      const f32x4 rounded = __builtin_convertvector(sums, f32x4);
      __builtin_memcpy(out + k, &rounded, sizeof(rounded));
    }
  } else {
    for (int k = 0; k < kRows; ++k)
      out[k] = static_cast<float>((total[k][0] + total[k][2]) + (total[k][1] + total[k][3]) + tails[k]);
  }
}

// acc[0, 8 * kVecs) += sum_r w[r] * rows[r * row_stride + (0, 8 * kVecs)] in float64 (axpy_rows_f64 says why): float
// sums over runs of kFloat64Chunk rows, each widened and added to the float64 sums, which are added to acc and
// rounded once.
template <int kVecs>
[[gnu::always_inline]] inline void axpy_slice_f64(const float* w, const float* rows, int64_t row_stride, int64_t n,
                                                  float* acc) {
  f64x4 low[kVecs] = {}, high[kVecs] = {};
  for (int64_t r0 = 0; r0 < n; r0 += kFloat64Chunk) {
    f32x8 part[kVecs] = {};
    const int64_t r1 = std::min(n, r0 + kFloat64Chunk);
    for (int64_t r = r0; r < r1; ++r) {
      const f32x8 weight = splat8(w[r]);
      const float* row = rows + r * row_stride;
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) part[v] += weight * load8(row + v * kVec);
    }
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) low[v] += low4(part[v]), high[v] += high4(part[v]);
  }
#pragma GCC unroll 4
  for (int v = 0; v < kVecs; ++v) {
    const f32x8 before = load8(acc + v * kVec);
    const f64x4 sum_low = low4(before) + low[v], sum_high = high4(before) + high[v];
    f32x8 after;
    for (int l = 0; l < 4; ++l) {
      after[l] = static_cast<float>(sum_low[l]);
      after[l + 4] = static_cast<float>(sum_high[l]);
    }
    store8(acc + v * kVec, after);
  }
}

}  // namespace

// Two registers' maxima by selects (vmaxps) and NaNs by a separate flag register: written per element, the select
// that keeps a NaN (x > m || x != x) and a flag array both compiled to scalar compares, an eighth of the speed.
FDC_CPU_SIMD float max_of(const float* x, int64_t n) {
  const f32x8 lowest = splat8(-INFINITY), one = splat8(1.f);
  f32x8 m0 = lowest, m1 = lowest, nan = splat8(0.f);
  int64_t i = 0;
  for (; i + 2 * kVec <= n; i += 2 * kVec) {
    const f32x8 v0 = load8(x + i), v1 = load8(x + i + kVec);
    m0 = v0 > m0 ? v0 : m0;
    m1 = v1 > m1 ? v1 : m1;
    nan = v0 != v0 ? one : nan;
    nan = v1 != v1 ? one : nan;
  }
  m0 = m1 > m0 ? m1 : m0;
  float m = -INFINITY;
  bool any_nan = false;
  for (int l = 0; l < kVec; ++l) {
    m = m0[l] > m ? m0[l] : m;
    any_nan |= nan[l] != 0.f;
  }
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    any_nan |= x[i] != x[i];
  }
  return any_nan ? NAN : m;
}

FDC_CPU_SIMD void dot_rows(const float* a, int64_t a_ld, int64_t group, const float* rows, int64_t row_stride,
                           int64_t n, int64_t dim, float* out, int64_t out_ld, bool accumulate) {
  constexpr int64_t kRowBlock = 8;  // rows per dot_block: 8 accumulators plus operands fit the 16 AVX2 registers
  float sums[kRowBlock];
  for (int64_t r = 0; r < n; r += kRowBlock) {
    const int64_t count = std::min(kRowBlock, n - r);
    for (int64_t i = 0; i < group; ++i) {
      if (count == kRowBlock) {
        dot_block<kRowBlock>(a + i * a_ld, rows + r * row_stride, row_stride, dim, sums);
      } else {
        for (int64_t k = 0; k < count; ++k)
          dot_block<1>(a + i * a_ld, rows + (r + k) * row_stride, row_stride, dim, sums + k);
      }
      float* o = out + i * out_ld + r;
      for (int64_t k = 0; k < count; ++k) o[k] = (accumulate ? o[k] : 0.f) + sums[k];
    }
  }
}

FDC_CPU_SIMD void axpy_rows(const float* w, int64_t w_ld, int64_t group, const float* rows, int64_t row_stride,
                            int64_t n, int64_t dim, float* acc, int64_t acc_ld) {
  // Columns go in slices of 64 (eight registers), the rest (fewer than 64) as one narrower slice, then one by one.
  constexpr int kSliceVecs = 8;
  for (int64_t i = 0; i < group; ++i) {
    const float* wi = w + i * w_ld;
    float* ai = acc + i * acc_ld;
    int64_t c0 = 0;
    for (; c0 + kSliceVecs * kVec <= dim; c0 += kSliceVecs * kVec)
      axpy_slice<kSliceVecs>(wi, rows + c0, row_stride, n, ai + c0);
    const int64_t rest_vecs = (dim - c0) / kVec;
    switch (rest_vecs) {
      case 0: break;
      case 1: axpy_slice<1>(wi, rows + c0, row_stride, n, ai + c0); break;
      case 2: axpy_slice<2>(wi, rows + c0, row_stride, n, ai + c0); break;
      case 3: axpy_slice<3>(wi, rows + c0, row_stride, n, ai + c0); break;
      case 4: axpy_slice<4>(wi, rows + c0, row_stride, n, ai + c0); break;
      case 5: axpy_slice<5>(wi, rows + c0, row_stride, n, ai + c0); break;
      case 6: axpy_slice<6>(wi, rows + c0, row_stride, n, ai + c0); break;
      case 7: axpy_slice<7>(wi, rows + c0, row_stride, n, ai + c0); break;
      default: TORCH_CHECK(false, "fdc: axpy_rows has ", rest_vecs, " leftover vectors, at most 7 are possible");
    }
    for (c0 += rest_vecs * kVec; c0 < dim; ++c0) {  // in chunks of rows too, as axpy_slice
      float total = ai[c0];
      for (int64_t r0 = 0; r0 < n; r0 += kSumChunk) {
        float part = 0.f;
        for (int64_t r = r0; r < std::min(n, r0 + kSumChunk); ++r) part += wi[r] * rows[r * row_stride + c0];
        total += part;
      }
      ai[c0] = total;
    }
  }
}

FDC_CPU_SIMD void dot_rows_f64(const float* a, int64_t a_ld, int64_t group, const float* rows, int64_t row_stride,
                               int64_t n, int64_t dim, float* out, int64_t out_ld) {
  constexpr int64_t kRowBlock = 8;  // as dot_rows
  for (int64_t r = 0; r < n; r += kRowBlock) {
    const int64_t count = std::min(kRowBlock, n - r);
    for (int64_t i = 0; i < group; ++i) {
      float* o = out + i * out_ld + r;
      if (count == kRowBlock) {
        dot_block_f64<kRowBlock>(a + i * a_ld, rows + r * row_stride, row_stride, dim, o);
      } else {
        for (int64_t k = 0; k < count; ++k)
          dot_block_f64<1>(a + i * a_ld, rows + (r + k) * row_stride, row_stride, dim, o + k);
      }
    }
  }
}

FDC_CPU_SIMD void axpy_rows_f64(const float* w, int64_t w_ld, int64_t group, const float* rows, int64_t row_stride,
                                int64_t n, int64_t dim, float* acc, int64_t acc_ld) {
  // Columns go in slices of 32 (eight registers of doubles), the rest as one narrower slice, then one by one.
  constexpr int kSliceVecs = 4;
  for (int64_t i = 0; i < group; ++i) {
    const float* wi = w + i * w_ld;
    float* ai = acc + i * acc_ld;
    int64_t c0 = 0;
    for (; c0 + kSliceVecs * kVec <= dim; c0 += kSliceVecs * kVec)
      axpy_slice_f64<kSliceVecs>(wi, rows + c0, row_stride, n, ai + c0);
    const int64_t rest_vecs = (dim - c0) / kVec;
    switch (rest_vecs) {
      case 0: break;
      case 1: axpy_slice_f64<1>(wi, rows + c0, row_stride, n, ai + c0); break;
      case 2: axpy_slice_f64<2>(wi, rows + c0, row_stride, n, ai + c0); break;
      case 3: axpy_slice_f64<3>(wi, rows + c0, row_stride, n, ai + c0); break;
      default: TORCH_CHECK(false, "fdc: axpy_rows_f64 has ", rest_vecs, " leftover vectors, at most 3 are possible");
    }
    for (c0 += rest_vecs * kVec; c0 < dim; ++c0) {
      double total = ai[c0];
      for (int64_t r = 0; r < n; ++r) total += double(wi[r]) * double(rows[r * row_stride + c0]);
      ai[c0] = static_cast<float>(total);
    }
  }
}

#define FDC_DEFINE_ROWS_TO_FLOAT(T)                                                                           \
  FDC_CPU_SIMD void rows_to_float(const T* src, int64_t src_stride, int64_t rows, int64_t cols, float* dst) { \
    const int64_t cols8 = cols / kVec * kVec;                                                                 \
    for (int64_t r = 0; r < rows; ++r) {                                                                      \
      const T* s = src + r * src_stride;                                                                      \
      float* d = dst + r * cols;                                                                              \
      for (int64_t c = 0; c < cols8; c += kVec) store8(d + c, load8(s + c));                                  \
      for (int64_t c = cols8; c < cols; ++c) d[c] = load1(s + c);                                             \
    }                                                                                                         \
  }

FDC_DEFINE_ROWS_TO_FLOAT(c10::BFloat16)
FDC_DEFINE_ROWS_TO_FLOAT(c10::Half)

}  // namespace fdc::cpu
