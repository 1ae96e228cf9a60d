// The CPU decode kernel's own work split (csrc/cpu/decode_attention.cpp, run_piece_avx512): every request cut into
// pieces of keys, each read for every KV head at once. A decode plan's tasks are (request, KV head, chunk), which
// read a strided fraction of every row or page; a piece reads its keys' rows or pages whole and in order, which was
// 2-3x faster on the CPUs measured (bench/results/ops/README.md, "CPU decode"). Torch-free, host only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fdc/attention_variant.h"
#include "fdc/common.h"

namespace fdc {

// Keys [t0, t1) of request b, for every KV head; index: which of its request's pieces this is. Keys [t0, visible) lie
// before the request's sliding window: read with the block that holds the window's first key, and masked (only a
// windowed request's first piece has such keys; visible == t0 elsewhere).
struct RowPiece {
  int64_t b, t0, t1, index, visible;
};

// Pieces per thread aimed at when requests are split: with pieces of equal length the threads' static ranges of
// pieces differ by at most one piece, a quarter of a thread's work; more pieces would add partials to merge.
constexpr int64_t kPiecesPerThread = 4;
// Shortest piece: a split costs a partial result per query head (d_v + 1 floats) to write and merge, small next to
// 256 rows of K/V.
constexpr int64_t kMinPieceRows = 256;

// Cuts every request into pieces of equal length (its first and last pieces shorter), a multiple of `quantum` keys (a
// paged cache's page size: no page is read by two pieces), about kPiecesPerThread pieces per thread over all requests
// and at least kMinPieceRows keys. Only the keys a query sees are read (window_left: the sliding window,
// fdc/attention_variant.h; kNoWindow for none), but a piece's reads start on a page: request b's pieces lie on a grid
// of that length from base = s - s % quantum, s = decode_window_start(length, window_left) its first visible key, and
// the first piece starts at the last multiple of `edge` keys past base at or before s. The kernel reads blocks of
// at least `edge` keys from a piece's start (a paged cache's page size or block length, the smaller; 1 for a
// contiguous cache, whose pieces start exactly at s), so its first block holds the key s and at most edge - 1 keys
// before it, which it masks (RowPiece::visible). split_offsets[b * H_kv + j] (B * H_kv + 1) numbers the partial slots
// of (request, KV head) pairs as a decode plan's do (a request's pieces for each of its KV heads), so the kernels'
// finish and merge serve both. seqlens: (B) non-negative; hkv, threads, quantum, edge: positive, edge <= quantum.
inline std::vector<RowPiece> cut_rows(const std::vector<int32_t>& seqlens, int64_t window_left, int64_t hkv,
                                      int64_t threads, int64_t quantum, int64_t edge,
                                      std::vector<int32_t>& split_offsets) {
  const auto grid_base = [&](int64_t length) {
    const int64_t first_visible = decode_window_start(length, window_left);
    return first_visible - first_visible % quantum;
  };
  int64_t total = 0;
  for (int32_t len : seqlens) total += len - grid_base(len);
  const int64_t piece =
      ceil_div(std::max(kMinPieceRows, ceil_div(total, kPiecesPerThread * threads)), quantum) * quantum;
  std::vector<RowPiece> pieces;
  split_offsets.assign(seqlens.size() * hkv + 1, 0);
  for (int64_t b = 0; b < int64_t(seqlens.size()); ++b) {
    const int64_t length = seqlens[b], visible = decode_window_start(length, window_left), base = grid_base(length);
    const int64_t first = base + (visible - base) / edge * edge;
    const int64_t count = ceil_div(length - base, piece);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t t0 = c == 0 ? first : base + c * piece;
      pieces.push_back({b, t0, std::min(length, base + (c + 1) * piece), c, std::max(t0, visible)});
    }
    for (int64_t j = 0; j < hkv; ++j) split_offsets[b * hkv + j + 1] = split_offsets[b * hkv + j] + int32_t(count);
  }
  return pieces;
}

}  // namespace fdc
