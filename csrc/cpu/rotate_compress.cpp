// fdc::rotate_compress on the CPU: the per-KV-head product with all G query heads of the group at once, written into
// the head's packed segment. The product (rotate_into_packed, cpu_common.h) is shared with rope_rotate_compress.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/cpu_common.h"
#include "cpu/vec_avx512.h"
#include "cpu/vec_avx512_axpy.h"
#include "cpu/vec_math.h"

namespace fdc::cpu {
namespace {

// x (T, G * H_kv, D) float32 with unit-stride rows, rot (H_kv, D, R_max) float32 contiguous -> out (T, G * W_qk)
// float32 contiguous: query head i of KV head j of token t at columns G * qk_offsets[j] + i * dim.
void rotate_rows(const at::Tensor& x, const at::Tensor& rot, const checks::HostLayout& layout, int64_t group,
                 at::Tensor& out) {
  const int64_t tokens = x.size(0), head_dim = x.size(2), r_max = rot.size(2), width = out.size(1);
  const int64_t hkv = layout.num_kv_heads();
  const float* xp = x.data_ptr<float>();
  const float* rp = rot.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool wide = cpu_isa("rotate_compress") != CpuIsa::kPortable;
  at::parallel_for(0, tokens * hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tj = begin; tj < end; ++tj) {
      const int64_t t = tj / hkv, j = tj % hkv;
      const int64_t dim = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
      float* o = op + t * width + group * layout.qk_offsets[j];
      std::fill(o, o + group * dim, 0.f);
      // The G rows x[t, j * G + i, :] weigh the D rows of R_j (first dim columns each).
      const float* w = xp + t * x.stride(0) + j * group * x.stride(1);
      const float* r = rp + j * head_dim * r_max;
      if (wide) {  // tiles of up to 4 query heads x 64 columns: each row of R_j is loaded once for the whole tile
        avx512::PrefetchStream nothing_ahead;
        avx512::axpy_rows(w, x.stride(1), group, r, r_max, head_dim, dim, o, dim, nothing_ahead);
      } else {
        axpy_rows(w, x.stride(1), group, r, r_max, head_dim, dim, o, dim);
      }
    }
  });
}

}  // namespace

// x_float (T, G * H_kv, D) float32, rot (H_kv, D, R_max) -> out (T, G * qk_offsets[-1]) of out's dtype.
void rotate_into_packed(const at::Tensor& x_float, const at::Tensor& rot, const checks::HostLayout& layout,
                        int64_t group, at::Tensor& out) {
  const int64_t tokens = x_float.size(0);
  const at::Tensor rotf = checks::as_float(rot).contiguous();  // (H_kv, D, R_max)
  // The AVX-512 row kernel beats the per-KV-head matmul at every size measured, so it takes any size; the portable
  // one takes up to kRowLoopTokens. Measured on the 2-core Intel Xeon, SmolLM2's 9 query and 3 key heads of 64 at
  // widths 56/64/48, median of 20-50 calls, matmul -> row kernel: 65 tokens 58 -> 24 us for the queries and 45 -> 13
  // us for the keys, 264 tokens 124 -> 85 and 94 -> 40 us, 2048 tokens 961 -> 678 and 496 -> 280 us, 4096 tokens
  // 1932 -> 1348 and 999 -> 538 us.
  if (tokens <= kRowLoopTokens || cpu_isa("rotate_compress") != CpuIsa::kPortable) {
    if (out.scalar_type() == at::kFloat) {
      rotate_rows(checks::unit_last_stride(x_float), rotf, layout, group, out);
    } else {
      at::Tensor out_float = at::empty(out.sizes(), out.options().dtype(at::kFloat));
      rotate_rows(checks::unit_last_stride(x_float), rotf, layout, group, out_float);
      out.copy_(out_float);
    }
    return;
  }
  for (int64_t j = 0; j < layout.num_kv_heads(); ++j) {
    const int64_t dim = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
    const at::Tensor segment =
        at::matmul(x_float.narrow(1, j * group, group), rotf[j].narrow(1, 0, dim));  // (T, G, dim)
    out.narrow(1, group * layout.qk_offsets[j], group * dim).view({tokens, group, dim}).copy_(segment);
  }
}

// x (T, G * H_kv, D), rot (H_kv, D, R_max) -> (T, G * qk_offsets[-1]).
at::Tensor rotate_compress_cpu(const at::Tensor& x, const at::Tensor& rot, const at::Tensor& qk_offsets, int64_t group,
                               std::optional<int64_t> out_width) {
  const checks::RotateShape shape =
      checks::check_rotate_compress("rotate_compress", x, rot, qk_offsets, group, out_width);
  at::Tensor out = at::empty({shape.tokens, group * shape.layout.qk_width()}, x.options());
  rotate_into_packed(checks::as_float(x), rot, shape.layout, group, out);
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("rotate_compress", &fdc::cpu::rotate_compress_cpu); }
