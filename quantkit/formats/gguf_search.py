"""The scale search every GGUF type shares: for groups of values x with weights w, try a fan of candidate
scales (and minimums), code each value to its nearest grid level, refit the scale (and minimum) by
weighted least squares on those codes, and keep per group whichever candidate leaves the least weighted
squared error. `store` rounds a candidate the way it will be stored (float16 for the legacy types), so
the error compared is the error of what gets written."""
from __future__ import annotations

from typing import Callable

import torch

Store = Callable[[torch.Tensor], torch.Tensor]


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def nearest(x: torch.Tensor, scale: torch.Tensor, lo: int, hi: int, offset: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Integer levels in [lo, hi] nearest to (x - offset) / scale; a zero scale codes everything to 0 (or lo)."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round((x - offset) / safe).clamp(lo, hi)
    return torch.where(scale == 0, torch.zeros_like(q).clamp(lo, hi), q)


def _werr(x, w, y) -> torch.Tensor:
    return (w * (x - y) ** 2).sum(-1)


def symmetric(x: torch.Tensor, w: torch.Tensor, lo: int, hi: int, divisors, store: Store = identity) -> torch.Tensor:
    """Best scale s (groups,) for values s * q, q in [lo, hi]. Candidates: the signed largest value over
    each divisor, and each one's least-squares refit."""
    amax = x.gather(-1, x.abs().argmax(-1, keepdim=True))          # signed, as llama.cpp's make_qx_quants
    best_s = torch.zeros(x.shape[:-1])
    best_e = torch.full(x.shape[:-1], float("inf"))
    for dv in divisors:
        s = store((amax / dv).squeeze(-1))
        for _ in range(2):
            q = nearest(x, s.unsqueeze(-1), lo, hi)
            e = _werr(x, w, s.unsqueeze(-1) * q)
            better = e < best_e
            best_s, best_e = torch.where(better, s, best_s), torch.where(better, e, best_e)
            den = (w * q * q).sum(-1)
            s = store(torch.where(den > 0, (w * x * q).sum(-1) / den.clamp_min(1e-30), s))
    return best_s


def _lsq_affine(x, w, q, nonpos_min: bool):
    """Weighted least squares for x ~ s * q + m; with nonpos_min the fit is held at m <= 0."""
    sw, sq, sx = w.sum(-1), (w * q).sum(-1), (w * x).sum(-1)
    sqq, sqx = (w * q * q).sum(-1), (w * q * x).sum(-1)
    det = sw * sqq - sq * sq
    ok = det > 0
    det = torch.where(ok, det, torch.ones_like(det))
    s = torch.where(ok, (sw * sqx - sq * sx) / det, torch.zeros_like(det))
    m = torch.where(ok, (sqq * sx - sq * sqx) / det, sx / sw.clamp_min(1e-30))
    if nonpos_min:
        pos = m > 0
        s = torch.where(pos, sqx / sqq.clamp_min(1e-30), s)
        m = torch.where(pos, torch.zeros_like(m), m)
    return s, m


def affine(x, w, levels: int, store: Store = identity, nonpos_min: bool = False, steps: int = 11):
    """Best (s, m) per group for values s * q + m, q in [0, levels - 1]: the candidates are the range
    split into levels - 1 + delta steps (delta -1 .. 1), each with its least-squares refit."""
    nmax = levels - 1
    lo, hi = x.min(-1).values, x.max(-1).values
    if nonpos_min:
        lo = lo.clamp_max(0)
    rng = (hi - lo).clamp_min(1e-30)
    best = (torch.zeros_like(lo), lo.clone(), torch.full_like(lo, float("inf")))
    for i in range(steps):
        s, m = store(rng / (nmax + (2 * i / (steps - 1) - 1))), store(lo)
        for _ in range(2):
            s = s.clamp_min(0)
            q = nearest(x, s.unsqueeze(-1), 0, nmax, m.unsqueeze(-1))
            e = _werr(x, w, s.unsqueeze(-1) * q + m.unsqueeze(-1))
            better = e < best[2]
            best = tuple(torch.where(better, a, b) for a, b in zip((s, m, e), best))
            s, m = _lsq_affine(x, w, q, nonpos_min)
            s, m = store(s), store(m)
    return best[0], best[1]
