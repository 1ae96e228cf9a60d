// Tiles and shared memory of the CUDA decode kernel (csrc/cuda/decode_kernels.cuh), torch-free so that
// tests/cpp/test_planners.cpp checks on the CPU which head layouts fit each GPU architecture's shared memory.
//
// A CTA of kDecodeThreads threads streams a task's keys in tiles of decode_tile_keys() keys. Shared memory, in
// elements of the cache type: `stages` staging tiles that cp.async fills (token-major rows for a contiguous cache,
// dim-major rows for a paged one), then, for a paged cache, one token-major compute tile the staged tile is
// transposed into; then, in floats, the scaled queries (heads x max qk width), the scores (heads x tile keys) and
// the softmax state (3 floats per head). After the last tile the staging and compute tiles hold the final
// (key groups, heads, v width) float reduction.
//
// Two stages keep the next tile's copy in flight through the wait for the current one. A paged cache can make do with
// one: its staged tile is transposed into the compute tile first, and the next copy then goes into the emptied stage
// while the compute tile is used. With two stages the widest paged heads (qk + v = 384 or more in bf16) do not fit
// an A100's 163 KiB; with one, every layout fits an A100 and an H100 in every dtype, as contiguous ones do. The
// 99 KiB parts (sm_86, sm_89, sm_120) fit every layout with qk + v <= 336, paged or not; wider ones are refused with
// the bytes they need (smaller key tiles would fit them). tests/cpp/test_planners.cpp checks these claims.
//
// A quantized cache (fdc/kv_format.h: int8 or float8 e4m3 codes, element_bytes 1) stages its codes as bytes, in the
// same tiles, and two tiles' key and value scales follow the softmax state (decode_tile_scales). Its rows are read
// in units of 8 codes: a head's codes are a multiple of 8 bytes, not of 16.
#pragma once

#include <cstdint>

#include "fdc/common.h"

namespace fdc {

constexpr int32_t kDecodeThreads = 128;

// Keys per tile: 64 for 2-byte and 1-byte (quantized) caches, 32 for float32 ones (one tile of the widest heads,
// 256 + 256 dims, is 64 KiB or less in every cache dtype).
FDC_HOST_DEVICE constexpr int32_t decode_tile_keys(int32_t element_bytes) { return element_bytes == 4 ? 32 : 64; }

// Elements in one 16-byte packet, the unit of cp.async and of the vector loads.
FDC_HOST_DEVICE constexpr int32_t decode_packet(int32_t element_bytes) { return 16 / element_bytes; }

// Rows of a dim-major staging tile are padded by one 16-byte packet: with rows of decode_tile_keys() elements (128
// bytes) every row would start on bank 0, and the transposing reads (consecutive dims, same keys) would all collide.
FDC_HOST_DEVICE constexpr int32_t decode_staged_row(int32_t element_bytes) {
  return decode_tile_keys(element_bytes) + decode_packet(element_bytes);
}

// Elements the score loop reads at once from a key's row: a 16-byte packet of a float cache, 8 codes (8 bytes) of a
// quantized one (a head's codes are a multiple of 8 bytes only).
FDC_HOST_DEVICE constexpr int32_t decode_score_unit(int32_t element_bytes) {
  return element_bytes == 1 ? 8 : decode_packet(element_bytes);
}

// Token-major K rows are padded so that the score loop, in which the kDecodeThreads / tile keys threads of a key
// read interleaved units of its row, touches distinct banks in each phase of a warp's access (a quarter warp of
// 16-byte loads, a half warp of 8-byte ones): a row stride of L units with L = threads per key (mod 2 * threads per
// key) does that in both cases.
FDC_HOST_DEVICE constexpr int32_t decode_padded_k_row(int32_t element_bytes, int32_t dim) {
  const int32_t per_key = kDecodeThreads / decode_tile_keys(element_bytes);
  const int32_t unit = decode_score_unit(element_bytes);
  int32_t units = dim / unit;
  while (units % (2 * per_key) != per_key) ++units;
  return units * unit;
}

// Floats of one tile's scales: a quantized cache's key and value scales of the tile's keys; none for a float cache.
// Two tiles' scales are kept whatever the stages: the next tile's arrive while the current tile's are in use (with one
// stage too, whose codes are transposed out of the stage before the next copy is issued, but whose scales are not).
FDC_HOST_DEVICE constexpr int32_t decode_tile_scales(int32_t element_bytes) {
  return element_bytes == 1 ? 2 * decode_tile_keys(element_bytes) : 0;
}

// Query heads one pass over a task's keys serves, at most: the kernel is instantiated for 4, 8 and 16.
FDC_HOST_DEVICE constexpr int32_t decode_heads_per_pass(int64_t group) {
  return group <= 4 ? 4 : (group <= 8 ? 8 : 16);
}

struct DecodeSharedLayout {
  int32_t heads = 0;          // query heads per pass
  int32_t stages = 0;         // staging tiles: 2, or 1 (paged only)
  int32_t stage_elems = 0;    // elements of one staging tile (a multiple of a packet)
  int32_t compute_elems = 0;  // elements of the compute tile (paged), 0 for a contiguous cache
  int64_t bytes = 0;          // dynamic shared memory of one CTA
};

// The layout for heads up to max_qk_dim / max_v_dim wide (multiples of 8), `heads` query heads per pass; element_bytes
// is the cache's: 4 or 2 (float caches), 1 (quantized).
FDC_HOST_DEVICE inline DecodeSharedLayout decode_shared_layout(int32_t element_bytes, int32_t max_qk_dim,
                                                               int32_t max_v_dim, int32_t heads, bool paged,
                                                               int32_t stages) {
  const int64_t packet = decode_packet(element_bytes), keys = decode_tile_keys(element_bytes);
  const int64_t token_major = keys * (decode_padded_k_row(element_bytes, max_qk_dim) + max_v_dim);
  const int64_t dim_major = int64_t(max_qk_dim + max_v_dim) * decode_staged_row(element_bytes);
  // key_groups * dv <= 2 * kDecodeThreads floats per head (each thread owns a column pair of one key group).
  const int64_t reduction = ceil_div(2 * int64_t(kDecodeThreads) * heads * 4, element_bytes);
  DecodeSharedLayout layout;
  layout.heads = heads;
  layout.stages = stages;
  const int64_t compute = paged ? ceil_div(token_major, packet) * packet : 0;
  const int64_t staged = paged ? dim_major : token_major;
  const int64_t for_reduction = ceil_div(reduction - compute > 0 ? reduction - compute : 0, stages);
  const int64_t stage = ceil_div(staged > for_reduction ? staged : for_reduction, packet) * packet;
  layout.stage_elems = static_cast<int32_t>(stage);
  layout.compute_elems = static_cast<int32_t>(compute);
  const int64_t floats = int64_t(heads) * max_qk_dim + int64_t(heads) * keys + 3 * int64_t(heads) +
                         2 * int64_t(decode_tile_scales(element_bytes));
  layout.bytes = (stages * stage + compute) * element_bytes + floats * 4;
  return layout;
}

// The layout the kernel runs with on a device that gives a block `limit` bytes: the most query heads per pass (each
// pass reads the task's keys again), and at those, two stages before one. If nothing fits, the smallest layout tried
// (four heads per pass, as few stages as the cache allows), whose bytes exceed limit.
FDC_HOST_DEVICE inline DecodeSharedLayout choose_decode_shared_layout(int32_t element_bytes, int32_t max_qk_dim,
                                                                      int32_t max_v_dim, int64_t group, bool paged,
                                                                      int64_t limit) {
  DecodeSharedLayout layout;
  for (int32_t heads = decode_heads_per_pass(group); heads >= 4; heads /= 2) {
    for (int32_t stages = 2; stages >= (paged ? 1 : 2); --stages) {
      layout = decode_shared_layout(element_bytes, max_qk_dim, max_v_dim, heads, paged, stages);
      if (layout.bytes <= limit) return layout;
    }
  }
  return layout;
}

}  // namespace fdc
