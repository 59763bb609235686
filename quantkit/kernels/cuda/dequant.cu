// Dequantisation of checkpoint tensors as written: packed INT4/INT8 (groups, zero points, g_idx) and FP8
// E4M3, to half / bfloat16 / float. One thread per packed int32 word, so each word is read once.
#include <cuda_fp8.h>

#include "qk_common.cuh"

namespace {

template <int BITS, typename T>
__global__ void dequant_int_kernel(const int32_t* __restrict__ wp, const T* __restrict__ scale,
                                   const int32_t* __restrict__ zp, const int32_t* __restrict__ g_idx,
                                   T* __restrict__ out, int n_rows, int k_cols, int words_per_row, int groups,
                                   int group_size) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr int OFFSET = 1 << (BITS - 1);
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(n_rows) * words_per_row) return;
  const int n = static_cast<int>(idx / words_per_row);
  const int w = static_cast<int>(idx % words_per_row);
  const uint32_t word = static_cast<uint32_t>(__ldg(wp + idx));
  const T* srow = scale + static_cast<int64_t>(n) * groups;
  T* orow = out + static_cast<int64_t>(n) * k_cols;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int k = w * PER + j;
    if (k >= k_cols) break;
    const int g = qk::group_of(k, g_idx, group_size);
    const int zero = zp != nullptr ? qk::zero_code<BITS>(zp, n, g, groups) : OFFSET;
    const int code = static_cast<int>((word >> (j * BITS)) & MASK);
    orow[k] = qk::from_f32<T>(static_cast<float>(code - zero) * qk::to_f32(srow[g]));
  }
}

template <typename T>
__global__ void dequant_fp8_kernel(const __nv_fp8_e4m3* __restrict__ w, const float* __restrict__ scale,
                                   T* __restrict__ out, int n_rows, int k_cols, int per_channel) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(n_rows) * k_cols) return;
  const float s = per_channel ? scale[idx / k_cols] : scale[0];
  out[idx] = qk::from_f32<T>(static_cast<float>(w[idx]) * s);
}

template <int BITS, typename T>
cudaError_t launch_int(const int32_t* wp, const void* scale, const int32_t* zp, const int32_t* g_idx, void* out,
                       int n, int k, int groups, int group_size, cudaStream_t stream) {
  constexpr int PER = 32 / BITS;
  const int words = (k + PER - 1) / PER;
  const int64_t total = static_cast<int64_t>(n) * words;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>((total + threads - 1) / threads);
  dequant_int_kernel<BITS, T><<<blocks, threads, 0, stream>>>(wp, static_cast<const T*>(scale), zp, g_idx,
                                                              static_cast<T*>(out), n, k, words, groups, group_size);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_int_bits(int bits, const int32_t* wp, const void* scale, const int32_t* zp,
                            const int32_t* g_idx, void* out, int n, int k, int groups, int group_size,
                            cudaStream_t stream) {
  if (bits == 4) return launch_int<4, T>(wp, scale, zp, g_idx, out, n, k, groups, group_size, stream);
  if (bits == 8) return launch_int<8, T>(wp, scale, zp, g_idx, out, n, k, groups, group_size, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

// scale has the output dtype (the binding converts it); returns a cudaError_t as int (0 = success).
extern "C" int qk_dequant_int(const int32_t* wp, const void* scale, const int32_t* zp, const int32_t* g_idx,
                              void* out, int dtype, int bits, int n, int k, int groups, int group_size,
                              void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case qk::kHalf: return launch_int_bits<__half>(bits, wp, scale, zp, g_idx, out, n, k, groups, group_size, s);
    case qk::kBFloat16:
      return launch_int_bits<__nv_bfloat16>(bits, wp, scale, zp, g_idx, out, n, k, groups, group_size, s);
    case qk::kFloat: return launch_int_bits<float>(bits, wp, scale, zp, g_idx, out, n, k, groups, group_size, s);
    default: return cudaErrorInvalidValue;
  }
}

// scale is float32, [n] (per channel) or [1] (per tensor).
extern "C" int qk_dequant_fp8(const void* w, const float* scale, void* out, int dtype, int n, int k,
                              int per_channel, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t total = static_cast<int64_t>(n) * k;
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>((total + threads - 1) / threads);
  const __nv_fp8_e4m3* wf = static_cast<const __nv_fp8_e4m3*>(w);
  switch (dtype) {
    case qk::kHalf:
      dequant_fp8_kernel<__half><<<blocks, threads, 0, s>>>(wf, scale, static_cast<__half*>(out), n, k, per_channel);
      break;
    case qk::kBFloat16:
      dequant_fp8_kernel<__nv_bfloat16><<<blocks, threads, 0, s>>>(wf, scale, static_cast<__nv_bfloat16*>(out), n, k,
                                                                   per_channel);
      break;
    case qk::kFloat:
      dequant_fp8_kernel<float><<<blocks, threads, 0, s>>>(wf, scale, static_cast<float*>(out), n, k, per_channel);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
