"""Encoders for llama.cpp's k-quants: super-blocks of 256 values, each cut into sub-blocks (16 values for
Q3_K/Q6_K, 32 for Q4_K/Q5_K) whose own scale (and, for Q4_K/Q5_K, minimum) is itself quantised against
one float16 super-block scale: 6 bits unsigned for Q4_K/Q5_K, 6 bits signed for Q3_K, 8 bits signed for
Q6_K. The sub-block scales are searched in float first, then quantised, then every value is coded to its
nearest level on the grid those quantised scales make, so the codes fit the stored scales exactly."""
from __future__ import annotations

import torch

from . import gguf_search as gs
from .gguf_blocks import Blocks, GGUFType


def _super_unsigned(v: torch.Tensor, top: int):
    """Non-negative sub-block values (n, subs) -> float16 super scale (n,) and integer multipliers 0..top."""
    d = gs.fp16(v.max(-1).values / top)
    return d, gs.nearest(v, d.unsqueeze(-1), 0, top)


def _super_signed(v: torch.Tensor, lo: int, hi: int):
    """Signed sub-block scales -> float16 super scale and integers in [lo, hi]; the largest in magnitude
    lands on lo, the level with no positive twin (llama.cpp does the same)."""
    amax = v.gather(-1, v.abs().argmax(-1, keepdim=True)).squeeze(-1)
    d = gs.fp16(amax / lo)
    return d, gs.nearest(v, d.unsqueeze(-1), lo, hi)


def grid_affine(kind: GGUFType, x: torch.Tensor, w: torch.Tensor):
    """Q4_K/Q5_K: (d, L, dmin, M) for x (n, 256) from a float search per sub-block of 32."""
    n, subs = x.shape[0], kind.block // kind.sub
    s, m = gs.affine(x.view(n, subs, kind.sub), w.view(n, subs, kind.sub), kind.levels, nonpos_min=True)
    d, L = _super_unsigned(s, 63)
    dmin, M = _super_unsigned(-m, 63)
    return d, L, dmin, M


def grid_symmetric(kind: GGUFType, x: torch.Tensor, w: torch.Tensor):
    """Q3_K/Q6_K: (d, L) for x (n, 256) from a float search per sub-block of 16."""
    n, subs = x.shape[0], kind.block // kind.sub
    lo, hi = -kind.offset, kind.offset - 1
    divisors = [lo * (1 - 0.0625 * i) for i in range(5)] + [hi * (1 - 0.08 * i) for i in range(3)]
    s = gs.symmetric(x.view(n, subs, kind.sub), w.view(n, subs, kind.sub), lo, hi, divisors)
    return _super_signed(s, -128, 127) if kind.name == "Q6_K" else _super_signed(s, -32, 31)


def sub_grid(kind: GGUFType, d, L, dmin=None, M=None):
    """The per-sub-block step and offset (n, subs, 1) that the stored scales give, in llama.cpp's float order."""
    step = (d.float().unsqueeze(-1) * L.float()).unsqueeze(-1)
    if dmin is None:
        return step, torch.zeros_like(step)
    return step, (dmin.float().unsqueeze(-1) * M.float()).unsqueeze(-1)


def code(kind: GGUFType, x: torch.Tensor, step, low) -> torch.Tensor:
    """Nearest stored code (n, 256) on the grid step * (q - offset) - low."""
    n, subs = x.shape[0], kind.block // kind.sub
    lo, hi = -kind.offset, kind.levels - 1 - kind.offset
    q = gs.nearest(x.view(n, subs, kind.sub), step, lo, hi, -low) + kind.offset
    return q.view(n, kind.block).to(torch.int16)


def encode_kquant(kind: GGUFType, x: torch.Tensor, w: torch.Tensor) -> Blocks:
    if kind.affine:
        d, L, dmin, M = grid_affine(kind, x, w)
        q = code(kind, x, *sub_grid(kind, d, L, dmin, M))
        return Blocks(kind, d.half(), q, L.to(torch.int16), dmin.half(), M.to(torch.int16))
    d, L = grid_symmetric(kind, x, w)
    q = code(kind, x, *sub_grid(kind, d, L))
    return Blocks(kind, d.half(), q, L.to(torch.int16))
