"""Round-to-nearest per group: the baseline every other solver must beat.

Symmetric: scale = absmax / qmax, zero = 0; or, full range (Scheme.full_range, the default for 2-4 bit
weight-only schemes), scale = e / qmin with e the group's largest-magnitude weight, signed: e lands exactly
on qmin (-8 at 4 bits) and every step is absmax / 8 rather than absmax / 7, using the code qmin that the plain
symmetric grid never reaches (llama.cpp's Q4_0 and AutoRound choose their scales this way). Asymmetric: the
range [min, max] (always containing 0, so 0 is exact) is mapped onto [qmin, qmax] with an integer zero point.
With clip search the range is shrunk by up to `clip_max_shrink` in `clip_grid` steps and, per group, the
shrink with the smallest squared error (weighted by input-channel importance when given) is kept. Scales are
rounded to the storage dtype *before* the codes are computed so that what is written dequantises to exactly
what was measured.
"""
from __future__ import annotations

import torch

from ..qweight import QWeight
from ..schemes import Scheme
from .base import LinearSolver


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, n_in = w.shape
    gs = n_in if group_size == -1 else group_size
    if n_in % gs:
        raise ValueError(f"in_features {n_in} is not divisible by group size {gs}")
    return w.reshape(out, n_in // gs, gs)


def qparams(wmin: torch.Tensor, wmax: torch.Tensor, scheme: Scheme, scale_dtype=torch.float16):
    """Scale and zero (int) for groups with the given range; both shaped like wmin."""
    qmin, qmax = scheme.qmin, scheme.qmax
    if scheme.symmetric and scheme.full_range:
        scale = signed_extreme(wmin, wmax) / qmin
        zero = None
    elif scheme.symmetric:
        absmax = torch.maximum(wmin.abs(), wmax.abs())
        scale = absmax / qmax
        zero = None
    else:
        wmin = torch.clamp(wmin, max=0)
        wmax = torch.clamp(wmax, min=0)
        scale = (wmax - wmin) / (qmax - qmin)
    scale = signed_floor(scale, scale_floor(scale_dtype)).to(scale_dtype).float()
    scale = torch.where(scale == 0, torch.full_like(scale, 1e-7), scale)
    if not scheme.symmetric:
        zero = torch.clamp(torch.round(qmin - wmin / scale), qmin, qmax)
    return scale, zero


def signed_extreme(wmin: torch.Tensor, wmax: torch.Tensor) -> torch.Tensor:
    """Per group, whichever of min and max is larger in magnitude, with its sign (the negative one on a tie,
    since -2^(b-1) is the grid's only end that a weight of that size can land on exactly)."""
    return torch.where(wmax.abs() > wmin.abs(), wmax, wmin)


def scale_floor(scale_dtype: torch.dtype) -> float:
    """The smallest scale magnitude stored: 1e-10, or the dtype's smallest normal number where that is larger."""
    return max(torch.finfo(scale_dtype).tiny, 1e-10) if scale_dtype.is_floating_point else 1e-10


def signed_floor(scale: torch.Tensor, floor: float) -> torch.Tensor:
    """scale with its magnitude at least floor and its sign kept (a full-range scale may be negative)."""
    return torch.where(scale < 0, -1.0, 1.0) * scale.abs().clamp_min(floor)


def quantize_groups(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: Scheme) -> torch.Tensor:
    """Codes for grouped weights wg [..., gs] with per-group scale/zero [...]."""
    q = torch.round(wg / scale.unsqueeze(-1))
    if zero is not None:
        q = q + zero.unsqueeze(-1)
    return torch.clamp(q, scheme.qmin, scheme.qmax)


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    if zero is not None:
        q = q - zero.unsqueeze(-1)
    return q * scale.unsqueeze(-1)


def rtn_quantize(w: torch.Tensor, scheme: Scheme, clip_search: bool = False, clip_grid: int = 20,
                 clip_max_shrink: float = 0.5, importance: torch.Tensor | None = None,
                 scale_dtype=torch.float16) -> QWeight:
    """Quantise w [out, in] on scheme's grid. importance: optional [in] weights for the clip-search error."""
    w = w.float()
    wg = _groups(w, scheme.group_size)
    wmin, wmax = wg.amin(-1), wg.amax(-1)
    scale, zero = qparams(wmin, wmax, scheme, scale_dtype)
    if clip_search:
        imp = None if importance is None else _groups(importance.float().reshape(1, -1), scheme.group_size)
        best_err = torch.full_like(wmin, float("inf"))
        for i in range(clip_grid):
            ratio = 1.0 - clip_max_shrink * i / clip_grid
            s, z = qparams(wmin * ratio, wmax * ratio, scheme, scale_dtype)
            err = (dequantize_groups(quantize_groups(wg, s, z, scheme), s, z) - wg).pow(2)
            err = (err * imp).sum(-1) if imp is not None else err.sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            scale = torch.where(better, s, scale)
            if zero is not None:
                zero = torch.where(better, z, zero)
    q = quantize_groups(wg, scale, zero, scheme)
    deq = dequantize_groups(q, scale, zero).reshape_as(w)
    err = ((deq - w).norm() / w.norm().clamp_min(1e-12)).item()
    return QWeight(scheme=scheme, q=q.reshape_as(w).to(torch.int8), scale=scale,
                   zero=None if zero is None else zero.to(torch.int8), stats={"weight_rel_error": err})


class RTNSolver(LinearSolver):
    needs_data = False

    def solve(self) -> QWeight:
        return rtn_quantize(self.weight, self.scheme, clip_search=self.options.clip_search,
                            scale_dtype=self.options.scale_dtype)
