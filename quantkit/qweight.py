"""The result of solving one Linear: integer (or FP8) codes plus what it takes to dequantise them.

Solvers produce it, the checkpoint writer consumes it; neither knows the other. The dequantisation of a
Linear's codes lives here, one function per layout, at the bottom of the layers so that both sides can call
it: dequantize_int for integer codes (the kernels' float reference, kernels/reference.py, unpacks a
checkpoint's tensors and calls it, so what a solver settled on and what a loaded layer computes with are the
same maths) and dequantize_fp8 for E4M3 ones (QWeight, FP8Linear and the reference alike).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import e4m3
from .schemes import Scheme


def group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None = None,
                device=None) -> torch.Tensor:
    """Group of every input column: g_idx when given (act-order), else column // group_size."""
    if g_idx is not None:
        return g_idx.long()
    if group_size == -1:
        return torch.zeros(in_features, dtype=torch.long, device=device)
    return torch.arange(in_features, device=device) // group_size


def dequantize_int(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                   groups: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] from signed integer codes [out, in], scales and zero points [out, n_groups] and the
    group of every input column (group_index)."""
    q = q.float()
    if zero is not None:
        q = q - zero.float()[:, groups]
    return q * scale.float()[:, groups]


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] from E4M3 codes [out, in] and a per-channel ([out, 1] or [out]) or per-tensor ([1])
    scale."""
    return e4m3.dequantize(q, scale.reshape(-1, 1) if scale.numel() > 1 else scale)


def dequantize_fp4(values: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """float32 [out, in] from E2M1 values [out, in], one scale per group of in / groups columns ([out, groups]:
    E4M3 values for nvfp4, powers of two for mxfp4) and nvfp4's per-tensor divisor (None for mxfp4)."""
    out, n = values.shape
    s = scale.float()
    if global_scale is not None:
        s = s / global_scale.float()
    return (values.float().reshape(out, s.shape[1], -1) * s.unsqueeze(-1)).reshape(out, n)


@dataclass
class QWeight:
    scheme: Scheme
    q: torch.Tensor  # int8 codes [out, in] in [qmin, qmax] (int), float8_e4m3fn [out, in] (fp8), E2M1 values (fp4)
    scale: torch.Tensor  # float32 [out, groups] (int), [out, 1] or [1] (fp8)
    zero: torch.Tensor | None = None  # int8 [out, groups], asymmetric int only
    g_idx: torch.Tensor | None = None  # int32 [in]: group of each input column (act-order)
    input_scale: torch.Tensor | None = None  # fp8 static activations: float32 [1]
    global_scale: torch.Tensor | None = None  # nvfp4: float32 [1], the divisor of every group scale
    stats: dict = field(default_factory=dict)  # per-layer facts for quantkit.json (error, alpha, damp, ...)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def group_of_columns(self) -> torch.Tensor:
        return group_index(self.q.shape[1], -1 if self.scheme.is_fp8 else self.scheme.group_size, self.g_idx)

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        if self.scheme.is_fp8:
            return dequantize_fp8(self.q, self.scale)
        if self.scheme.is_fp4:
            return dequantize_fp4(self.q, self.scale, self.global_scale)
        return dequantize_int(self.q, self.scale, self.zero, self.group_of_columns().to(self.q.device))
