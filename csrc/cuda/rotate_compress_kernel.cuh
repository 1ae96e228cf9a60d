// The kernel of rotate_compress and rope_rotate_compress on CUDA, shared through the template flag kRope: the fused
// op applies rotate-half RoPE to each x tile while loading it into shared memory, so both ops read x once and write
// the packed output once.
//
// One CTA computes a kTileRows x kTileCols block of one KV head's output: rows are (token, query head of the group)
// pairs, row r = token * G + i, so the G query heads of the head share the rotation tile; columns are the head's
// leading qk_dim columns of rot. The CTA walks D in steps of kTileDepth, multiplying in float32 from shared memory.
// Each output element is written straight into its packed column G * qk_offsets[j] + i * qk_dim(j) + c.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/cuda_common.cuh"

namespace fdc::cuda {

// 64 x 64 output tiles over 256 threads give each thread a 4 x 4 register tile: each k step costs 8 shared-memory
// reads for 16 FMAs, and the two tiles (17 KB of float32) leave room for several CTAs per SM. A head is at most
// 256 wide (kMaxHeadDim), so at most 4 column tiles per head. A depth of 32 keeps one x row's slice of a tile within
// two 32-byte sectors in float32 and one in 16-bit types.
constexpr int kRotateTileRows = 64;
constexpr int kRotateTileCols = 64;
constexpr int kRotateTileDepth = 32;
constexpr int kRotateThreads = 256;
constexpr int kRotateThreadTile = 4;  // rows and columns per thread: (64 / 4) x (64 / 4) = 256 threads
// KV heads per launch. Their offsets travel in the kernel's parameters (a device copy of the host offsets would need
// a host-to-device transfer per call, which CUDA-graph capture forbids); 129 int32 keep the parameters far below
// the 4 KB limit. Layers with more KV heads take several launches.
constexpr int kRotateHeadsPerLaunch = 128;

static_assert(kRotateThreads == (kRotateTileRows / kRotateThreadTile) * (kRotateTileCols / kRotateThreadTile));

template <typename T>
struct RotateArgs {
  const T* x;                                  // (T, G * H_kv, D), unit-stride rows
  int64_t x_token_stride;                      // elements between tokens of x
  int64_t x_head_stride;                       // elements between heads of x
  const T* rot;                                // (H_kv, D, R_max), unit-stride rows
  int64_t rot_head_stride;                     // elements between KV heads of rot
  int64_t rot_row_stride;                      // elements between rows (d) of rot
  const T* cos;                                // (T, rotary_dim), unit-stride rows; unused unless kRope
  const T* sin;                                // (T, rotary_dim), unit-stride rows; unused unless kRope
  int64_t cos_stride;                          // elements between tokens of cos
  int64_t sin_stride;                          // elements between tokens of sin
  int32_t rotary_half;                         // rotary_dim / 2
  T* out;                                      // (T, G * qk_offsets[-1]), contiguous
  int64_t out_stride;                          // G * qk_offsets[-1]
  int64_t tokens;                              // T
  int32_t head_dim;                            // D
  int32_t group;                               // G
  int32_t first_head;                          // KV head of blockIdx.y == 0
  int32_t offsets[kRotateHeadsPerLaunch + 1];  // qk_offsets[first_head ...], one more than the launch's heads
};

// Loads elements [d, d + kPacket<T>) of `row` (a row of x, cos, sin or rot, `limit` elements wide) into v as
// float32: one 16-byte load when kVector (the host checked alignment and that the row's width in use is a multiple
// of the packet), else element by element; elements at or past `limit` read as 0.
template <typename T, bool kVector>
__device__ __forceinline__ void load_packet(const T* row, int32_t d, int32_t limit, float* v) {
  if constexpr (kVector) {
    if (d < limit) {
      const uint4 bits = __ldg(reinterpret_cast<const uint4*>(row + d));
      const T* e = reinterpret_cast<const T*>(&bits);
#pragma unroll
      for (int i = 0; i < kPacket<T>; ++i) v[i] = to_float(e[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kPacket<T>; ++i) v[i] = 0.f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPacket<T>; ++i) v[i] = d + i < limit ? to_float(row[d + i]) : 0.f;
  }
}

// x[token, head, d .. d + kPacket) with RoPE applied when kRope (`row` is x[token, head, :], D elements):
//   d <  half:            x[d] * cos[d] - x[d + half] * sin[d]
//   half <= d < 2 * half: x[d] * cos[d] + x[d - half] * sin[d]
//   d >= 2 * half:        x[d]
// When kVector the host checked that half is a multiple of the packet, so a packet lies in one of the three ranges.
template <typename T, bool kRope, bool kVector>
__device__ __forceinline__ void load_x(const RotateArgs<T>& a, const T* row, int64_t token, int32_t d, float* v) {
  load_packet<T, kVector>(row, d, a.head_dim, v);
  if constexpr (kRope) {
    const int32_t half = a.rotary_half;
    if (d >= 2 * half) return;
    float partner[kPacket<T>], c[kPacket<T>], s[kPacket<T>];
    const T* cos_row = a.cos + token * a.cos_stride;
    const T* sin_row = a.sin + token * a.sin_stride;
    if constexpr (kVector) {
      const bool first_half = d < half;
      load_packet<T, true>(row, first_half ? d + half : d - half, a.head_dim, partner);
      load_packet<T, true>(cos_row, d, 2 * half, c);
      load_packet<T, true>(sin_row, d, 2 * half, s);
#pragma unroll
      for (int i = 0; i < kPacket<T>; ++i)
        v[i] = first_half ? v[i] * c[i] - partner[i] * s[i] : v[i] * c[i] + partner[i] * s[i];
    } else {
#pragma unroll
      for (int i = 0; i < kPacket<T>; ++i) {
        const int32_t e = d + i;
        if (e >= 2 * half) continue;
        const float cs = to_float(cos_row[e]), sn = to_float(sin_row[e]);
        v[i] = e < half ? v[i] * cs - to_float(row[e + half]) * sn : v[i] * cs + to_float(row[e - half]) * sn;
      }
    }
  }
}

template <typename T, bool kRope, bool kVector>
__global__ void __launch_bounds__(kRotateThreads) rotate_compress_kernel(const __grid_constant__ RotateArgs<T> a) {
  constexpr int kPack = kPacket<T>;
  constexpr int kRowPackets = kRotateTileDepth / kPack;  // packets of one x row in a tile
  constexpr int kColPackets = kRotateTileCols / kPack;   // packets of one rot row in a tile
  const int32_t local_head = blockIdx.y;
  const int32_t column0 = a.offsets[local_head];
  const int32_t dim = a.offsets[local_head + 1] - column0;
  const int32_t n0 = blockIdx.z * kRotateTileCols;
  if (n0 >= dim) return;  // the head is narrower than this column tile: the whole CTA leaves
  const int64_t head = a.first_head + local_head;
  const int64_t rows = a.tokens * a.group;
  const int64_t m0 = int64_t(blockIdx.x) * kRotateTileRows;

  // x tile stored transposed (depth-major) so the product reads a column of rows as a broadcast; one float of
  // padding per line spreads the transposed packet stores over all 32 banks.
  __shared__ float x_tile[kRotateTileDepth][kRotateTileRows + 1];
  __shared__ float rot_tile[kRotateTileDepth][kRotateTileCols];

  const int tid = threadIdx.x;
  const int tx = tid % (kRotateTileCols / kRotateThreadTile);
  const int ty = tid / (kRotateTileCols / kRotateThreadTile);
  float acc[kRotateThreadTile][kRotateThreadTile] = {};
  const T* rot_head = a.rot + head * a.rot_head_stride;

  for (int32_t k0 = 0; k0 < a.head_dim; k0 += kRotateTileDepth) {
    // x: kTileRows rows of kRowPackets packets; consecutive threads read consecutive packets of a row.
    for (int p = tid; p < kRotateTileRows * kRowPackets; p += kRotateThreads) {
      const int r = p / kRowPackets, kp = p % kRowPackets;
      const int64_t row = m0 + r;
      float v[kPack];
      if (row < rows) {
        const int64_t token = row / a.group;
        const int64_t x_head = head * a.group + row % a.group;
        const T* x_row = a.x + token * a.x_token_stride + x_head * a.x_head_stride;
        load_x<T, kRope, kVector>(a, x_row, token, k0 + kp * kPack, v);
      } else {
#pragma unroll
        for (int i = 0; i < kPack; ++i) v[i] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < kPack; ++i) x_tile[kp * kPack + i][r] = v[i];
    }
    // rot: kTileDepth rows of kColPackets packets, columns past the head's width as 0.
    for (int p = tid; p < kRotateTileDepth * kColPackets; p += kRotateThreads) {
      const int k = p / kColPackets, np = p % kColPackets;
      const int32_t d = k0 + k;
      float v[kPack];
      if (d < a.head_dim) {
        load_packet<T, kVector>(rot_head + int64_t(d) * a.rot_row_stride, n0 + np * kPack, dim, v);
      } else {
#pragma unroll
        for (int i = 0; i < kPack; ++i) v[i] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < kPack; ++i) rot_tile[k][np * kPack + i] = v[i];
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kRotateTileDepth; ++k) {
      float xv[kRotateThreadTile], rv[kRotateThreadTile];
#pragma unroll
      for (int i = 0; i < kRotateThreadTile; ++i) {
        xv[i] = x_tile[k][ty + i * (kRotateTileRows / kRotateThreadTile)];
        rv[i] = rot_tile[k][tx + i * (kRotateTileCols / kRotateThreadTile)];
      }
#pragma unroll
      for (int i = 0; i < kRotateThreadTile; ++i) {
#pragma unroll
        for (int c = 0; c < kRotateThreadTile; ++c) acc[i][c] = fmaf(xv[i], rv[c], acc[i][c]);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < kRotateThreadTile; ++i) {
    const int64_t row = m0 + ty + i * (kRotateTileRows / kRotateThreadTile);
    if (row >= rows) continue;
    const int64_t token = row / a.group;
    const int64_t member = row % a.group;
    T* out_row = a.out + token * a.out_stride + int64_t(a.group) * column0 + member * dim;
#pragma unroll
    for (int c = 0; c < kRotateThreadTile; ++c) {
      const int32_t column = n0 + tx + c * (kRotateTileCols / kRotateThreadTile);
      if (column < dim) out_row[column] = from_float<T>(acc[i][c]);
    }
  }
}

// Runs the kernel for x (T, G * H_kv, D) and rot (H_kv, D, R_max), both with unit-stride rows, and, when kRope,
// cos and sin (T, rotary_dim) with unit-stride rows. Returns (T, G * qk_offsets[-1]). No host synchronisation.
template <bool kRope>
at::Tensor launch_rotate_compress(const checks::RotateShape& shape, const at::Tensor& x, const at::Tensor& rot,
                                  const at::Tensor* cos, const at::Tensor* sin) {
  const checks::HostLayout& layout = shape.layout;
  const int64_t group = layout.group;
  at::Tensor out = at::empty({shape.tokens, group * layout.qk_width()}, x.options());
  const int64_t rows = shape.tokens * group;
  if (rows == 0) return out;
  const int64_t row_tiles = ceil_div(rows, kRotateTileRows);
  FDC_CHECK(row_tiles <= INT32_MAX, kRope ? "rope_rotate_compress" : "rotate_compress", "x has ", shape.tokens,
            " tokens, more than one launch can cover");
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  FDC_DISPATCH_FLOAT_TYPES(x.scalar_type(), "fdc::rotate_compress", [&] {
    constexpr int kPack = kPacket<scalar_t>;
    RotateArgs<scalar_t> args{};
    args.x = x.data_ptr<scalar_t>();
    args.x_token_stride = x.stride(0);
    args.x_head_stride = x.stride(1);
    args.rot = rot.data_ptr<scalar_t>();
    args.rot_head_stride = rot.stride(0);
    args.rot_row_stride = rot.stride(1);
    args.out = out.data_ptr<scalar_t>();
    args.out_stride = out.stride(0);
    args.tokens = shape.tokens;
    args.head_dim = static_cast<int32_t>(shape.head_dim);
    args.group = static_cast<int32_t>(group);
    bool vector = is_aligned16(args.x) && args.x_token_stride % kPack == 0 && args.x_head_stride % kPack == 0 &&
                  shape.head_dim % kPack == 0 && is_aligned16(args.rot) && args.rot_head_stride % kPack == 0 &&
                  args.rot_row_stride % kPack == 0;
    if constexpr (kRope) {
      args.cos = cos->data_ptr<scalar_t>();
      args.sin = sin->data_ptr<scalar_t>();
      args.cos_stride = cos->stride(0);
      args.sin_stride = sin->stride(0);
      args.rotary_half = static_cast<int32_t>(cos->size(1) / 2);
      vector = vector && is_aligned16(args.cos) && is_aligned16(args.sin) && args.cos_stride % kPack == 0 &&
               args.sin_stride % kPack == 0 && args.rotary_half % kPack == 0;
    }
    for (int32_t first = 0; first < layout.num_kv_heads(); first += kRotateHeadsPerLaunch) {
      const int32_t heads = std::min<int32_t>(kRotateHeadsPerLaunch, layout.num_kv_heads() - first);
      args.first_head = first;
      int32_t max_dim = 0;
      for (int32_t j = 0; j <= heads; ++j) {
        args.offsets[j] = layout.qk_offsets[first + j];
        if (j > 0) max_dim = std::max(max_dim, args.offsets[j] - args.offsets[j - 1]);
      }
      const dim3 grid(static_cast<uint32_t>(row_tiles), static_cast<uint32_t>(heads),
                      static_cast<uint32_t>(ceil_div(max_dim, kRotateTileCols)));
      if (vector) {
        rotate_compress_kernel<scalar_t, kRope, true><<<grid, kRotateThreads, 0, stream>>>(args);
      } else {
        rotate_compress_kernel<scalar_t, kRope, false><<<grid, kRotateThreads, 0, stream>>>(args);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

}  // namespace fdc::cuda
