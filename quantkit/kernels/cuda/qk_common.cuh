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

// Magic-number int4 -> 16-bit float: OR a 4-bit code into the low mantissa bits of a number whose mantissa step is
// 1 (fp16 1024 = 0x6400, bf16 128 = 0x4300) and the register holds exactly base + code in each half; subtracting
// base + zero (also exact) leaves code - zero. One lop3 gives two codes, no integer-to-float conversion.
// tests/test_kernels_cuda_bits.py reads these constants and replays the arithmetic in NumPy.
constexpr uint32_t kLowNibbles = 0x000F000Fu;  // bits 0-3 of each 16-bit half
constexpr uint32_t kHalfMagic = 0x64006400u;   // half2 (1024, 1024)
constexpr uint32_t kBf16Magic = 0x43004300u;   // bfloat162 (128, 128)
constexpr float kHalfBase = 1024.0f;
constexpr float kBf16Base = 128.0f;
// A word's codes come out paired (t, t + 4) for t = 0..3 (shift by 4t, one lop3); activations are re-paired the
// same way with byte permutes: (x_t, x_{t+4}) = prmt(r[t/2], r[t/2 + 2], kPairLo or kPairHi).
constexpr uint32_t kPairLo = 0x5410u;  // low 16 bits of each source word
constexpr uint32_t kPairHi = 0x7632u;  // high 16 bits of each source word

// (a & b) | c in one instruction
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

}  // namespace qk
