"""The learnable integer quantiser of learned rounding (signround.py): one per Linear.

Each weight gets a rounding offset v in [-0.5, 0.5] added before round(), so it may round the other way than
nearest; each group gets two clip factors in [0.5, 1] that shrink its max and min before the scale is taken.
With v = 0 and both factors 1 it is exactly RTN (rtn.py). round() passes gradients straight through (the STE),
and the scale is rounded to the checkpoint's scale dtype in the forward pass only, so the float weight seen while
learning is bit-for-bit what codes() writes and the loader dequantises.
"""
from __future__ import annotations

import torch

from ..qweight import QWeight
from ..schemes import Scheme
from .rtn import scale_floor, signed_extreme, signed_floor

CLIP_LOW = 0.5  # the smallest clip factor: a group's range is never shrunk below half


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (straight-through)."""
    return x + (torch.round(x) - x).detach()


def _as_dtype_ste(x: torch.Tensor, dtype) -> torch.Tensor:
    return x + (x.to(dtype).float() - x).detach()


class LearnedRounding:
    """v [out, in] and the clip factors hi, lo [out, groups] of one weight, with the quantiser they define."""

    def __init__(self, weight: torch.Tensor, scheme: Scheme, scale_dtype=torch.float16, clip: bool = True):
        w = weight.detach().float()
        out, n_in = w.shape
        gs = n_in if scheme.group_size == -1 else scheme.group_size
        self.scheme, self.scale_dtype, self.shape = scheme, scale_dtype, (out, n_in)
        self.wg = w.reshape(out, n_in // gs, gs)
        self.wmin, self.wmax = self.wg.amin(-1), self.wg.amax(-1)
        self.v = torch.zeros_like(self.wg, requires_grad=True)
        groups = self.wmin.shape
        self.hi = torch.ones(groups, requires_grad=clip)
        self.lo = torch.ones(groups, requires_grad=clip)

    def params(self) -> list[torch.Tensor]:
        return [p for p in (self.v, self.hi, self.lo) if p.requires_grad]

    @torch.no_grad()
    def clamp_(self) -> None:
        self.v.clamp_(-0.5, 0.5)
        self.hi.clamp_(CLIP_LOW, 1.0)
        self.lo.clamp_(CLIP_LOW, 1.0)

    def _qparams(self):
        s = self.scheme
        floor = scale_floor(self.scale_dtype)
        if s.symmetric and s.full_range:  # rtn.qparams' rule, differentiable in the clip factors
            e = signed_extreme(self.wmin * self.lo, self.wmax * self.hi) / s.qmin
            return _as_dtype_ste(signed_floor(e, floor), self.scale_dtype), None
        if s.symmetric:
            absmax = torch.maximum((self.wmin * self.lo).abs(), (self.wmax * self.hi).abs())
            scale = _as_dtype_ste((absmax / s.qmax).clamp_min(floor), self.scale_dtype)
            return scale, None
        lo = (self.wmin * self.lo).clamp_max(0)
        hi = (self.wmax * self.hi).clamp_min(0)
        scale = _as_dtype_ste(((hi - lo) / (s.qmax - s.qmin)).clamp_min(floor), self.scale_dtype)
        zero = torch.clamp(round_ste(s.qmin - lo / scale), s.qmin, s.qmax)
        return scale, zero

    def _codes(self, scale, zero):
        q = round_ste(self.wg / scale.unsqueeze(-1) + self.v)
        if zero is not None:
            q = q + zero.unsqueeze(-1)
        return torch.clamp(q, self.scheme.qmin, self.scheme.qmax)

    def fake(self) -> torch.Tensor:
        """The dequantised weight [out, in], differentiable in v, hi and lo."""
        scale, zero = self._qparams()
        q = self._codes(scale, zero)
        if zero is not None:
            q = q - zero.unsqueeze(-1)
        return (q * scale.unsqueeze(-1)).reshape(self.shape)

    @torch.no_grad()
    def qweight(self) -> QWeight:
        """The codes on the scheme's grid, as the checkpoint writer takes them."""
        scale, zero = self._qparams()
        q = self._codes(scale, zero).reshape(self.shape).to(torch.int8)
        return QWeight(scheme=self.scheme, q=q, scale=scale.detach().clone(),
                       zero=None if zero is None else zero.to(torch.int8))

    def mean_abs_v(self) -> float:
        return float(self.v.detach().abs().mean())
