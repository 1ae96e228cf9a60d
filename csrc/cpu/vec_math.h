// Vectorisable float loops of the softmax, shared by the CPU attention kernels. Each is compiled for AVX2+FMA and
// for baseline x86-64 and picked at load time (FDC_CPU_SIMD in cpu_common.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace fdc::cpu {

// Rows a weighted row sum (axpy_rows, here and in vec_avx512_axpy.h) adds in registers before it adds them to the
// accumulator in memory. A float sum of n products in one running register rounds n times at the size of the partial
// sum; in chunks of 16 its error grows with 16 + n / 16 roundings (32 for the 256 dims of a paged cache's key scores,
// where one running sum per score left the float32 paged decode at 3-7x torch's own error, whose products sum in short
// vectorised runs; the rule of tests/conftest.py allows 2x; on AVX-512 those scores take float64 sums now,
// avx512::axpy_tile_f64). 16 = sqrt(256) is the chunk that minimises the bound at the widest head; every chunk costs
// one load and store of the accumulators, against 16 rows of FMAs.
constexpr int64_t kSumChunk = 16;

// Rows avx512::axpy_tile_f64 (the float32 key scores of dim-major pages) adds in float before it widens the run's sums
// and adds them to its float64 sums: a run of 4 rounds 4 times at the size of a few products rather than of the
// score (on the portable kernel runs of 8 and 16 left the error where float chunks of 16 had it), and the widening
// costs a quarter of a conversion per product (measured in bench/results/ops/README.md, "Accuracy against torch").
constexpr int64_t kFloat64Chunk = 4;

// Largest of x[0, n); -inf when n == 0, NaN when any is NaN (so a NaN score reaches the output, as in the reference).
float max_of(const float* x, int64_t n);

// x[i] = exp(x[i] * scale - shift) for i < n; returns the sum of the results. Arguments below the smallest
// normal float's log give exactly 0 (so a -inf score contributes nothing).
float exp_and_sum(float* x, int64_t n, float scale, float shift);

// Logit soft-capping (fdc/attention_variant.h) of scores not yet scaled: x[i] = soft_cap(x[i] * scale, softcap) for
// i < n (scale = 1 for scores already scaled), so the results are scaled scores. Divided by softcap, not multiplied by
// a rounded 1 / softcap and its inverse: such a pair of factors is off 1 by a rounding that every score of a row then
// shares, which moves the whole softmax where independent roundings average out (the float32 capped decode measured up
// to 3.3x torch's error that way). tanh to a few ulp; a NaN score stays NaN. softcap > 0.
void soft_cap_scores(float* x, int64_t n, float scale, float softcap);

// x[i] *= factor for i < n.
void scale_in_place(float* x, int64_t n, float factor);

// acc[i] += factor * x[i] for i < n.
void add_scaled(float* acc, const float* x, int64_t n, float factor);

// Keyformer's noisy softmax weights, unnormalised: x[i] = exp(((x[i] - shift) - log(-log u_i)) * inverse_temperature)
// for i < n, u_i = (bits[i] >> 8) * 2^-24 (24 random bits) clamped to [1e-20, 1 - 1e-7], so that -log(-log u_i) is
// Gumbel(0, 1) noise added to x[i]; returns the sum of the results. At temperature 1 it is exp(x[i] - shift) / -log
// u_i: one log per weight instead of two. x[i] - shift <= 0 keeps every weight finite (-log u_i >= 1.19e-7).
float gumbel_exp_and_sum(float* x, const uint32_t* bits, int64_t n, float shift, float inverse_temperature);

// Widens half-precision rows once, so the row kernels below read each element as float for all G query heads:
// dst[r * cols + c] = float(src[r * src_stride + c]) for r < rows, c < cols.
void rows_to_float(const c10::BFloat16* src, int64_t src_stride, int64_t rows, int64_t cols, float* dst);
void rows_to_float(const c10::Half* src, int64_t src_stride, int64_t rows, int64_t cols, float* dst);

// Dot products along rows: out[i * out_ld + r] = sum_c a[i * a_ld + c] * rows[r * row_stride + c], for i < group,
// r < n, c < dim; added to out when `accumulate`.
void dot_rows(const float* a, int64_t a_ld, int64_t group, const float* rows, int64_t row_stride, int64_t n,
              int64_t dim, float* out, int64_t out_ld, bool accumulate);

// Weighted row sums: acc[i * acc_ld + c] += sum_r w[i * w_ld + r] * rows[r * row_stride + c], for i < group, r < n,
// c < dim.
void axpy_rows(const float* w, int64_t w_ld, int64_t group, const float* rows, int64_t row_stride, int64_t n,
               int64_t dim, float* acc, int64_t acc_ld);

// dot_rows (not accumulating) for the key scores of float32 caches, each dot product's 8 lanes added in float64 and
// rounded once: the float tree rounded three times at about the score's size, and the scores' errors, times the
// values, put the float32 decode up to 3.1 float32 ulps over twice torch's own error (whose matmul sums each score
// over more, shorter runs), past the rule of tests/conftest.py in 1 of 2400 soft-capped cases; now 1.1 at most, in
// the time of the float tree (bench/results/ops/README.md, "Accuracy against torch").
void dot_rows_f64(const float* a, int64_t a_ld, int64_t group, const float* rows, int64_t row_stride, int64_t n,
                  int64_t dim, float* out, int64_t out_ld);

// axpy_rows for the key scores of float32 dim-major pages, in float64 as avx512::axpy_tile_f64 (it says why): from
// 2.7 to 1.0 ulps over twice torch's error at most, for 1.0-1.5x the time of the float sums.
void axpy_rows_f64(const float* w, int64_t w_ld, int64_t group, const float* rows, int64_t row_stride, int64_t n,
                   int64_t dim, float* acc, int64_t acc_ld);

}  // namespace fdc::cpu
