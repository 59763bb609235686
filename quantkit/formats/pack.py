"""INT2-INT8 packing in the compressed-tensors `pack-quantized` layout.

Signed values q in [-2^(b-1), 2^(b-1)-1] are stored unsigned (q + 2^(b-1)) and packed densely: element i of a
row occupies bits [i*b, (i+1)*b) of the row's bit stream, least significant first, so a row of n values takes
ceil(n*b/32) int32 words. Widths dividing 32 (2, 4, 8) never straddle a word; 3-bit values do, exactly as
compressed-tensors' pack_to_int32 (0.20) packs them (tests/test_lowbit.py compares the two bit for bit).
Rows are packed along the last dim (weights) or, with dim=0, along the first (zero points).
"""
from __future__ import annotations

import torch

BITS = (2, 3, 4, 8)  # the integer widths quantkit writes; the packing itself works for any width 1-8


def packed_words(n: int, bits: int) -> int:
    """int32 words holding N values of BITS bits."""
    return -(-n * bits // 32)


def _positions(n: int, bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.arange(n, dtype=torch.int64, device=device) * bits
    return start // 32, start % 32


def pack_int32(q: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    if not 1 <= bits <= 8:
        raise ValueError(f"pack_int32 supports 1-8 bits, got {bits}")
    if dim == 0:
        return pack_int32(q.t(), bits, 1).t().contiguous()
    rows, cols = q.shape
    u = (q.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    word, off = _positions(cols, bits, q.device)
    words = torch.zeros(rows, packed_words(cols, bits) + 1, dtype=torch.int64, device=q.device)
    # the bits that fit in a value's first word, then (3 bits: 1 of every 32 values) the rest in the next word;
    # the fields are disjoint, so summing them is OR-ing them
    words.index_add_(1, word, (u << off) & 0xFFFFFFFF)
    words.index_add_(1, word + 1, u >> (32 - off))
    words = words[:, :-1]
    # reinterpret the low 32 bits as signed int32 (two's complement), as safetensors has no uint32 consumers
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, n: int, dim: int = 1) -> torch.Tensor:
    """Inverse of pack_int32: returns signed int8 values; n is the unpacked length along dim."""
    if dim == 0:
        return unpack_int32(packed.t(), bits, n, 1).t().contiguous()
    mask = (1 << bits) - 1
    if 32 % bits == 0:  # no value straddles a word: split each word in place
        per = 32 // bits
        shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
        u = (packed.unsqueeze(-1) >> shifts) & mask
        u = u.reshape(packed.shape[0], -1)[:, :n]
    else:
        w = packed.to(torch.int64) & 0xFFFFFFFF
        w = torch.nn.functional.pad(w, (0, 1))
        word, off = _positions(n, bits, packed.device)
        u = ((w[:, word] >> off) | (w[:, word + 1] << (32 - off))) & mask
    return (u - (1 << (bits - 1))).to(torch.int8)


def unpacked_width(packed: torch.Tensor, bits: int, in_features: int | None = None) -> int:
    """Columns of the unpacked matrix: IN_FEATURES when the caller knows it, else every whole slot of the words."""
    return in_features if in_features is not None else packed.shape[1] * 32 // bits
