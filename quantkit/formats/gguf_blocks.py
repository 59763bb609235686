"""llama.cpp's block quantisation types: one record of codes and scales per type, its float decode, and
`encode` (a float weight to the exact bytes llama.cpp reads) / `decode` (those codes back to floats).

A weight of shape (rows, cols) is cut along each row into blocks of `block` values (32 for the legacy
types, 256 for the k-quants' super-blocks). `Blocks` keeps the chosen codes in the unsigned form llama.cpp
stores and the scales as float16/int tensors, so `dequantize(blocks)` follows llama.cpp's (and the `gguf`
package's) float32 order of operations exactly: value = (d * sc) * (q - offset) - (dmin * mn).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass(frozen=True)
class GGUFType:
    name: str
    block: int     # values per block (a k-quant super-block holds `block // sub` sub-blocks)
    sub: int       # values per sub-block that has its own scale (== block for the legacy types)
    offset: int    # stored unsigned code minus this is the signed level
    levels: int    # codes run 0 .. levels - 1
    nbytes: int    # bytes per block
    affine: bool   # a minimum beside the scale


TYPES = {t.name: t for t in (
    GGUFType("Q4_0", 32, 32, 8, 16, 18, False),
    GGUFType("Q4_1", 32, 32, 0, 16, 20, True),
    GGUFType("Q5_0", 32, 32, 16, 32, 22, False),
    GGUFType("Q5_1", 32, 32, 0, 32, 24, True),
    GGUFType("Q8_0", 32, 32, 0, 256, 34, False),  # int8 codes kept signed: offset 0, levels cover -128..127
    GGUFType("IQ4_NL", 32, 32, 0, 16, 18, False),
    GGUFType("Q3_K", 256, 16, 4, 8, 110, False),
    GGUFType("Q4_K", 256, 32, 0, 16, 144, True),
    GGUFType("Q5_K", 256, 32, 0, 32, 176, True),
    GGUFType("Q6_K", 256, 16, 32, 64, 210, False),
)}
# IQ4_NL's 16 non-uniform levels (llama.cpp's kvalues_iq4nl): a code indexes this table, times d
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass
class Blocks:
    """Codes and scales of `n` blocks of one type. d, dmin: float16 (n,); sc, mn: int (n, block // sub),
    the sub-block scale and minimum multipliers (all ones / absent for the legacy types); q: int (n, block)."""
    kind: GGUFType
    d: torch.Tensor
    q: torch.Tensor
    sc: Optional[torch.Tensor] = None
    dmin: Optional[torch.Tensor] = None
    mn: Optional[torch.Tensor] = None


def levels(kind: GGUFType, q: torch.Tensor) -> torch.Tensor:
    """The signed grid level each stored code stands for, as float32."""
    if kind.name == "IQ4_NL":
        return torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32)[q.long()]
    return (q.long() - kind.offset).float()


def dequantize(b: Blocks) -> torch.Tensor:
    """(n, block) float32 values, bit for bit what llama.cpp's reference dequantisation gives."""
    n, k = b.q.shape
    subs = k // b.kind.sub
    d = b.d.float().view(n, 1, 1)
    if b.sc is not None:
        d = d * b.sc.float().view(n, subs, 1)
    out = d * levels(b.kind, b.q).view(n, subs, b.kind.sub)
    if b.dmin is not None:
        m = b.dmin.float().view(n, 1, 1)
        if b.mn is not None:
            m = m * b.mn.float().view(n, subs, 1)
        out = out + m if b.kind.name in ("Q4_1", "Q5_1") else out - m
    return out.reshape(n, k)


def check_shape(kind: GGUFType, shape) -> None:
    from ..errors import UserError

    if len(shape) != 2 or shape[1] % kind.block:
        raise UserError(f"{kind.name} needs a 2-D weight whose row length is a multiple of {kind.block}, got "
                        f"shape {tuple(shape)}; pick a type with smaller blocks (q8_0, q4_0) for this tensor")


def encode(weight: torch.Tensor, type_name: str, importance: Optional[torch.Tensor] = None) -> tuple[Blocks, np.ndarray]:
    """Round `weight` (rows, cols) to `type_name`'s grid, minimising the squared error weighted by
    `importance` (per column, or per element; default: plain squared error). Returns the codes and the
    (rows, cols // block * nbytes) uint8 array llama.cpp reads."""
    from .gguf_kquants import encode_kquant
    from .gguf_legacy import encode_legacy
    from .gguf_pack import pack

    kind = TYPES[type_name]
    check_shape(kind, weight.shape)
    rows, cols = weight.shape
    x = weight.detach().float().reshape(-1, kind.block)
    w = torch.ones_like(x) if importance is None else importance.float().expand(rows, cols).reshape(-1, kind.block)
    solve = encode_kquant if kind.block == 256 else encode_legacy
    blocks = concat([solve(kind, x[i:i + _CHUNK], w[i:i + _CHUNK]) for i in range(0, x.shape[0], _CHUNK)])
    return blocks, pack(blocks).reshape(rows, cols // kind.block * kind.nbytes)


_CHUNK = 1 << 13  # blocks searched at once: bounds the per-candidate temporaries to a few MB


def concat(parts: list[Blocks]) -> Blocks:
    def cat(name):
        return None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
    return Blocks(parts[0].kind, cat("d"), cat("q"), cat("sc"), cat("dmin"), cat("mn"))


def decode(blocks: Blocks, shape) -> torch.Tensor:
    return dequantize(blocks).reshape(shape)
