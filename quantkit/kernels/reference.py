"""The truth every kernel is tested against: unpack, dequantise and matmul in float32, in plain PyTorch."""
from __future__ import annotations

import torch

from ..formats.pack import unpack_int32


def group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None = None,
                device=None) -> torch.Tensor:
    """Group of every input column: g_idx when given (act-order), else column // group_size."""
    if g_idx is not None:
        return g_idx.long()
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.long, device=device)
    return torch.arange(in_features, device=device) // group_size


def unpack_zero_points(weight_zero_point: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """Signed int8 zero points [out, groups] from their dim-0 packed form."""
    return unpack_int32(weight_zero_point, bits, out_features, dim=0)


def dequantize(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None = None,
               g_idx: torch.Tensor | None = None, group_size: int = 128, bits: int = 4,
               in_features: int | None = None) -> torch.Tensor:
    """float32 [out, in] from the checkpoint tensors exactly as written (packed zero points along dim 0)."""
    out_features = weight_packed.shape[0]
    if in_features is None:
        in_features = weight_packed.shape[1] * (32 // bits)
    q = unpack_int32(weight_packed, bits, in_features).float()
    gi = group_index(in_features, group_size, g_idx, q.device)
    scale = weight_scale.float()[:, gi]
    if weight_zero_point is not None:
        zero = unpack_zero_points(weight_zero_point, bits, out_features).float()
        q = q - zero[:, gi]
    return q * scale


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] from an E4M3 weight and a per-channel [out, 1] or per-tensor [1] scale."""
    scale = weight_scale.float()
    if scale.numel() > 1:
        scale = scale.reshape(-1, 1)
    return weight.float() * scale


def matmul(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
           weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
           group_size: int = 128, bits: int = 4, in_features: int | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    w = dequantize(weight_packed, weight_scale, weight_zero_point, g_idx, group_size, bits, in_features)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y
