"""The FP8 E4M3 number format (float8_e4m3fn): scales, saturating casts, per-token activation quantisation.

Shared by the FP8 solver (weights, static input scales), the FP8 Linear (run-time activations) and the FP8 KV
cache, so every place rounds and saturates the same way. No imports from the rest of quantkit.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value; the format has no infinity, so anything larger must be clamped
# The floor for every scale: the smallest positive normal float32. A zero tensor (dead channel, padding token)
# then quantises to exact zeros instead of 0/0 = NaN.
MIN_SCALE = torch.finfo(torch.float32).tiny


def scale_for(amax: torch.Tensor, margin: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Scale mapping amax*margin onto 448, rounded to `dtype` (the dtype it is stored in) and never zero.

    Rounding to the storage dtype here, before any codes are computed, keeps what is written and what was
    measured identical; values that end up a hair above 448 after the rounding saturate.
    """
    s = amax.detach().float() * margin / E4M3_MAX
    floor = max(MIN_SCALE, torch.finfo(dtype).tiny) if dtype.is_floating_point else MIN_SCALE
    s = torch.nan_to_num(s, nan=floor, posinf=torch.finfo(dtype).max).clamp(min=floor)
    return s.to(dtype).float()


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of x / scale, round-to-nearest-even, saturating at ±448 (never NaN from overflow)."""
    return (x.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantisation: one float32 scale per row (token) from its absmax. (codes, scale [..., 1])."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / E4M3_MAX).clamp(min=MIN_SCALE)
    return quantize(x, scale), scale


def fake_quantize(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded through e4m3 and back, in float32: per tensor with `scale`, else per token (dynamic)."""
    if scale is None:
        q, scale = quantize_per_token(x)
    else:
        q = quantize(x, scale)
    return q.float() * scale.float()
