// fdc::rope_rotate_compress on the CPU: rotate-half RoPE on the first rotary_dim columns of x in float32, then the
// per-KV-head product of rotate_compress (no rounding to x's dtype in between).
#include <torch/library.h>

#include "cpu/cpu_common.h"

namespace fdc::cpu {

// x (T, G * H_kv, D) pre-RoPE, cos and sin (T, rotary_dim), rot (H_kv, D, R_max) -> (T, G * qk_offsets[-1]).
at::Tensor rope_rotate_compress_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                    const at::Tensor& rot, const at::Tensor& qk_offsets, int64_t group) {
  const char* op = "rope_rotate_compress";
  const checks::RotateShape shape = checks::check_rotate_compress(op, x, rot, qk_offsets, group);
  const int64_t rotary_dim = checks::check_rope_tables(op, cos, sin, x);
  const int64_t half = rotary_dim / 2;

  at::Tensor roped = x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);  // (T, G * H_kv, D)
  const at::Tensor first = roped.narrow(2, 0, half).clone();                   // (T, G * H_kv, rotary_dim / 2)
  const at::Tensor second = roped.narrow(2, half, half).clone();               // (T, G * H_kv, rotary_dim / 2)
  const at::Tensor cosf = cos.to(at::kFloat).unsqueeze(1);                     // (T, 1, rotary_dim)
  const at::Tensor sinf = sin.to(at::kFloat).unsqueeze(1);                     // (T, 1, rotary_dim)
  roped.narrow(2, 0, half).copy_(first * cosf.narrow(2, 0, half) - second * sinf.narrow(2, 0, half));
  roped.narrow(2, half, half).copy_(second * cosf.narrow(2, half, half) + first * sinf.narrow(2, half, half));

  at::Tensor out = at::empty({shape.tokens, group * shape.layout.qk_width()}, x.options());
  rotate_into_packed(roped, rot, shape.layout, group, out);
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("rope_rotate_compress", &fdc::cpu::rope_rotate_compress_cpu); }
