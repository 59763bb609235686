"""Shape checks and launch constants shared by the Triton dequant and matmul wrappers (no Triton import here)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UserError


@dataclass(frozen=True)
class IntLayout:
    n: int  # out_features
    k: int  # in_features
    bits: int
    groups: int
    group_span: int  # columns per group as the kernel sees it; a huge value for one group per channel
    per_k_group: bool  # group changes inside a K tile: look it up per column
    block_k: int


def int_layout(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None,
               g_idx: torch.Tensor | None, group_size: int, bits: int, in_features: int,
               block_k: int) -> IntLayout:
    if bits not in (4, 8):
        raise UserError(f"packed weights must be 4 or 8 bits, got {bits}; use bits=4 or bits=8")
    per = 32 // bits
    n = weight_packed.shape[0]
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise UserError("weight_packed must be a 2-D int32 tensor [out, in*bits/32]; pass it as written by pack_int32")
    if weight_packed.shape[1] != -(-in_features // per):
        raise UserError(f"weight_packed has {weight_packed.shape[1]} words per row but in_features={in_features} "
                        f"needs {-(-in_features // per)} at {bits} bits; check bits and the input width")
    groups = weight_scale.shape[-1] if weight_scale.dim() == 2 else 1
    if weight_scale.shape[0] != n:
        raise UserError(f"weight_scale has {weight_scale.shape[0]} rows, expected out_features={n}")
    if weight_zero_point is not None and tuple(weight_zero_point.shape) != (-(-n // per), groups):
        raise UserError(f"weight_zero_point must be packed along dim 0 as [{-(-n // per)}, {groups}], "
                        f"got {tuple(weight_zero_point.shape)}")
    if g_idx is not None:
        if g_idx.numel() != in_features:
            raise UserError(f"g_idx has {g_idx.numel()} entries, expected in_features={in_features}")
        return IntLayout(n, in_features, bits, groups, 1 << 30, True, block_k)
    if group_size == -1 or groups == 1:
        return IntLayout(n, in_features, bits, groups, 1 << 30, False, block_k)
    if group_size <= 0 or -(-in_features // group_size) != groups:
        raise UserError(f"group_size={group_size} with in_features={in_features} gives "
                        f"{-(-in_features // group_size)} groups but weight_scale has {groups}")
    # a K tile must not straddle groups unless the kernel looks the group up per column
    if group_size % block_k == 0:
        return IntLayout(n, in_features, bits, groups, group_size, False, block_k)
    pow2 = group_size & (group_size - 1) == 0
    if pow2 and group_size >= max(per, 16):
        return IntLayout(n, in_features, bits, groups, group_size, False, group_size)
    return IntLayout(n, in_features, bits, groups, group_size, True, block_k)


def require_same_device(*tensors):
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise UserError(f"kernel inputs are on different devices {sorted(map(str, devices))}; move them to one")
