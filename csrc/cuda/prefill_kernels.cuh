// The prefill attention kernels of csrc/cuda/prefill_attention.cu (whose header comment describes them), in a
// header so that each (dtype, width bucket) instantiation of the tensor-core kernel compiles in its own generated
// translation unit (csrc/cuda/generated/, written by scripts/generate_kernels.py): a parallel build compiles them side
// by side, and the op's file only dispatches.
//
// Keys and values are packed rows or a paged cache (decode_attention's page layout); both kernels address them through
// key_offset, so the paging is a branch on PrefillArgs::block_table that every thread takes the same way. The
// tensor-core kernel also reads int8 and float8 e4m3 pages (PrefillArgs::format), a branch of the same kind.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "fdc/attention_variant.h"
#include "fdc/kv_format.h"
#include "fdc/prefill_plan.h"

namespace fdc::cuda::prefill {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
// Query rows of a base tile: 16 per warp, the m of one m16n8k16 product.
constexpr int kRowsPerCta = 16 * kWarps;
// The layout travels in the kernel parameters (no host-to-device copy per call); 256 KV heads keep them far
// inside the 4 KiB parameter space.
constexpr int kMaxKvHeads = 256;
// Scores are exponentiated with exp2: natural-unit values (capped scores, log-sum-exps) convert by these.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

template <typename T>
struct PrefillArgs {
  const T* q;  // (T_q, G * W_qk), row stride q_stride
  const T* k;  // packed (T_k, W_qk) with 16-byte aligned rows, or paged (num_pages, W_qk, page_size)
  const T* v;  // packed (T_k, W_v) with 16-byte aligned rows, or paged (num_pages, W_v, page_size)
  // A quantized paged cache instead (fdc/kv_format.h; the tensor-core kernel only): k and v are null and its pages
  // are read as bytes, k_codes (num_pages, W_qk + 4 H_kv, page_size) and v_codes (num_pages, W_v + 4 H_kv,
  // page_size), the page strides k_stride and v_stride in bytes.
  const uint8_t* k_codes;
  const uint8_t* v_codes;
  KvFormat format;      // kFloat (k and v hold T), kInt8 or kFp8E4M3 (k_codes and v_codes)
  const int32_t* cu_q;  // (B + 1) query boundaries, on the device
  const int32_t* cu_k;  // (B + 1) key boundaries, on the device
  const int32_t* plan;  // the prefill plan, validated on the host
  T* out;               // (T_q, G * W_v), row stride out_stride, zero-initialised
  // k_stride, v_stride: between rows when packed, between pages when paged.
  int64_t q_stride, k_stride, v_stride, out_stride;
  // Paged keys and values: block_table (B, max_pages) int32 on the device, validated on the host for every page a
  // query sees; nullptr for packed rows. Inside a page, column c holds page_size consecutive keys contiguously, so a
  // column step is col_stride = page_size elements (1 for packed rows).
  const int32_t* block_table;
  int64_t max_pages, page_size, col_stride;
  float scale_log2;  // softmax scale * log2(e): scores are exponentiated with exp2
  // The attention variants (fdc/attention_variant.h), uniform over the launch: every use is a branch on them that
  // all threads take the same way, and without them the kernels do what they did before they existed.
  float scale;          // the softmax scale: soft-capping applies to the scaled scores in natural units
  float softcap;        // 0, or the cap of the scaled scores
  const float* sinks;   // (H) sink logits, one per query head, or nullptr for none
  int32_t window_left;  // kNoWindow, or the keys before its own position a query row sees
  int32_t group;
  int32_t num_kv_heads;
  bool causal;
  int32_t qk_offsets[kMaxKvHeads + 1];  // (H_kv + 1)
  int32_t v_offsets[kMaxKvHeads + 1];   // (H_kv + 1)
};

// One record's geometry, shared by both paths.
struct RecordView {
  int64_t q_row0;  // first packed row of the sequence's queries
  int64_t k_row0;  // first packed row of its keys (packed k and v only)
  int32_t b;       // the sequence: its block-table row (paged k and v only)
  int32_t s_q, s_k;
  int32_t row_start, row_end;  // the record's rows, counted from the sequence's first query
  int32_t h, j;                // query head, its KV head
  int32_t dq, dv;
  int64_t q_col, k_col, v_col, o_col;
};

template <typename T>
__device__ RecordView read_record(const PrefillArgs<T>& a, const int32_t* rec) {
  RecordView r;
  const int b = rec[0];
  r.b = b;
  r.h = rec[1];
  r.j = r.h / a.group;
  r.q_row0 = a.cu_q[b];
  r.k_row0 = a.cu_k[b];
  r.s_q = a.cu_q[b + 1] - a.cu_q[b];
  r.s_k = a.cu_k[b + 1] - a.cu_k[b];
  r.row_start = rec[2];
  r.row_end = rec[3];
  r.dq = a.qk_offsets[r.j + 1] - a.qk_offsets[r.j];
  r.dv = a.v_offsets[r.j + 1] - a.v_offsets[r.j];
  const int i = r.h % a.group;
  r.k_col = a.qk_offsets[r.j];
  r.v_col = a.v_offsets[r.j];
  r.q_col = int64_t(a.group) * r.k_col + int64_t(i) * r.dq;
  r.o_col = int64_t(a.group) * r.v_col + int64_t(i) * r.dv;
  return r;
}

// Where key t of record r lies in k (stride a.k_stride) or v (a.v_stride): its column c of the tensor's packed width is
// at base + key_offset(a, r, t, stride) + c * a.col_stride. Packed: row k_row0 + t. Paged: slot t % page_size of page
// block_table[b][t / page_size]; only keys some row of the record sees may be asked for, since the block-table
// entries of other pages (before the first query's window, past the last key) need not be page indices.
template <typename T>
__device__ __forceinline__ int64_t key_offset(const PrefillArgs<T>& a, const RecordView& r, int32_t t, int64_t stride) {
  if (a.block_table == nullptr) return (r.k_row0 + t) * stride;
  const int64_t page = a.block_table[int64_t(r.b) * a.max_pages + t / a.page_size];
  return page * stride + t % a.page_size;
}

// Key t of request b from one quantized paged cache (k_codes or v_codes, page stride `stride` bytes, `data_bytes`
// byte rows of codes per page) into a shared-memory row of T: columns column0, column0 + step, ... below `dim` of KV
// head j (its first column `col`), each code times the (token, KV head) scale (fdc/kv_format.h), rounded to T as a
// float page's element is. A warp's lanes take consecutive keys, so each byte row is read in runs of consecutive slots,
// as a float page's columns are. K and V are staged one after the other, so that little is live beside the tile loop's
// accumulators.
template <typename T>
__device__ __forceinline__ void stage_quantized_key(const PrefillArgs<T>& a, const uint8_t* codes, int64_t stride,
                                                    int64_t data_bytes, int32_t b, int32_t t, int32_t j, int64_t col,
                                                    int dim, int column0, int step, T* dst) {
  // t and its slot are int32: a page wider than INT32_MAX holds every key in its first INT32_MAX slots.
  const int32_t page_size = static_cast<int32_t>(min64(a.page_size, INT32_MAX));
  const int32_t page = a.block_table[int64_t(b) * a.max_pages + t / page_size];
  const int32_t slot = t % page_size;
  const uint8_t* page_start = codes + page * stride;
  const float scale =
      *reinterpret_cast<const float*>(page_start + kv_page_scale_offset(data_bytes, a.page_size, j, slot));
  const uint8_t* src = page_start + col * a.page_size + slot + column0 * a.page_size;
  const int64_t src_step = step * a.page_size;
  for (int c = column0; c < dim; c += step, src += src_step) {
    dst[c] = static_cast<T>(code_to_float(*src, a.format) * scale);
  }
}

// Keys [0, keys_end) are the ones some row of [row0, row1) sees (causal: bottom-right aligned, as in the planner).
inline __device__ int32_t keys_seen(const RecordView& r, int32_t row1, bool causal) {
  if (!causal) return r.s_k;
  const int64_t end = int64_t(row1) + r.s_k - r.s_q;  // row row1 - 1 sees keys up to row1 - 1 + s_k - s_q
  return static_cast<int32_t>(end < 0 ? 0 : (end > r.s_k ? r.s_k : end));
}

// The first key row `row` sees: its sliding window's start (0 without a window). Windows move with the rows, so a
// row range's first row has the range's first key.
inline __device__ int32_t first_key_seen(const RecordView& r, int32_t row, int32_t window_left) {
  return static_cast<int32_t>(window_start(int64_t(row) + r.s_k - r.s_q, window_left));
}

// A row's softmax normaliser: 1 / row_sum, times the sink's factor (fdc/attention_variant.h) when the op has sinks;
// row_max and row_sum in exp2 units (row_sum = sum of exp2(score - row_max)). 0 for a row that saw no key.
inline __device__ float row_normaliser(float row_max, float row_sum, const float* sinks, int32_t head) {
  if (!(row_sum > 0.f)) return 0.f;
  const float inv = 1.f / row_sum;
  return sinks == nullptr ? inv : inv * sink_factor((row_max + log2f(row_sum)) * kLn2, sinks[head]);
}

// ------------------------------------------------------------------------------------------------------------------
// Tensor-core path (fp16 / bf16).

template <typename T>
struct MmaType;
template <>
struct MmaType<c10::Half> {
  static constexpr bool kBf16 = false;
};
template <>
struct MmaType<c10::BFloat16> {
  static constexpr bool kBf16 = true;
};

// d (16x8 fp32) += a (16x16) * b (16x8), PTX fragment layouts of mma.m16n8k16.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (MmaType<T>::kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two elements of T packed in one 32-bit register, low half first (the fragments' element order).
template <typename T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) {
  uint16_t l, h;
  memcpy(&l, &lo, 2);
  memcpy(&h, &hi, 2);
  return uint32_t(l) | (uint32_t(h) << 16);
}

template <typename T>
__device__ __forceinline__ uint32_t pack2_float(float lo, float hi) {
  return pack2<T>(static_cast<T>(lo), static_cast<T>(hi));
}

// B fragments of a 16 (keys) x 8 (columns) block of row-major V in shared memory, transposed by ldmatrix: lanes
// 0..15 give the addresses of the block's 16 key rows.
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t& b0, uint32_t& b1, const void* row_address) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(b0), "=r"(b1) : "r"(addr));
}

// Per-bucket constants. kDim: the widest head of the layout rounded up (64, 128 or 256). Key tiles of 64 keys, 32
// for the 256 bucket, keep the per-thread state (Q fragments kDim / 4, O accumulators kDim / 2 and S kKeys / 2
// registers) under the 255-register limit, and two K + V stages within 70 KiB of shared memory.
template <int kDim>
struct Bucket {
  static constexpr int kKeys = kDim > 128 ? 32 : 64;
  static constexpr int kQkSteps = kDim / 16;   // k-steps of QK^T
  static constexpr int kVTiles = kDim / 8;     // n-tiles of PV
  static constexpr int kKeyTiles = kKeys / 8;  // n-tiles of S
  // Row strides in shared memory, in elements. K: 32-bit fragment loads of 8 rows x 4 words are conflict-free when
  // the row stride is 4 (mod 8) words: width + 8. V: ldmatrix reads 8 rows of 16 bytes per phase, conflict-free
  // when the stride is an odd number of 16-byte units: width + 8.
  static constexpr int kLdk = kDim + 8;
  static constexpr int kLdv = kDim + 8;
  static constexpr int kStageElems = kKeys * (kLdk + kLdv);
  static constexpr int kSharedBytes = 2 * kStageElems * 2;
};

template <typename T, int kDim>
__global__ void __launch_bounds__(kThreads) prefill_mma_kernel(const __grid_constant__ PrefillArgs<T> a) {
  using B = Bucket<kDim>;
  extern __shared__ __align__(16) char smem[];
  T* stages = reinterpret_cast<T*>(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // fragment group (row) and thread-in-group (column pair)
  const PrefillPlanView plan{a.plan};
  const int first = plan.worker_offsets()[blockIdx.x], last = plan.worker_offsets()[blockIdx.x + 1];

  for (int ri = first; ri < last; ++ri) {
    const RecordView r = read_record(a, plan.records() + int64_t(ri) * kPrefillRecordFields);
    const int dq16 = (r.dq + 15) / 16 * 16;  // QK^T k extent, zero padded
    const int qk_steps = dq16 / 16, v_tiles = r.dv / 8;
    const int packets_k = r.dq / 8, packets_v = r.dv / 8;

    // The padding columns [dq, dq16) of both K stages are zero for the whole record (the tile loads never write
    // them).
    __syncthreads();
    for (int e = threadIdx.x; e < 2 * B::kKeys * (dq16 - r.dq); e += kThreads) {
      const int pad = dq16 - r.dq;
      const int stage = e / (B::kKeys * pad), rem = e % (B::kKeys * pad);
      stages[stage * B::kStageElems + (rem / pad) * B::kLdk + r.dq + rem % pad] = T(0.f);
    }

    for (int row0 = r.row_start; row0 < r.row_end; row0 += kRowsPerCta) {
      const int row1 = min(r.row_end, row0 + kRowsPerCta);
      const int keys_end = keys_seen(r, row1, a.causal);
      // Key tiles before the first row's window hold no key any row of the tile sees: they are never loaded.
      const int keys_begin = first_key_seen(r, row0, a.window_left);
      if (keys_end <= keys_begin) continue;  // no row of this tile sees a key: the zero output stands
      const int my_row0 = row0 + 16 * warp;  // this warp's rows my_row0 + g and my_row0 + g + 8
      // Rows g and g + 8 see keys [row_first, row_first + row_span): their window, up to the causal diagonal and
      // keys_end. One unsigned compare per score tests both ends.
      int row_first[2], row_span[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = my_row0 + g + 8 * half;
        const int64_t diagonal_end = int64_t(row) + r.s_k - r.s_q + 1;
        const int64_t end = a.causal ? min64(keys_end, max64(0, diagonal_end)) : keys_end;
        row_first[half] = first_key_seen(r, row, a.window_left);
        row_span[half] = static_cast<int>(max64(0, end - row_first[half]));
      }

      // Q fragments, zero past the record's rows and past dq.
      uint32_t qf[B::kQkSteps][4];
#pragma unroll
      for (int ks = 0; ks < B::kQkSteps; ++ks) {
#pragma unroll
        for (int half = 0; half < 4; ++half) {
          const int row = my_row0 + g + 8 * (half & 1);
          const int col = ks * 16 + 2 * t + 8 * (half >> 1);
          T x0 = T(0.f), x1 = T(0.f);
          if (ks < qk_steps && row < row1 && col < r.dq) {
            const T* src = a.q + (r.q_row0 + row) * a.q_stride + r.q_col + col;
            x0 = src[0];
            x1 = src[1];
          }
          qf[ks][half] = pack2<T>(x0, x1);
        }
      }
      float acc[B::kVTiles][4];
#pragma unroll
      for (int n = 0; n < B::kVTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
      float row_max[2] = {-INFINITY, -INFINITY};
      float row_sum[2] = {0.f, 0.f};  // this lane's part of the row sums; the quad adds up at the end

      auto issue = [&](int stage, int k0) {
        T* ks_ptr = stages + stage * B::kStageElems;
        T* vs_ptr = ks_ptr + B::kKeys * B::kLdk;
        const int n = min(B::kKeys, keys_end - k0);
        if (a.block_table == nullptr) {
          for (int e = threadIdx.x; e < n * packets_k; e += kThreads) {
            const int key = e / packets_k, p = e % packets_k;
            cp_async_16(ks_ptr + key * B::kLdk + 8 * p, a.k + (r.k_row0 + k0 + key) * a.k_stride + r.k_col + 8 * p);
          }
          for (int e = threadIdx.x; e < n * packets_v; e += kThreads) {
            const int key = e / packets_v, p = e % packets_v;
            cp_async_16(vs_ptr + key * B::kLdv + 8 * p, a.v + (r.k_row0 + k0 + key) * a.v_stride + r.v_col + 8 * p);
          }
          // Rows past the last key are multiplied by probability 0: they must hold finite values, not stale ones.
          for (int e = threadIdx.x; e < (B::kKeys - n) * r.dv; e += kThreads) {
            vs_ptr[(n + e / r.dv) * B::kLdv + e % r.dv] = T(0.f);
          }
        } else {
          // Paged: a page's keys of one column are contiguous, so each thread takes one key of the tile (its
          // block-table entries read once) and every kThreads / kKeys-th column: a warp reads one column of 32
          // consecutive keys, contiguous within each page. Plain loads and shared stores, visible to the compute after
          // the loop's __syncthreads; they are not pipelined like cp.async: each thread waits for its loads here, so
          // the next tile's loads do not overlap this tile's compute. Keys past n (the last key or the tile's end) are
          // zero: no block-table entry or page past the last key is read, and their V rows, multiplied by probability
          // 0, hold no stale value (0 * NaN = NaN). Quantized pages are dequantized into the same tiles.
          static_assert(kThreads % B::kKeys == 0, "every key of a tile has the same number of threads");
          constexpr int kColumnStep = kThreads / B::kKeys;
          const int key = threadIdx.x % B::kKeys;
          const int column0 = threadIdx.x / B::kKeys;
          T* k_dst = ks_ptr + key * B::kLdk;
          T* v_dst = vs_ptr + key * B::kLdv;
          if (key < n && a.format != KvFormat::kFloat) {
            stage_quantized_key(a, a.k_codes, a.k_stride, a.qk_offsets[a.num_kv_heads], r.b, k0 + key, r.j, r.k_col,
                                r.dq, column0, kColumnStep, k_dst);
            stage_quantized_key(a, a.v_codes, a.v_stride, a.v_offsets[a.num_kv_heads], r.b, k0 + key, r.j, r.v_col,
                                r.dv, column0, kColumnStep, v_dst);
          } else if (key < n) {
            const T* k_src = a.k + key_offset(a, r, k0 + key, a.k_stride) + r.k_col * a.col_stride;
            const T* v_src = a.v + key_offset(a, r, k0 + key, a.v_stride) + r.v_col * a.col_stride;
            for (int c = column0; c < r.dq; c += kColumnStep) k_dst[c] = k_src[c * a.col_stride];
            for (int c = column0; c < r.dv; c += kColumnStep) v_dst[c] = v_src[c * a.col_stride];
          } else {
            for (int c = column0; c < r.dq; c += kColumnStep) k_dst[c] = T(0.f);
            for (int c = column0; c < r.dv; c += kColumnStep) v_dst[c] = T(0.f);
          }
        }
        cp_async_commit();
      };

      issue(0, keys_begin);
      int stage = 0;
      for (int k0 = keys_begin; k0 < keys_end; k0 += B::kKeys, stage ^= 1) {
        if (k0 + B::kKeys < keys_end) {
          issue(stage ^ 1, k0 + B::kKeys);
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncthreads();
        const T* ks_ptr = stages + stage * B::kStageElems;
        const T* vs_ptr = ks_ptr + B::kKeys * B::kLdk;

        // S = Q K^T for this warp's 16 rows and the tile's keys.
        float s[B::kKeyTiles][4];
#pragma unroll
        for (int n = 0; n < B::kKeyTiles; ++n) {
          s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
          const T* key_row = ks_ptr + (8 * n + g) * B::kLdk + 2 * t;
#pragma unroll
          for (int ks = 0; ks < B::kQkSteps; ++ks) {
            if (ks < qk_steps) {
              const uint32_t b0 = *reinterpret_cast<const uint32_t*>(key_row + 16 * ks);
              const uint32_t b1 = *reinterpret_cast<const uint32_t*>(key_row + 16 * ks + 8);
              mma_16816<T>(s[n], qf[ks], b0, b1);
            }
          }
        }

        // Soft-capping (natural units), then the mask (keys past the sequence, causal, window) and the conversion
        // to exp2 units, then the online softmax of rows g and g + 8.
        if (a.softcap > 0.f) {
#pragma unroll
          for (int n = 0; n < B::kKeyTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = soft_cap(s[n][e] * a.scale, a.softcap);
          }
        }
        const float to_log2 = a.softcap > 0.f ? kLog2e : a.scale_log2;
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < B::kKeyTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + 8 * n + 2 * t + (e & 1);
            const int half = e >> 1;
            const bool visible = unsigned(key - row_first[half]) < unsigned(row_span[half]);
            s[n][e] = visible ? s[n][e] * to_log2 : -INFINITY;
            tile_max[half] = fmaxf(tile_max[half], s[n][e]);
          }
        }
        float factor[2], base[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 1));
          tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 2));
          const float new_max = fmaxf(row_max[half], tile_max[half]);
          // A row that has seen no key yet keeps max -inf: its probabilities are exp2(-inf) = 0 against base 0.
          base[half] = new_max == -INFINITY ? 0.f : new_max;
          factor[half] = row_max[half] == -INFINITY ? 0.f : exp2f(row_max[half] - new_max);
          row_max[half] = new_max;
          row_sum[half] *= factor[half];
        }
#pragma unroll
        for (int n = 0; n < B::kVTiles; ++n) {
          acc[n][0] *= factor[0];
          acc[n][1] *= factor[0];
          acc[n][2] *= factor[1];
          acc[n][3] *= factor[1];
        }
        uint32_t p_frag[B::kKeyTiles / 2][4];  // P as A fragments, one per 16 keys
#pragma unroll
        for (int n = 0; n < B::kKeyTiles; ++n) {
          const float p0 = exp2f(s[n][0] - base[0]), p1 = exp2f(s[n][1] - base[0]);
          const float p2 = exp2f(s[n][2] - base[1]), p3 = exp2f(s[n][3] - base[1]);
          row_sum[0] += p0 + p1;
          row_sum[1] += p2 + p3;
          p_frag[n / 2][2 * (n % 2)] = pack2_float<T>(p0, p1);
          p_frag[n / 2][2 * (n % 2) + 1] = pack2_float<T>(p2, p3);
        }

        // O += P V.
#pragma unroll
        for (int kk = 0; kk < B::kKeyTiles / 2; ++kk) {
          const T* v_rows = vs_ptr + (16 * kk + (lane % 16)) * B::kLdv;
#pragma unroll
          for (int n = 0; n < B::kVTiles; ++n) {
            if (n < v_tiles) {
              uint32_t b0, b1;
              ldmatrix_x2_trans(b0, b1, v_rows + 8 * n);
              mma_16816<T>(acc[n], p_frag[kk], b0, b1);
            }
          }
        }
        __syncthreads();  // the stage just read is the next issue's target
      }

      // Normalise and store rows g and g + 8 of this warp that belong to the record.
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
        row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = my_row0 + g + 8 * half;
        if (row >= row1) continue;
        const float inv = row_normaliser(row_max[half], row_sum[half], a.sinks, r.h);
        T* dst = a.out + (r.q_row0 + row) * a.out_stride + r.o_col + 2 * t;
#pragma unroll
        for (int n = 0; n < B::kVTiles; ++n) {
          if (n < v_tiles) {
            dst[8 * n] = static_cast<T>(acc[n][2 * half] * inv);
            dst[8 * n + 1] = static_cast<T>(acc[n][2 * half + 1] * inv);
          }
        }
      }
    }
  }
}

// The caller raises a CUDA error from the status (cuda_common.cuh's check_launch).
template <typename T, int kDim>
LaunchStatus launch_mma(const PrefillArgs<T>& args, int workers, cudaStream_t stream) {
  auto kernel = prefill_mma_kernel<T, kDim>;
  LaunchStatus status;
  status.error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Bucket<kDim>::kSharedBytes);
  if (status.error != cudaSuccess) return status;
  kernel<<<workers, kThreads, Bucket<kDim>::kSharedBytes, stream>>>(args);
  status.error = cudaGetLastError();
  return status;
}

}  // namespace fdc::cuda::prefill
