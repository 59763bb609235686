// W4A16 GEMV for 1-4 activation rows on the packed checkpoint layout (no repacking).
//
// Decode is bound by the packed weight's bytes, so the inner loop must spend few instructions per weight:
// - each 16-byte load brings 32 codes; a word's 8 codes become four 16-bit pairs with one shift + one lop3 each
//   (qk_common.cuh's magic numbers), then code - zero (hsub2) and * scale (hmul2): about 2 instructions a weight;
// - the scale and zero point are read once per 16-byte vector when the group holds whole vectors (group_size a
//   multiple of 32, or one group per row), else once per word; act-order (g_idx) looks each code's group up;
// - the block stages its activations in shared memory once per K chunk, already re-paired to the codes' (t, t+4)
//   order, so each output row's dot product is four half2 FMAs per word and row (float FMAs for bfloat16, whose
//   8-bit mantissa is too short to accumulate in);
// - each warp owns kRowsPerWarp output rows and keeps kRowsPerWarp * kUnroll 16-byte loads in flight before any
//   arithmetic; a shuffle reduction finishes each row.
// Preconditions (checked by binding.cpp): K % 32 == 0, group_size % 8 == 0 or <= 0, x and weights 16-byte aligned.
#include "w4_pairs.cuh"

namespace {

using qk::bits_to_pair;
using qk::dequant_word;
using qk::Group;
using qk::group_at;
using qk::make_pair;
using qk::PairOf;

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 2;
constexpr int kUnroll = 4;
constexpr int kChunkCols = 32 * kUnroll * 32;  // lanes x vectors per lane x codes per vector
constexpr int kChunkWords = kChunkCols / 8;

// The dot of four weight pairs with four activation pairs: half2 FMAs for fp16, float FMAs for bf16.
__device__ __forceinline__ float dot4(const __half2 (&w)[4], const uint4& xv) {
  __half2 p = __hmul2(w[0], bits_to_pair<__half2>(xv.x));
  p = __hfma2(w[1], bits_to_pair<__half2>(xv.y), p);
  p = __hfma2(w[2], bits_to_pair<__half2>(xv.z), p);
  p = __hfma2(w[3], bits_to_pair<__half2>(xv.w), p);
  return __low2float(p) + __high2float(p);
}
__device__ __forceinline__ float dot4(const __nv_bfloat162 (&w)[4], const uint4& xv) {
  const uint32_t xs[4] = {xv.x, xv.y, xv.z, xv.w};
  float acc = 0.0f;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const float2 wf = __bfloat1622float2(w[t]);
    const float2 xf = __bfloat1622float2(bits_to_pair<__nv_bfloat162>(xs[t]));
    acc = fmaf(wf.x, xf.x, fmaf(wf.y, xf.y, acc));
  }
  return acc;
}

// Eight consecutive activations re-paired as (x0,x4) (x1,x5) (x2,x6) (x3,x7), the order the codes come out in.
__device__ __forceinline__ uint4 repair(const uint4& r) {
  return make_uint4(__byte_perm(r.x, r.z, qk::kPairLo), __byte_perm(r.x, r.z, qk::kPairHi),
                    __byte_perm(r.y, r.w, qk::kPairLo), __byte_perm(r.y, r.w, qk::kPairHi));
}

// act-order: each code has its own group; the pairs keep the (t, t+4) order.
template <typename T>
__device__ __forceinline__ void dequant_word_gidx(uint32_t word, int k0, int n, const T* __restrict__ srow,
                                                  const int32_t* __restrict__ zp, const int32_t* __restrict__ g_idx,
                                                  int groups, typename PairOf<T>::type (&w)[4]) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int g = __ldg(g_idx + k0 + j);
    const int zero = zp != nullptr ? qk::zero_code<4>(zp, n, g, groups) : 8;
    v[j] = static_cast<float>(static_cast<int>((word >> (4 * j)) & 0xFu) - zero) * qk::to_f32(srow[g]);
  }
#pragma unroll
  for (int t = 0; t < 4; ++t) w[t] = make_pair<T>(v[t], v[t + 4]);
}

template <int M, typename T>
__device__ __forceinline__ void accumulate_vector(const uint4& q, int v, int local_word, int n,
                                                  const T* __restrict__ srow, const int32_t* __restrict__ zp,
                                                  const int32_t* __restrict__ g_idx, int groups, int group_size,
                                                  int vec_shift, bool per_vec, const uint4* __restrict__ xs,
                                                  float (&acc)[M]) {
  using P = typename PairOf<T>::type;
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  Group<T> grp;
  if (per_vec) {  // a shift for power-of-two groups (32, 64, 128, ...): no integer division in the loop
    const int g = group_size <= 0 ? 0 : (vec_shift >= 0 ? v >> vec_shift : (v * 32) / group_size);
    grp = group_at<T>(g, n, srow, zp, groups);
  }
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int k0 = (v * 4 + t) * 8;
    P w[4];
    if (g_idx != nullptr) {
      dequant_word_gidx<T>(words[t], k0, n, srow, zp, g_idx, groups, w);
    } else {
      if (!per_vec) grp = group_at<T>(group_size > 0 ? k0 / group_size : 0, n, srow, zp, groups);
      dequant_word<T>(words[t], grp, w);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] += dot4(w, xs[m * kChunkWords + local_word + t]);
  }
}

// Stage rows [0, M) x columns [c0, c0 + kChunkCols) of x into shared memory, re-paired.
template <int M, typename T>
__device__ __forceinline__ void stage(const T* __restrict__ x, int k_cols, int c0, uint4* __restrict__ xs) {
  for (int i = threadIdx.x; i < M * kChunkWords; i += blockDim.x) {
    const int m = i / kChunkWords, j = i % kChunkWords;
    const int col = c0 + 8 * j;
    if (col < k_cols) xs[i] = repair(__ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * k_cols + col)));
  }
}

template <int M, typename T>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_w4a16_kernel(const T* __restrict__ x, const int32_t* __restrict__ wp, const T* __restrict__ scale,
                      const int32_t* __restrict__ zp, const int32_t* __restrict__ g_idx, const T* __restrict__ bias,
                      T* __restrict__ y, int n_rows, int k_cols, int groups, int group_size, int vec_shift,
                      bool per_vec) {
  __shared__ uint4 xs[M * kChunkWords];
  const int lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * kRowsPerWarp;
  const int vecs = k_cols / 32;
  float acc[kRowsPerWarp][M] = {};
  for (int c0 = 0; c0 < k_cols; c0 += kChunkCols) {
    const int v_base = c0 / 32;
    uint4 buf[kRowsPerWarp][kUnroll];
    // weights first: their loads are in flight while the block stages this chunk's activations
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v_base + u * 32 + lane, n = n0 + r;
        buf[r][u] = n < n_rows && v < vecs
                        ? __ldg(reinterpret_cast<const uint4*>(wp + static_cast<int64_t>(n) * (k_cols / 8)) + v)
                        : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    __syncthreads();  // the previous chunk's readers are done with xs
    stage<M, T>(x, k_cols, c0, xs);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int n = n0 + r;
      if (n >= n_rows) continue;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v_base + u * 32 + lane;
        if (v < vecs)
          accumulate_vector<M, T>(buf[r][u], v, (v - v_base) * 4, n, scale + static_cast<int64_t>(n) * groups, zp,
                                  g_idx, groups, group_size, vec_shift, per_vec, xs, acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int n = n0 + r;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], off);
    }
    if (lane == 0 && n < n_rows) {
      const float b = bias != nullptr ? qk::to_f32(bias[n]) : 0.0f;
#pragma unroll
      for (int m = 0; m < M; ++m) y[static_cast<int64_t>(m) * n_rows + n] = qk::from_f32<T>(acc[r][m] + b);
    }
  }
}

struct Args {
  const void* x;
  const int32_t* wp;
  const void* scale;
  const int32_t* zp;
  const int32_t* g_idx;
  const void* bias;
  void* y;
  int n, k, groups, group_size;
  int vec_shift;  // log2(group_size / 32) when group_size is a power of two >= 32, else -1
};

template <int M, typename T>
cudaError_t launch(const Args& a, cudaStream_t stream) {
  // one scale per 16-byte vector when a vector never straddles two groups (a uniform branch in the kernel)
  const bool per_vec = a.g_idx == nullptr && (a.group_size <= 0 || a.group_size % 32 == 0);
  const int rows_per_block = kWarps * kRowsPerWarp;
  const unsigned blocks = static_cast<unsigned>((a.n + rows_per_block - 1) / rows_per_block);
  gemv_w4a16_kernel<M, T><<<blocks, kWarps * 32, 0, stream>>>(
      static_cast<const T*>(a.x), a.wp, static_cast<const T*>(a.scale), a.zp, a.g_idx, static_cast<const T*>(a.bias),
      static_cast<T*>(a.y), a.n, a.k, a.groups, a.group_size, a.vec_shift, per_vec);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rows(int m, const Args& a, cudaStream_t stream) {
  switch (m) {
    case 1: return launch<1, T>(a, stream);
    case 2: return launch<2, T>(a, stream);
    case 3: return launch<3, T>(a, stream);
    case 4: return launch<4, T>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// x [m, k], y [m, n], scale [n, groups] and bias [n] all in dtype (half or bfloat16); returns cudaError_t as int.
extern "C" int qk_gemv_w4a16(const void* x, const int32_t* wp, const void* scale, const int32_t* zp,
                             const int32_t* g_idx, const void* bias, void* y, int dtype, int m, int n, int k,
                             int groups, int group_size, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (k % 32 != 0 || (g_idx == nullptr && group_size > 0 && group_size % 8 != 0)) return cudaErrorInvalidValue;
  int vec_shift = -1;
  for (int s = 0; group_size >= 32 && (32 << s) <= group_size; ++s)
    if ((32 << s) == group_size) vec_shift = s;
  const Args a{x, wp, scale, zp, g_idx, bias, y, n, k, groups, group_size, vec_shift};
  switch (dtype) {
    case qk::kHalf: return launch_rows<__half>(m, a, s);
    case qk::kBFloat16: return launch_rows<__nv_bfloat16>(m, a, s);
    default: return cudaErrorInvalidValue;
  }
}
