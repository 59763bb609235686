// Thin PyTorch binding over the extern "C" launchers in dequant.cu and gemv_w4a16.cu. It includes no CUDA
// headers (the stream arrives as an integer from torch.cuda.current_stream().cuda_stream), so it compiles
// against any torch build; shapes and dtypes are checked in Python (quantkit/kernels/cuda/ops.py) and here.
#include <torch/extension.h>

#include <cstdint>
#include <optional>

extern "C" int qk_dequant_int(const int32_t* wp, const void* scale, const int32_t* zp, const int32_t* g_idx,
                              void* out, int dtype, int bits, int n, int k, int groups, int group_size,
                              void* stream);
extern "C" int qk_dequant_fp8(const void* w, const float* scale, void* out, int dtype, int n, int k,
                              int per_channel, void* stream);
extern "C" int qk_gemv_w4a16(const void* x, const int32_t* wp, const void* scale, const int32_t* zp,
                             const int32_t* g_idx, const void* bias, void* y, int dtype, int m, int n, int k,
                             int groups, int group_size, void* stream);

namespace {

int dtype_code(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return 0;
  if (t.scalar_type() == at::kBFloat16) return 1;
  if (t.scalar_type() == at::kFloat) return 2;
  TORCH_CHECK(false, "quantkit cuda: unsupported dtype ", t.scalar_type());
  return -1;
}

const int32_t* opt_i32(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->is_cuda(), "expected contiguous CUDA int32");
  return t->data_ptr<int32_t>();
}

void check(int err, const char* what) { TORCH_CHECK(err == 0, "quantkit cuda: ", what, " failed, cudaError ", err); }

void dequant_int(const at::Tensor& wp, const at::Tensor& scale, const std::optional<at::Tensor>& zp,
                 const std::optional<at::Tensor>& g_idx, at::Tensor& out, int64_t bits, int64_t group_size,
                 int64_t stream) {
  TORCH_CHECK(wp.is_cuda() && wp.scalar_type() == at::kInt && wp.is_contiguous(), "weight_packed: CUDA int32");
  TORCH_CHECK(out.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == out.scalar_type(),
              "scale must be contiguous in the output dtype");
  const int groups = scale.dim() == 2 ? static_cast<int>(scale.size(1)) : 1;
  check(qk_dequant_int(wp.data_ptr<int32_t>(), scale.data_ptr(), opt_i32(zp), opt_i32(g_idx), out.data_ptr(),
                       dtype_code(out), static_cast<int>(bits), static_cast<int>(out.size(0)),
                       static_cast<int>(out.size(1)), groups, static_cast<int>(group_size),
                       reinterpret_cast<void*>(stream)),
        "dequant_int");
}

void dequant_fp8(const at::Tensor& w, const at::Tensor& scale, at::Tensor& out, int64_t stream) {
  TORCH_CHECK(w.is_cuda() && w.is_contiguous() && w.element_size() == 1, "fp8 weight: contiguous CUDA, 1 byte");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "fp8 scale must be contiguous float32");
  check(qk_dequant_fp8(w.data_ptr(), scale.data_ptr<float>(), out.data_ptr(), dtype_code(out),
                       static_cast<int>(w.size(0)), static_cast<int>(w.size(1)), scale.numel() > 1 ? 1 : 0,
                       reinterpret_cast<void*>(stream)),
        "dequant_fp8");
}

void gemv_w4a16(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& scale,
                const std::optional<at::Tensor>& zp, const std::optional<at::Tensor>& g_idx,
                const std::optional<at::Tensor>& bias, at::Tensor& y, int64_t group_size, int64_t stream) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 4,
              "x: contiguous CUDA [1-4, K]");
  TORCH_CHECK(scale.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type(),
              "scale and y must have x's dtype");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous()),
              "bias must be contiguous in x's dtype");
  const int groups = scale.dim() == 2 ? static_cast<int>(scale.size(1)) : 1;
  check(qk_gemv_w4a16(x.data_ptr(), wp.data_ptr<int32_t>(), scale.data_ptr(), opt_i32(zp), opt_i32(g_idx),
                      bias.has_value() ? bias->data_ptr() : nullptr, y.data_ptr(), dtype_code(x),
                      static_cast<int>(x.size(0)), static_cast<int>(wp.size(0)), static_cast<int>(x.size(1)),
                      groups, static_cast<int>(group_size), reinterpret_cast<void*>(stream)),
        "gemv_w4a16");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequant_int", &dequant_int);
  m.def("dequant_fp8", &dequant_fp8);
  m.def("gemv_w4a16", &gemv_w4a16);
}
