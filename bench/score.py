"""The one scoring rule of every bench suite: quantkit's own perplexity (quantkit/evaluate/perplexity.py, what
`quantkit eval` reports) over equal, non-overlapping token windows, and top-1 agreement with a reference.

Agreement is teacher-forced: at each position of the same windows, is this model's argmax the reference's?
Every position is then scored on the same prefix, so one early divergence does not decide a whole window.
"""
from __future__ import annotations

import torch


def score(model, windows: list[torch.Tensor], ref_top1: list[torch.Tensor] | None = None) -> dict:
    """{"ppl", "agreement" (None without ref_top1), "top1" (one argmax tensor per window)}."""
    from quantkit.evaluate.perplexity import nll, perplexity, window_logprobs

    device = next(model.parameters()).device
    total, count, same, tops = 0.0, 0, 0, []
    for i, w in enumerate(windows):
        logp = window_logprobs(model, w, device)
        total += float(nll(logp, w[1:]).double().sum())
        count += len(w) - 1
        top = logp.argmax(-1).cpu()
        tops.append(top)
        if ref_top1 is not None:
            same += int((top == ref_top1[i]).sum())
    return {"ppl": perplexity(total, count), "top1": tops,
            "agreement": None if ref_top1 is None else same / count}
