"""The result of solving one Linear: integer (or FP8) codes plus what it takes to dequantise them.

Solvers produce it, the checkpoint writer consumes it; neither knows the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .schemes import Scheme


@dataclass
class QWeight:
    scheme: Scheme
    q: torch.Tensor  # int8 codes [out, in] in [qmin, qmax] (int), or float8_e4m3fn [out, in] (fp8)
    scale: torch.Tensor  # float32 [out, groups] (int), [out, 1] or [1] (fp8)
    zero: torch.Tensor | None = None  # int8 [out, groups], asymmetric int only
    g_idx: torch.Tensor | None = None  # int32 [in]: group of each input column (act-order)
    input_scale: torch.Tensor | None = None  # fp8 static activations: float32 [1]
    stats: dict = field(default_factory=dict)  # per-layer facts for quantkit.json (error, alpha, damp, ...)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def group_of_columns(self) -> torch.Tensor:
        n_in = self.q.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        if self.scheme.is_fp8 or self.scheme.group_size == -1:
            return torch.zeros(n_in, dtype=torch.long)
        return torch.arange(n_in) // self.scheme.group_size

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        if self.scheme.is_fp8:
            return self.q.float() * self.scale.float().reshape(-1, 1) if self.scale.numel() > 1 \
                else self.q.float() * self.scale.float()
        gi = self.group_of_columns().to(self.q.device)
        q = self.q.float()
        if self.zero is not None:
            q = q - self.zero.float()[:, gi]
        return q * self.scale.float()[:, gi]
