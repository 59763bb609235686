"""How much of a Gram or Hessian's off-diagonal part to trust when it was measured on a few thousand tokens.

AWQ's clip search and GPTQ both weigh a weight change by the calibration inputs' second moments, X Xᵀ. Its
diagonal (how large each input channel is) carries over to other text; its off-diagonal part (how channels move
together) is largely a trait of the calibration text's domain, and on a few thousand tokens partly noise. Fitted
to it, both solvers lost to plain rounding on text of other domains (docs/benchmarks.md, "A clip that carries
across domains" and "GPTQ at every calibration size"). So each estimates X Xᵀ as if PRIOR more tokens had
uncorrelated channels: a covariance shrunk towards its diagonal, by a share that fades as the calibration grows.
"""
from __future__ import annotations

import torch


def decorrelation(tokens: int, prior: int) -> float:
    """The share of the off-diagonal part given up when it was measured on TOKENS tokens (0 with no prior)."""
    return prior / (prior + tokens) if prior else 0.0


def toward_diagonal(gram: torch.Tensor, share: float) -> torch.Tensor:
    """A copy of GRAM ([n, n]) with its off-diagonal entries scaled by 1 - SHARE and its diagonal as it was
    (GRAM itself when SHARE is 0)."""
    if not share:
        return gram
    out = gram * (1.0 - share)
    out.diagonal().copy_(gram.diagonal())
    return out
