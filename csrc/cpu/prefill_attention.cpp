// fdc::prefill_attention on the CPU: executes a prefill plan (include/fdc/prefill_plan.h) with one
// at::parallel_for worker per plan worker, FlashAttention's loop over (row tile, key block) with an online softmax.
//
// Both products of a tile are torch's batch-reduce GEMM micro-kernel, at::native::cpublas::brgemm (oneDNN's JIT
// ukernel, the one torch's own CPU flash attention calls), on blocks packed once per call:
// - bfloat16 inputs on CPUs with AMX where the ukernel runs (torch's oneDNN enabled; see bf16_brgemm_runs): bf16 x
//   bf16 -> fp32 on AMX tiles, with K^T and V packed in VNNI pairs (V zero-padded to the ukernel's column block) and
//   the probabilities rounded to bf16, as torch's flash attention does, after one pass that exponentiates a row's
//   block against its running reference (see kReferenceSumLimit);
// - everything else (float32, float16, bf16 where that ukernel does not run): float32 operands, K^T packed, V copied
//   with zero columns to a multiple of 16.
// Packing each (sequence, KV head) once costs one pass over K and V and lets every product run with a fixed leading
// dimension and a shape from a small set (rows rounded up to kRowQuantum, keys to kKeyQuantum), so the ukernel's
// per-shape code generation happens a bounded number of times per process; no head is ever padded to another's width.
//
// The variants (include/fdc/attention_variant.h): a tile multiplies only the key blocks some row of it sees (from its
// first row's window start to its last row's position, causal, or the last key), and each row's softmax runs over
// its visible keys of a block, a range [lo, hi) (the window's edge cuts it from below as the causal edge does from
// above; the other scores of the block get probability 0); soft-capping rewrites those scores before the softmax;
// a sink scales each row's normalised output once at the end.
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/vec_avx512.h"
#include "cpu/vec_avx512_axpy.h"
#include "cpu/vec_avx512_rows.h"
#include "cpu/vec_avx512_softmax.h"
#include "cpu/vec_math.h"
#include "fdc/attention_variant.h"
#include "fdc/prefill_plan.h"
#include "fdc/softmax_merge.h"

namespace fdc::cpu {
namespace {

namespace cpublas = at::native::cpublas;

// Keys per score tile and per packed block, and query rows per tile. Swept on a 2-core Intel Xeon with AMX (bench_ops'
// layout, one 4K sequence): first (fp32 and bf16, causal and not; 128 / 256 / 512 keys x 32 / 64 / 128 / 256 rows)
// 256 x 128 was fastest or within noise of it; then, after the bf16 softmax became one pass (bf16 causal, each
// variant timed in turn three times), 256 x 256 was 5-7% faster than 256 x 128 (each key block's K^T and V tiles serve
// twice the rows before they leave L2), 512 rows and 128 keys 5-10% slower, 512 keys 25% slower, and fp32 and the
// 512-2048 varlen batch were unchanged. A tile's fp32 scores and bf16 probabilities (384 KiB) stay in L2 between the
// two products and the softmax.
constexpr int64_t kKeyBlock = 256;
constexpr int64_t kRowTile = 256;
// Rows per task of the widest head in the plan this op builds when given none (the planner's default, 64, is sized
// for a GPU CTA's registers): where some sequence has more than kShortQueryRows rows, kLongRowBlock, so tiles of the
// widest heads fill kRowTile (with 64, the 4K causal bf16 prefill of bench_ops ran about 3% slower at 128 rows per
// tile on an AMX Xeon); otherwise kShortRowBlock. A short causal sequence in one 256-row tile multiplies every key of
// its block for every row, twice its useful work, and a batch of few sequences has few tasks to balance over the
// workers: with 64 rows per task, prompts of 256 tokens took 0.78-0.93x the time of 256 (bench_ops' layout: 1 and 16
// prompts, SmolLM2's: 1 and 8; float32 and bf16; a 2-core Intel Xeon without AMX), while 1-4K-token sequences
// moved within the machine's noise either way.
constexpr int32_t kLongRowBlock = 256;
constexpr int32_t kShortRowBlock = 64;
constexpr int32_t kShortQueryRows = 1024;

int32_t cpu_row_block(const std::vector<int32_t>& cu_q) {
  int32_t longest = 0;
  for (size_t b = 1; b < cu_q.size(); ++b) longest = std::max(longest, cu_q[b] - cu_q[b - 1]);
  return longest > kShortQueryRows ? kLongRowBlock : kShortRowBlock;
}
// Products are issued with rows rounded up to 16 (an AMX tile's rows) and keys to 64 (the ukernel's B block), so a
// model sees few distinct shapes, each generated once per thread.
constexpr int64_t kRowQuantum = 16;
constexpr int64_t kKeyQuantum = 64;
static_assert(kKeyBlock % kKeyQuantum == 0 && kRowTile % kRowQuantum == 0);
// The ukernel adds a score's dq products one after another in one register, so its float32 rounding error grows with
// dq; torch's own float32 matmul (the tests' measure, tests/conftest.py) adds them in short runs. For float32 queries
// the scores are therefore made kScoreChunk dims at a time, each product added to the last: at dq = 232 that took the
// op's error from 2.9x torch's to 1.0x (error of the scores alone, emulated in float64: 2.3x with chunks of 64). Half-
// precision queries keep one product: their outputs' rounding is far coarser than what the order of the sums costs.
constexpr int64_t kScoreChunk = 32;
template <typename O>
constexpr bool kChunkedScores = std::is_same_v<O, float>;
// bf16 rows exponentiate a key block against their running softmax reference (not necessarily the largest score
// seen) in one pass, and move the reference (a second pass) only when the block's exps sum to more than this,
// exp(16) = 8.9e6. Below that every exp is too, so probabilities, their sum over any sequence and the accumulator stay
// far inside float32's and bfloat16's range (both reach 3.4e38), and bf16 rounding is relative, so a reference below
// the true maximum costs no precision. It saves a separate pass over the fp32 scores for their maximum.
constexpr float kReferenceSumLimit = 8.886110520507872e6f;

int64_t round_up(int64_t x, int64_t q) { return (x + q - 1) / q * q; }

// Whether bf16 prefill multiplies VNNI-packed bf16 with torch's brgemm: where the CPU has AMX tiles, torch's oneDNN
// ukernel is built in and the user has not disabled oneDNN (torch.backends.mkldnn). Torch has no public query for the
// ukernel, so one tiny product is tried once (its fallback raises instead of computing). Without AMX the ukernel
// runs bf16 on AVX-512-BF16 (vdpbf16ps), which was slower than widening to float32 and using the float32 products:
// 1.33x the time on one 4K causal sequence, 1.27x on a 512-2048 varlen batch and 1.12x on 16 x 256 tokens (bench_ops'
// layout, a 2-core Intel Xeon with AVX-512-BF16 and no AMX, the three paths timed in turn in one process).
bool bf16_brgemm_runs() {
  if (!at::globalContext().userEnabledMkldnn()) return false;
  static const bool runs = [] {
    if (!at::cpu::init_amx()) return false;
    const c10::BFloat16 one(1.f);
    const c10::BFloat16 a[2] = {one, one};
    c10::BFloat16 b[2 * 16];
    std::fill(b, b + 32, one);
    float c[16] = {};
    try {
      cpublas::brgemm(1, 16, 2, 2, 16, 16, false, a, b, c, true);
      cpublas::brgemm_release(true);
    } catch (const c10::Error&) {
      return false;
    }
    return c[0] == 2.f && c[15] == 2.f;
  }();
  return runs;
}

// Transposes 32-bit words: dst[c * dst_ld + r] = src[r * src_ld + c] for r < rows, c < cols (word strides). A bf16
// pair (two adjacent dims of a key row) is one word, so this packs K^T in VNNI pairs and float K^T alike. Reads by
// memcpy: rows of a packed head need not be 4-byte aligned.
void transpose_words(const char* src, int64_t src_ld_bytes, int64_t rows, int64_t cols, uint32_t* dst, int64_t dst_ld) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = src + r * src_ld_bytes;
    for (int64_t c = 0; c < cols; ++c) std::memcpy(dst + c * dst_ld + r, row + 4 * c, 4);
  }
}

// The packed K^T and V blocks of every (sequence, KV head): block i of (b, j) holds keys [i * kKeyBlock, ...) of
// sequence b, zero beyond the sequence's end.
//   K^T block: (dq / P, kKeyBlock, P) elements, P = 2 (VNNI pairs) for bf16, 1 for float: the ukernel's B for
//              scores = q K^T, leading dimension kKeyBlock.
//   V block:   (kKeyBlock / P, dvp, P), dvp = padded_v_width(dv), zero beyond dv: the B of acc += p V, leading
//              dimension dvp.
template <typename T>
struct PackedKV {
  static constexpr int64_t kPair = sizeof(T) == 2 ? 2 : 1;
  // V blocks of bf16 are padded with zero columns to a multiple of 32, the ukernel's column block on AMX (two tiles
  // of 16 fp32 columns): it charges whole tile products for a narrower last block anyway, and runs column tails at
  // up to half the speed per product. Measured with ONEDNN_VERBOSE on a 2-core Intel Xeon with AMX: p V over 256
  // keys for 80 rows took 4.9 us at 56 columns, 4.3 at 48 and 3.0 at 64; the whole bf16 prefill of bench_ops' 4K
  // layout ran about 5% faster padded to 32 than to 16. Float V is padded to 16 columns, one AVX-512 register: p V
  // over 256 keys for 256 rows then took 0.39x the time of a 112-wide q K^T product at 48 columns against 0.43x at 40,
  // and 0.52x at 64 against 0.58x at 56 (same measure); the whole fp32 prefill changed within the machine's noise.
  static constexpr int64_t kVColumnQuantum = sizeof(T) == 2 ? 32 : 16;
  static int64_t padded_v_width(int64_t dv) { return round_up(dv, kVColumnQuantum); }
  at::Tensor k_storage, v_storage;
  std::vector<int64_t> k_base, v_base;  // (B * H_kv): element offset of (b, j)'s first block
  // (B): sequence b's first packed block; the blocks before it hold no key any of its queries sees (packed rows pack
  // from block 0, a paged cache from its first query's window on).
  std::vector<int64_t> first_block;

  const T* k_block(int64_t b, int64_t j, int64_t num_kv, int64_t block, int64_t dq) const {
    return k_storage.data_ptr<T>() + k_base[b * num_kv + j] + (block - first_block[b]) * kKeyBlock * dq;
  }
  const T* v_block(int64_t b, int64_t j, int64_t num_kv, int64_t block, int64_t dvp) const {
    return v_storage.data_ptr<T>() + v_base[b * num_kv + j] + (block - first_block[b]) * kKeyBlock * dvp;
  }

  // Places every (sequence, KV head)'s blocks back to back, sequence b holding keys[b] packed keys (a multiple of
  // kKeyBlock) from block first_block[b] on; returns the element counts (K, V) the storage needs.
  std::pair<int64_t, int64_t> lay_out(const checks::HostLayout& layout, const std::vector<int64_t>& keys,
                                      std::vector<int64_t> first) {
    const int64_t batch = static_cast<int64_t>(keys.size()), num_kv = layout.num_kv_heads();
    first_block = std::move(first);
    k_base.resize(batch * num_kv);
    v_base.resize(batch * num_kv);
    int64_t k_total = 0, v_total = 0;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t j = 0; j < num_kv; ++j) {
        k_base[b * num_kv + j] = k_total;
        v_base[b * num_kv + j] = v_total;
        k_total += keys[b] * (layout.qk_offsets[j + 1] - layout.qk_offsets[j]);
        v_total += keys[b] * padded_v_width(layout.v_offsets[j + 1] - layout.v_offsets[j]);
      }
    }
    return {k_total, v_total};
  }
};

// k (T_k, W_qk), v (T_k, W_v) of element type T with unit column stride.
template <typename T>
PackedKV<T> pack_kv(const at::Tensor& k, const at::Tensor& v, const std::vector<int32_t>& cu_k,
                    const checks::HostLayout& layout) {
  constexpr int64_t kPair = PackedKV<T>::kPair;
  const int64_t batch = static_cast<int64_t>(cu_k.size()) - 1, num_kv = layout.num_kv_heads();
  PackedKV<T> packed;
  std::vector<int64_t> keys(batch);
  for (int64_t b = 0; b < batch; ++b) keys[b] = round_up(cu_k[b + 1] - cu_k[b], kKeyBlock);
  const auto [k_total, v_total] = packed.lay_out(layout, keys, std::vector<int64_t>(batch, 0));
  packed.k_storage = at::empty({k_total}, k.options());  // every element is written below, padding with zeros
  packed.v_storage = at::empty({v_total}, v.options());
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  T* k_out = packed.k_storage.template data_ptr<T>();
  T* v_out = packed.v_storage.template data_ptr<T>();
  at::parallel_for(0, batch * num_kv, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / num_kv, j = task % num_kv;
      const int64_t dq = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
      const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
      const int64_t dvp = PackedKV<T>::padded_v_width(dv);
      const int64_t s_k = cu_k[b + 1] - cu_k[b];
      for (int64_t c0 = 0, block = 0; c0 < s_k; c0 += kKeyBlock, ++block) {
        const int64_t n = std::min(kKeyBlock, s_k - c0);  // keys [n, kKeyBlock) of the block are zero
        const T* k_rows = k_data + (cu_k[b] + c0) * k.stride(0) + layout.qk_offsets[j];
        uint32_t* k_dst = reinterpret_cast<uint32_t*>(k_out + packed.k_base[task] + block * kKeyBlock * dq);
        transpose_words(reinterpret_cast<const char*>(k_rows), k.stride(0) * sizeof(T), n, dq / kPair, k_dst,
                        kKeyBlock);
        for (int64_t c = 0; c < dq / kPair; ++c) std::fill(k_dst + c * kKeyBlock + n, k_dst + (c + 1) * kKeyBlock, 0u);
        const T* v_rows = v_data + (cu_k[b] + c0) * v.stride(0) + layout.v_offsets[j];
        T* v_dst = v_out + packed.v_base[task] + block * kKeyBlock * dvp;
        for (int64_t key = 0; key < kKeyBlock; key += kPair) {  // (key / P, x, key % P) <- v[key, x]
          T* dst = v_dst + key * dvp;
          const T* src = v_rows + key * v.stride(0);
          if (key >= n) {
            std::fill(dst, dst + kPair * dvp, T(0));
          } else if constexpr (kPair == 2) {
            avx512::interleave_pairs(src, key + 1 < n ? src + v.stride(0) : nullptr, dv, dvp, dst);
          } else {
            std::fill(std::copy(src, src + dv, dst), dst + dvp, T(0));
          }
        }
      }
    }
  });
  return packed;
}

// The same blocks from a paged cache (decode_attention's page layout, checks::check_paged): k (num_pages, W_qk, P),
// v (num_pages, W_v, P) of element type S, converted to T. Key t of sequence b is slot t % P of page
// block_table[b][t / P], and its head j's columns are rows qk_offsets[j] .. of that page (v_offsets[j] .. for v), so
// a page's keys of one column are contiguous. Only keys from the sequence's first query's window start on are read
// (the pages before it need not exist); the blocks start at the block holding that key, zero before it and past the
// sequence's last key. A quantized cache (S int8, float8_e4m3fn or Int4Pair: fdc/kv_format.h) is dequantized as it is
// packed, each key's codes times its scale, which follows the page's data rows.
template <typename S, typename T>
PackedKV<T> pack_kv_paged(const at::Tensor& k, const at::Tensor& v, const checks::PrefillInputs& in,
                          int64_t window_left) {
  constexpr int64_t kPair = PackedKV<T>::kPair;
  const checks::HostLayout& layout = in.layout;
  const int64_t batch = in.batch, num_kv = layout.num_kv_heads(), page_size = in.paged.page_size;
  PackedKV<T> packed;
  // Keys [first_key, last_key) of sequence b are read (none when it has no query), from its block first_block on.
  std::vector<int64_t> first_key(batch, 0), last_key(batch, 0), first_block(batch, 0), keys(batch, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t s_q = in.cu_q[b + 1] - in.cu_q[b], s_k = in.cu_k[b + 1] - in.cu_k[b];
    if (s_q > 0) {
      first_key[b] = checks::prefill_first_key(s_q, s_k, window_left);
      last_key[b] = s_k;
      first_block[b] = first_key[b] / kKeyBlock;
    }
    keys[b] = std::max<int64_t>(0, round_up(last_key[b], kKeyBlock) - first_block[b] * kKeyBlock);
  }
  const auto [k_total, v_total] = packed.lay_out(layout, keys, std::move(first_block));
  // Zeros where no key is read: before the first one, past the last one, and the padding columns of V.
  packed.k_storage = at::zeros({k_total}, k.options().dtype(c10::CppTypeToScalarType<T>::value));
  packed.v_storage = at::zeros({v_total}, v.options().dtype(c10::CppTypeToScalarType<T>::value));
  const S* k_data = static_cast<const S*>(k.data_ptr());
  const S* v_data = static_cast<const S*>(v.data_ptr());
  const int32_t* table = in.block_table.data_ptr<int32_t>();
  T* k_out = packed.k_storage.template data_ptr<T>();
  T* v_out = packed.v_storage.template data_ptr<T>();
  at::parallel_for(0, batch * num_kv, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / num_kv, j = task % num_kv;
      const int64_t dq = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
      const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
      const int64_t dvp = PackedKV<T>::padded_v_width(dv);
      const int64_t key0 = packed.first_block[b] * kKeyBlock;  // the first packed block's first key
      // Runs of keys within one page and one packed block.
      for (int64_t key = first_key[b]; key < last_key[b];) {
        const int64_t slot = key % page_size, in_block = (key - key0) % kKeyBlock;
        const int64_t run = std::min({page_size - slot, kKeyBlock - in_block, last_key[b] - key});
        const int64_t page = table[b * in.paged.max_pages + key / page_size];
        // Head j's first element row of the page, at the run's first key (int4: a byte row holds two columns).
        const S* k_src = k_data + page * k.stride(0) + layout.qk_offsets[j] / kColumnsPer<S> * page_size + slot;
        const S* v_src = v_data + page * v.stride(0) + layout.v_offsets[j] / kColumnsPer<S> * page_size + slot;
        // A quantized page's scales of head j from the run's first key on (none for a float cache).
        const float* k_scale = nullptr;
        const float* v_scale = nullptr;
        if constexpr (kQuantized<S>) {
          const int64_t k_rows = layout.qk_width() / kColumnsPer<S>, v_rows = layout.v_width() / kColumnsPer<S>;
          k_scale = reinterpret_cast<const float*>(k_data + page * k.stride(0) +
                                                   kv_page_scale_offset(k_rows, page_size, j, slot));
          v_scale = reinterpret_cast<const float*>(v_data + page * v.stride(0) +
                                                   kv_page_scale_offset(v_rows, page_size, j, slot));
        }
        // Column c of the run's token i, from the head's first element row src.
        const auto value = [page_size](const S* src, int64_t c, const float* scales, int64_t i) {
          if constexpr (std::is_same_v<S, Int4Pair>) {
            return static_cast<T>(static_cast<float>(src[(c / 2) * page_size + i].code(c)) * scales[i]);
          } else if constexpr (kQuantized<S>) {
            return static_cast<T>(to_float(src[c * page_size + i]) * scales[i]);
          } else {
            return static_cast<T>(src[c * page_size + i]);
          }
        };
        const int64_t block = (key - key0) / kKeyBlock;
        T* k_dst = k_out + packed.k_base[task] + block * kKeyBlock * dq;
        T* v_dst = v_out + packed.v_base[task] + block * kKeyBlock * dvp;
        for (int64_t c = 0; c < dq; ++c) {  // K^T block element (c, key) at (c / P, key, c % P)
          T* dst = k_dst + (c / kPair) * kKeyBlock * kPair + in_block * kPair + c % kPair;
          for (int64_t i = 0; i < run; ++i) dst[i * kPair] = value(k_src, c, k_scale, i);
        }
        for (int64_t i = 0; i < run; ++i) {  // V block element (key, x) at (key / P, x, key % P)
          const int64_t kk = in_block + i;
          T* dst = v_dst + (kk / kPair) * dvp * kPair + kk % kPair;
          for (int64_t x = 0; x < dv; ++x) dst[x * kPair] = value(v_src, x, v_scale, i);
        }
        key += run;
      }
    }
  });
  return packed;
}

// One worker's scratch: the tile's queries (when its rows are padded with zeros), fp32 scores, probabilities (a
// separate bf16 buffer, or the scores themselves for float), fp32 accumulator, and the rows' softmax state.
template <typename T>
struct TileScratch {
  std::vector<T> q = std::vector<T>(kRowTile * kMaxHeadDim);
  std::vector<float> scores = std::vector<float>(kRowTile * kKeyBlock);
  std::vector<T> probs = std::vector<T>(std::is_same_v<T, float> ? 0 : kRowTile * kKeyBlock);
  std::vector<float> acc = std::vector<float>(kRowTile * kMaxHeadDim);
  std::vector<OnlineSoftmax> softmax = std::vector<OnlineSoftmax>(kRowTile);
};

struct TileTask {
  int64_t b, h;      // sequence, query head
  int64_t q_start;   // the sequence's first row in q and out
  int64_t s_q, s_k;  // its query and key counts
  int64_t a, m;      // rows [a, a + m) of the sequence
};

// Rows [a, a + m) of sequence b for query head h: q (T_q, G * W_qk) of element type T (unit column stride), the
// packed keys and values, out (T_q, G * W_v) of type O (row stride out_ld).
template <typename T, typename O>
void run_row_tile(const TileTask& t, const T* q, int64_t q_ld, const PackedKV<T>& kv, const checks::HostLayout& layout,
                  const HeadLayoutView& view, bool causal, float scale, const checks::AttentionVariant& variant,
                  bool avx512, O* out, int64_t out_ld, TileScratch<T>& ws) {
  constexpr bool kFloat = std::is_same_v<T, float>;
  const int64_t num_kv = layout.num_kv_heads();
  const int64_t j = t.h / layout.group;
  const int64_t dq = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
  const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
  const int64_t dvp = PackedKV<T>::padded_v_width(dv);  // the accumulator's width
  const int64_t shift = t.s_k - t.s_q;                  // row i sits at position i + shift (bottom-right aligned)
  // The tile's rows see keys [keys_begin, keys_end): window starts and causal ends grow with the row.
  const int64_t keys_begin = window_start(t.a + shift, variant.window_left);
  const int64_t keys_end = causal ? std::clamp<int64_t>(t.a + t.m + shift, 0, t.s_k) : t.s_k;
  O* out_rows = out + (t.q_start + t.a) * out_ld + view.o_column(static_cast<int32_t>(t.h));
  if (keys_end <= keys_begin) {  // no row of the tile sees a key
    for (int64_t r = 0; r < t.m; ++r) std::fill(out_rows + r * out_ld, out_rows + r * out_ld + dv, O(0));
    return;
  }

  const int64_t rows = round_up(t.m, kRowQuantum);
  // The queries are read in place (leading dimension q_ld) unless rows must be padded with zeros to `rows`.
  const T* q_tile = q + (t.q_start + t.a) * q_ld + view.q_column(static_cast<int32_t>(t.h));
  int64_t q_tile_ld = q_ld;
  if (rows != t.m) {
    for (int64_t r = 0; r < t.m; ++r) std::memcpy(ws.q.data() + r * dq, q_tile + r * q_ld, dq * sizeof(T));
    std::fill(ws.q.begin() + t.m * dq, ws.q.begin() + rows * dq, T(0));
    q_tile = ws.q.data();
    q_tile_ld = dq;
  }
  std::fill(ws.softmax.begin(), ws.softmax.begin() + t.m, OnlineSoftmax{});
  if constexpr (!kFloat) std::fill(ws.probs.begin() + t.m * kKeyBlock, ws.probs.begin() + rows * kKeyBlock, T(0));
  T* probs = kFloat ? reinterpret_cast<T*>(ws.scores.data()) : ws.probs.data();
  // Capped scores are rewritten already scaled (vec_math.h), so the softmax then takes them with scale 1.
  const bool capped = variant.softcap > 0.f;
  const float score_scale = capped ? 1.f : scale;

  const int64_t first_block = keys_begin / kKeyBlock;  // the blocks before it lie wholly outside every row's window
  for (int64_t block = first_block, c0 = first_block * kKeyBlock; c0 < keys_end; c0 += kKeyBlock, ++block) {
    const int64_t n = std::min(kKeyBlock, keys_end - c0);
    const int64_t cols = round_up(n, kKeyQuantum);
    const T* k_block = kv.k_block(t.b, j, num_kv, block, dq);
    // float32 queries: the product over dq in chunks of kScoreChunk dims, each added to the scores (kScoreChunk says
    // why); otherwise one product.
    const int64_t depth = kChunkedScores<O> ? std::min<int64_t>(dq, kScoreChunk) : dq;
    for (int64_t c = 0; c < dq; c += depth) {
      cpublas::brgemm(rows, cols, std::min(depth, dq - c), q_tile_ld, kKeyBlock, kKeyBlock, c > 0, q_tile + c,
                      k_block + c * kKeyBlock, ws.scores.data(), !kFloat);
    }
    for (int64_t r = 0; r < t.m; ++r) {
      T* p_row = probs + r * kKeyBlock;
      // The row's visible keys of this block are [c0 + lo, c0 + hi).
      const int64_t position = t.a + r + shift;
      const int64_t lo = std::clamp<int64_t>(window_start(position, variant.window_left) - c0, 0, n);
      const int64_t hi = causal ? std::clamp<int64_t>(position + 1 - c0, 0, n) : n;
      if (hi <= lo) {  // none: the row's softmax state and accumulator are left as they are
        std::fill(p_row, p_row + cols, T(0));
        continue;
      }
      const int64_t visible = hi - lo;
      float* s = ws.scores.data() + r * kKeyBlock + lo;
      std::fill(p_row, p_row + lo, T(0));  // for float, p_row holds the scores: those before lo are never read
      T* p = p_row + lo;
      float* acc = ws.acc.data() + r * dvp;
      if (capped) soft_cap_scores(s, visible, scale, variant.softcap);
      OnlineSoftmax& sm = ws.softmax[r];
      if constexpr (!kFloat) {
        // A row's first keys get a provisional reference, the largest of their first 16 scores.
        if (sm.max == -INFINITY) sm.max = avx512::max_of(s, std::min(visible, avx512::kLanes)) * score_scale;
        if (sm.max != -INFINITY) {  // one pass against the running reference; a second only if it must move
          const float sum = avx512::exp_sum_to_bf16(s, visible, score_scale, sm.max, p);
          if (sum <= kReferenceSumLimit) {
            sm.sum += sum;
            std::fill(p + visible, p_row + cols, T(0));
            continue;
          }
        }
      }
      const float factor = sm.rescale_for((avx512 ? avx512::max_of(s, visible) : max_of(s, visible)) * score_scale);
      if (factor != 1.f) avx512 ? avx512::scale_in_place(acc, dv, factor) : scale_in_place(acc, dv, factor);
      if (sm.max == -INFINITY) {
        std::fill(p_row, p_row + cols, T(0));
        continue;
      }
      if constexpr (kFloat) {
        sm.sum += avx512 ? avx512::exp_and_sum(s, visible, score_scale, sm.max)
                         : exp_and_sum(s, visible, score_scale, sm.max);
      } else {
        sm.sum += avx512::exp_sum_to_bf16(s, visible, score_scale, sm.max, p);
      }
      std::fill(p + visible, p_row + cols, T(0));
    }
    // The tile's first block's product overwrites the accumulator (never zeroed: a rescale before it reads stale
    // values that this product then replaces; a row that sees none of this block gets zeros from it).
    cpublas::brgemm(rows, dvp, cols, kKeyBlock, dvp, dvp, block > first_block, probs,
                    kv.v_block(t.b, j, num_kv, block, dvp), ws.acc.data(), !kFloat);
  }
  const float* sinks = variant.sink_logits();
  for (int64_t r = 0; r < t.m; ++r) {  // a row that saw no key has sum 0 and writes zeros
    float inv = ws.softmax[r].inverse_sum();
    if (sinks != nullptr) inv *= sink_factor(ws.softmax[r].lse(), sinks[t.h]);
    if constexpr (kFloat) {
      for (int64_t c = 0; c < dv; ++c) out_rows[r * out_ld + c] = static_cast<O>(ws.acc[r * dvp + c] * inv);
    } else {
      avx512::scale_to_bf16(ws.acc.data() + r * dvp, dv, inv, out_rows + r * out_ld);
    }
  }
}

// Runs the plan's records on queries q of element type T (unit column stride) and the packed keys and values,
// writing out (type O).
template <typename T, typename O>
void run_plan(const PrefillPlanView& plan, const at::Tensor& q, const PackedKV<T>& kv, const std::vector<int32_t>& cu_q,
              const std::vector<int32_t>& cu_k, const checks::HostLayout& layout, bool causal, float scale,
              const checks::AttentionVariant& variant, bool avx512, at::Tensor& out) {
  const HeadLayoutView view = layout.view();
  const T* q_data = q.data_ptr<T>();
  O* out_data = out.data_ptr<O>();
  at::parallel_for(0, plan.num_workers(), 1, [&](int64_t w0, int64_t w1) {
    TileScratch<T> ws;
    for (int64_t w = w0; w < w1; ++w) {
      for (int64_t r = plan.worker_offsets()[w]; r < plan.worker_offsets()[w + 1]; ++r) {
        const int32_t* rec = plan.records() + r * kPrefillRecordFields;
        const int64_t b = rec[0];
        TileTask t{b, rec[1], cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], 0, 0};
        for (t.a = rec[2]; t.a < rec[3]; t.a += kRowTile) {
          t.m = std::min<int64_t>(kRowTile, rec[3] - t.a);
          run_row_tile<T, O>(t, q_data, q.stride(0), kv, layout, view, causal, scale, variant, avx512, out_data,
                             out.stride(0), ws);
        }
      }
    }
    if constexpr (!std::is_same_v<T, float>) cpublas::brgemm_release(true);  // this thread's AMX tile state
  });
}

}  // namespace

// q (T_q, G * W_qk), k (T_k, W_qk), v (T_k, W_v) -> (T_q, G * W_v); or k (num_pages, W_qk, page_size),
// v (num_pages, W_v, page_size) with block_table (B, max_pages).
at::Tensor prefill_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                 const at::Tensor& qk_offsets, const at::Tensor& v_offsets, int64_t group, double scale,
                                 bool causal, const std::optional<at::Tensor>& plan, int64_t window_left,
                                 double softcap, const std::optional<at::Tensor>& sinks,
                                 const std::optional<at::Tensor>& block_table) {
  const char* op = "prefill_attention";
  const checks::PrefillInputs in = checks::check_prefill_inputs(op, q, k, v, cu_seqlens_q, cu_seqlens_k, qk_offsets,
                                                                v_offsets, group, scale, block_table, window_left);
  const checks::HostLayout& layout = in.layout;
  const checks::AttentionVariant variant =
      checks::check_attention_variant(op, window_left, softcap, sinks, q, layout.num_heads());
  const int64_t batch = in.batch;
  const std::vector<int32_t>& cu_q = in.cu_q;
  const std::vector<int32_t>& cu_k = in.cu_k;

  at::Tensor schedule;
  if (plan) {
    checks::check_plan_tensor(op, *plan, q, kPrefillHeader);
    schedule = *plan;
    checks::check_prefill_plan_header(op, schedule.data_ptr<int32_t>(), schedule.size(0), batch, layout, causal);
  } else {
    schedule = prefill_plan_cpu(cu_seqlens_q, cu_seqlens_k, qk_offsets, v_offsets, group, causal, std::nullopt,
                                cpu_row_block(cu_q), window_left);
  }
  const PrefillPlanView view{schedule.data_ptr<int32_t>()};
  checks::check_prefill_plan_records(op, view, cu_q);

  // Every row of every sequence is written by the record that holds it (checked above); rows outside are zeroed here.
  at::Tensor out = at::empty({q.size(0), group * layout.v_width()}, q.options());
  out.narrow(0, 0, cu_q[0]).zero_();
  out.narrow(0, cu_q[batch], q.size(0) - cu_q[batch]).zero_();
  const CpuIsa isa = cpu_isa(op);
  const bool avx512 = isa >= CpuIsa::kAvx512;
  const float fscale = static_cast<float>(scale);
  // A paged cache's keys packed as T from its own elements (S: q's dtype, or a quantized format's codes).
  const auto paged_kv = [&]<typename S, typename T>() -> PackedKV<T> {
    switch (in.format) {
      case KvFormat::kInt8: return pack_kv_paged<int8_t, T>(k, v, in, window_left);
      case KvFormat::kFp8E4M3: return pack_kv_paged<c10::Float8_e4m3fn, T>(k, v, in, window_left);
      case KvFormat::kInt4: return pack_kv_paged<Int4Pair, T>(k, v, in, window_left);
      case KvFormat::kFloat: break;
    }
    return pack_kv_paged<S, T>(k, v, in, window_left);
  };
  if (q.scalar_type() == at::kBFloat16 && isa == CpuIsa::kAvx512Bf16 && bf16_brgemm_runs()) {
    using BF16 = c10::BFloat16;
    const PackedKV<BF16> kv =
        in.is_paged() ? paged_kv.template operator()<BF16, BF16>()
                      : pack_kv<BF16>(checks::unit_last_stride(k), checks::unit_last_stride(v), cu_k, layout);
    run_plan<BF16, BF16>(view, checks::unit_last_stride(q), kv, cu_q, cu_k, layout, causal, fscale, variant, avx512,
                         out);
    return out;
  }
  // Float32 operands (float32 row-strided inputs are used in place; a paged cache is converted as it is packed).
  const at::Tensor qf = checks::unit_last_stride(q.to(at::kFloat));
  FDC_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fdc::prefill_attention", [&] {
    const PackedKV<float> kv = in.is_paged() ? paged_kv.template operator()<scalar_t, float>()
                                             : pack_kv<float>(checks::unit_last_stride(k.to(at::kFloat)),
                                                              checks::unit_last_stride(v.to(at::kFloat)), cu_k, layout);
    run_plan<float, scalar_t>(view, qf, kv, cu_q, cu_k, layout, causal, fscale, variant, avx512, out);
  });
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("prefill_attention", &fdc::cpu::prefill_attention_cpu); }
