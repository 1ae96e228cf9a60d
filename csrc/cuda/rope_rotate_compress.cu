// fdc::rope_rotate_compress on CUDA: the kernel of rotate_compress with RoPE applied to each x tile as it is loaded
// (rotate_compress_kernel.cuh, kRope = true), so pre-RoPE x is read once and the roped x is never stored.
#include <torch/library.h>

#include "cuda/rotate_compress_kernel.cuh"

namespace fdc::cuda {

// x (T, G * H_kv, D) pre-RoPE, cos and sin (T, rotary_dim), rot (H_kv, D, R_max) -> (T, G * qk_offsets[-1]).
at::Tensor rope_rotate_compress_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                     const at::Tensor& rot, const at::Tensor& qk_offsets, int64_t group,
                                     std::optional<int64_t> out_width) {
  const char* op = "rope_rotate_compress";
  const checks::RotateShape shape = checks::check_rotate_compress(op, x, rot, qk_offsets, group, out_width);
  checks::check_rope_tables(op, cos, sin, x);
  checks::check_cuda_tensor(op, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor cos_rows = checks::unit_last_stride(cos);
  const at::Tensor sin_rows = checks::unit_last_stride(sin);
  return launch_rotate_compress<true>(shape, checks::unit_last_stride(x), checks::unit_last_stride(rot), &cos_rows,
                                      &sin_rows);
}

}  // namespace fdc::cuda

TORCH_LIBRARY_IMPL(fdc, CUDA, m) { m.impl("rope_rotate_compress", &fdc::cuda::rope_rotate_compress_cuda); }
