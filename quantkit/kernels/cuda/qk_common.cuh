// Shared by the quantkit CUDA kernels: dtype codes, float conversions, and the packed-layout rules.
// Layout (compressed-tensors pack-quantized): int32 words along the input dim, code i at bit i*BITS, least
// significant first, stored unsigned with offset 2^(BITS-1); zero points packed the same way along dim 0.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace qk {

// dtype codes shared with binding.cpp
enum DType : int { kHalf = 0, kBFloat16 = 1, kFloat = 2 };

__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }

// Unsigned code of output row n's zero point for group g (zero points are packed along dim 0).
template <int BITS>
__device__ __forceinline__ int zero_code(const int32_t* __restrict__ zp, int n, int g, int groups) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const uint32_t word = static_cast<uint32_t>(__ldg(zp + static_cast<int64_t>(n / PER) * groups + g));
  return static_cast<int>((word >> ((n % PER) * BITS)) & MASK);
}

// Group of input column k: g_idx when present (act-order), else k / group_size (group_size <= 0: one group).
__device__ __forceinline__ int group_of(int k, const int32_t* __restrict__ g_idx, int group_size) {
  if (g_idx != nullptr) return __ldg(g_idx + k);
  return group_size > 0 ? k / group_size : 0;
}

}  // namespace qk
