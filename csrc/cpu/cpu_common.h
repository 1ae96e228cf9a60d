// Helpers shared by the CPU kernels: plan entry points (each plan op is also run inside its attention op when no
// plan is passed), dtype dispatch, and the float conversions of the hot loops.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "checks.h"
#include "dispatch.h"

// Hot float loops are compiled twice, for x86-64-v3 (AVX2+FMA) and for the baseline x86-64, and picked when the library
// loads (GCC function multi-versioning): the wheel stays runnable on any x86-64 while current CPUs get 8-wide FMA.
// FDC_CPU_SIMD_WIDE adds an x86-64-v4 (AVX-512) clone, for loops that have no AVX-512 kernel in vec_avx512.h and
// whose FDC_CPU_ISA=portable path need not be compared with one (the window_scores' noisy exponentials).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define FDC_CPU_SIMD __attribute__((target_clones("arch=x86-64-v3", "default")))
#define FDC_CPU_SIMD_WIDE __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FDC_CPU_SIMD
#define FDC_CPU_SIMD_WIDE
#endif

namespace fdc::cpu {

at::Tensor prefill_plan_cpu(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                            const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group, bool causal,
                            std::optional<int64_t> num_workers, int64_t row_block, int64_t window_left);

at::Tensor decode_plan_cpu(const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets, const at::Tensor& v_offsets,
                           int64_t group, std::optional<int64_t> num_workers, int64_t window_left);

// Up to this many tokens (decode steps, short prompts) rotate_into_packed runs one row kernel per (token, KV head),
// and rope_rotate_compress one RoPE loop per (token, head): their general paths are ATen calls (a broadcast matmul,
// narrows and copies per KV head; RoPE's slices and products), fixed costs whatever the size, measured at 118 us per
// rotate_compress call inside a vLLM decode step of SmolLM2 (8 requests: 9 query or 3 key heads of 64; 7 ms of a 60
// ms step) and ~100 us per rope_rotate_compress call at B = 1 on a 2-core AMD EPYC. Above it matmul's blocking wins
// over the portable row kernel; rotate_into_packed takes the AVX-512 row kernel at any size (rotate_compress.cpp).
constexpr int64_t kRowLoopTokens = 64;

// The product of rotate_compress and rope_rotate_compress: x_float (T, G * H_kv, D) float32 times
// rot (H_kv, D, R_max) truncated per head, written into out (T, G * qk_offsets[-1]).
void rotate_into_packed(const at::Tensor& x_float, const at::Tensor& rot, const checks::HostLayout& layout,
                        int64_t group, at::Tensor& out);

// The row kernels a CPU op may use: the portable ones of vec_math.cpp (AVX2+FMA or baseline x86-64, picked when
// the library loads), the AVX-512 ones of vec_avx512.h, or those plus the AVX-512-BF16 and VNNI dot products (every
// CPU with AVX-512-BF16 has VNNI; kAvx512Bf16 asks for both).
enum class CpuIsa { kPortable = 0, kAvx512 = 1, kAvx512Bf16 = 2 };

// The widest row kernels this CPU runs, capped by the environment variable FDC_CPU_ISA (portable, avx512 or
// avx512bf16; read at every call, so tests and benchmarks can compare the paths in one process). `op` names the
// caller in the error raised for any other value.
CpuIsa cpu_isa(const char* op);

// The element type of an int4 cache (fdc/kv_format.h): one byte holding two columns' codes, column 2m's in the low
// nibble and column 2m + 1's in the high one, two's complement.
struct Int4Pair {
  uint8_t bits;
  int8_t low() const { return static_cast<int8_t>(static_cast<uint8_t>(bits << 4)) >> 4; }
  int8_t high() const { return static_cast<int8_t>(bits) >> 4; }
  int8_t code(int64_t column) const { return column % 2 == 0 ? low() : high(); }
};

// int8, float8_e4m3fn and int4: the element types of quantized caches (fdc/kv_format.h), whose rows end in scales.
template <typename T>
constexpr bool kQuantized =
    std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, Int4Pair>;

// Columns per element of a cache of element type T (kv_columns_per_element): 2 for int4, else 1.
template <typename T>
constexpr int64_t kColumnsPer = std::is_same_v<T, Int4Pair> ? 2 : 1;

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
// A quantized cache's codes (fdc/kv_format.h), unscaled. e4m3 by a 256-entry table: c10's conversion rebuilds the
// float's fields bit by bit, which made the paged prefill's packing of e4m3 pages 1.13-1.32x the bf16 pages' time
// where int8's conversion (one instruction) kept it at 0.98-1.01x (bench/results/ops/README.md, "Quantized caches").
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> table{};
    for (int code = 0; code < 256; ++code) {
      table[code] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
    }
    return table;
  }();
  return values[x.x];
}

}  // namespace fdc::cpu
