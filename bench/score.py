"""The one scoring rule of every bench suite: quantkit's own perplexity (quantkit/evaluate/perplexity.py, what
`quantkit eval` reports) over equal, non-overlapping token windows, and top-1 agreement with a reference.

Agreement is teacher-forced: at each position of the same windows, is this model's argmax the reference's?
Every position is then scored on the same prefix, so one early divergence does not decide a whole window.
"""
from __future__ import annotations

import math
import random

import torch


def score(model, windows: list[torch.Tensor], ref_top1: list[torch.Tensor] | None = None) -> dict:
    """{"ppl", "agreement" (None without ref_top1), "top1" (one argmax tensor per window), "window_nll" (each
    window's mean NLL per token, for paired_ratio's interval)}."""
    from quantkit.evaluate.perplexity import nll, perplexity, window_logprobs

    device = next(model.parameters()).device
    total, count, same, tops, per_window = 0.0, 0, 0, [], []
    for i, w in enumerate(windows):
        logp = window_logprobs(model, w, device)
        window = float(nll(logp, w[1:]).double().sum())
        total += window
        count += len(w) - 1
        per_window.append(window / (len(w) - 1))
        top = logp.argmax(-1).cpu()
        tops.append(top)
        if ref_top1 is not None:
            same += int((top == ref_top1[i]).sum())
    return {"ppl": perplexity(total, count), "top1": tops, "window_nll": per_window,
            "agreement": None if ref_top1 is None else same / count}


def paired_ratio(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Perplexity of A over B on the same chunks, exp(mean(a - b)), with a 95% bootstrap interval over chunks:
    the two files read the same text, so their chunk-to-chunk variation cancels in the difference."""
    d = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(d) for _ in d) / len(d) for _ in range(resamples))
    lo, hi = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return math.exp(sum(d) / len(d)), math.exp(lo), math.exp(hi)
