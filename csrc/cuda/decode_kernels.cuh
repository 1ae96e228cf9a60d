// The decode attention kernel of csrc/cuda/decode_attention.cu (whose header comment describes it), in a header so
// that each (dtype, query heads per pass) instantiation compiles in its own generated translation unit
// (csrc/cuda/generated/, written by scripts/generate_kernels.py): a parallel build compiles them side by side, and
// the op's file only dispatches.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/device_common.cuh"
#include "fdc/attention_variant.h"
#include "fdc/decode_plan.h"
#include "fdc/decode_tiles.h"
#include "fdc/kv_format.h"

namespace fdc::cuda::decode {

// Four warps: enough threads to keep a few 16-byte copies per thread in flight for a tile, few enough that a CTA's
// per-thread accumulators (2 value columns x up to 16 query heads) stay in registers. Tile sizes, row paddings and
// the shared-memory layout are in include/fdc/decode_tiles.h.
constexpr int kThreads = kDecodeThreads;
static_assert(kThreads == 128, "the score loop's bank-conflict padding and the reduction bound assume 128 threads");

// The cache's element type C: the activations' own T for a float cache, uint8_t for a quantized one (int8 or float8
// e4m3 codes, DecodeArgs::format; int4 has no CUDA kernel yet), whose rows end in one float32 scale per KV head.
template <typename C>
constexpr bool kCodes = std::is_same_v<C, uint8_t>;

template <typename C>
constexpr int tile_keys() {
  return decode_tile_keys(sizeof(C));
}

template <typename C>
constexpr int staged_row() {
  return decode_staged_row(sizeof(C));
}

template <typename C>
__host__ __device__ constexpr int padded_k_row(int dim) {
  return decode_padded_k_row(sizeof(C), dim);
}

// An element of a cache tile as a float: a float cache's value, or a quantized cache's code before its scale.
template <typename C>
__device__ __forceinline__ float cache_to_float(C x, KvFormat format) {
  if constexpr (kCodes<C>) {
    return code_to_float(x, format);
  } else {
    return to_float(x);
  }
}

// KV heads a launch takes: the head layout travels in the kernel's parameters (captured by value in a CUDA graph,
// no copy to the device per call), and two int32 tables of 257 entries keep them within the 4 KiB parameter limit.
// Current models have at most 128 KV heads.
constexpr int kMaxKvHeads = 256;

// Everything a task needs besides its record; one copy per launch (kernel parameter space). T: q's and the output's
// dtype; C: the caches' elements (T, or a quantized cache's one-byte codes).
template <typename T, typename C>
struct DecodeArgs {
  const T* q;                    // (B, G * W_qk), row stride q_stride
  const C* k_cache;              // contiguous (B, S_max, W_qk) or paged (num_pages, W_qk, page_size); quantized: the
                                 // W_qk codes of a row (or byte rows of a page), then H_kv float32 scales
  const C* v_cache;              // contiguous (B, S_max, W_v) or paged (num_pages, W_v, page_size); as k_cache
  const int32_t* cache_seqlens;  // (B)
  const int32_t* block_table;    // (B, max_pages) when paged, else nullptr
  const int32_t* plan;           // decode plan, decode_plan_size(B, H_kv, N) entries
  T* out;                        // (B, G * W_v), row stride out_stride
  float* partial_out;            // (capacity, G, max_v_dim): normalised outputs of the chunks of split requests
  float* partial_lse;            // (capacity, G): their log-sum-exps
  const float* sinks;            // (H_kv * G) sink logits, one per query head j * G + i, or nullptr for none
  int64_t q_stride, out_stride;
  int64_t k_stride0, k_stride1;  // contiguous: between requests, between rows; paged: between pages (stride1 unused)
  int64_t v_stride0, v_stride1;
  int64_t capacity;  // rows a request can hold: S_max, or max_pages * page_size
  int64_t page_size, max_pages, num_pages;
  int32_t batch, num_kv_heads, group, num_workers, plan_capacity, max_v_dim;
  int32_t max_qk_dim;  // the widest qk head: the row length of the scaled queries in shared memory
  float scale;
  // The attention variants (fdc/attention_variant.h), uniform over the launch: every use is a branch on them that
  // all threads take the same way, and without them the kernel does what it did before they existed.
  int64_t window_left;  // kNoWindow, or the keys before its own position the query sees
  float softcap;        // 0, or the cap of the scaled scores
  KvFormat format;      // the caches' format: kFloat (C = T), or kInt8 or kFp8E4M3 (C = uint8_t)
  // Shared-memory carve-up, in elements of T (fdc/decode_tiles.h): `stages` staging tiles (2, or 1 for a paged
  // cache), then (paged) one token-major compute tile.
  int32_t stages, stage_elems, compute_elems;
  int32_t qk_offsets[kMaxKvHeads + 1];  // (H_kv + 1) prefix sums of the qk widths
  int32_t v_offsets[kMaxKvHeads + 1];   // (H_kv + 1) prefix sums of the v widths
};

// Header checks every kernel makes before trusting a plan: made by decode_plan for these shapes, and its planner
// succeeded (entry [7] is the status the device planner writes).
template <typename T, typename C>
__device__ bool plan_is_usable(const DecodeArgs<T, C>& a) {
  const DecodePlanView plan{a.plan};
  return a.plan[0] == kDecodePlanTag && plan.batch() == a.batch && plan.num_kv_heads() == a.num_kv_heads &&
         plan.num_workers() == a.num_workers && plan.capacity() == a.plan_capacity && plan.group() == a.group &&
         a.plan[7] == 0 && plan.num_tasks() >= 0 && plan.num_tasks() <= plan.capacity();
}

// Physical location of token t of request b in a paged cache: (page, slot), or page -1 if the block table does not
// name a valid page for it.
template <typename T, typename C>
__device__ __forceinline__ int64_t page_of(const DecodeArgs<T, C>& a, int64_t b, int64_t t) {
  const int64_t logical = t / a.page_size;
  if (logical >= a.max_pages) return -1;
  const int64_t page = a.block_table[b * a.max_pages + logical];
  return (page >= 0 && page < a.num_pages) ? page : -1;
}

// Starts the copy of keys [t0, t0 + n) of request b, columns [col, col + dim) of one cache, into a staging tile:
// token-major rows of `ld` elements (contiguous cache) or dim-major rows of staged_row() elements (paged cache).
// A contiguous quantized cache's rows are copied 4 bytes at a time (a row is codes and 4-byte scales, so only 4-byte
// aligned), everything else in 16-byte packets where pages hold whole ones. Returns false if a block-table entry it
// needed was invalid (those elements are not loaded).
template <typename T, typename C, bool kPaged>
__device__ bool load_tile(const DecodeArgs<T, C>& a, const C* cache, int64_t stride0, int64_t stride1, int64_t b,
                          int64_t t0, int n, int64_t col, int dim, int ld, C* stage) {
  constexpr int P = kPacket<C>;
  bool ok = true;
  if constexpr (!kPaged) {
    constexpr int kCopy = kCodes<C> ? 4 : P;  // elements per copy
    const int copies_per_row = dim / kCopy;
    const C* base = cache + b * stride0 + t0 * stride1 + col;
    for (int e = threadIdx.x; e < n * copies_per_row; e += kThreads) {
      const int key = e / copies_per_row, p = e % copies_per_row;
      if constexpr (kCodes<C>) {
        cp_async_4(stage + key * ld + p * kCopy, base + key * stride1 + p * kCopy);
      } else {
        cp_async_16(stage + key * ld + p * kCopy, base + key * stride1 + p * kCopy);
      }
    }
  } else {
    constexpr int kRow = staged_row<C>();
    const int key_packets = (n + P - 1) / P;
    if (a.page_size % P == 0) {
      // A packet of P tokens starting at a multiple of P (tiles start at multiples of P keys: run_pass) never
      // crosses a page, so its tail past n stays inside a valid page; those slots may hold anything (NaN-poisoned
      // or stale) and are dropped by transpose_tile, which copies keys below n only.
      for (int e = threadIdx.x; e < dim * key_packets; e += kThreads) {
        const int c = e / key_packets, key = (e % key_packets) * P;
        const int64_t t = t0 + key, page = page_of(a, b, t);
        if (page < 0) {
          ok = false;
          continue;
        }
        cp_async_16(stage + c * kRow + key, cache + page * stride0 + (col + c) * a.page_size + t % a.page_size);
      }
    } else {
      for (int e = threadIdx.x; e < dim * n; e += kThreads) {
        const int c = e / n, key = e % n;
        const int64_t t = t0 + key, page = page_of(a, b, t);
        if (page < 0) {
          ok = false;
          continue;
        }
        stage[c * kRow + key] = cache[page * stride0 + (col + c) * a.page_size + t % a.page_size];
      }
    }
  }
  return ok;
}

// Paged tiles only: dim-major staging (dim rows of staged_row() keys) -> token-major (n rows of ld dims).
template <typename C>
__device__ void transpose_tile(const C* stage, int dim, int n, int ld, C* tile) {
  constexpr int P = kPacket<C>;
  constexpr int kRow = staged_row<C>();
  const int key_packets = (n + P - 1) / P;
  for (int e = threadIdx.x; e < dim * key_packets; e += kThreads) {
    const int c = e % dim, key0 = (e / dim) * P;
    alignas(16) C values[P];
    *reinterpret_cast<uint4*>(values) = *reinterpret_cast<const uint4*>(stage + c * kRow + key0);
#pragma unroll
    for (int u = 0; u < P; ++u) {
      if (key0 + u < n) tile[(key0 + u) * ld + c] = values[u];
    }
  }
}

// A quantized cache only: starts the copy of the scales of KV head j for keys [t0, t0 + n) of request b into
// scales[n] (fdc/kv_format.h: after a contiguous row's `data_width` codes, H_kv float32; after a page's data_width byte
// rows, H_kv runs of page_size float32). Returns false if a block-table entry it needed was invalid.
template <typename T, bool kPaged>
__device__ bool load_scales(const DecodeArgs<T, uint8_t>& a, const uint8_t* cache, int64_t stride0, int64_t stride1,
                            int64_t data_width, int64_t b, int64_t t0, int n, int j, float* scales) {
  bool ok = true;
  for (int key = threadIdx.x; key < n; key += kThreads) {
    const int64_t t = t0 + key;
    const uint8_t* scale;
    if constexpr (kPaged) {
      const int64_t page = page_of(a, b, t);
      if (page < 0) {
        ok = false;
        continue;
      }
      scale = cache + page * stride0 + kv_page_scale_offset(data_width, a.page_size, j, t % a.page_size);
    } else {
      scale = cache + b * stride0 + t * stride1 + kv_row_scale_offset(data_width, j);
    }
    cp_async_4(scales + key, scale);
  }
  return ok;
}

// Shared state of the CTA for one task (one pass over at most kHeads query heads).
template <int kHeads>
struct SoftmaxState {
  float max[kHeads];     // running maximum score per query head
  float sum[kHeads];     // running sum of exp(score - max)
  float factor[kHeads];  // rescale of this tile for what was accumulated before it
};

// Runs the query heads [head0, head0 + heads) of one task over its keys. A quantized cache's codes are staged and
// read as bytes and turned into floats as they are used (never a float copy of the cache): a key's scores are scaled by
// its key scale after the products, each probability by its value scale before the value sums (as on the CPU).
template <typename T, typename C, int kHeads, bool kPaged>
__device__ void run_pass(const DecodeArgs<T, C>& a, int64_t b, int j, int64_t kv_start, int64_t kv_end, bool split,
                         int split_slot, int head0, int heads, char* smem) {
  constexpr int P = kPacket<C>;
  constexpr int kTile = tile_keys<C>();
  constexpr int kPerKey = kThreads / kTile;  // threads that share one key's score
  // The score loop's loads: 16-byte packets of a float cache, 8 codes of a quantized one (fdc/decode_tiles.h).
  constexpr int kUnit = decode_score_unit(sizeof(C));
  using Unit = std::conditional_t<kCodes<C>, uint2, uint4>;
  static_assert(sizeof(Unit) == kUnit * sizeof(C), "a score unit is one vector load");
  const int qk_col = a.qk_offsets[j], dq = a.qk_offsets[j + 1] - qk_col;
  const int v_col = a.v_offsets[j], dv = a.v_offsets[j + 1] - v_col;
  const int ldk = padded_k_row<C>(dq), ldv = dv;

  // Carve-up (fdc/decode_tiles.h): [stage 0 | stage 1 if two | compute tile (paged)] in C, then q (kHeads x
  // max_qk_dim) and scores (kHeads x kTile) in float, then the softmax state, then (quantized) two tiles' scales.
  C* stages = reinterpret_cast<C*>(smem);
  C* compute = stages + a.stages * a.stage_elems;
  float* s_q = reinterpret_cast<float*>(compute + a.compute_elems);
  float* s_scores = s_q + kHeads * a.max_qk_dim;
  SoftmaxState<kHeads>* state = reinterpret_cast<SoftmaxState<kHeads>*>(s_scores + kHeads * kTile);
  // Tile i's key scales at s_scales + (i % 2) * 2 kTile, its value scales kTile further.
  float* s_scales = reinterpret_cast<float*>(state + 1);

  // Each (request, KV head) is one task's; the q row is scaled once here.
  const int group = a.group;
  const T* q_row = a.q + b * a.q_stride + int64_t(group) * qk_col;
  for (int e = threadIdx.x; e < kHeads * dq; e += kThreads) {
    const int i = e / dq, c = e % dq;
    s_q[i * a.max_qk_dim + c] = i < heads ? to_float(q_row[int64_t(head0 + i) * dq + c]) * a.scale : 0.f;
  }
  if (threadIdx.x < kHeads) {
    state->max[threadIdx.x] = -INFINITY;
    state->sum[threadIdx.x] = 0.f;
  }

  // Value accumulation: thread t owns columns (2p, 2p+1), p = t % pairs, for the keys k = kg (mod key_groups) of
  // every tile; narrow heads leave no thread idle by giving each column pair several key groups.
  const int pairs = dv / 2;
  const int key_groups = kThreads / pairs;
  const int pair = threadIdx.x % pairs, key_group = threadIdx.x / pairs;
  const bool accumulates = key_group < key_groups;
  float acc[kHeads][2];
#pragma unroll
  for (int i = 0; i < kHeads; ++i) acc[i][0] = acc[i][1] = 0.f;

  auto stage_k = [&](int s) { return stages + s * a.stage_elems; };
  auto stage_v = [&](int s) { return stages + s * a.stage_elems + (kPaged ? dq * staged_row<C>() : kTile * ldk); };
  auto tile_scales = [&](int64_t tile) { return s_scales + (tile % 2) * 2 * kTile; };
  bool pages_ok = true;
  // Tile `tile` of the pass (its keys from t0) into stage s.
  auto issue = [&](int s, int64_t t0, int64_t tile) {
    const int n = static_cast<int>(min64(kTile, kv_end - t0));
    pages_ok &= load_tile<T, C, kPaged>(a, a.k_cache, a.k_stride0, a.k_stride1, b, t0, n, qk_col, dq, ldk, stage_k(s));
    pages_ok &= load_tile<T, C, kPaged>(a, a.v_cache, a.v_stride0, a.v_stride1, b, t0, n, v_col, dv, ldv, stage_v(s));
    if constexpr (kCodes<C>) {
      pages_ok &= load_scales<T, kPaged>(a, a.k_cache, a.k_stride0, a.k_stride1, a.qk_offsets[a.num_kv_heads], b, t0, n,
                                         j, tile_scales(tile));
      pages_ok &= load_scales<T, kPaged>(a, a.v_cache, a.v_stride0, a.v_stride1, a.v_offsets[a.num_kv_heads], b, t0, n,
                                         j, tile_scales(tile) + kTile);
    }
    cp_async_commit();
  };

  // Tiles start at the chunk's first key, except on a paged cache read in packets, whose tiles must start on a
  // packet (load_tile): there they start at the first key rounded down to one. Chunks start on multiples of
  // kChunkAlign, a multiple of P, except a sliding window's first chunk; its lead keys, before the window, lie in the
  // first key's page (page_size is a multiple of P) and are loaded but masked: scores -inf, no value sums.
  const int64_t tiles_start = (kPaged && a.page_size % P == 0) ? kv_start - kv_start % P : kv_start;
  int masked = static_cast<int>(kv_start - tiles_start);  // lead keys of the current tile: 0 past the first

  // Two stages: the next tile's copy is issued before waiting for the current one. One (paged caches only): it is
  // issued into the stage just emptied into the compute tile, and overlaps the tile's compute only.
  const bool double_buffered = !kPaged || a.stages == 2;
  issue(0, tiles_start, 0);
  int s = 0;
  for (int64_t t0 = tiles_start, tile = 0; t0 < kv_end; t0 += kTile, ++tile) {
    const int n = static_cast<int>(min64(kTile, kv_end - t0));
    const bool more = t0 + kTile < kv_end;
    if (double_buffered && more) {
      issue(s ^ 1, t0 + kTile, tile + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const C* k_tile = stage_k(s);
    const C* v_tile = stage_v(s);
    const float* k_scales = tile_scales(tile);  // quantized caches only
    const float* v_scales = k_scales + kTile;
    if constexpr (kPaged) {
      transpose_tile(stage_k(s), dq, n, ldk, compute);
      transpose_tile(stage_v(s), dv, n, ldv, compute + kTile * ldk);
      __syncthreads();
      if (!double_buffered && more) issue(s, t0 + kTile, tile + 1);
      k_tile = compute;
      v_tile = compute + kTile * ldk;
    }

    // Scores: the kPerKey threads of a key take interleaved units of its row, then add up by shuffles.
    {
      const int key = threadIdx.x / kPerKey, part = threadIdx.x % kPerKey;
      float dot[kHeads];
#pragma unroll
      for (int i = 0; i < kHeads; ++i) dot[i] = 0.f;
      for (int p = part; p < dq / kUnit; p += kPerKey) {
        alignas(sizeof(Unit)) C kv[kUnit];
        *reinterpret_cast<Unit*>(kv) = *reinterpret_cast<const Unit*>(k_tile + key * ldk + p * kUnit);
        float kf[kUnit];
#pragma unroll
        for (int u = 0; u < kUnit; ++u) kf[u] = cache_to_float(kv[u], a.format);
#pragma unroll
        for (int i = 0; i < kHeads; ++i) {
          const float* qi = s_q + i * a.max_qk_dim + p * kUnit;
#pragma unroll
          for (int u = 0; u < kUnit; ++u) dot[i] += qi[u] * kf[u];
        }
      }
#pragma unroll
      for (int i = 0; i < kHeads; ++i) {
#pragma unroll
        for (int lane_mask = 1; lane_mask < kPerKey; lane_mask *= 2)
          dot[i] += __shfl_xor_sync(0xffffffffu, dot[i], lane_mask);
      }
      if (part == 0) {
        if constexpr (kCodes<C>) {  // a key's scale multiplies its products' sum (unused past n: masked below)
#pragma unroll
          for (int i = 0; i < kHeads; ++i) dot[i] *= k_scales[key];
        }
        if (a.softcap > 0.f) {
#pragma unroll
          for (int i = 0; i < kHeads; ++i) dot[i] = soft_cap(dot[i], a.softcap);
        }
        const bool visible = key >= masked && key < n;
#pragma unroll
        for (int i = 0; i < kHeads; ++i) s_scores[i * kTile + key] = visible ? dot[i] : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax: warp w updates query heads w, w + 4, ...; scores become probabilities in place.
    {
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      for (int i = warp; i < heads; i += kThreads / 32) {
        float* si = s_scores + i * kTile;
        float tile_max = -INFINITY;
        for (int k = lane; k < kTile; k += 32) tile_max = fmaxf(tile_max, si[k]);
#pragma unroll
        for (int m = 16; m > 0; m /= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, m));
        const float old_max = state->max[i];
        const float new_max = fmaxf(old_max, tile_max);  // finite: every tile has a visible key
        float tile_sum = 0.f;
        for (int k = lane; k < kTile; k += 32) {
          const float p = k < n ? __expf(si[k] - new_max) : 0.f;
          if constexpr (kCodes<C>) {  // the weight of the key's value codes: p times its value scale (0 if masked)
            si[k] = k >= masked && k < n ? p * v_scales[k] : 0.f;
          } else {
            si[k] = p;
          }
          tile_sum += p;
        }
#pragma unroll
        for (int m = 16; m > 0; m /= 2) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, m);
        // Every lane read state->max[i] above; lane 0 replaces it below. A shuffle is no memory barrier, so only this
        // orders the two (racecheck reported the read and the write as a race on an H100 without it).
        __syncwarp();
        if (lane == 0) {
          const float factor = old_max == -INFINITY ? 0.f : __expf(old_max - new_max);
          state->factor[i] = factor;
          state->sum[i] = state->sum[i] * factor + tile_sum;
          state->max[i] = new_max;
        }
      }
    }
    __syncthreads();

    // Values: acc[i] = acc[i] * factor[i] + sum over this thread's keys of p[i][k] * V[k][2 pair .. 2 pair + 1].
    if (accumulates) {
#pragma unroll
      for (int i = 0; i < kHeads; ++i) {
        if (i < heads) {
          acc[i][0] *= state->factor[i];
          acc[i][1] *= state->factor[i];
        }
      }
      for (int k = masked + key_group; k < n; k += key_groups) {
        const float v0 = cache_to_float(v_tile[k * ldv + 2 * pair], a.format);
        const float v1 = cache_to_float(v_tile[k * ldv + 2 * pair + 1], a.format);
#pragma unroll
        for (int i = 0; i < kHeads; ++i) {
          const float p = s_scores[i * kTile + k];
          acc[i][0] += p * v0;
          acc[i][1] += p * v1;
        }
      }
    }
    __syncthreads();  // the tiles just read are the next issue's or transpose's target
    if (double_buffered) s ^= 1;
    masked = 0;
  }

  // Reduce the key groups' accumulators through shared memory (the staging and compute tiles are free now: every
  // copy was waited for), then normalise.
  const bool valid = __syncthreads_and(pages_ok);
  float* reduce = reinterpret_cast<float*>(stages);  // (key_groups, kHeads, dv)
  if (accumulates) {
#pragma unroll
    for (int i = 0; i < kHeads; ++i) {
      reduce[(key_group * kHeads + i) * dv + 2 * pair] = acc[i][0];
      reduce[(key_group * kHeads + i) * dv + 2 * pair + 1] = acc[i][1];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < heads * dv; e += kThreads) {
    const int i = e / dv, c = e % dv;
    float total = 0.f;
    for (int g = 0; g < key_groups; ++g) total += reduce[(g * kHeads + i) * dv + c];
    const float sum = state->sum[i];
    float value = !valid ? NAN : (sum > 0.f ? total / sum : 0.f);
    const int h = head0 + i;
    auto lse = [&] { return sum > 0.f ? state->max[i] + logf(sum) : -INFINITY; };
    if (split) {
      // Sinks join after the merge (decode_combine_kernel), with the lse of all the request's keys.
      a.partial_out[(int64_t(split_slot) * group + h) * a.max_v_dim + c] = value;
      if (c == 0) a.partial_lse[int64_t(split_slot) * group + h] = valid ? lse() : NAN;
    } else {
      if (a.sinks != nullptr) value *= sink_factor(lse(), a.sinks[int64_t(j) * group + h]);
      a.out[b * a.out_stride + int64_t(group) * v_col + int64_t(h) * dv + c] = from_float<T>(value);
    }
  }
  __syncthreads();  // shared memory is reused by the next pass or task
}

// One CTA per plan worker; blockIdx.x is the worker. The launch bound's 1 (CTA per SM) costs nothing: workers are the
// SM count by default and a CTA's shared memory leaves room for few more. Without it ptxas aimed at more CTAs per SM,
// capped registers at 64 to 96 and spilled (ptxas -v on sm_80 and sm_90, with and without the attention variants:
// up to 52 bytes); with it, no instantiation spills.
template <typename T, typename C, int kHeads, bool kPaged>
__global__ void __launch_bounds__(kThreads, 1) decode_attention_kernel(const __grid_constant__ DecodeArgs<T, C> a) {
  extern __shared__ __align__(16) char smem[];
  if (!plan_is_usable(a)) return;  // the combine kernel writes NaN everywhere
  const DecodePlanView plan{a.plan};
  const int32_t* workers = plan.worker_offsets();
  const int32_t* split = plan.split_offsets();
  const int w = blockIdx.x;
  const int first = workers[w], last = workers[w + 1];
  if (first < 0 || last > plan.num_tasks() || first > last) return;
  const int pairs = plan.batch() * plan.num_kv_heads();
  for (int r = first; r < last; ++r) {
    const int32_t* rec = plan.records() + int64_t(r) * kDecodeRecordFields;
    const int bj = rec[0], chunk = rec[1];
    if (bj < 0 || bj >= pairs) continue;
    const int64_t b = bj / a.num_kv_heads;
    const int j = bj % a.num_kv_heads;
    const int chunks = split[bj + 1] - split[bj];
    const int64_t length = a.cache_seqlens[b];
    // Chunks after the first start at multiples of kChunkAlign keys (the planner's rule, decode_chunk_keys), which
    // the 16-byte paged loads rely on; the first starts where the query's window does (key 0 without a window).
    const bool is_split = chunks > 1;
    const int slot = split[bj] + chunk;
    const int64_t first_key = decode_window_start(length, a.window_left);
    // A plan made for other lengths of this batch, or for another window, is caught where it matters without a host
    // read: its first chunk must start at the window's first key and its last end at the request's length (a stale
    // plan would silently drop keys, or attend to keys outside the window).
    const bool starts_ok = chunk == 0 ? rec[2] == first_key : (rec[2] > first_key && rec[2] % kChunkAlign == 0);
    const bool in_range = chunk >= 0 && chunk < chunks && starts_ok && rec[2] < rec[3] && rec[3] <= length &&
                          rec[3] <= a.capacity && (chunk != chunks - 1 || rec[3] == length) &&
                          (!is_split || (slot >= 0 && slot < a.plan_capacity));
    if (!in_range) {
      // Nothing is read; the outputs this record was to produce become NaN.
      const int dv = a.v_offsets[j + 1] - a.v_offsets[j];
      for (int e = threadIdx.x; e < a.group * dv; e += kThreads) {
        const int h = e / dv, c = e % dv;
        if (is_split && slot >= 0 && slot < a.plan_capacity) {
          a.partial_out[(int64_t(slot) * a.group + h) * a.max_v_dim + c] = NAN;
          if (c == 0) a.partial_lse[int64_t(slot) * a.group + h] = NAN;
        } else if (!is_split) {
          a.out[b * a.out_stride + int64_t(a.group) * a.v_offsets[j] + int64_t(h) * dv + c] = from_float<T>(NAN);
        }
      }
      continue;
    }
    for (int head0 = 0; head0 < a.group; head0 += kHeads) {
      run_pass<T, C, kHeads, kPaged>(a, b, j, rec[2], rec[3], is_split, slot, head0, min(kHeads, a.group - head0),
                                     smem);
    }
  }
}

// Launches the kernel unless it needs more dynamic shared memory than the device lets it have; the caller raises the
// op's error from the status (cuda_common.cuh's check_launch).
template <typename T, typename C, int kHeads, bool kPaged>
LaunchStatus launch(const DecodeArgs<T, C>& args, int64_t smem_bytes, cudaStream_t stream) {
  auto kernel = decode_attention_kernel<T, C, kHeads, kPaged>;
  LaunchStatus status = allow_all_shared_memory(kernel);
  if (status.error != cudaSuccess || smem_bytes > status.smem_limit) return status;
  kernel<<<args.num_workers, kThreads, smem_bytes, stream>>>(args);
  status.error = cudaGetLastError();
  return status;
}

template <typename T, typename C, int kHeads>
LaunchStatus launch_layout(const DecodeArgs<T, C>& args, bool paged, int64_t smem_bytes, cudaStream_t stream) {
  return paged ? launch<T, C, kHeads, true>(args, smem_bytes, stream)
               : launch<T, C, kHeads, false>(args, smem_bytes, stream);
}

}  // namespace fdc::cuda::decode
