// Four-bit codes to 16-bit float pairs, shared by the GEMV (gemv_w4a16.cu) and the tensor-core GEMM
// (gemm_w4a16_tc.cu): qk_common.cuh's magic numbers, one lop3 per pair of codes, then code - zero and * scale.
#pragma once
#include <cstring>

#include "qk_common.cuh"

namespace qk {

template <typename T> struct PairOf;
template <> struct PairOf<__half> {
  using type = __half2;
  static constexpr uint32_t magic = kHalfMagic;
  static constexpr float base = kHalfBase;
};
template <> struct PairOf<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static constexpr uint32_t magic = kBf16Magic;
  static constexpr float base = kBf16Base;
};

template <typename P> __device__ __forceinline__ P bits_to_pair(uint32_t u) {
  P p;
  memcpy(&p, &u, sizeof(p));
  return p;
}
template <typename T> __device__ __forceinline__ typename PairOf<T>::type make_pair(float a, float b);
template <> __device__ __forceinline__ __half2 make_pair<__half>(float a, float b) { return __floats2half2_rn(a, b); }
template <> __device__ __forceinline__ __nv_bfloat162 make_pair<__nv_bfloat16>(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}

template <typename T> struct Group {
  typename PairOf<T>::type scale, base_zero;  // (s, s) and (base + zero, base + zero)
};

template <typename T>
__device__ __forceinline__ Group<T> group_at(int g, int n, const T* __restrict__ srow, const int32_t* __restrict__ zp,
                                             int groups) {
  const float zero = zp != nullptr ? static_cast<float>(zero_code<4>(zp, n, g, groups)) : 8.0f;
  const T s = srow[g];
  return {make_pair<T>(to_f32(s), to_f32(s)), make_pair<T>(PairOf<T>::base + zero, PairOf<T>::base + zero)};
}

// w[t] = (code_t - zero, code_{t+4} - zero) * scale, exact up to the one rounding of the product.
template <typename T>
__device__ __forceinline__ void dequant_word(uint32_t word, const Group<T>& grp, typename PairOf<T>::type (&w)[4]) {
  using P = typename PairOf<T>::type;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const P biased = bits_to_pair<P>(and_or(word >> (4 * t), kLowNibbles, PairOf<T>::magic));
    w[t] = __hmul2(__hsub2(biased, grp.base_zero), grp.scale);
  }
}

// A word's pairs (t, t+4) back in column order: (c0,c1) (c2,c3) (c4,c5) (c6,c7) as one 16-byte value.
template <typename P>
__device__ __forceinline__ uint4 in_column_order(const P (&w)[4]) {
  uint32_t u[4];
  memcpy(u, w, sizeof(u));
  return make_uint4(__byte_perm(u[0], u[1], kPairLo), __byte_perm(u[2], u[3], kPairLo),
                    __byte_perm(u[0], u[1], kPairHi), __byte_perm(u[2], u[3], kPairHi));
}

}  // namespace qk
