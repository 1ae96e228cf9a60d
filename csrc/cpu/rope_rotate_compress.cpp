// fdc::rope_rotate_compress on the CPU: rotate-half RoPE on the first rotary_dim columns of x in float32, then the
// per-KV-head product of rotate_compress (no rounding to x's dtype in between).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "cpu/cpu_common.h"

namespace fdc::cpu {
namespace {

// Up to this many tokens (decode steps, short prompts) one loop per (token, head) does RoPE and the product: the
// general path below is about fifteen ATen calls, ~100 us per call on a 2-core AMD EPYC whatever the size, which was
// most of this op's cost in a SmolLM2 decode step (B = 1: 9 query heads of 64); above it matmul's blocking wins.
constexpr int64_t kLoopTokens = 64;

// x (T, heads, D) any strides, cos/sin (T, rotary_dim) contiguous, rot (H_kv, D, R_max) contiguous
// -> out (T, group * qk_offsets[-1]) contiguous, head h = j * group + i at columns group * qk_offsets[j] + i * dim.
template <typename T>
void rope_rotate_loop(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& rot,
                      const checks::HostLayout& layout, int64_t group, int64_t rotary_dim, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2), half = rotary_dim / 2;
  const int64_t r_max = rot.size(2), width = out.size(1);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const T* rp = rot.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tokens * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> roped(head_dim), acc(kMaxHeadDim);
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / heads, h = th % heads, j = h / group, i = h % group;
      const T* row = xp + t * x.stride(0) + h * x.stride(1);
      const int64_t stride = x.stride(2);
      const T* c = cp + t * rotary_dim;
      const T* sn = sp + t * rotary_dim;
      for (int64_t d = 0; d < half; ++d) {
        const float a = to_float(row[d * stride]), b = to_float(row[(d + half) * stride]);
        roped[d] = a * to_float(c[d]) - b * to_float(sn[d]);
        roped[d + half] = b * to_float(c[d + half]) + a * to_float(sn[d + half]);
      }
      for (int64_t d = rotary_dim; d < head_dim; ++d) roped[d] = to_float(row[d * stride]);
      const int64_t dim = layout.qk_offsets[j + 1] - layout.qk_offsets[j];
      std::fill(acc.begin(), acc.begin() + dim, 0.f);
      for (int64_t d = 0; d < head_dim; ++d) {
        const float w = roped[d];
        const T* r = rp + (j * head_dim + d) * r_max;
        for (int64_t k = 0; k < dim; ++k) acc[k] += w * to_float(r[k]);
      }
      T* o = op + t * width + group * layout.qk_offsets[j] + i * dim;
      for (int64_t k = 0; k < dim; ++k) o[k] = static_cast<T>(acc[k]);
    }
  });
}

}  // namespace

// x (T, G * H_kv, D) pre-RoPE, cos and sin (T, rotary_dim), rot (H_kv, D, R_max) -> (T, G * qk_offsets[-1]).
at::Tensor rope_rotate_compress_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                    const at::Tensor& rot, const at::Tensor& qk_offsets, int64_t group) {
  const char* op = "rope_rotate_compress";
  const checks::RotateShape shape = checks::check_rotate_compress(op, x, rot, qk_offsets, group);
  const int64_t rotary_dim = checks::check_rope_tables(op, cos, sin, x);
  const int64_t half = rotary_dim / 2;

  if (shape.tokens <= kLoopTokens) {
    at::Tensor out = at::empty({shape.tokens, group * shape.layout.qk_width()}, x.options());
    const at::Tensor cosc = cos.contiguous(), sinc = sin.contiguous(), rotc = rot.contiguous();
    FDC_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fdc::rope_rotate_compress", [&] {
      rope_rotate_loop<scalar_t>(x, cosc, sinc, rotc, shape.layout, group, rotary_dim, out);
    });
    return out;
  }
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
