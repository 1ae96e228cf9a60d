// fdc::rope_rotate_compress on the CPU: rotate-half RoPE on the first rotary_dim columns of x in float32, then the
// per-KV-head product of rotate_compress (no rounding to x's dtype in between).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu/cpu_common.h"

namespace fdc::cpu {
namespace {

// RoPE of x (T, heads, D, any strides) with cos/sin (T, rotary_dim) contiguous -> roped (T, heads, D) float32
// contiguous, one loop per (token, head) for short inputs (kRowLoopTokens).
template <typename T>
void rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim,
               at::Tensor& roped) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), half = rotary_dim / 2;
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  float* rp = roped.data_ptr<float>();
  at::parallel_for(0, tokens * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / heads;
      const T* row = xp + t * x.stride(0) + (th % heads) * x.stride(1);
      const int64_t stride = x.stride(2);
      const T* c = cp + t * rotary_dim;
      const T* sn = sp + t * rotary_dim;
      float* out = rp + th * head_dim;
      for (int64_t d = 0; d < half; ++d) {
        const float a = to_float(row[d * stride]), b = to_float(row[(d + half) * stride]);
        out[d] = a * to_float(c[d]) - b * to_float(sn[d]);
        out[d + half] = b * to_float(c[d + half]) + a * to_float(sn[d + half]);
      }
      for (int64_t d = rotary_dim; d < head_dim; ++d) out[d] = to_float(row[d * stride]);
    }
  });
}

}  // namespace

// x (T, G * H_kv, D) pre-RoPE, cos and sin (T, rotary_dim), rot (H_kv, D, R_max) -> (T, G * qk_offsets[-1]).
at::Tensor rope_rotate_compress_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                    const at::Tensor& rot, const at::Tensor& qk_offsets, int64_t group,
                                    std::optional<int64_t> out_width) {
  const char* op = "rope_rotate_compress";
  const checks::RotateShape shape = checks::check_rotate_compress(op, x, rot, qk_offsets, group, out_width);
  const int64_t rotary_dim = checks::check_rope_tables(op, cos, sin, x);
  const int64_t half = rotary_dim / 2;

  at::Tensor roped;  // (T, G * H_kv, D) float32
  if (shape.tokens <= kRowLoopTokens) {
    roped = at::empty(x.sizes(), x.options().dtype(at::kFloat));
    const at::Tensor cosc = cos.contiguous(), sinc = sin.contiguous();
    FDC_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fdc::rope_rotate_compress",
                             [&] { rope_rows<scalar_t>(x, cosc, sinc, rotary_dim, roped); });
  } else {
    roped = x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    const at::Tensor first = roped.narrow(2, 0, half).clone();      // (T, G * H_kv, rotary_dim / 2)
    const at::Tensor second = roped.narrow(2, half, half).clone();  // (T, G * H_kv, rotary_dim / 2)
    const at::Tensor cosf = cos.to(at::kFloat).unsqueeze(1);        // (T, 1, rotary_dim)
    const at::Tensor sinf = sin.to(at::kFloat).unsqueeze(1);        // (T, 1, rotary_dim)
    roped.narrow(2, 0, half).copy_(first * cosf.narrow(2, 0, half) - second * sinf.narrow(2, 0, half));
    roped.narrow(2, half, half).copy_(second * cosf.narrow(2, half, half) + first * sinf.narrow(2, half, half));
  }
  at::Tensor out = at::empty({shape.tokens, group * shape.layout.qk_width()}, x.options());
  rotate_into_packed(roped, rot, shape.layout, group, out);
  return out;
}

}  // namespace fdc::cpu

TORCH_LIBRARY_IMPL(fdc, CPU, m) { m.impl("rope_rotate_compress", &fdc::cpu::rope_rotate_compress_cpu); }
