"""llama.cpp's block quantisation types: one record of codes and scales per type and its float decode
(`gguf_codec.encode` turns a float weight into such a record and the exact bytes llama.cpp reads).

A weight of shape (rows, cols) is cut along each row into blocks of `block` values (32 for the legacy
types, 256 for the k-quants' super-blocks). `Blocks` keeps the chosen codes in the unsigned form llama.cpp
stores and the scales as float16/int tensors, so `dequantize(blocks)` follows llama.cpp's (and the `gguf`
package's) float32 order of operations exactly: value = (d * sc) * (q - offset) - (dmin * mn).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


def sub_steps(b: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block (n, subs, 1): step and low of its grid, value = step * level - low, each formed in
    llama.cpp's float32 order (d * sc, dmin * mn); the legacy types' added minimum is a negated low, which
    IEEE subtraction gives back exactly."""
    n, k = b.q.shape
    subs = k // b.kind.sub
    step = b.d.float().view(n, 1, 1)
    if b.sc is not None:
        step = step * b.sc.float().view(n, subs, 1)
    low = torch.zeros_like(step)
    if b.dmin is not None:
        m = b.dmin.float().view(n, 1, 1)
        if b.mn is not None:
            m = m * b.mn.float().view(n, subs, 1)
        low = -m if b.kind.name in ("Q4_1", "Q5_1") else m
    return step.expand(n, subs, 1), low.expand(n, subs, 1)


def dequantize(b: Blocks) -> torch.Tensor:
    """(n, block) float32 values, bit for bit what llama.cpp's reference dequantisation gives."""
    n, k = b.q.shape
    step, low = sub_steps(b)
    return (step * levels(b.kind, b.q).view(n, -1, b.kind.sub) - low).reshape(n, k)
