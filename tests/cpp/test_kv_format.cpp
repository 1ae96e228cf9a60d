// The quantized caches' layout (include/fdc/kv_format.h), which the CPU and CUDA kernels address through the same
// helpers: for random layouts, formats and page sizes, the data bytes and the float32 scales of a contiguous row and
// of a dim-major page (kv_row_scale_offset, kv_page_scale_offset) cover the stored width exactly once each, with no
// gap and no overlap, and every scale lies on a 4-byte boundary. The seed is printed; pass one as argv[1] to replay.
// Exit code = number of failed checks (capped at 255).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "fdc/kv_format.h"

#include "test_support.h"

using fdc_test::failures;
using fdc_test::random_layout;
using fdc_test::seed;

namespace {

// Counts how often each byte of a row (page_size 0) or of a page is claimed by a code or a scale.
void test_layout(int64_t width, int64_t heads, fdc::KvFormat format, int64_t page_size) {
  const int64_t data_bytes = width / fdc::kv_columns_per_element(format);
  const int64_t stored = fdc::kv_stored_width(width, heads, format);  // bytes of a row, byte rows of a page
  const int64_t slots = page_size > 0 ? page_size : 1;
  std::vector<int> claims(stored * slots, 0);
  for (int64_t slot = 0; slot < slots; ++slot) {
    for (int64_t byte = 0; byte < data_bytes; ++byte) ++claims[page_size > 0 ? byte * page_size + slot : byte];
    for (int64_t j = 0; j < heads; ++j) {
      const int64_t at = page_size > 0 ? fdc::kv_page_scale_offset(data_bytes, page_size, j, slot)
                                       : fdc::kv_row_scale_offset(data_bytes, j);
      CHECK(at % fdc::kKvScaleBytes == 0, "scale of head %lld slot %lld at byte %lld: not 4-byte aligned",
            static_cast<long long>(j), static_cast<long long>(slot), static_cast<long long>(at));
      for (int64_t b = 0; b < fdc::kKvScaleBytes; ++b) {
        const int64_t byte = at + b;
        CHECK(byte >= 0 && byte < stored * slots, "scale of head %lld slot %lld reaches byte %lld of %lld",
              static_cast<long long>(j), static_cast<long long>(slot), static_cast<long long>(byte),
              static_cast<long long>(stored * slots));
        if (byte >= 0 && byte < stored * slots) ++claims[byte];
      }
    }
  }
  for (int64_t byte = 0; byte < stored * slots; ++byte) {
    CHECK(claims[byte] == 1, "width %lld, %lld heads, format %d, page_size %lld: byte %lld claimed %d times",
          static_cast<long long>(width), static_cast<long long>(heads), static_cast<int>(format),
          static_cast<long long>(page_size), static_cast<long long>(byte), claims[byte]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  seed = argc > 1 ? static_cast<unsigned>(std::strtoul(argv[1], nullptr, 10)) : std::random_device{}();
  std::printf("test_kv_format seed %u\n", seed);
  std::mt19937 rng(seed);
  const fdc::KvFormat formats[] = {fdc::KvFormat::kInt8, fdc::KvFormat::kFp8E4M3, fdc::KvFormat::kInt4};
  const int64_t page_sizes[] = {0, 1, 3, 16, 64, 100, 256};  // 0: a contiguous row
  for (int trial = 0; trial < 200; ++trial) {
    const fdc_test::Layout layout = random_layout(rng, 12, 1);
    const int64_t heads = static_cast<int64_t>(layout.qk.size()) - 1;
    for (fdc::KvFormat format : formats) {
      for (int64_t page_size : page_sizes) {
        test_layout(layout.qk.back(), heads, format, page_size);
        test_layout(layout.v.back(), heads, format, page_size);
      }
    }
  }
  std::printf("test_kv_format: %d failed checks\n", failures);
  return failures > 255 ? 255 : failures;
}
