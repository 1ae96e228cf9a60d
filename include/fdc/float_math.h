// float32 exp and tanh to a few ulp, branch-free so that a loop over them vectorises on a CPU, and the same
// arithmetic on a GPU: one definition for every kernel that exponentiates or soft-caps scores this way (the CPU
// softmax loops in csrc/cpu/vec_math.cpp, and fdc::soft_cap for every op on both backends).
#pragma once

#include <cstdint>

#include "fdc/common.h"

// Always inlined: a CPU loop compiled for several ISAs (target_clones) would otherwise call one baseline copy of
// these from every clone, unvectorised.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define FDC_FORCE_INLINE __forceinline__
#else
#define FDC_FORCE_INLINE [[gnu::always_inline]] inline
#endif

namespace fdc {

// Coefficient k of the degree-6 polynomial for exp(r), |r| <= ln2/2 (what remains after taking out n ln2): fitted for
// the least maximum relative error (3e-9) with the first two fixed at 1, so that evaluated by Horner's rule in float32
// it is within 0.88 ulp of exp (RMS 0.30 ulp, a correctly rounded exp's being 0.29), where the Taylor polynomial of the
// same degree is within 2.7 ulp (RMS 0.50): an attention output adds up every probability's error.
FDC_HOST_DEVICE constexpr float exp_polynomial_coefficient(int k) {
  switch (k) {
    case 0: return 1.f;
    case 1: return 1.f;
    case 2: return 4.999999404e-1f;
    case 3: return 1.666652113e-1f;
    case 4: return 4.166838899e-2f;
    case 5: return 8.368710056e-3f;
    case 6: return 1.381461276e-3f;
    default: return 0.f;
  }
}

// exp(x) to within 0.9 ulp: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), exp(r) by the polynomial above,
// times 2^n built in the exponent bits. Arguments below log(FLT_MIN) give exactly 0 (so a -inf score contributes
// nothing), above log(FLT_MAX) the largest power it can build; NaN stays NaN.
FDC_HOST_DEVICE FDC_FORCE_INLINE float exp_approx(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;     // ln2 rounded to 10 bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;  // ln2 - kLn2Hi
  constexpr float kMinArg = -87.3365447f;    // log(FLT_MIN): below it the result is flushed to 0
  constexpr float kMaxArg = 88.7228391f;     // log(FLT_MAX)
  const bool underflow = x < kMinArg;
  // Comparisons, not fmin/fmax, so a NaN argument stays NaN and poisons the result as it should.
  x = x < kMinArg ? kMinArg : x;
  x = x > kMaxArg ? kMaxArg : x;
  // Round to nearest by the 1.5 * 2^23 trick (|x * log2e| < 2^22 here): plain arithmetic, unlike nearbyint.
  constexpr float kRound = 12582912.f;
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = exp_polynomial_coefficient(6);
  p = p * r + exp_polynomial_coefficient(5);
  p = p * r + exp_polynomial_coefficient(4);
  p = p * r + exp_polynomial_coefficient(3);
  p = p * r + exp_polynomial_coefficient(2);
  p = p * r + exp_polynomial_coefficient(1);
  p = p * r + exp_polynomial_coefficient(0);
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.f : p * scale;
}

// tanh(y) to about 3 ulp of the result, however small |y| is. Below |y| = 0.55 its Taylor series to y^15 (the next
// term is under 2^-24 relative there); above, 1 - 2 / (exp(2|y|) + 1), whose subtraction loses little once tanh >= 0.5.
// (That form alone cancels for small |y|: its error stays a few ulps of 1, not of tanh(y), which soft-capping by a cap
// c multiplies into ulps of c on scores far below it.) 0.55 gave the smallest worst-case error of the thresholds tried
// (0.3 to 0.625: 2.7 ulp against tanh in double). Infinite y gives +-1 (exp_approx saturates), NaN stays NaN (it fails
// the comparison and reaches exp_approx).
FDC_HOST_DEVICE FDC_FORCE_INLINE float tanh_approx(float y) {
  constexpr float kSeriesBelow = 0.55f;
  const float a = y < 0.f ? -y : y;
  const float a2 = a * a;
  float p = -929569.f / 638512875.f;
  p = p * a2 + 21844.f / 6081075.f;
  p = p * a2 - 1382.f / 155925.f;
  p = p * a2 + 62.f / 2835.f;
  p = p * a2 - 17.f / 315.f;
  p = p * a2 + 2.f / 15.f;
  p = p * a2 - 1.f / 3.f;
  const float series = a + a * a2 * p;
  const float exponential = 1.f - 2.f / (exp_approx(2.f * a) + 1.f);
  const float t = a < kSeriesBelow ? series : exponential;
  return y < 0.f ? -t : t;
}

}  // namespace fdc
