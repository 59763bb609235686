"""Python side of the CUDA kernels: thin calls into the `quantkit::` ops (kernels/cuda_library.py declares and
checks them; binding.cpp implements them). Nothing is converted or copied per call: the arguments must already
have the kernels' dtypes and be contiguous (kernels/dispatch.py prepares them once per layer), and the op
allocates only its output."""
from __future__ import annotations

import torch

from ...formats.pack import unpacked_width
from ..cuda_library import (GEMV_MAX_ROWS, TC_MAX_ROWS, check_dequant_int, check_gemv, gemv_supported,
                            load_extension, tc_supported)

__all__ = ["load", "gemv_w4a16", "gemm_w4a16_tc", "dequantize_int", "dequantize_fp8", "gemv_supported",
           "tc_supported", "GEMV_MAX_ROWS", "TC_MAX_ROWS"]


def load() -> None:
    load_extension()


def gemv_w4a16(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
               group_size: int = 128, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] fp16/bf16 with at most 4 rows; weight_scale and bias in x's dtype; zero points, g_idx int32."""
    x2 = x.reshape(-1, x.shape[-1])
    check_gemv(x2, weight_packed, weight_scale, weight_zero_point, g_idx, bias, group_size)
    y = torch.ops.quantkit.gemv_w4a16(x2, weight_packed, weight_scale, weight_zero_point, g_idx, bias, group_size)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def gemm_w4a16_tc(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                  weight_zero_point: torch.Tensor | None = None, group_size: int = 128,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor-core path: x [..., in] fp16/bf16 with at most 64 rows; no g_idx; group_size % 32 == 0."""
    x2 = x.reshape(-1, x.shape[-1])
    check_gemv(x2, weight_packed, weight_scale, weight_zero_point, None, bias, group_size, tensor_cores=True)
    y = torch.ops.quantkit.gemm_w4a16_tc(x2, weight_packed, weight_scale, weight_zero_point, bias, group_size)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def dequantize_int(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                   weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                   group_size: int = 128, bits: int = 4, in_features: int | None = None,
                   out_dtype: torch.dtype = torch.float16, out: torch.Tensor | None = None) -> torch.Tensor:
    """[out, in] weight; into `out` (a reused buffer) when given. weight_scale must have the output dtype."""
    in_features = unpacked_width(weight_packed, bits, in_features)
    if out is None:
        out = torch.empty(weight_packed.shape[0], in_features, dtype=out_dtype, device=weight_packed.device)
    check_dequant_int(weight_packed, weight_scale, weight_zero_point, g_idx, bits, group_size, out)
    torch.ops.quantkit.dequant_int_out(weight_packed, weight_scale, weight_zero_point, g_idx, bits, group_size, out)
    return out


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[out, in] from float8_e4m3fn bits and a float32 [out] or [1] scale."""
    return torch.ops.quantkit.dequant_fp8(weight, weight_scale.reshape(-1), out_dtype)
