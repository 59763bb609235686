// W4 weights times int8-quantised activations on x86 CPUs with AVX2 (every AVX-512 CPU runs it too).
//
// Why: torch's packed int4 op is fast only with AVX-512 BF16; capped to AVX2 it costs about a float32 product,
// so a W4 model decodes barely faster than float16. Quantising each row of activations to int8 in blocks of 32
// (one float scale per block, as llama.cpp's Q8_0) turns the inner product into byte multiplies
// (vpmaddubsw: unsigned 4-bit weight x signed 8-bit activation), eight times the work per instruction of a
// float multiply-add. kernels/cpu_w4a8.py documents the layout and the error; the float64 check at load
// (linear/path_candidates.py) holds every use to its tolerance.
//
// Layout, per output row: K/2 bytes, one 16-byte block per 32 inputs; byte j of a block holds input j in its
// low nibble and input 16 + j in its high nibble, as unsigned codes u = q + 8 in [0, 15]. Scales: float32
// [N, G] (G = K / group). Zero points: uint8 [N, G] unsigned (u of a zero weight), or empty for 8 (symmetric).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

constexpr int SUB = 32;     // inputs per 16-byte block of codes
constexpr int ROWS_AT_ONCE = 4;  // weight rows computed together: four independent accumulators hide FMA latency

// One row of activations as int8 codes with one float scale per block of 32 inputs, and per weight group
// sum over its blocks of scale * sum(codes), which the weights' zero points multiply.
struct QuantRow {
  std::vector<int8_t> q;
  std::vector<float> scale, group_sum;
};

void quantise_row(const float* x, int64_t k, int64_t group, QuantRow& out) {
  const int64_t blocks = k / SUB;
  out.q.resize(k);
  out.scale.resize(blocks);
  out.group_sum.assign(k / group, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * SUB;
    float amax = 0.f;
    for (int j = 0; j < SUB; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
    const float s = amax / 127.f;
    const float inv = s > 0.f ? 1.f / s : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < SUB; ++j) {
      const int8_t q = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      out.q[b * SUB + j] = q;
      sum += q;
    }
    out.scale[b] = s;
    out.group_sum[b * SUB / group] += s * static_cast<float>(sum);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// u . q_x over one 32-input block as 8 int32 lane sums
inline __m256i block_dot(const uint8_t* w, const int8_t* xq) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

// y[o] for R weight rows o..o+R-1 against one quantised activation row: per group,
// scale_w * (sum over its blocks of scale_x * (u . q_x) - zero_u * sum over its blocks of scale_x * sum(q_x))
template <int R>
inline void dot_rows(const uint8_t* w, const float* ws, const uint8_t* wz, int64_t row_bytes, int64_t groups,
                     int64_t group, const QuantRow& xr, float* y) {
  __m256 acc[R];
  float zero_part[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    zero_part[r] = 0.f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256 gacc[R];
    for (int r = 0; r < R; ++r) gacc[r] = _mm256_setzero_ps();
    for (int64_t i = g * group; i < (g + 1) * group; i += SUB) {
      const __m256 sx = _mm256_set1_ps(xr.scale[i / SUB]);
      const int8_t* xq = xr.q.data() + i;
      for (int r = 0; r < R; ++r)
        gacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(w + r * row_bytes + i / 2, xq)), sx, gacc[r]);
    }
    for (int r = 0; r < R; ++r) {
      const float sw = ws[r * groups + g];
      acc[r] = _mm256_fmadd_ps(gacc[r], _mm256_set1_ps(sw), acc[r]);
      zero_part[r] += sw * static_cast<float>(wz ? wz[r * groups + g] : 8) * xr.group_sum[g];
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum(acc[r]) - zero_part[r];
}

at::Tensor w4a8_matmul(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& ws, const at::Tensor& wz,
                       int64_t group) {
  TORCH_CHECK(x.dim() == 2 && wq.dim() == 2 && ws.dim() == 2, "w4a8_matmul: 2-d tensors expected");
  TORCH_CHECK(wq.scalar_type() == at::kByte && ws.scalar_type() == at::kFloat, "w4a8_matmul: uint8 codes, float scales");
  const int64_t m = x.size(0), k = x.size(1), n = wq.size(0);
  TORCH_CHECK(k % SUB == 0 && group % SUB == 0 && k % group == 0 && wq.size(1) * 2 == k,
              "w4a8_matmul: K and the group must be multiples of 32");
  TORCH_CHECK(ws.size(0) == n && ws.size(1) == k / group, "w4a8_matmul: scales must be [N, K / group]");
  const bool has_zero = wz.numel() > 0;
  TORCH_CHECK(!has_zero || (wz.scalar_type() == at::kByte && wz.sizes() == ws.sizes()),
              "w4a8_matmul: zero points must be uint8 [N, K / group]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wqc = wq.contiguous(), wsc = ws.contiguous(), wzc = has_zero ? wz.contiguous() : wz;
  const int64_t groups = k / group;
  std::vector<QuantRow> rows(m);
  for (int64_t r = 0; r < m; ++r) quantise_row(xf.data_ptr<float>() + r * k, k, group, rows[r]);
  at::Tensor y = at::empty({m, n}, xf.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* w = wqc.data_ptr<uint8_t>();
  const float* s = wsc.data_ptr<float>();
  const uint8_t* z = has_zero ? wzc.data_ptr<uint8_t>() : nullptr;
  const int64_t row_bytes = k / 2;
  // weight rows split across threads; each is read once for all M activation rows
  at::parallel_for(0, (n + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t o = t * ROWS_AT_ONCE;
      const int64_t left = std::min<int64_t>(ROWS_AT_ONCE, n - o);
      for (int64_t r = 0; r < m; ++r) {
        const uint8_t* zo = z ? z + o * groups : nullptr;
        if (left == ROWS_AT_ONCE)
          dot_rows<ROWS_AT_ONCE>(w + o * row_bytes, s + o * groups, zo, row_bytes, groups, group, rows[r],
                                 yp + r * n + o);
        else
          for (int64_t i = 0; i < left; ++i)
            dot_rows<1>(w + (o + i) * row_bytes, s + (o + i) * groups, zo ? zo + i * groups : nullptr, row_bytes,
                        groups, group, rows[r], yp + r * n + o + i);
      }
    }
  });
  return y;
}

// The float32 weight [N, K] of the same layout, into OUT: what a product of many rows (a prefill, a batch of
// sequences) multiplies with a float GEMM, where the byte products would redo each weight's work per row.
void w4a8_dequant_out(const at::Tensor& wq, const at::Tensor& ws, const at::Tensor& wz, int64_t group,
                      at::Tensor& out) {
  const int64_t n = wq.size(0), k = wq.size(1) * 2, groups = k / group;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == n && out.size(1) == k,
              "w4a8_dequant_out: out must be a contiguous float32 [N, K]");
  TORCH_CHECK(wq.is_contiguous() && ws.is_contiguous() && ws.size(1) == groups, "w4a8_dequant_out: bad layout");
  const bool has_zero = wz.numel() > 0;
  const uint8_t* w = wq.data_ptr<uint8_t>();
  const float* s = ws.data_ptr<float>();
  const uint8_t* z = has_zero ? wz.data_ptr<uint8_t>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < k / SUB; ++b) {
        const int64_t g = b * SUB / group;
        const __m256 scale = _mm256_set1_ps(s[r * groups + g]);
        const __m256 zero = _mm256_set1_ps(static_cast<float>(z ? z[r * groups + g] : 8));
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * (k / 2) + b * 16));
        const __m128i halves[2] = {_mm_and_si128(packed, _mm_set1_epi8(0x0F)),
                                   _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F))};
        float* dst = o + r * k + b * SUB;
        for (int h = 0; h < 2; ++h) {  // inputs 0-15 in the low nibbles, 16-31 in the high ones
          for (int q = 0; q < 2; ++q) {
            const __m128i part = q == 0 ? halves[h] : _mm_srli_si128(halves[h], 8);
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
            _mm256_storeu_ps(dst + h * 16 + q * 8, _mm256_mul_ps(_mm256_sub_ps(v, zero), scale));
          }
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(quantkit_cpu, lib) {
  lib.def("w4a8_matmul(Tensor x, Tensor wq, Tensor ws, Tensor wz, int group) -> Tensor");
  lib.def("w4a8_dequant_out(Tensor wq, Tensor ws, Tensor wz, int group, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(quantkit_cpu, CPU, lib) {
  lib.impl("w4a8_matmul", &w4a8_matmul);
  lib.impl("w4a8_dequant_out", &w4a8_dequant_out);
}
