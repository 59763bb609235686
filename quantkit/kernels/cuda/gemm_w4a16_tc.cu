// W4A16 GEMM on tensor cores for 5-64 activation rows, on the packed checkpoint layout (no repacking).
//
// Each block owns kBN output features and all (up to BM) rows. Per K step of kBK columns it stages the activations
// and the weights, dequantised to 16-bit floats with w4_pairs.cuh's lop3 conversion (one scale per 32 codes), in
// shared memory; each warp multiplies one 16-feature slice with WMMA 16x16x16 fragments (fp16/bf16 in, float32
// accumulators), and the block writes y with the bias through a float staging tile.
// Not Marlin: the weights are not re-laid out for the fragments and the K loop is not pipelined.
// Preconditions (checked by binding.cpp): 1 <= m <= 64, K % 32 == 0, group_size % 32 == 0 or <= 0, no g_idx,
// x and weights 16-byte aligned.
#include <mma.h>

#include "w4_pairs.cuh"

namespace {

constexpr int kThreads = 128;  // 4 warps, one 16-feature slice each
constexpr int kBN = 64;
constexpr int kBK = 64;
constexpr int kPad = 8;  // 16-bit elements of padding per shared row: 16 bytes, keeps wmma's 32-byte alignment

template <int BM, typename T>
struct Tiles {
  alignas(32) T x[BM][kBK + kPad];
  alignas(32) T w[kBN][kBK + kPad];  // row n holds columns k: the col-major B operand
  alignas(32) float y[BM][kBN + 4];
};

template <int BM, typename T>
__device__ __forceinline__ void stage_x(const T* __restrict__ x, int m_rows, int k_cols, int k0, Tiles<BM, T>& t) {
  for (int i = threadIdx.x; i < BM * (kBK / 8); i += kThreads) {
    const int m = i / (kBK / 8), c = 8 * (i % (kBK / 8));
    const bool in = m < m_rows && k0 + c < k_cols;
    *reinterpret_cast<uint4*>(&t.x[m][c]) =
        in ? __ldg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * k_cols + k0 + c)) : make_uint4(0, 0, 0, 0);
  }
}

// Thread i dequantises 32 columns of feature n0 + i / 2 (one 16-byte load): two threads per feature.
template <int BM, typename T>
__device__ __forceinline__ void stage_w(const int32_t* __restrict__ wp, const T* __restrict__ scale,
                                        const int32_t* __restrict__ zp, int n_rows, int k_cols, int groups,
                                        int group_size, int vec_shift, int n0, int k0, Tiles<BM, T>& t) {
  using P = typename qk::PairOf<T>::type;
  const int row = threadIdx.x / 2, half = threadIdx.x % 2;
  const int n = n0 + row, v = k0 / 32 + half;
  uint4* dst = reinterpret_cast<uint4*>(&t.w[row][32 * half]);
  if (n >= n_rows || 32 * v >= k_cols) {
#pragma unroll
    for (int j = 0; j < 4; ++j) dst[j] = make_uint4(0, 0, 0, 0);
    return;
  }
  const uint4 q = __ldg(reinterpret_cast<const uint4*>(wp + static_cast<int64_t>(n) * (k_cols / 8)) + v);
  const int g = group_size <= 0 ? 0 : (vec_shift >= 0 ? v >> vec_shift : (v * 32) / group_size);
  const qk::Group<T> grp = qk::group_at<T>(g, n, scale + static_cast<int64_t>(n) * groups, zp, groups);
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    P w[4];
    qk::dequant_word<T>(words[j], grp, w);
    dst[j] = qk::in_column_order(w);
  }
}

template <int BM, typename T>
__global__ void __launch_bounds__(kThreads)
    gemm_w4a16_tc_kernel(const T* __restrict__ x, const int32_t* __restrict__ wp, const T* __restrict__ scale,
                         const int32_t* __restrict__ zp, const T* __restrict__ bias, T* __restrict__ y, int m_rows,
                         int n_rows, int k_cols, int groups, int group_size, int vec_shift) {
  using namespace nvcuda;
  __shared__ Tiles<BM, T> t;
  const int warp = threadIdx.x / 32, n0 = blockIdx.x * kBN;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BM / 16];
#pragma unroll
  for (int i = 0; i < BM / 16; ++i) wmma::fill_fragment(acc[i], 0.0f);
  for (int k0 = 0; k0 < k_cols; k0 += kBK) {
    __syncthreads();  // the previous step's fragments are loaded
    stage_x<BM, T>(x, m_rows, k_cols, k0, t);
    stage_w<BM, T>(wp, scale, zp, n_rows, k_cols, groups, group_size, vec_shift, n0, k0, t);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
      wmma::load_matrix_sync(b, &t.w[16 * warp][kk], kBK + kPad);
#pragma unroll
      for (int i = 0; i < BM / 16; ++i) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::load_matrix_sync(a, &t.x[16 * i][kk], kBK + kPad);
        wmma::mma_sync(acc[i], a, b, acc[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < BM / 16; ++i) wmma::store_matrix_sync(&t.y[16 * i][16 * warp], acc[i], kBN + 4, wmma::mem_row_major);
  __syncthreads();
  for (int i = threadIdx.x; i < BM * kBN; i += kThreads) {
    const int m = i / kBN, n = n0 + i % kBN;
    if (m < m_rows && n < n_rows) {
      const float b = bias != nullptr ? qk::to_f32(bias[n]) : 0.0f;
      y[static_cast<int64_t>(m) * n_rows + n] = qk::from_f32<T>(t.y[m][i % kBN] + b);
    }
  }
}

template <int BM, typename T>
cudaError_t launch(const void* x, const int32_t* wp, const void* scale, const int32_t* zp, const void* bias, void* y,
                   int m, int n, int k, int groups, int group_size, int vec_shift, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((n + kBN - 1) / kBN);
  gemm_w4a16_tc_kernel<BM, T><<<blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(x), wp, static_cast<const T*>(scale), zp, static_cast<const T*>(bias), static_cast<T*>(y),
      m, n, k, groups, group_size, vec_shift);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rows(const void* x, const int32_t* wp, const void* scale, const int32_t* zp, const void* bias,
                        void* y, int m, int n, int k, int groups, int group_size, int vec_shift, cudaStream_t s) {
  if (m <= 16) return launch<16, T>(x, wp, scale, zp, bias, y, m, n, k, groups, group_size, vec_shift, s);
  if (m <= 32) return launch<32, T>(x, wp, scale, zp, bias, y, m, n, k, groups, group_size, vec_shift, s);
  return launch<64, T>(x, wp, scale, zp, bias, y, m, n, k, groups, group_size, vec_shift, s);
}

}  // namespace

// x [m, k], y [m, n], scale [n, groups] and bias [n] in dtype (half or bfloat16); returns cudaError_t as int.
extern "C" int qk_gemm_w4a16_tc(const void* x, const int32_t* wp, const void* scale, const int32_t* zp,
                                const void* bias, void* y, int dtype, int m, int n, int k, int groups, int group_size,
                                void* stream) {
  if (m < 1 || m > 64 || k % 32 != 0 || (group_size > 0 && group_size % 32 != 0)) return cudaErrorInvalidValue;
  int vec_shift = -1;
  for (int s = 0; group_size >= 32 && (32 << s) <= group_size; ++s)
    if ((32 << s) == group_size) vec_shift = s;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case qk::kHalf: return launch_rows<__half>(x, wp, scale, zp, bias, y, m, n, k, groups, group_size, vec_shift, st);
    case qk::kBFloat16:
      return launch_rows<__nv_bfloat16>(x, wp, scale, zp, bias, y, m, n, k, groups, group_size, vec_shift, st);
    default: return cudaErrorInvalidValue;
  }
}
