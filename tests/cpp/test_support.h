// What the torch-free header tests (tests/cpp/test_*.cpp, one executable each) share: a CHECK that counts failures
// and names the seed of the run, and random head layouts.
#pragma once

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "fdc/head_layout.h"

namespace fdc_test {

inline int failures = 0;
inline unsigned seed = 0;  // of the run's random cases, printed by main and given back as argv[1] to replay them

#define CHECK(cond, ...)                                                                                      \
  do {                                                                                                        \
    if (!(cond)) {                                                                                            \
      ++fdc_test::failures;                                                                                   \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed (seed %u): ", __FILE__, __LINE__, #cond, fdc_test::seed); \
      std::fprintf(stderr, __VA_ARGS__);                                                                      \
      std::fprintf(stderr, "\n");                                                                             \
    }                                                                                                         \
  } while (0)

struct Layout {
  std::vector<int32_t> qk, v;  // offsets
  int32_t group;
  fdc::HeadLayoutView view() const { return {qk.data(), v.data(), static_cast<int32_t>(qk.size()) - 1, group}; }
};

// 1..max_heads KV heads of widths 8..256 (multiples of 8), group 1..max_group.
inline Layout random_layout(std::mt19937& rng, int max_heads = 8, int max_group = 8) {
  std::uniform_int_distribution<int> heads(1, max_heads), group(1, max_group), width(1, 32);
  Layout layout;
  const int hkv = heads(rng);
  layout.group = group(rng);
  layout.qk = {0};
  layout.v = {0};
  for (int j = 0; j < hkv; ++j) {
    layout.qk.push_back(layout.qk.back() + 8 * width(rng));
    layout.v.push_back(layout.v.back() + 8 * width(rng));
  }
  return layout;
}

}  // namespace fdc_test
