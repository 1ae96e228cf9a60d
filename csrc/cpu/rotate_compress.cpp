// fdc::rotate_compress on the CPU: one float32 matrix product per KV head (all G query heads of the group at once),
// written into the head's packed segment. The product is shared with rope_rotate_compress (cpu_common.h).
#include <torch/library.h>

#include "cpu/cpu_common.h"

namespace fdc::cpu {

// x_float (T, G * H_kv, D) float32, rot (H_kv, D, R_max) -> out (T, G * qk_offsets[-1]) of out's dtype.
void rotate_into_packed(const at::Tensor& x_float, const at::Tensor& rot, const checks::HostLayout& layout,
                        int64_t group, at::Tensor& out) {
  const int64_t tokens = x_float.size(0);
  const at::Tensor rotf = rot.to(at::kFloat);
  for (int64_t j = 0; j < layout.num_kv_heads(); ++j) {
    const int64_t dim = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
    const at::Tensor segment =
        at::matmul(x_float.narrow(1, j * group, group), rotf[j].narrow(1, 0, dim));  // (T, G, dim)
    out.narrow(1, group * layout.qk_offsets[j], group * dim).view({tokens, group, dim}).copy_(segment);
  }
}

// x (T, G * H_kv, D), rot (H_kv, D, R_max) -> (T, G * qk_offsets[-1]).
at::Tensor rotate_compress_cpu(const at::Tensor& x, const at::Tensor& rot, const at::Tensor& qk_offsets,
                               int64_t group) {
  const checks::RotateShape shape = checks::check_rotate_compress("rotate_compress", x, rot, qk_offsets, group);
  at::Tensor out = at::empty({shape.tokens, group * shape.layout.qk_width()}, x.options());
  rotate_into_packed(x.to(at::kFloat), rot, shape.layout, group, out);
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("rotate_compress", &fdc::cpu::rotate_compress_cpu); }
