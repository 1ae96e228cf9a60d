// fdc::decode_attention on the CPU. Two ways to the same result, chosen by cpu_isa():
// - AVX-512 (run_piece_avx512): requests are cut into pieces of keys, and a piece reads its keys' K/V block by block,
//   whole (every KV head's columns: a contiguous cache's rows, a paged cache's pages), scoring every KV head's G query
//   heads on a block while it is in cache; the plan, when passed, is checked but the pieces are the CPU's own (see
//   RowPiece for why);
// - the portable kernels (run_task): one at::parallel_for worker per plan worker, each task reading its chunk's K/V
//   rows of one KV head once for all G query heads, block by block, half-precision blocks widened to float first.
// Both compute each product in the cache's own memory order (dot products along token-major rows, weighted row sums
// along the token runs of dim-major pages). Requests split into several chunks or pieces leave (output, log-sum-exp)
// partials that a second pass merges.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cpu/cpu_common.h"
#include "cpu/vec_avx512.h"
#include "cpu/vec_math.h"
#include "fdc/decode_plan.h"
#include "fdc/softmax_merge.h"

namespace fdc::cpu {
namespace {

// The longest block of keys of a piece (run_piece_avx512), the scores' leading dimension there, a multiple of 32
// (exp_sum_to_bf16 fills whole 32-value chunks): reached by contiguous caches of narrow layers (contiguous_block_rows).
constexpr int64_t kMaxBlockKeys = 512;
// The longest block of keys of a piece of a paged cache (paged_block_keys), whose page runs a piece lists per block.
constexpr int64_t kMaxPagedBlockKeys = 128;

// Keys per block of the portable task kernel (run_task): a whole page at vLLM's CPU page size, so a KV head's block of
// a dim-major page is one contiguous run; best of those measured (bench/results/ops/README.md, "CPU decode").
constexpr int64_t kTaskKeyBlock = 128;

// Degree of the exp polynomial (vec_avx512.h exp16) of the AVX-512 kernels: half-precision outputs are rounded to 8
// (bf16) or 11 (fp16) significant bits, far coarser than degree 4's 5e-5 relative error; float32 keeps degree 6.
template <typename T>
constexpr int kExpDegree = std::is_same_v<T, float> ? 6 : 4;

// A block of a float matrix: element (r, c) at data[r * stride + c].
struct FloatRows {
  const float* data;
  int64_t stride;
};

// One cache (K or V): contiguous (B, S_max, width) or paged (num_pages, width, page_size) with a block table.
template <typename T>
struct CacheView {
  const T* data;
  int64_t stride0;             // between requests (contiguous) or pages (paged)
  int64_t stride1;             // between rows (contiguous); unused when paged
  const int32_t* block_table;  // (B, max_pages) when paged, else nullptr
  int64_t max_pages;
  int64_t page_size;

  bool paged() const { return block_table != nullptr; }

  // End of the block starting at t0: at most `keys` keys, cut at the chunk end and, when paged, at the page end.
  int64_t block_end(int64_t t0, int64_t chunk_end, int64_t keys) const {
    int64_t end = std::min(chunk_end, t0 + keys);
    if (paged()) end = std::min(end, (t0 / page_size + 1) * page_size);
    return end;
  }

  // Asks for the memory of keys [t0, t1), columns [col, col + dim), ahead of use. Contiguous caches put every row
  // of a wide layer on its own 4 KiB page, where hardware prefetchers stop, so without this each row of a block
  // waits on DRAM in turn.
  void prefetch(int64_t b, int64_t t0, int64_t t1, int64_t col, int64_t dim) const {
    constexpr int64_t kLine = 64;  // bytes per cache line
    const int64_t runs = paged() ? dim : t1 - t0;
    const int64_t run_bytes = (paged() ? t1 - t0 : dim) * static_cast<int64_t>(sizeof(T));
    const char* first = reinterpret_cast<const char*>(
        paged() ? data + block_table[b * max_pages + t0 / page_size] * stride0 + col * page_size + t0 % page_size
                : data + b * stride0 + t0 * stride1 + col);
    const int64_t run_stride = static_cast<int64_t>(sizeof(T)) * (paged() ? page_size : stride1);
    for (int64_t r = 0; r < runs; ++r)
      for (int64_t byte = 0; byte < run_bytes; byte += kLine) __builtin_prefetch(first + r * run_stride + byte);
  }

  // Element (key t, column col) of request b: within a block (a page, when paged) keys follow each other stride1
  // elements apart (1 when paged), columns col_stride() apart.
  const T* at(int64_t b, int64_t t, int64_t col) const {
    return paged() ? data + block_table[b * max_pages + t / page_size] * stride0 + col * page_size + t % page_size
                   : data + b * stride0 + t * stride1 + col;
  }
  int64_t col_stride() const { return paged() ? page_size : 1; }

  // Keys [t0, t1) of request b, columns [col, col + dim), as float: token-major (t1 - t0 rows of dim) when
  // contiguous, column-major (dim rows of t1 - t0 tokens) when paged, the page's own order. Float caches are read
  // in place; half-precision ones are widened into `scratch`.
  FloatRows block(int64_t b, int64_t t0, int64_t t1, int64_t col, int64_t dim, float* scratch) const {
    const T* src;
    int64_t src_stride, rows, cols;
    if (paged()) {
      src = data + block_table[b * max_pages + t0 / page_size] * stride0 + col * page_size + t0 % page_size;
      src_stride = page_size, rows = dim, cols = t1 - t0;
    } else {
      src = data + b * stride0 + t0 * stride1 + col;
      src_stride = stride1, rows = t1 - t0, cols = dim;
    }
    if constexpr (std::is_same_v<T, float>) {
      return {src, src_stride};
    } else {
      rows_to_float(src, src_stride, rows, cols, scratch);
      return {scratch, cols};
    }
  }
};

// A float buffer of n elements left uninitialised: every user writes what it reads first (the tests pass with these
// buffers filled with NaN), and zero-filling the task scratch (136 KiB per call when it always held the two widened
// blocks) cost more than a short decode task's own work.
inline std::unique_ptr<float[]> uninitialized_floats(int64_t n) { return std::unique_ptr<float[]>(new float[n]); }

// Per-thread scratch of run_task: the queries, the key and value blocks widened to float (`widen`: half-precision
// caches; float ones are read in place), the scores and the accumulator.
struct TaskScratch {
  std::unique_ptr<float[]> q, k, v, scores, acc;
  TaskScratch(int64_t group, bool widen)
      : q(uninitialized_floats(group * kMaxHeadDim)),
        k(widen ? uninitialized_floats(kMaxHeadDim * kTaskKeyBlock) : nullptr),
        v(widen ? uninitialized_floats(kTaskKeyBlock * kMaxHeadDim) : nullptr),
        scores(uninitialized_floats(group * kTaskKeyBlock)), acc(uninitialized_floats(group * kMaxHeadDim)) {}
};

struct Problem {
  const checks::HostLayout* layout;
  float scale;
  const int32_t* split_offsets;  // (B * H_kv + 1) from the plan
  float* partial_out;            // (num_tasks, G, max_v_dim) for split requests
  float* partial_lse;            // (num_tasks, G)
  int64_t max_v_dim;
};

// Writes one task's result: the normalised output of each of the G query heads, or, when its request is split
// into chunks, the (output, log-sum-exp) partial for merge_splits. acc (G, d_v) holds the unnormalised sums.
template <typename T>
void finish_task(const int32_t* record, const Problem& pb, const float* acc, const OnlineSoftmax* softmax, T* out,
                 int64_t out_ld) {
  const checks::HostLayout& layout = *pb.layout;
  const int64_t hkv = layout.num_kv_heads(), group = layout.group;
  const int64_t b = record[0] / hkv, j = record[0] % hkv, chunk = record[1];
  const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
  const HeadLayoutView view = layout.view();
  const int64_t bj = b * hkv + j;
  const bool split = pb.split_offsets[bj + 1] - pb.split_offsets[bj] > 1;
  for (int64_t i = 0; i < group; ++i) {
    const float inv = softmax[i].inverse_sum();
    if (split) {
      const int64_t slot = pb.split_offsets[bj] + chunk;
      float* po = pb.partial_out + (slot * group + i) * pb.max_v_dim;
      for (int64_t c = 0; c < dv; ++c) po[c] = acc[i * dv + c] * inv;
      pb.partial_lse[slot * group + i] = softmax[i].lse();
    } else {
      T* oi = out + b * out_ld + view.o_column(static_cast<int32_t>(j * group + i));
      for (int64_t c = 0; c < dv; ++c) oi[c] = static_cast<T>(acc[i * dv + c] * inv);
    }
  }
}

// Runs one plan record: request b, KV head j, keys [kv_start, kv_end), for the G query heads of j at once.
template <typename T>
void run_task(const int32_t* record, const Problem& pb, const T* q, int64_t q_ld, const CacheView<T>& kc,
              const CacheView<T>& vc, T* out, int64_t out_ld, TaskScratch& ws) {
  const checks::HostLayout& layout = *pb.layout;
  const int64_t hkv = layout.num_kv_heads(), group = layout.group;
  const int64_t b = record[0] / hkv, j = record[0] % hkv;
  const int64_t kv_start = record[2], kv_end = record[3];
  const int64_t dq = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
  const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
  const HeadLayoutView view = layout.view();

  for (int64_t i = 0; i < group; ++i) {
    const T* qi = q + b * q_ld + view.q_column(static_cast<int32_t>(j * group + i));
    for (int64_t c = 0; c < dq; ++c) ws.q[i * dq + c] = to_float(qi[c]) * pb.scale;
  }
  std::fill(ws.acc.get(), ws.acc.get() + group * dv, 0.f);
  std::vector<OnlineSoftmax> softmax(group);
  float* scores = ws.scores.get();

  for (int64_t t0 = kv_start; t0 < kv_end;) {
    const int64_t t1 = kc.block_end(t0, kv_end, kTaskKeyBlock), n = t1 - t0;
    if (t1 < kv_end) {
      const int64_t t2 = kc.block_end(t1, kv_end, kTaskKeyBlock);
      kc.prefetch(b, t1, t2, layout.qk_offsets[j], dq);
      vc.prefetch(b, t1, t2, layout.v_offsets[j], dv);
    }
    const FloatRows keys = kc.block(b, t0, t1, layout.qk_offsets[j], dq, ws.k.get());
    if (kc.paged()) {  // keys are dq rows of n tokens: scores = Q K, a weighted sum of key rows
      std::fill(scores, scores + group * kTaskKeyBlock, 0.f);
      axpy_rows(ws.q.get(), dq, group, keys.data, keys.stride, dq, n, scores, kTaskKeyBlock);
    } else {  // keys are n rows of dq: one dot product per (query head, key)
      dot_rows(ws.q.get(), dq, group, keys.data, keys.stride, n, dq, scores, kTaskKeyBlock, false);
    }
    for (int64_t i = 0; i < group; ++i) {
      float* si = scores + i * kTaskKeyBlock;
      const float factor = softmax[i].rescale_for(max_of(si, n));
      if (factor != 1.f) scale_in_place(ws.acc.get() + i * dv, dv, factor);
      softmax[i].sum += exp_and_sum(si, n, 1.f, softmax[i].max);
    }
    const FloatRows values = vc.block(b, t0, t1, layout.v_offsets[j], dv, ws.v.get());
    if (vc.paged()) {  // values are dv rows of n tokens: acc[i][c] += p_i . V[c]
      dot_rows(scores, kTaskKeyBlock, group, values.data, values.stride, dv, n, ws.acc.get(), dv, true);
    } else {  // values are n rows of dv: acc_i += sum_t p_i[t] V[t]
      axpy_rows(scores, kTaskKeyBlock, group, values.data, values.stride, n, dv, ws.acc.get(), dv);
    }
    t0 = t1;
  }

  finish_task(record, pb, ws.acc.get(), softmax.data(), out, out_ld);
}

// Keys of a request for run_piece_avx512: a piece is keys [t0, t1) of request b for every KV head. A task of one KV
// head would read a strided fraction of every row or page, measured 2-3x slower than whole rows in order; a piece
// reads its keys' blocks whole and in order and scores every KV head on a block while it is in cache
// (bench/results/ops/README.md, "CPU decode").
struct RowPiece {
  int64_t b, t0, t1, index;  // index: which of its request's pieces this is
};

// Pieces per thread aimed at when requests are split: with pieces of equal length the threads' static ranges of
// pieces differ by at most one piece, a quarter of a thread's work; more pieces would add partials to merge.
constexpr int64_t kPiecesPerThread = 4;
// Shortest piece: a split costs a partial result per query head (d_v + 1 floats) to write and merge, small next to
// 256 rows of K/V.
constexpr int64_t kMinPieceRows = 256;

// Cuts every request into pieces of equal length (its last piece shorter), a multiple of `quantum` keys (a paged
// cache's page size: no page is read by two pieces). split_offsets[b * H_kv + j] (B * H_kv + 1) numbers the partial
// slots of (request, KV head) pairs as a decode plan's do, so finish_task and merge_splits serve both.
std::vector<RowPiece> cut_rows(const std::vector<int32_t>& seqlens, int64_t hkv, int64_t threads, int64_t quantum,
                               std::vector<int32_t>& split_offsets) {
  int64_t total = 0;
  for (int32_t len : seqlens) total += len;
  const int64_t piece =
      ceil_div(std::max(kMinPieceRows, ceil_div(total, kPiecesPerThread * threads)), quantum) * quantum;
  std::vector<RowPiece> pieces;
  split_offsets.assign(seqlens.size() * hkv + 1, 0);
  for (int64_t b = 0; b < int64_t(seqlens.size()); ++b) {
    const int64_t count = ceil_div(int64_t(seqlens[b]), piece);
    for (int64_t c = 0; c < count; ++c)
      pieces.push_back({b, c * piece, std::min<int64_t>(seqlens[b], (c + 1) * piece), c});
    for (int64_t j = 0; j < hkv; ++j) split_offsets[b * hkv + j + 1] = split_offsets[b * hkv + j] + count;
  }
  return pieces;
}

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

// How the next block is brought towards the core, measured to differ between vendors and, on AMD, between kernels
// (read_ahead_for; the A/B runs: bench/results/ops/README.md, "CPU decode"):
// - kStream: prefetcht0 of the whole next block spread over the current block's loads (avx512::PrefetchStream):
//   prefetches retire at once, so they overlap the arithmetic where a burst of missing loads would stall it;
// - kLoads: plain loads of the next block in a burst, where the block's arithmetic is short next to its bytes
//   (contiguous caches widened to float), where the stream lost on AMD;
// - kPrefetchL2: prefetcht1 per cache line, a share of the block before each KV head: the best on Intel.
enum class ReadAhead { kStream, kLoads, kPrefetchL2 };

// The way for this CPU, a paged cache or not, and products without widening (bf16 by vdpbf16ps) or not, unless the
// environment variable FDC_CPU_READ_AHEAD names one (stream, loads or prefetch_l2; read at every call, like
// FDC_CPU_ISA, so tests run every way on any CPU and a new CPU can be measured without a rebuild). `op` names the
// caller in the error raised for any other value.
ReadAhead read_ahead_for(const char* op, bool paged, bool bf16_products) {
  const char* forced = std::getenv("FDC_CPU_READ_AHEAD");
  if (forced != nullptr && *forced != '\0') {
    const std::string_view name(forced);
    if (name == "stream") return ReadAhead::kStream;
    if (name == "loads") return ReadAhead::kLoads;
    if (name == "prefetch_l2") return ReadAhead::kPrefetchL2;
    TORCH_CHECK(false, "fdc::", op, ": FDC_CPU_READ_AHEAD must be stream, loads or prefetch_l2 but is '", name, "'");
  }
  static const bool intel = __builtin_cpu_is("intel");
  if (intel) return ReadAhead::kPrefetchL2;
  return paged || bf16_products ? ReadAhead::kStream : ReadAhead::kLoads;
}

// K and V bytes of a contiguous cache's block under kStream and kLoads (contiguous_block_rows): about 160 KiB, so a
// block and the one read ahead take a third of a 1 MiB L2; one long sequential sweep per block is what the L2 stream
// prefetcher follows best (bench/results/ops/README.md, "CPU decode").
constexpr int64_t kBlockBytes = 160 << 10;

// Rows per block of a piece of a contiguous cache whose rows take row_bytes of K and V together.
// - kPrefetchL2: 16, one dot_rows group: the block stays in L1 from its scores to its value sums (fastest on Intel).
// - kStream and kLoads: kBlockBytes of rows, a multiple of 16 from 16 to kMaxBlockKeys, and at most a quarter of
//   the piece's `piece_rows` (but not below 64): a thread's first piece starts on a block nobody read ahead.
// The measurements: bench/results/ops/README.md, "CPU decode".
int64_t contiguous_block_rows(ReadAhead way, int64_t row_bytes, int64_t piece_rows) {
  if (way == ReadAhead::kPrefetchL2) return 16;
  const int64_t quarter = std::max<int64_t>(64, ceil_div(piece_rows, 4 * 16) * 16);
  return std::clamp<int64_t>(std::min(kBlockBytes / row_bytes / 16 * 16, quarter), 16, kMaxBlockKeys);
}

// Keys per block of a piece of a paged cache: the runs of every page the block touches, at most kMaxPagedBlockKeys.
// - kPrefetchL2: 256 bytes of each column (the bytes per column set the best length, not the key count);
// - kStream: whole pages, as many as fit in kStreamPagedBlockKeys, or one page of at most kMaxPagedBlockKeys keys.
// The measurements: bench/results/ops/README.md, "CPU decode".
constexpr int64_t kStreamPagedBlockKeys = 64;

template <typename T>
int64_t paged_block_keys(ReadAhead way, int64_t page_size) {
  if (way == ReadAhead::kPrefetchL2) return 256 / int64_t(sizeof(T));
  if (way == ReadAhead::kLoads) return kMaxPagedBlockKeys;
  return page_size < kStreamPagedBlockKeys ? kStreamPagedBlockKeys / page_size * page_size
                                           : std::min(page_size, kMaxPagedBlockKeys);
}

// prefetcht1 of bytes [first, first + bytes), one per cache line (ReadAhead::kPrefetchL2).
inline void prefetch_l2(const void* first, int64_t bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t byte = 0; byte < bytes; byte += avx512::kCacheLine) _mm_prefetch(p + byte, _MM_HINT_T1);
}

// prefetch_l2 of the j-th of `shares` parts of n rows of a contiguous cache (every column of each), the first at
// `first`: a range of bytes. One block ahead was best (ReadAhead).
template <typename T>
inline void prefetch_rows_share(const CacheView<T>& cache, const T* first, int64_t n, int64_t j, int64_t shares) {
  if (n <= 0) return;
  const char* start = reinterpret_cast<const char*>(first);
  const int64_t bytes = n * cache.stride1 * int64_t(sizeof(T));
  prefetch_l2(start + bytes * j / shares, bytes * (j + 1) / shares - bytes * j / shares);
}

// The keys [t0, t1) of request b in a paged cache as runs, one per page they touch: run s is keys t0 + first[s] ..
// t0 + first[s] + len[s], whose column 0 starts at k[s] in the K cache and v[s] in the V cache.
template <typename T>
struct PageRuns {
  int64_t count = 0;
  int64_t first[kMaxPagedBlockKeys], len[kMaxPagedBlockKeys];
  const T* k[kMaxPagedBlockKeys];
  const T* v[kMaxPagedBlockKeys];

  void assign(const CacheView<T>& kc, const CacheView<T>& vc, int64_t b, int64_t t0, int64_t t1) {
    count = 0;
    for (int64_t t = t0; t < t1; ++count) {
      const int64_t end = std::min(t1, (t / kc.page_size + 1) * kc.page_size);
      first[count] = t - t0, len[count] = end - t, k[count] = kc.at(b, t, 0), v[count] = vc.at(b, t, 0);
      t = end;
    }
  }
};

// prefetch_l2 of the j-th of `shares` parts of a paged block's K and V, page by page: the block's columns listed run
// by run (the K columns of run 0, its V columns, the K columns of run 1, ...), each part a contiguous slice of that
// list, so a part is one or two long ranges of bytes; one block ahead (bench/results/ops/README.md, "CPU decode").
template <typename T>
inline void prefetch_runs_share(const PageRuns<T>& runs, int64_t page_size, int64_t qk_width, int64_t v_width,
                                int64_t j, int64_t shares) {
  const int64_t per_run = qk_width + v_width, total = runs.count * per_run;
  const int64_t u1 = total * (j + 1) / shares;
  const int64_t run_bytes = page_size * int64_t(sizeof(T));  // bytes between columns
  for (int64_t u = total * j / shares; u < u1;) {
    const int64_t s = u / per_run, c = u % per_run;
    const bool keys = c < qk_width;
    const int64_t cols = std::min(keys ? qk_width : per_run, c + (u1 - u)) - c;
    const char* first =
        reinterpret_cast<const char*>(keys ? runs.k[s] : runs.v[s]) + (keys ? c : c - qk_width) * run_bytes;
    if (runs.len[s] == page_size) {
      prefetch_l2(first, cols * run_bytes);
    } else {
      for (int64_t k = 0; k < cols; ++k) prefetch_l2(first + k * run_bytes, runs.len[s] * int64_t(sizeof(T)));
    }
    u += cols;
  }
}

// The ranges of bytes that hold a block's K and V, at most kMaxRanges: a contiguous cache's K rows and V rows (2), or
// each page run's K columns and V columns, prefetched by an avx512::PrefetchStream (ReadAhead::kStream), a line of
// each range in turn (faster than ranges one after the other); pages that follow each other in memory are one range
// (add). Measured: bench/results/ops/README.md, "CPU decode".
template <int64_t kMaxRanges>
struct BlockBytes {
  const char* first[kMaxRanges];
  int64_t bytes[kMaxRanges];
  int64_t count = 0;

  // A range that starts where the last one ends extends it.
  void add(const void* start, int64_t size) {
    const char* p = static_cast<const char*>(start);
    if (count > 0 && first[count - 1] + bytes[count - 1] == p) {
      bytes[count - 1] += size;
    } else {
      first[count] = p;
      bytes[count++] = size;
    }
  }
  // n rows of `width` columns of a contiguous cache from key t of request b (with what lies between the rows)
  template <typename T>
  void add_rows(const CacheView<T>& cache, int64_t b, int64_t t, int64_t n, int64_t width) {
    if (n > 0) add(cache.at(b, t, 0), ((n - 1) * cache.stride1 + width) * int64_t(sizeof(T)));
  }
  template <typename T>
  void add_runs(const PageRuns<T>& runs, int64_t page_size, int64_t qk_width, int64_t v_width) {
    for (int64_t s = 0; s < runs.count; ++s)
      add(runs.k[s], ((qk_width - 1) * page_size + runs.len[s]) * int64_t(sizeof(T)));
    for (int64_t s = 0; s < runs.count; ++s)
      add(runs.v[s], ((v_width - 1) * page_size + runs.len[s]) * int64_t(sizeof(T)));
  }
  int64_t longest() const { return count == 0 ? 0 : *std::max_element(bytes, bytes + count); }
  avx512::PrefetchStream stream() const { return {first, bytes, count, longest()}; }
};

// ReadAhead::kLoads: a load of one byte per cache line of every range, in the order of PrefetchStream (ranges in
// turns, line by line). The range count's bound is a template argument so that a contiguous block's two ranges are an
// unrolled pair of loads per line (SmolLM2's 30-layer step, whose blocks are short, took 10% longer with a loop over
// a runtime count).
template <int64_t kMaxRanges>
FDC_AVX512 inline void read_ahead_interleaved(const BlockBytes<kMaxRanges>& block) {
  const int64_t longest = block.longest();
  char sink = 0;
  for (int64_t byte = 0; byte < longest; byte += avx512::kCacheLine) {
#pragma GCC unroll 2
    for (int64_t r = 0; r < std::min(kMaxRanges, block.count); ++r) {
      if (byte < block.bytes[r]) sink ^= *static_cast<const volatile char*>(block.first[r] + byte);
    }
  }
  asm volatile("" : : "r"(sink));
}

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
    return kc.paged() ? paged_block_keys<T>(way, kc.page_size)
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

// Merges the partials of every split (request, KV head) by log-sum-exp into the output.
template <typename T>
void merge_splits(const Problem& pb, int64_t batch, T* out, int64_t out_ld) {
  const checks::HostLayout& layout = *pb.layout;
  const int64_t hkv = layout.num_kv_heads(), group = layout.group;
  const HeadLayoutView view = layout.view();
  at::parallel_for(0, batch * hkv, 1, [&](int64_t bj0, int64_t bj1) {
    std::vector<float> lse, weight;
    for (int64_t bj = bj0; bj < bj1; ++bj) {
      const int64_t first = pb.split_offsets[bj], count = pb.split_offsets[bj + 1] - first;
      if (count <= 1) continue;
      const int64_t b = bj / hkv, j = bj % hkv;
      const int64_t dv = layout.v_offsets[j + 1] - layout.v_offsets[j];
      lse.resize(count);
      weight.resize(count);
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t s = 0; s < count; ++s) lse[s] = pb.partial_lse[(first + s) * group + i];
        merge_weights(lse.data(), static_cast<int32_t>(count), weight.data());
        T* oi = out + b * out_ld + view.o_column(static_cast<int32_t>(j * group + i));
        for (int64_t c = 0; c < dv; ++c) {
          float sum = 0.f;
          for (int64_t s = 0; s < count; ++s)
            sum += weight[s] * pb.partial_out[((first + s) * group + i) * pb.max_v_dim + c];
          oi[c] = static_cast<T>(sum);
        }
      }
    }
  });
}

// A plan from the caller must describe exactly these lengths: every record in range, chunks numbered within their
// (request, head), and the keys of each (request, head) covered in total exactly once.
void check_plan_records(const char* op, const DecodePlanView& plan, const std::vector<int32_t>& seqlens) {
  const int64_t hkv = plan.num_kv_heads(), pairs = int64_t(plan.batch()) * hkv;
  const int32_t* split = plan.split_offsets();
  const int32_t* workers = plan.worker_offsets();
  FDC_CHECK(split[0] == 0 && split[pairs] == plan.num_tasks() && plan.num_tasks() <= plan.capacity() &&
                workers[0] == 0 && workers[plan.num_workers()] == plan.num_tasks(),
            op, "plan is corrupt: its task counts disagree");
  std::vector<int64_t> covered(pairs, 0);
  for (int64_t r = 0; r < plan.num_tasks(); ++r) {
    const int32_t* rec = plan.records() + r * kDecodeRecordFields;
    FDC_CHECK(rec[0] >= 0 && rec[0] < pairs, op, "plan record ", r, " names (request, head) ", rec[0],
              " outside the batch");
    const int64_t b = rec[0] / hkv;
    FDC_CHECK(rec[1] >= 0 && rec[1] < split[rec[0] + 1] - split[rec[0]] && rec[2] >= 0 && rec[2] < rec[3] &&
                  rec[3] <= seqlens[b],
              op, "plan record ", r, " (keys ", rec[2], "..", rec[3], " of request ", b, " of length ", seqlens[b],
              ") does not fit cache_seqlens: make the plan from the same cache_seqlens");
    covered[rec[0]] += rec[3] - rec[2];
  }
  for (int64_t bj = 0; bj < pairs; ++bj) {
    FDC_CHECK(covered[bj] == seqlens[bj / hkv], op, "plan covers ", covered[bj], " keys of request ", bj / hkv,
              " but cache_seqlens says ", seqlens[bj / hkv], ": make the plan from the same cache_seqlens");
  }
}

}  // namespace

// q (B, G * W_qk); caches contiguous (B, S_max, W) or paged (num_pages, W, page_size) -> (B, G * W_v).
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_seqlens, const at::Tensor& qk_offsets,
                                const at::Tensor& v_offsets, int64_t group, double scale,
                                const std::optional<at::Tensor>& plan, const std::optional<at::Tensor>& block_table) {
  const char* op = "decode_attention";
  const checks::DecodeInputs inputs =
      checks::check_decode_inputs(op, q, k_cache, v_cache, qk_offsets, v_offsets, group, scale, block_table);
  const checks::HostLayout& layout = inputs.layout;
  const checks::CacheShape& cache = inputs.cache;
  const int64_t batch = inputs.batch;
  const checks::PagedCache& paged = cache.paged;
  const int64_t capacity = cache.capacity;
  const at::Tensor table = block_table ? block_table->contiguous() : at::Tensor();
  const std::vector<int32_t> seqlens = checks::read_cache_seqlens(op, cache_seqlens, batch, capacity);
  if (block_table) {
    for (int64_t b = 0; b < batch; ++b) {
      checks::check_block_table_entries(op, table.data_ptr<int32_t>() + b * paged.max_pages, b,
                                        ceil_div(seqlens[b], paged.page_size), paged.num_pages);
    }
  }

  const CpuIsa isa = cpu_isa(op);
  // On AVX-512 every block of keys is read once for all KV heads (run_piece_avx512); a caller's plan is still checked
  // against cache_seqlens, and decides the work of the portable kernels.
  const bool by_pieces = isa != CpuIsa::kPortable;
  at::Tensor schedule;
  if (plan) {
    checks::check_plan_tensor(op, *plan, q, kDecodeHeader);
    schedule = *plan;
    checks::check_decode_plan_header(op, schedule.data_ptr<int32_t>(), schedule.size(0), batch, layout);
    check_plan_records(op, DecodePlanView{schedule.data_ptr<int32_t>()}, seqlens);
  } else if (!by_pieces) {
    schedule = decode_plan_cpu(cache_seqlens, qk_offsets, v_offsets, group, std::nullopt);
  }

  const at::Tensor qc = checks::unit_last_stride(q);
  // Every output row is written by its request's tasks, or by merge_splits, except the rows of empty requests, which
  // are zeros.
  at::Tensor out = at::empty({batch, group * layout.v_width()}, q.options());
  for (int64_t b = 0; b < batch; ++b) {
    if (seqlens[b] == 0) out[b].zero_();
  }
  const int64_t max_v_dim = layout.max_v_dim(), hkv = layout.num_kv_heads();
  std::vector<int32_t> piece_splits;
  const std::vector<RowPiece> pieces =
      by_pieces ? cut_rows(seqlens, hkv, at::get_num_threads(), block_table ? paged.page_size : 1, piece_splits)
                : std::vector<RowPiece>{};
  const DecodePlanView view{by_pieces ? nullptr : schedule.data_ptr<int32_t>()};
  const int64_t slots = by_pieces ? piece_splits.back() : view.num_tasks();
  // Only split (request, KV head) pairs write and read their slots here.
  const std::unique_ptr<float[]> partial_out = uninitialized_floats(slots * group * max_v_dim);
  const std::unique_ptr<float[]> partial_lse = uninitialized_floats(slots * group);
  const int32_t* splits = by_pieces ? piece_splits.data() : view.split_offsets();  // (B * H_kv + 1)
  const Problem pb{&layout, static_cast<float>(scale), splits, partial_out.get(), partial_lse.get(), max_v_dim};

  const ReadAhead way =
      read_ahead_for(op, block_table.has_value(), q.scalar_type() == at::kBFloat16 && isa == CpuIsa::kAvx512Bf16);

  FDC_DISPATCH_FLOAT_TYPES(q.scalar_type(), "fdc::decode_attention", [&] {
    const int32_t* bt = block_table ? table.data_ptr<int32_t>() : nullptr;
    const auto view_of = [&](const at::Tensor& cache) {
      const int64_t row_stride = block_table ? 0 : cache.stride(1);
      return CacheView<scalar_t>{
          cache.data_ptr<scalar_t>(), cache.stride(0), row_stride, bt, paged.max_pages, paged.page_size};
    };
    const CacheView<scalar_t> kview = view_of(k_cache), vview = view_of(v_cache);
    scalar_t* op_out = out.data_ptr<scalar_t>();
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    if (by_pieces) {
      at::parallel_for(0, int64_t(pieces.size()), 1, [&](int64_t p0, int64_t p1) {
        RowScratch ws(group, layout.qk_offsets[hkv], layout.v_offsets[hkv], hkv * group);
        for (int64_t p = p0; p < p1; ++p) {
          run_piece_avx512(pieces[p], pb, qp, qc.stride(0), kview, vview, op_out, out.stride(0), ws,
                           isa == CpuIsa::kAvx512Bf16, way, p + 1 < p1 ? &pieces[p + 1] : nullptr);
        }
      });
    } else {
      at::parallel_for(0, view.num_workers(), 1, [&](int64_t w0, int64_t w1) {
        TaskScratch ws(group, !std::is_same_v<scalar_t, float>);
        for (int64_t w = w0; w < w1; ++w) {
          for (int64_t r = view.worker_offsets()[w]; r < view.worker_offsets()[w + 1]; ++r) {
            const int32_t* record = view.records() + r * kDecodeRecordFields;
            run_task(record, pb, qp, qc.stride(0), kview, vview, op_out, out.stride(0), ws);
          }
        }
      });
    }
    merge_splits(pb, batch, op_out, out.stride(0));
  });
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("decode_attention", &fdc::cpu::decode_attention_cpu); }
