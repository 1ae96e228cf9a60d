// How the CPU decode's AVX-512 kernel brings the next block of keys towards the core while it works on the current
// one (ReadAhead: chosen per CPU, measured in bench/results/ops/README.md, "CPU decode"), and the block sizes that
// go with each way. Included by decode_attention.cpp only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "cpu/decode_common.h"
#include "cpu/vec_avx512.h"

// Internal linkage, as when this was part of decode_attention.cpp (the only file that includes it): the compiler may
// inline and specialise these functions for their one caller.
namespace fdc::cpu::decode {
namespace {

// How the next block is brought towards the core, measured to differ between vendors and, on AMD, between kernels
// (read_ahead_for; the A/B runs: bench/results/ops/README.md, "CPU decode"):
// - kStream: prefetcht0 of the whole next block spread over the current block's loads (avx512::PrefetchStream):
//   prefetches retire at once, so they overlap the arithmetic where a burst of missing loads would stall it;
//   the choice on Intel, and on AMD wherever it beat kLoads;
// - kLoads: plain loads of the next block in a burst, where the block's arithmetic is short next to its bytes
//   (contiguous caches widened to float), where the stream lost on AMD;
// - kPrefetchL2: prefetcht1 per cache line, a share of the block before each KV head: the best on an Intel Xeon with
//   AMX before the stream existed; on an Intel Xeon with AVX-512-BF16 and no AMX the stream took 0.54-0.90x its time
//   in all 8 cases measured (bf16 and float32, contiguous and 128-token pages, B=4 x 8K and B=8 x 16K) and
//   0.55-0.81x the time of kLoads, so no Intel CPU measured is left where either wins; kept for measuring new ones.
enum class ReadAhead { kStream, kLoads, kPrefetchL2 };

// The way for this CPU, a paged cache or not, and products without widening (vdpbf16ps, vpdpwssd) or not, unless the
// environment variable FDC_CPU_READ_AHEAD names one (stream, loads or prefetch_l2; read at every call, like
// FDC_CPU_ISA, so tests run every way on any CPU and a new CPU can be measured without a rebuild). `op` names the
// caller in the error raised for any other value.
ReadAhead read_ahead_for(const char* op, bool paged, bool unwidened_products) {
  const char* forced = std::getenv("FDC_CPU_READ_AHEAD");
  if (forced != nullptr && *forced != '\0') {
    const std::string_view name(forced);
    if (name == "stream") return ReadAhead::kStream;
    if (name == "loads") return ReadAhead::kLoads;
    if (name == "prefetch_l2") return ReadAhead::kPrefetchL2;
    TORCH_CHECK(false, "fdc::", op, ": FDC_CPU_READ_AHEAD must be stream, loads or prefetch_l2 but is '", name, "'");
  }
  static const bool intel = __builtin_cpu_is("intel");
  if (intel) return ReadAhead::kStream;
  return paged || unwidened_products ? ReadAhead::kStream : ReadAhead::kLoads;
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
// - kPrefetchL2: 256 bytes of each column (the bytes per column set the best length, not the key count), at most
//   kMaxPagedBlockKeys (the one-byte elements of a quantized cache);
// - kStream: whole pages, as many as fit in kStreamPagedBlockKeys, or one page of at most kMaxPagedBlockKeys keys.
// The measurements: bench/results/ops/README.md, "CPU decode".
constexpr int64_t kStreamPagedBlockKeys = 64;

// element_bytes: the cache's sizeof(T) (known outside the kernels' dtype dispatch too, for cut_rows).
inline int64_t paged_block_keys(ReadAhead way, int64_t page_size, int64_t element_bytes) {
  if (way == ReadAhead::kPrefetchL2) return std::min(256 / element_bytes, kMaxPagedBlockKeys);
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

}  // namespace
}  // namespace fdc::cpu::decode
