// Quantized K/V caches (docs/design.md, "Quantized caches"): how a cache stores its elements, shared by the checks,
// the CPU and CUDA kernels, and mirrored by the float64 reference (fdc_ops/reference.py, quantize_kv_ref).
//
// A quantized cache holds one byte per element (int8, or float8 e4m3 "fn": no infinities, 448 the largest finite), or
// one byte per two elements (int4: a uint8 tensor whose byte m of a row holds column 2m in its low nibble and column
// 2m + 1 in its high one, each a two's-complement code in [-7, 7], so a zero-filled cache reads as zeros), and, after
// the data columns of a row, one float32 scale per KV head: element = code * scale. The scale of a
// (token, KV head) is that head's largest magnitude in the token's row divided by kv_code_max, so its codes span the
// format's range whatever the head's size. Token-major rows of a contiguous cache are (data columns, then the
// H_kv scales' 4 * H_kv bytes); a dim-major page is (data columns, then the scales as H_kv runs of page_size float32:
// the 4 * H_kv trailing byte rows), so one block table addresses both.
#pragma once

#include <cstdint>

#include "fdc/common.h"

namespace fdc {

// kFloat: the activations' own dtype (float32, float16 or bfloat16), no scales.
enum class KvFormat : int32_t { kFloat = 0, kInt8 = 1, kFp8E4M3 = 2, kInt4 = 3 };

// Bytes of one (token, KV head) scale: a float32.
constexpr int32_t kKvScaleBytes = 4;

// The largest code magnitude: integer codes are symmetric, int8's in [-127, 127] and int4's in [-7, 7] (-128 and -8
// are never written, so a code's negation is a code); 448 is e4m3fn's largest finite value.
FDC_HOST_DEVICE inline float kv_code_max(KvFormat format) {
  return format == KvFormat::kInt8 ? 127.f : format == KvFormat::kInt4 ? 7.f : 448.f;
}

// Columns per element of the cache's dtype: 2 for int4 (two codes per byte), else 1. Widths are multiples of 8, so
// every KV head starts on a whole byte.
FDC_HOST_DEVICE inline int64_t kv_columns_per_element(KvFormat format) { return format == KvFormat::kInt4 ? 2 : 1; }

// Elements of the cache's dtype per row of a contiguous cache, or byte rows of a page: the `width` data columns
// (width / 2 bytes for int4), then, when quantized, the scales.
FDC_HOST_DEVICE inline int64_t kv_stored_width(int64_t width, int64_t num_kv_heads, KvFormat format) {
  return format == KvFormat::kFloat ? width : width / kv_columns_per_element(format) + kKvScaleBytes * num_kv_heads;
}

// Where the float32 scale of (token, KV head j) lies, in bytes from the start of the token's row in a contiguous cache
// or of its page in a paged one, `data_bytes` being the data columns' bytes of a row (width / 2 for int4) or byte rows
// of a page: right after the row's data, or, in a page, after the data's byte rows, in head j's run of page_size
// scales at the token's slot.
FDC_HOST_DEVICE inline int64_t kv_row_scale_offset(int64_t data_bytes, int64_t j) {
  return data_bytes + kKvScaleBytes * j;
}
FDC_HOST_DEVICE inline int64_t kv_page_scale_offset(int64_t data_bytes, int64_t page_size, int64_t j, int64_t slot) {
  return data_bytes * page_size + kKvScaleBytes * (j * page_size + slot);
}

}  // namespace fdc
