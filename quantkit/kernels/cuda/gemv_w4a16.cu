// W4A16 GEMV for 1-4 activation rows on the packed checkpoint layout, no repacking.
// One warp per output row; each lane streams 16-byte (uint4 = 4 words = 32 codes) read-only loads, UNROLL of
// them in flight before any arithmetic, and keeps M float32 accumulators; a shuffle reduction finishes the row.
// Decode is memory-bound: the packed weight is read exactly once, activations come from L1/L2.
// Preconditions (checked by the binding): K % 32 == 0, group_size % 8 == 0 or <= 0, 16-byte aligned pointers.
#include <type_traits>

#include "qk_common.cuh"

namespace {

constexpr int kWarps = 4;
constexpr int kUnroll = 4;

__device__ __forceinline__ float2 pair_to_float2(__half2 h) { return __half22float2(h); }
__device__ __forceinline__ float2 pair_to_float2(__nv_bfloat162 h) { return __bfloat1622float2(h); }

// Eight 16-bit activations from one 16-byte load; Pair is the two-lane type of T (__half2 or __nv_bfloat162).
template <typename T, typename Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>>
__device__ __forceinline__ void to_float8(const uint4& v, T, float out[8]) {
  const Pair* h = reinterpret_cast<const Pair*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = pair_to_float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <int M, typename T>
__device__ __forceinline__ void accumulate_word(uint32_t word, int w, int n, const T* __restrict__ x, int k_cols,
                                                const T* __restrict__ srow, const int32_t* __restrict__ zp,
                                                const int32_t* __restrict__ g_idx, int groups, int group_size,
                                                float (&acc)[M]) {
  const int k0 = w * 8;
  float codes[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) codes[j] = static_cast<float>((word >> (4 * j)) & 0xFu);
  if (g_idx == nullptr) {
    // group_size % 8 == 0: the word's 8 codes share one group, so scale once per word
    const int g = group_size > 0 ? k0 / group_size : 0;
    const float zero = zp != nullptr ? static_cast<float>(qk::zero_code<4>(zp, n, g, groups)) : 8.0f;
    const float s = qk::to_f32(srow[g]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xv[8];
      to_float8(__ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * k_cols + k0)), T(), xv);
      float part = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) part = fmaf(codes[j] - zero, xv[j], part);
      acc[m] = fmaf(part, s, acc[m]);
    }
  } else {
    // act-order: every column may sit in a different group
    float wv[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int g = __ldg(g_idx + k0 + j);
      const float zero = zp != nullptr ? static_cast<float>(qk::zero_code<4>(zp, n, g, groups)) : 8.0f;
      wv[j] = (codes[j] - zero) * qk::to_f32(srow[g]);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xv[8];
      to_float8(__ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * k_cols + k0)), T(), xv);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[m] = fmaf(wv[j], xv[j], acc[m]);
    }
  }
}

template <int M, typename T>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_w4a16_kernel(const T* __restrict__ x, const int32_t* __restrict__ wp, const T* __restrict__ scale,
                      const int32_t* __restrict__ zp, const int32_t* __restrict__ g_idx, const T* __restrict__ bias,
                      T* __restrict__ y, int n_rows, int k_cols, int groups, int group_size) {
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (n >= n_rows) return;  // n is uniform across the warp, so whole warps leave together
  const int words = k_cols / 8;
  const int vecs = words / 4;
  const uint4* wrow = reinterpret_cast<const uint4*>(wp + static_cast<int64_t>(n) * words);
  const T* srow = scale + static_cast<int64_t>(n) * groups;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.0f;
  for (int v0 = lane; v0 < vecs; v0 += 32 * kUnroll) {
    uint4 buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32;
      buf[u] = v < vecs ? __ldg(wrow + v) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + u * 32;
      if (v < vecs) {
        accumulate_word<M, T>(buf[u].x, 4 * v + 0, n, x, k_cols, srow, zp, g_idx, groups, group_size, acc);
        accumulate_word<M, T>(buf[u].y, 4 * v + 1, n, x, k_cols, srow, zp, g_idx, groups, group_size, acc);
        accumulate_word<M, T>(buf[u].z, 4 * v + 2, n, x, k_cols, srow, zp, g_idx, groups, group_size, acc);
        accumulate_word<M, T>(buf[u].w, 4 * v + 3, n, x, k_cols, srow, zp, g_idx, groups, group_size, acc);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
  }
  if (lane == 0) {
    const float b = bias != nullptr ? qk::to_f32(bias[n]) : 0.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) y[static_cast<int64_t>(m) * n_rows + n] = qk::from_f32<T>(acc[m] + b);
  }
}

template <int M, typename T>
cudaError_t launch(const void* x, const int32_t* wp, const void* scale, const int32_t* zp, const int32_t* g_idx,
                   const void* bias, void* y, int n, int k, int groups, int group_size, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((n + kWarps - 1) / kWarps);
  gemv_w4a16_kernel<M, T><<<blocks, kWarps * 32, 0, stream>>>(
      static_cast<const T*>(x), wp, static_cast<const T*>(scale), zp, g_idx, static_cast<const T*>(bias),
      static_cast<T*>(y), n, k, groups, group_size);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rows(int m, const void* x, const int32_t* wp, const void* scale, const int32_t* zp,
                        const int32_t* g_idx, const void* bias, void* y, int n, int k, int groups, int group_size,
                        cudaStream_t stream) {
  switch (m) {
    case 1: return launch<1, T>(x, wp, scale, zp, g_idx, bias, y, n, k, groups, group_size, stream);
    case 2: return launch<2, T>(x, wp, scale, zp, g_idx, bias, y, n, k, groups, group_size, stream);
    case 3: return launch<3, T>(x, wp, scale, zp, g_idx, bias, y, n, k, groups, group_size, stream);
    case 4: return launch<4, T>(x, wp, scale, zp, g_idx, bias, y, n, k, groups, group_size, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// x [m, k], y [m, n], scale [n, groups] and bias [n] all in dtype (half or bfloat16); returns cudaError_t as int.
extern "C" int qk_gemv_w4a16(const void* x, const int32_t* wp, const void* scale, const int32_t* zp,
                             const int32_t* g_idx, const void* bias, void* y, int dtype, int m, int n, int k,
                             int groups, int group_size, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (k % 32 != 0 || (group_size > 0 && group_size % 8 != 0)) return cudaErrorInvalidValue;
  switch (dtype) {
    case qk::kHalf: return launch_rows<__half>(m, x, wp, scale, zp, g_idx, bias, y, n, k, groups, group_size, s);
    case qk::kBFloat16:
      return launch_rows<__nv_bfloat16>(m, x, wp, scale, zp, g_idx, bias, y, n, k, groups, group_size, s);
    default: return cudaErrorInvalidValue;
  }
}
