// The quantkit:: CUDA ops, registered with TORCH_LIBRARY so that torch.compile keeps them in its graphs (their
// fake implementations are registered from Python: quantkit/kernels/cuda_library.py, which holds the same
// schemas). This file includes no CUDA kernels: it calls the extern "C" launchers in dequant.cu,
// gemv_w4a16.cu and gemm_w4a16_tc.cu on torch's current stream. Every precondition the kernels rely on is checked here, so a direct
// torch.ops.quantkit call with bad arguments fails with a message instead of reading out of bounds.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

extern "C" int qk_dequant_int(const int32_t* wp, const void* scale, const int32_t* zp, const int32_t* g_idx,
                              void* out, int dtype, int bits, int n, int k, int groups, int group_size,
                              void* stream);
extern "C" int qk_dequant_fp8(const void* w, const float* scale, void* out, int dtype, int n, int k,
                              int per_channel, void* stream);
extern "C" int qk_gemm_w4a16_tc(const void* x, const int32_t* wp, const void* scale, const int32_t* zp,
                                const void* bias, void* y, int dtype, int m, int n, int k, int groups, int group_size,
                                void* stream);
extern "C" int qk_gemv_w4a16(const void* x, const int32_t* wp, const void* scale, const int32_t* zp,
                             const int32_t* g_idx, const void* bias, void* y, int dtype, int m, int n, int k,
                             int groups, int group_size, void* stream);

namespace {

int dtype_code(at::ScalarType t) {
  if (t == at::kHalf) return 0;
  if (t == at::kBFloat16) return 1;
  if (t == at::kFloat) return 2;
  TORCH_CHECK(false, "quantkit: unsupported dtype ", t, "; use float16, bfloat16 or float32");
  return -1;
}

void check_on(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), "quantkit: ", name, " is on ", t.device(), ", expected ", ref.device());
  TORCH_CHECK(t.is_contiguous(), "quantkit: ", name, " must be contiguous");
}

const int32_t* opt_i32(const std::optional<at::Tensor>& t, const at::Tensor& ref, const char* name) {
  if (!t.has_value()) return nullptr;
  check_on(*t, ref, name);
  TORCH_CHECK(t->scalar_type() == at::kInt, "quantkit: ", name, " must be int32, got ", t->scalar_type());
  return t->data_ptr<int32_t>();
}

int scale_groups(const at::Tensor& scale, int64_t n) {
  TORCH_CHECK(scale.dim() <= 2 && (scale.dim() == 2 ? scale.size(0) == n : scale.numel() == n),
              "quantkit: weight_scale must be [", n, ", groups]");
  return scale.dim() == 2 ? static_cast<int>(scale.size(1)) : 1;
}

void check_groups(int groups, const std::optional<at::Tensor>& zp, const std::optional<at::Tensor>& g_idx,
                  int64_t n, int64_t k, int64_t group_size, int64_t bits) {
  const int64_t per = 32 / bits;
  if (g_idx.has_value()) {
    TORCH_CHECK(g_idx->numel() == k, "quantkit: g_idx must have ", k, " entries");
  } else if (group_size > 0) {
    TORCH_CHECK(groups == (k + group_size - 1) / group_size, "quantkit: ", groups, " scale groups do not fit ",
                "group_size ", group_size, " over ", k, " columns");
  }
  TORCH_CHECK(!zp.has_value() || (zp->dim() == 2 && zp->size(0) == (n + per - 1) / per && zp->size(1) == groups),
              "quantkit: weight_zero_point must be [", (n + per - 1) / per, ", ", groups, "]");
}

void launched(int err, const char* what) {
  TORCH_CHECK(err == 0, "quantkit: ", what, " launch failed (cudaError ", err, ")");
}

void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

void dequant_int_out(const at::Tensor& wp, const at::Tensor& scale, const std::optional<at::Tensor>& zp,
                     const std::optional<at::Tensor>& g_idx, int64_t bits, int64_t group_size, at::Tensor& out) {
  TORCH_CHECK(wp.is_cuda() && wp.scalar_type() == at::kInt && wp.dim() == 2, "quantkit: weight_packed: CUDA int32 2-D");
  TORCH_CHECK(bits == 4 || bits == 8, "quantkit: bits must be 4 or 8");
  check_on(scale, wp, "weight_scale");
  check_on(out, wp, "out");
  const int64_t n = out.size(0), k = out.size(1), per = 32 / bits;
  TORCH_CHECK(wp.size(0) == n && wp.size(1) == (k + per - 1) / per, "quantkit: weight_packed does not fit out");
  TORCH_CHECK(scale.scalar_type() == out.scalar_type(), "quantkit: weight_scale must have out's dtype");
  const int groups = scale_groups(scale, n);
  check_groups(groups, zp, g_idx, n, k, group_size, bits);
  const c10::cuda::CUDAGuard guard(wp.device());
  launched(qk_dequant_int(wp.data_ptr<int32_t>(), scale.data_ptr(), opt_i32(zp, wp, "weight_zero_point"),
                          opt_i32(g_idx, wp, "g_idx"), out.data_ptr(), dtype_code(out.scalar_type()),
                          static_cast<int>(bits), static_cast<int>(n), static_cast<int>(k), groups,
                          static_cast<int>(group_size), stream_of(wp)),
           "dequant_int");
}

at::Tensor dequant_int(const at::Tensor& wp, const at::Tensor& scale, const std::optional<at::Tensor>& zp,
                       const std::optional<at::Tensor>& g_idx, int64_t bits, int64_t group_size,
                       int64_t in_features, at::ScalarType dtype) {
  at::Tensor out = at::empty({wp.size(0), in_features}, wp.options().dtype(dtype));
  dequant_int_out(wp, scale, zp, g_idx, bits, group_size, out);
  return out;
}

at::Tensor dequant_fp8(const at::Tensor& w, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(w.is_cuda() && w.is_contiguous() && w.dim() == 2 && w.element_size() == 1,
              "quantkit: fp8 weight must be a contiguous CUDA [out, in] float8_e4m3fn tensor");
  check_on(scale, w, "weight_scale");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && (scale.numel() == 1 || scale.numel() == w.size(0)),
              "quantkit: fp8 weight_scale must be float32 [1] or [out]");
  at::Tensor out = at::empty(w.sizes(), w.options().dtype(dtype));
  const c10::cuda::CUDAGuard guard(w.device());
  launched(qk_dequant_fp8(w.data_ptr(), scale.data_ptr<float>(), out.data_ptr(), dtype_code(dtype),
                          static_cast<int>(w.size(0)), static_cast<int>(w.size(1)), scale.numel() > 1 ? 1 : 0,
                          stream_of(w)),
           "dequant_fp8");
  return out;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0; }

// The checks both W4A16 products share; returns the scale's group count. max_rows and group_multiple are the
// kernel's limits (the GEMV: 4 rows, groups of 8 codes; the tensor-core GEMM: 64 rows, groups of 32).
int check_w4_product(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale,
                     const std::optional<at::Tensor>& zp, const std::optional<at::Tensor>& g_idx,
                     const std::optional<at::Tensor>& bias, int64_t group_size, int64_t max_rows,
                     int64_t group_multiple) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= max_rows,
              "quantkit: x must be a contiguous CUDA [1-", max_rows, ", in_features] tensor");
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, "quantkit: x: fp16 or bf16");
  check_on(wp, x, "weight_packed");
  check_on(scale, x, "weight_scale");
  const int64_t k = x.size(1), n = wp.size(0);
  TORCH_CHECK(k % 32 == 0 && wp.scalar_type() == at::kInt && wp.dim() == 2 && wp.size(1) * 8 == k,
              "quantkit: needs in_features % 32 == 0 and weight_packed [out, in_features / 8] int32");
  TORCH_CHECK(group_size <= 0 || group_size % group_multiple == 0 || g_idx.has_value(),
              "quantkit: group_size must be a multiple of ", group_multiple);
  TORCH_CHECK(aligned16(x) && aligned16(wp), "quantkit: x and weight_packed must be 16-byte aligned");
  TORCH_CHECK(scale.scalar_type() == x.scalar_type(), "quantkit: weight_scale must have x's dtype");
  const int groups = scale_groups(scale, n);
  check_groups(groups, zp, g_idx, n, k, group_size, 4);
  if (bias.has_value()) {
    check_on(*bias, x, "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == n, "quantkit: bias must be [out] in x's dtype");
  }
  return groups;
}

const void* opt_ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

at::Tensor gemv_w4a16(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale,
                      const std::optional<at::Tensor>& zp, const std::optional<at::Tensor>& g_idx,
                      const std::optional<at::Tensor>& bias, int64_t group_size) {
  const int groups = check_w4_product(x, wp, scale, zp, g_idx, bias, group_size, 4, 8);
  at::Tensor y = at::empty({x.size(0), wp.size(0)}, x.options());
  const c10::cuda::CUDAGuard guard(x.device());
  launched(qk_gemv_w4a16(x.data_ptr(), wp.data_ptr<int32_t>(), scale.data_ptr(), opt_i32(zp, x, "weight_zero_point"),
                         opt_i32(g_idx, x, "g_idx"), opt_ptr(bias), y.data_ptr(), dtype_code(x.scalar_type()),
                         static_cast<int>(x.size(0)), static_cast<int>(wp.size(0)), static_cast<int>(x.size(1)),
                         groups, static_cast<int>(g_idx.has_value() ? -1 : group_size), stream_of(x)),
           "gemv_w4a16");
  return y;
}

at::Tensor gemm_w4a16_tc(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale,
                         const std::optional<at::Tensor>& zp, const std::optional<at::Tensor>& bias,
                         int64_t group_size) {
  const int groups = check_w4_product(x, wp, scale, zp, std::nullopt, bias, group_size, 64, 32);
  at::Tensor y = at::empty({x.size(0), wp.size(0)}, x.options());
  const c10::cuda::CUDAGuard guard(x.device());
  launched(qk_gemm_w4a16_tc(x.data_ptr(), wp.data_ptr<int32_t>(), scale.data_ptr(),
                            opt_i32(zp, x, "weight_zero_point"), opt_ptr(bias), y.data_ptr(),
                            dtype_code(x.scalar_type()), static_cast<int>(x.size(0)), static_cast<int>(wp.size(0)),
                            static_cast<int>(x.size(1)), groups, static_cast<int>(group_size), stream_of(x)),
           "gemm_w4a16_tc");
  return y;
}

}  // namespace

TORCH_LIBRARY(quantkit, m) {
  m.def("gemv_w4a16(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? weight_zero_point, "
        "Tensor? g_idx, Tensor? bias, int group_size) -> Tensor");
  m.def("dequant_int(Tensor weight_packed, Tensor weight_scale, Tensor? weight_zero_point, "
        "Tensor? g_idx, int bits, int group_size, int in_features, ScalarType dtype) -> Tensor");
  m.def("dequant_int_out(Tensor weight_packed, Tensor weight_scale, Tensor? weight_zero_point, "
        "Tensor? g_idx, int bits, int group_size, Tensor(a!) out) -> ()");
  m.def("dequant_fp8(Tensor weight, Tensor weight_scale, ScalarType dtype) -> Tensor");
  m.def("gemm_w4a16_tc(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? weight_zero_point, "
        "Tensor? bias, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(quantkit, CUDA, m) {
  m.impl("gemv_w4a16", &gemv_w4a16);
  m.impl("dequant_int", &dequant_int);
  m.impl("dequant_int_out", &dequant_int_out);
  m.impl("dequant_fp8", &dequant_fp8);
  m.impl("gemm_w4a16_tc", &gemm_w4a16_tc);
}
