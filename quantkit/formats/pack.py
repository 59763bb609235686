"""INT4/INT8 packing in the compressed-tensors `pack-quantized` layout.

Signed values q in [-2^(b-1), 2^(b-1)-1] are stored unsigned (q + 2^(b-1)); element i of a row sits at bit
offset i*b of its int32 word, least significant first. Rows are packed along the last dim (weights) or,
with dim=0, along the first (zero points).
"""
from __future__ import annotations

import torch


def pack_int32(q: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    if bits not in (4, 8):
        raise ValueError(f"pack_int32 supports 4 and 8 bits, got {bits}")
    per = 32 // bits
    if dim == 0:
        return pack_int32(q.t(), bits, 1).t().contiguous()
    rows, cols = q.shape
    u = (q.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    pad = (-cols) % per
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.view(rows, -1, per)
    shifts = torch.arange(per, dtype=torch.int64, device=q.device) * bits
    words = (u << shifts).sum(-1)  # < 2^32, fits int64
    # reinterpret the low 32 bits as signed int32 (two's complement), as safetensors has no uint32 consumers
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: returns signed int8 values; n is the unpacked length along dim."""
    if dim == 0:
        return unpack_int32(packed.t(), bits, n, 1).t().contiguous()
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    u = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    u = u.reshape(packed.shape[0], -1)[:, :n]
    return (u - (1 << (bits - 1))).to(torch.int8)


def unpacked_width(packed: torch.Tensor, bits: int, in_features: int | None = None) -> int:
    """Columns of the unpacked matrix: IN_FEATURES when the caller knows it, else every slot of the int32 words."""
    return in_features if in_features is not None else packed.shape[1] * (32 // bits)
