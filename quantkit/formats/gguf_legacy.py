"""Encoders for llama.cpp's legacy 32-value block types: Q4_0, Q5_0, Q8_0 (d * q), Q4_1, Q5_1 (d * q + m)
and IQ4_NL (d times one of 16 non-uniform levels). One float16 scale (and minimum) per block, searched by
`gguf_search` with the float16 rounding applied, so the error compared is that of the stored block."""
from __future__ import annotations

import torch

from . import gguf_search as gs
from .gguf_blocks import IQ4_NL_LEVELS, TYPES, Blocks, GGUFType

# divisors of the signed largest value: llama.cpp's own choice (-8 for Q4_0, i.e. the largest lands on
# the extra negative level) and a fan around it, both signs
_SYM_DIVISORS = {
    "Q4_0": [-8, -7.5, -7, -6.5, -6, 7, 6.5, 6],
    "Q5_0": [-16, -15, -14, -13, 15, 14, 13],
    "Q8_0": [127, -128],
}
_IQ4 = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32)
_IQ4_MIDS = (_IQ4[1:] + _IQ4[:-1]) / 2


def _iq4nl_codes(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Index of the level nearest to x / d (|x - d g| = |d| |x / d - g|), by the midpoints of the sorted table."""
    safe = torch.where(d == 0, torch.ones_like(d), d).unsqueeze(-1)
    return torch.bucketize(x / safe, _IQ4_MIDS).clamp(0, 15)


def _iq4nl(x: torch.Tensor, w: torch.Tensor) -> Blocks:
    amax = x.gather(-1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)
    best_d, best_e = torch.zeros_like(amax), torch.full_like(amax, float("inf"))
    for dv in [-127 + 4 * i for i in range(6)] + [113 - 4 * i for i in range(4)]:
        d = gs.fp16(amax / dv)
        for _ in range(2):
            g = _IQ4[_iq4nl_codes(x, d)]
            e = (w * (x - d.unsqueeze(-1) * g) ** 2).sum(-1)
            better = e < best_e
            best_d, best_e = torch.where(better, d, best_d), torch.where(better, e, best_e)
            den = (w * g * g).sum(-1)
            d = gs.fp16(torch.where(den > 0, (w * x * g).sum(-1) / den.clamp_min(1e-30), d))
    return Blocks(TYPES["IQ4_NL"], best_d.half(), _iq4nl_codes(x, best_d))


def encode_legacy(kind: GGUFType, x: torch.Tensor, w: torch.Tensor) -> Blocks:
    if kind.name == "IQ4_NL":
        return _iq4nl(x, w)
    if kind.affine:
        s, m = gs.affine(x, w, kind.levels, store=gs.fp16)
        q = gs.nearest(x, s.unsqueeze(-1), 0, kind.levels - 1, m.unsqueeze(-1))
        return Blocks(kind, s.half(), q.to(torch.int16), dmin=m.half())
    lo, hi = (-128, 127) if kind.name == "Q8_0" else (-kind.offset, kind.offset - 1)
    s = gs.symmetric(x, w, lo, hi, _SYM_DIVISORS[kind.name], store=gs.fp16)
    q = gs.nearest(x, s.unsqueeze(-1), lo, hi) + kind.offset
    return Blocks(kind, s.half(), q.to(torch.int16))

