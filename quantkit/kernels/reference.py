"""The truth every kernel is tested against: unpack, dequantise and matmul in float32, in plain PyTorch.

The dequantisation itself is the solver side's (qweight.dequantize_int for integer codes, dequantize_fp8 for
E4M3 weights), so a checkpoint's tensors and the QWeight they were written from decode through the same maths.
"""
from __future__ import annotations

import torch

from ..formats.pack import unpack_int32, unpacked_width
from ..qweight import dequantize_fp8, dequantize_int, group_index  # noqa: F401  (dequantize_fp8: the kernels' name)


def unpack_zero_points(weight_zero_point: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """Signed int8 zero points [out, groups] from their dim-0 packed form."""
    return unpack_int32(weight_zero_point, bits, out_features, dim=0)


def dequantize(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None = None,
               g_idx: torch.Tensor | None = None, group_size: int = 128, bits: int = 4,
               in_features: int | None = None) -> torch.Tensor:
    """float32 [out, in] from the checkpoint tensors exactly as written (packed zero points along dim 0)."""
    out_features = weight_packed.shape[0]
    in_features = unpacked_width(weight_packed, bits, in_features)
    q = unpack_int32(weight_packed, bits, in_features)
    zero = None if weight_zero_point is None else unpack_zero_points(weight_zero_point, bits, out_features)
    return dequantize_int(q, weight_scale, zero, group_index(in_features, group_size, g_idx, q.device))


def matmul(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
           weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
           group_size: int = 128, bits: int = 4, in_features: int | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    w = dequantize(weight_packed, weight_scale, weight_zero_point, g_idx, group_size, bits, in_features)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y
