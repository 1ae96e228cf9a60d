// Quantized K/V caches (docs/design.md, "Quantized caches"): how a cache stores its elements, shared by the checks,
// the CPU and CUDA kernels, and mirrored by the float64 reference (fdc_ops/reference.py, quantize_kv_ref).
//
// A quantized cache holds one byte per element (int8, or float8 e4m3 "fn": no infinities, 448 the largest finite)
// and, after the data columns of a row, one float32 scale per KV head: element = code * scale. The scale of a
// (token, KV head) is that head's largest magnitude in the token's row divided by kv_code_max, so its codes span the
// format's range whatever the head's size. Token-major rows of a contiguous cache are (data columns, then the
// H_kv scales' 4 * H_kv bytes); a dim-major page is (data columns, then the scales as H_kv runs of page_size float32:
// the 4 * H_kv trailing byte rows), so one block table addresses both.
#pragma once

#include <cstdint>

#include "fdc/common.h"

namespace fdc {

// kFloat: the activations' own dtype (float32, float16 or bfloat16), no scales.
enum class KvFormat : int32_t { kFloat = 0, kInt8 = 1, kFp8E4M3 = 2 };

// Bytes of one (token, KV head) scale: a float32.
constexpr int32_t kKvScaleBytes = 4;

// The largest code magnitude: int8 codes are symmetric in [-127, 127] (-128 is never written, so a code's negation
// is a code); 448 is e4m3fn's largest finite value.
FDC_HOST_DEVICE inline float kv_code_max(KvFormat format) { return format == KvFormat::kInt8 ? 127.f : 448.f; }

// Elements of the cache's dtype per row of a contiguous cache, or byte rows of a page: the `width` data columns,
// then, when quantized, the scales.
FDC_HOST_DEVICE inline int64_t kv_stored_width(int64_t width, int64_t num_kv_heads, KvFormat format) {
  return format == KvFormat::kFloat ? width : width + kKvScaleBytes * num_kv_heads;
}

}  // namespace fdc
