"""A float weight to llama.cpp's block bytes and back: `encode` rounds onto a type's grid (the encoders'
weighted scale search) and packs; `decode` gives the floats llama.cpp's dequantisation gives for them."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..errors import UserError
from .gguf_blocks import TYPES, Blocks, GGUFType, dequantize
from .gguf_kquants import encode_kquant
from .gguf_legacy import encode_legacy
from .gguf_pack import pack


def check_shape(kind: GGUFType, shape) -> None:
    if len(shape) != 2 or shape[1] % kind.block:
        raise UserError(f"{kind.name} needs a 2-D weight whose row length is a multiple of {kind.block}, got "
                        f"shape {tuple(shape)}; pick a type with smaller blocks (q8_0, q4_0) for this tensor")


def encode(weight: torch.Tensor, type_name: str, importance: Optional[torch.Tensor] = None) -> tuple[Blocks, np.ndarray]:
    """Round `weight` (rows, cols) to `type_name`'s grid, minimising the squared error weighted by
    `importance` (per column, or per element; default: plain squared error). Returns the codes and the
    (rows, cols // block * nbytes) uint8 array llama.cpp reads."""
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
