// fdc::rotate_compress on CUDA: the tiled per-KV-head product of rotate_compress_kernel.cuh, without RoPE.
#include <torch/library.h>

#include "cuda/rotate_compress_kernel.cuh"

namespace fdc::cuda {

// x (T, G * H_kv, D), rot (H_kv, D, R_max) -> (T, G * qk_offsets[-1]).
at::Tensor rotate_compress_cuda(const at::Tensor& x, const at::Tensor& rot, const at::Tensor& qk_offsets, int64_t group,
                                std::optional<int64_t> out_width) {
  const char* op = "rotate_compress";
  const checks::RotateShape shape = checks::check_rotate_compress(op, x, rot, qk_offsets, group, out_width);
  checks::check_cuda_tensor(op, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  return launch_rotate_compress<false>(shape, checks::unit_last_stride(x), checks::unit_last_stride(rot), nullptr,
                                       nullptr);
}

}  // namespace fdc::cuda

TORCH_LIBRARY_IMPL(fdc, CUDA, m) { m.impl("rotate_compress", &fdc::cuda::rotate_compress_cuda); }
