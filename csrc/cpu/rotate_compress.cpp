// fdc::rotate_compress on the CPU: one float32 matrix product per KV head (all G query heads of the group at once),
// written into the head's packed segment.
#include <torch/library.h>

#include "cpu/cpu_common.h"

namespace fdc::cpu {

// x (T, G * H_kv, D), rot (H_kv, D, R_max) -> (T, G * qk_offsets[-1]).
at::Tensor rotate_compress_cpu(const at::Tensor& x, const at::Tensor& rot, const at::Tensor& qk_offsets,
                               int64_t group) {
  const char* op = "rotate_compress";
  checks::check_float(op, "x", x, 3);
  checks::check_float(op, "rot", rot, 3);
  checks::check_same_dtype(op, "rot", rot, "x", x);
  checks::check_same_device(op, "rot", rot, "x", x);
  const checks::HostLayout layout = checks::read_layout(op, qk_offsets, nullptr, group);
  const int64_t hkv = layout.num_kv_heads(), tokens = x.size(0), head_dim = x.size(2);
  FDC_CHECK(x.size(1) == group * hkv, op, "x must have group * H_kv = ", group, " * ", hkv, " = ", group * hkv,
            " heads in dimension 1 but got shape ", x.sizes());
  int32_t max_dim = 0;
  for (int64_t j = 0; j < hkv; ++j) max_dim = std::max(max_dim, layout.qk_offsets[j + 1] - layout.qk_offsets[j]);
  FDC_CHECK(rot.size(0) == hkv && rot.size(1) == head_dim && rot.size(2) >= max_dim, op,
            "rot must have shape (H_kv=", hkv, ", D=", head_dim, ", R_max>=", max_dim, ") but got ", rot.sizes());

  at::Tensor out = at::empty({tokens, group * layout.qk_width()}, x.options());
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor rotf = rot.to(at::kFloat);
  for (int64_t j = 0; j < hkv; ++j) {
    const int64_t dim = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
    const at::Tensor segment = at::matmul(xf.narrow(1, j * group, group), rotf[j].narrow(1, 0, dim));  // (T, G, dim)
    out.narrow(1, group * layout.qk_offsets[j], group * dim).view({tokens, group, dim}).copy_(segment);
  }
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("rotate_compress", &fdc::cpu::rotate_compress_cpu); }
