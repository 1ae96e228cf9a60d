// AVX-512 softmax pieces (vec_avx512.h says how these kernels are built): exp by a polynomial, exps summed and
// rounded to bf16 as they are made, maxima and scaling.
#pragma once

#include "cpu/vec_avx512.h"
#include "fdc/float_math.h"

namespace fdc::cpu::avx512 {

// exp(x), 16 lanes: x = n ln2 + r (Cody-Waite split of ln2), exp(r) by a polynomial of degree kDegree, times 2^n by
// vscalefps (exact, no exponent-field arithmetic). Degree 6 is fdc/float_math.h's (within 0.9 ulp of float32); degree
// 4 is Taylor's, within 5e-5 relative (|r| <= ln2 / 2), for results rounded to bfloat16 right after (a rounding step of
// 3.9e-3). Arguments below log(FLT_MIN) give 0, so a -inf score contributes nothing; NaN stays NaN.
template <int kDegree = 6>
FDC_AVX512 inline __m512 exp16(__m512 x) {
  static_assert(kDegree == 4 || kDegree == 6);
  constexpr float kTaylor[] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24};
  auto coefficient = [&](int k) { return kDegree == 6 ? fdc::exp_polynomial_coefficient(k) : kTaylor[k]; };
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365447f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_set1_ps(88.7228391f), x);  // min/max return their second operand on NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(coefficient(kDegree));
#pragma GCC unroll 6
  for (int k = kDegree - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(coefficient(k)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_scalef_ps(p, n));
}

// 2^y, 16 lanes, for results rounded to bfloat16 right after: y = n + f with n = floor(y) and 0 <= f < 1 (f from
// one vreduceps), 2^f by a cubic fitted for least maximum relative error on [0, 1) (7.5e-5, against bf16's rounding
// step of 3.9e-3), times 2^n by vscalefps, which floors y itself. The caller folds log2(e) into its scale. No range
// check is needed: -inf gives f = 0 and a product of 0, vscalefps underflows to 0 and overflows to inf by itself, and
// NaN stays NaN. Measured on a 2-core Intel Xeon (64K values, exponentiated, summed and stored as bf16): 0.082 ns per
// value, against 0.116 with n = round(y) by vroundscaleps, a subtraction and a clamp from below.
FDC_AVX512 inline __m512 exp2_for_bf16(__m512 y) {
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // y - floor(y)
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.07802453f), f, _mm512_set1_ps(0.22606715f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69583354f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99992522f));
  return _mm512_scalef_ps(p, y);
}

// out[i] = bfloat16(exp(x[i] * scale - shift)) for i < n (vcvtne2ps2bf16: round to nearest even, 32 values per
// conversion and store), times factors[i] before the rounding where factors are given (a quantized cache's value
// scales); returns the sum of the float32 exps (the softmax denominator is summed before rounding, as torch's CPU
// flash attention does, and without the factors). With kZeroToChunkEnd, zeros follow up to the next multiple of 32
// (out must have room): the weights of axpy_rows_bf16 and of dot_columns' bf16 tiles, which read them in pairs or
// whole 16-token runs.
template <bool kZeroToChunkEnd = false>
FDC_AVX512_BF16 inline float exp_sum_to_bf16(const float* x, int64_t n, float scale, float shift, c10::BFloat16* out,
                                             const float* factors = nullptr) {
  constexpr float kLog2e = 1.44269504088896341f;
  const __m512 sc = _mm512_set1_ps(scale * kLog2e), s = _mm512_set1_ps(-shift * kLog2e);
  __m512 sum = _mm512_setzero_ps();
  // 32 values from i: those of masks lo (the first 16) and hi (the next 16); the rest are neither read nor written.
  auto step = [&](int64_t i, __mmask16 lo, __mmask16 hi) FDC_AVX512_BF16 {
    const __m512 e0 = _mm512_maskz_mov_ps(lo, exp2_for_bf16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(lo, x + i), sc, s)));
    const __m512 e1 =
        _mm512_maskz_mov_ps(hi, exp2_for_bf16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(hi, x + i + kLanes), sc, s)));
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    const __m512 w0 = factors == nullptr ? e0 : _mm512_mul_ps(e0, _mm512_maskz_loadu_ps(lo, factors + i));
    const __m512 w1 = factors == nullptr ? e1 : _mm512_mul_ps(e1, _mm512_maskz_loadu_ps(hi, factors + i + kLanes));
    const __mmask32 store = kZeroToChunkEnd ? __mmask32(0xFFFFFFFF) : (__mmask32(hi) << 16) | lo;
    _mm512_mask_storeu_epi16(out + i, store, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w1, w0)));
  };
  const int64_t full = n / (2 * kLanes) * (2 * kLanes);
  for (int64_t i = 0; i < full; i += 2 * kLanes) step(i, 0xFFFF, 0xFFFF);
  if (full < n) step(full, lanes_mask(n - full), n - full > kLanes ? lanes_mask(n - full - kLanes) : __mmask16(0));
  return _mm512_reduce_add_ps(sum);
}

// out[i] = bfloat16(x[i] * factor) for i < n (round to nearest even).
FDC_AVX512_BF16 inline void scale_to_bf16(const float* x, int64_t n, float factor, c10::BFloat16* out) {
  const __m512 f = _mm512_set1_ps(factor);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = lanes_mask(n - i);
    const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), f);
    _mm256_mask_storeu_epi16(out + i, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
  }
}

// Largest of x[0, n); -inf when n == 0, NaN when any is NaN (vmaxps alone would drop a NaN it met first).
FDC_AVX512 inline float max_of(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = lanes_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    m = _mm512_mask_max_ps(m, mask, m, v);
    nan |= _mm512_mask_cmp_ps_mask(mask, v, v, _CMP_UNORD_Q);
  }
  return nan ? NAN : _mm512_reduce_max_ps(m);
}

// x[i] = exp(x[i] * scale - shift) for i < n, by exp16<kDegree>; returns the sum of the results.
template <int kDegree = 6>
FDC_AVX512 inline float exp_and_sum(float* x, int64_t n, float scale, float shift) {
  const __m512 sc = _mm512_set1_ps(scale), s = _mm512_set1_ps(-shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = lanes_mask(n - i);
    const __m512 e = exp16<kDegree>(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + i), sc, s));
    _mm512_mask_storeu_ps(x + i, mask, e);
    sum = _mm512_mask_add_ps(sum, mask, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// x[i] *= factor for i < n.
FDC_AVX512 inline void scale_in_place(float* x, int64_t n, float factor) {
  const __m512 f = _mm512_set1_ps(factor);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 mask = lanes_mask(n - i);
    _mm512_mask_storeu_ps(x + i, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + i), f));
  }
}

}  // namespace fdc::cpu::avx512
