// The packed head layout (docs/design.md section 3), as plain-array math usable on host and device.
//
// A layout has H_kv KV heads; KV head j has a qk width qk_dim(j) and a v width v_dim(j), stored as int32 prefix sums
// qk_offsets[H_kv + 1] and v_offsets[H_kv + 1]. Each KV head serves `group` (G) query heads; query head h belongs to
// KV head h / G. Packed tensors put heads side by side along their last dimension:
//   keys    k  (T, qk_offsets[H_kv])      KV head j: columns [qk_offsets[j], qk_offsets[j+1])
//   values  v  (T, v_offsets[H_kv])       KV head j: columns [v_offsets[j], v_offsets[j+1])
//   queries q  (T, G * qk_offsets[H_kv])  head h = j*G + i: columns G*qk_offsets[j] + i*qk_dim(j) + [0, qk_dim(j))
//   outputs o  (T, G * v_offsets[H_kv])   head h = j*G + i: columns G*v_offsets[j] + i*v_dim(j) + [0, v_dim(j))
// so the G query heads of a KV head are adjacent, which is what a packed linear projection produces.
//
// Paged caches are (num_pages, width, page_size): a page stores each column's page_size tokens contiguously, so KV
// head j owns the contiguous (dim(j), page_size) block of rows [offsets[j], offsets[j+1]). A decode task reads one
// head, so it streams whole contiguous blocks instead of dim(j)-element pieces strided by the full width (which
// would waste part of every 32-byte memory sector), and its score and value loops run along contiguous tokens.
#pragma once

#include "fdc/common.h"

namespace fdc {

// Checks prefix sums of per-head widths: offsets[0] == 0 and every width a positive multiple of 8 of at most 256.
FDC_HOST_DEVICE inline Status check_offsets(const int32_t* offsets, int32_t num_kv_heads) {
  if (num_kv_heads <= 0 || offsets[0] != 0) return Status::kBadOffsets;
  for (int32_t j = 0; j < num_kv_heads; ++j) {
    const int32_t width = offsets[j + 1] - offsets[j];
    if (width <= 0 || width % kDimMultiple != 0 || width > kMaxHeadDim) return Status::kBadOffsets;
  }
  return Status::kOk;
}

struct HeadLayoutView {
  const int32_t* qk_offsets;  // (H_kv + 1) prefix sums of qk widths
  const int32_t* v_offsets;   // (H_kv + 1) prefix sums of v widths
  int32_t num_kv_heads;       // H_kv
  int32_t group;              // G, query heads per KV head

  FDC_HOST_DEVICE int32_t num_heads() const { return num_kv_heads * group; }
  FDC_HOST_DEVICE int32_t qk_dim(int32_t j) const { return qk_offsets[j + 1] - qk_offsets[j]; }
  FDC_HOST_DEVICE int32_t v_dim(int32_t j) const { return v_offsets[j + 1] - v_offsets[j]; }
  FDC_HOST_DEVICE int32_t qk_width() const { return qk_offsets[num_kv_heads]; }
  FDC_HOST_DEVICE int32_t v_width() const { return v_offsets[num_kv_heads]; }
  // The paper's d_sum = d_qk + d_v + 1: per (query row, key) work of QK^T, PV and the softmax.
  FDC_HOST_DEVICE int32_t d_sum(int32_t j) const { return qk_dim(j) + v_dim(j) + 1; }
  FDC_HOST_DEVICE int32_t max_d_sum() const {
    int32_t m = 0;
    for (int32_t j = 0; j < num_kv_heads; ++j) m = d_sum(j) > m ? d_sum(j) : m;
    return m;
  }
  // First column of query head h in a packed query tensor (T, G * qk_width()).
  FDC_HOST_DEVICE int64_t q_column(int32_t h) const {
    const int32_t j = h / group;
    return int64_t(group) * qk_offsets[j] + int64_t(h % group) * qk_dim(j);
  }
  // First column of query head h in a packed output tensor (T, G * v_width()).
  FDC_HOST_DEVICE int64_t o_column(int32_t h) const {
    const int32_t j = h / group;
    return int64_t(group) * v_offsets[j] + int64_t(h % group) * v_dim(j);
  }
};

}  // namespace fdc
