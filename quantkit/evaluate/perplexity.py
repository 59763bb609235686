"""Perplexity over fixed token windows, one forward per window through the runtime's cache path.

Each window predicts its own tokens 1..T-1. When windows overlap (stride below the text length), only each
later window's last `stride` predictions are scored, so no token counts twice; every model sees the very
same windows and scores the very same positions, which is what makes perplexities comparable.
"""
from __future__ import annotations

import math

import torch


def scored_positions(n_tokens: int, index: int, stride: int, body: int) -> int:
    """How many of the window's final predictions are scored (all of them unless windows overlap)."""
    if index == 0 or stride >= body:
        return n_tokens - 1
    return min(stride, n_tokens - 1)


@torch.inference_mode()
def window_logprobs(model, ids: torch.Tensor, device) -> torch.Tensor:
    """[T-1, V] float32 log-probabilities of the next token at positions 0..T-2."""
    from ..runtime.forward import forward
    from .cache import eval_cache

    logits = forward(model, ids.to(device), eval_cache(model), last_only=False)
    return logits[:-1].float().log_softmax(-1)


def nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[n] negative log-likelihood of the targets under rows of log-probabilities."""
    return -logp.gather(-1, targets.to(logp.device).unsqueeze(-1)).squeeze(-1)


def perplexity(total_nll: float, n: int) -> float | None:
    return math.exp(total_nll / n) if n else None
