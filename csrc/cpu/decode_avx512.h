// The CPU decode's AVX-512 way: one piece of keys of a request (include/fdc/decode_pieces.h) read block by block,
// whole, every KV head's query heads scored and accumulated on a block while it is in cache. Included by
// decode_attention.cpp only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/decode_common.h"
#include "cpu/decode_read_ahead.h"
#include "cpu/vec_avx512.h"
#include "cpu/vec_avx512_axpy.h"
#include "cpu/vec_avx512_columns.h"
#include "cpu/vec_avx512_rows.h"
#include "cpu/vec_avx512_softmax.h"
#include "fdc/decode_pieces.h"

// Internal linkage, as when this was part of decode_attention.cpp (the only file that includes it): the compiler may
// inline and specialise these functions for their one caller.
namespace fdc::cpu::decode {
namespace {

// Per-thread state of run_piece_avx512: queries as float (G * W_qk, q's own order), the unnormalised outputs
// (G * W_v, the output's order), one online softmax per query head, and the scores of one block for one KV head.
struct RowScratch {
  std::vector<float> q, acc, scores;
  std::vector<uint16_t> weights_bf16;  // scores' probabilities rounded to bf16, for axpy_rows_bf16
  std::vector<OnlineSoftmax> softmax;
  RowScratch(int64_t group, int64_t qk_width, int64_t v_width, int64_t heads)
      : q(group * qk_width), acc(group * v_width), scores(group * kMaxBlockKeys), weights_bf16(group * kMaxBlockKeys),
        softmax(heads) {}
};

// One piece on AVX-512: blocks of contiguous_block_rows keys of a contiguous cache or paged_block_keys of a paged one
// (the runs of every page the block touches), each scored and accumulated for every KV head in turn, so a block (whole
// rows of a contiguous cache, runs of pages' columns) is read once for all heads. The next block is read ahead as the
// CPU's ReadAhead says: by a PrefetchStream that the kernels step through as they load the current block (each KV
// head's end catching up with its share), or by prefetcht1, its j-th share before KV head j. With AVX-512-BF16, bf16
// keys and values are multiplied without widening (dot_rows_bf16, axpy_rows_bf16). Products follow the cache's memory
// order: dot products along token-major rows, weighted row sums along a dim-major page's token runs.
template <typename T>
FDC_AVX512 void run_piece_avx512(const RowPiece& piece, const Problem& pb, const T* q, int64_t q_ld,
                                 const CacheView<T>& kc, const CacheView<T>& vc, T* out, int64_t out_ld, RowScratch& ws,
                                 bool bf16_dot, ReadAhead way, const RowPiece* following) {
  const checks::HostLayout& layout = *pb.layout;
  const int64_t hkv = layout.num_kv_heads(), group = layout.group, b = piece.b;
  const int64_t qk_width = layout.qk_offsets[hkv], v_width = layout.v_offsets[hkv];
  const T* qb = q + b * q_ld;
  for (int64_t c = 0; c < group * qk_width; ++c) ws.q[c] = to_float(qb[c]);
  std::fill(ws.acc.begin(), ws.acc.end(), 0.f);
  std::fill(ws.softmax.begin(), ws.softmax.end(), OnlineSoftmax{});
  float* scores = ws.scores.data();

  const auto block_keys = [&](const RowPiece& of) {
    return kc.paged() ? paged_block_keys(way, kc.page_size, int64_t(sizeof(T)))
                      : contiguous_block_rows(way, (qk_width + v_width) * int64_t(sizeof(T)), of.t1 - of.t0);
  };
  const int64_t rows = block_keys(piece);
  const int64_t col_stride = kc.col_stride();
  // Value sums over bf16 pages by vdpbf16ps (dot_columns_tile_bf16) where a page's column fills a 32-token register,
  // and for 16-token pages two columns per register (dot_columns_page16_bf16); pages of 17 to 31 tokens keep
  // widening, whose cost their half-filled registers would exceed (bench/results/ops/README.md, "CPU decode").
  const bool bf16_pages =
      std::is_same_v<T, c10::BFloat16> && bf16_dot && vc.paged() && (vc.page_size >= 32 || vc.page_size == 16);
  // Key scores of bf16 pages without widening: pages of 32 tokens or more by axpy_rows_bf16 (two columns interleaved,
  // one vdpbf16ps per pair of columns and head), pages of 16 by dot_page16_bf16 (two columns in one load); both
  // faster than widening (bench/results/ops/README.md, "CPU decode"). The runs of a 16-token page start at its
  // first token: pieces start at page starts (cut_rows) and blocks are whole pages (paged_block_keys).
  const bool bf16_key_pages = std::is_same_v<T, c10::BFloat16> && bf16_dot && kc.paged();
  const bool bf16_weights = vc.paged() ? bf16_pages : std::is_same_v<T, c10::BFloat16> && bf16_dot;
  PageRuns<T> runs[2];  // paged: the block's and the next block's runs, by turns
  if (kc.paged()) runs[0].assign(kc, vc, b, piece.t0, std::min(piece.t1, piece.t0 + rows));
  const T* run_values[kMaxPagedBlockKeys];        // one KV head's value columns in each run of the block
  BlockBytes<2 * kMaxPagedBlockKeys> next_bytes;  // kStream: the next block's ranges
  for (int64_t t0 = piece.t0, turn = 0; t0 < piece.t1; turn ^= 1) {
    const int64_t t1 = std::min(piece.t1, t0 + rows), n = t1 - t0;
    // The block read ahead: the piece's next, or after its last the first block of the piece this thread runs next
    // (`following`), so that only a thread's first piece starts on a block nobody asked for.
    int64_t next_b = b, next_t0 = t1, next = std::min(piece.t1, t1 + rows) - t1;
    if (next == 0 && following != nullptr) {
      next_b = following->b, next_t0 = following->t0;
      next = std::min(following->t1 - following->t0, block_keys(*following));
    }
    const PageRuns<T>& here = runs[turn];
    PageRuns<T>& ahead = runs[turn ^ 1];
    if (kc.paged()) ahead.assign(kc, vc, next_b, next_t0, next_t0 + next);
    next_bytes.count = 0;
    if (way != ReadAhead::kPrefetchL2 && next > 0) {
      if (kc.paged()) {
        next_bytes.add_runs(ahead, kc.page_size, qk_width, v_width);
        if (way == ReadAhead::kLoads) read_ahead_interleaved(next_bytes);
      } else if (way == ReadAhead::kLoads) {
        BlockBytes<2> rows_ahead;
        rows_ahead.add_rows(kc, next_b, next_t0, next, qk_width);
        rows_ahead.add_rows(vc, next_b, next_t0, next, v_width);
        read_ahead_interleaved(rows_ahead);
      } else {
        next_bytes.add_rows(kc, next_b, next_t0, next, qk_width);
        next_bytes.add_rows(vc, next_b, next_t0, next, v_width);
      }
    }
    avx512::PrefetchStream stream = way == ReadAhead::kStream ? next_bytes.stream() : avx512::PrefetchStream{};
    // Keys before the sliding window that this block reads (its first block's, cut_rows): fewer than the block holds,
    // so its largest score is finite, and their -inf scores give weights of exactly 0.
    const int64_t masked = std::max<int64_t>(0, piece.visible - t0);
    for (int64_t j = 0; j < hkv; ++j) {
      if (way == ReadAhead::kPrefetchL2) {
        if (kc.paged()) {
          prefetch_runs_share(ahead, kc.page_size, qk_width, v_width, j, hkv);
        } else {
          prefetch_rows_share(kc, kc.at(next_b, next_t0, 0), next, j, hkv);
          prefetch_rows_share(vc, vc.at(next_b, next_t0, 0), next, j, hkv);
        }
      }
      const int64_t k_col = layout.qk_offsets[j], v_col = layout.v_offsets[j];
      const int64_t dq = layout.qk_offsets[j + 1] - k_col, dv = layout.v_offsets[j + 1] - v_col;
      float* acc = ws.acc.data() + group * v_col;
      OnlineSoftmax* softmax = ws.softmax.data() + j * group;
      const float* qj = ws.q.data() + group * k_col;  // the G query heads of KV head j, dq apart
      if (kc.paged()) {  // each run's keys are dq columns of consecutive tokens: scores = sum_c q[c] K[c]
        for (int64_t i = 0; i < group; ++i) std::fill(scores + i * kMaxBlockKeys, scores + i * kMaxBlockKeys + n, 0.f);
        const uint16_t* q_bf16 = reinterpret_cast<const uint16_t*>(qb + group * k_col);  // read as bf16 only
        for (int64_t s = 0; s < here.count; ++s) {
          run_values[s] = here.v[s] + v_col * col_stride;
          const T* keys = here.k[s] + k_col * col_stride;
          float* run_scores = scores + here.first[s];
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (bf16_key_pages && kc.page_size == 16) {
              avx512::dot_page16_bf16(q_bf16, dq, group, keys, dq, here.len[s], run_scores, kMaxBlockKeys, stream);
              continue;
            }
            if (bf16_key_pages) {
              avx512::axpy_rows_bf16(q_bf16, dq, group, keys, col_stride, dq, here.len[s], run_scores, kMaxBlockKeys,
                                     stream);
              continue;
            }
          }
          avx512::axpy_rows(qj, dq, group, keys, col_stride, dq, here.len[s], run_scores, kMaxBlockKeys, stream);
        }
      } else {  // keys are n rows of dq: one dot product per (query head, key)
        const T* keys = kc.at(b, t0, k_col);
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (bf16_dot) {
            avx512::dot_rows_bf16(reinterpret_cast<const uint16_t*>(qb + group * k_col), dq, group, keys, kc.stride1, n,
                                  dq, scores, kMaxBlockKeys, stream);
          } else {
            avx512::dot_rows(qj, dq, group, keys, kc.stride1, n, dq, scores, kMaxBlockKeys);
          }
        } else {
          avx512::dot_rows(qj, dq, group, keys, kc.stride1, n, dq, scores, kMaxBlockKeys);
        }
      }
      uint16_t* const weights = ws.weights_bf16.data();
      for (int64_t i = 0; i < group; ++i) {
        float* si = scores + i * kMaxBlockKeys;
        // The scores stay divided by pb.scale, which the exps multiply in.
        if (pb.softcap > 0.f) soft_cap_scores(si + masked, n - masked, pb.scale, pb.softcap);
        if (masked > 0) std::fill(si, si + masked, -INFINITY);
        const float factor = softmax[i].rescale_for(avx512::max_of(si, n) * pb.scale);
        if (factor != 1.f) avx512::scale_in_place(acc + i * dv, dv, factor);
        // Where the value products take bf16 weights, the exps are rounded as they are made (exp2_for_bf16, one
        // pass, not a pass of their own: measured in bench/results/ops/README.md, "CPU decode").
        if (bf16_weights) {
          softmax[i].sum += avx512::exp_sum_to_bf16<true>(
              si, n, pb.scale, softmax[i].max, reinterpret_cast<c10::BFloat16*>(weights + i * kMaxBlockKeys));
        } else {
          softmax[i].sum += avx512::exp_and_sum<kExpDegree<T>>(si, n, pb.scale, softmax[i].max);
        }
      }
      if (vc.paged()) {  // each run's values are dv columns of consecutive tokens: acc[i][c] += p_i . V[c]
        if (bf16_pages) {
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (vc.page_size == 16) {
              avx512::dot_columns_page16_bf16(weights, kMaxBlockKeys, group, run_values, here.first, here.len,
                                              here.count, dv, acc, dv, stream);
            } else {
              avx512::dot_columns(weights, kMaxBlockKeys, group, run_values, here.first, here.len, here.count,
                                  col_stride, dv, acc, dv, stream);
            }
          }
        } else {
          avx512::dot_columns(scores, kMaxBlockKeys, group, run_values, here.first, here.len, here.count, col_stride,
                              dv, acc, dv, stream);
        }
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // values are n rows of dv: acc_i += sum_t p_i[t] V[t]
        if (bf16_dot) {
          avx512::axpy_rows_bf16(weights, kMaxBlockKeys, group, vc.at(b, t0, v_col), vc.stride1, n, dv, acc, dv,
                                 stream);
        } else {
          avx512::axpy_rows(scores, kMaxBlockKeys, group, vc.at(b, t0, v_col), vc.stride1, n, dv, acc, dv, stream);
        }
      } else {
        avx512::axpy_rows(scores, kMaxBlockKeys, group, vc.at(b, t0, v_col), vc.stride1, n, dv, acc, dv, stream);
      }
      stream.finish_share(j + 1, hkv);
    }
    t0 = t1;
  }
  for (int64_t j = 0; j < hkv; ++j) {
    const int32_t record[kDecodeRecordFields] = {static_cast<int32_t>(b * hkv + j), static_cast<int32_t>(piece.index),
                                                 static_cast<int32_t>(piece.t0), static_cast<int32_t>(piece.t1)};
    finish_task(record, pb, ws.acc.data() + group * layout.v_offsets[j], ws.softmax.data() + j * group, out, out_ld);
  }
}

}  // namespace
}  // namespace fdc::cpu::decode
