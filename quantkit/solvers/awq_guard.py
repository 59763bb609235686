"""AWQ's held-out guard: its choices are checked on calibration samples the search never saw.

AWQ picks a scale per group and a clip per weight group by the error they leave on calibration text; with a
few thousand tokens of one domain those choices can fit that text rather than the model (issue 23 measured AWQ
losing to plain rounding on a held-back code model). So the calibration hold-out (recipe calibration.holdout,
whole samples from the end, capture/holdout.py: the ones GPTQ's guard judges on) is kept out of the search and
the clip's statistics, and each choice must not do worse there than its plain-RTN alternative: a scale that
loses to s = 1 on the held-out samples is dropped (the group keeps RTN scales, recorded as awq_guard in quantkit.json), and each
weight group's clip that raises its held-out output error is undone (awq_clip_reverted counts them).
"""
from __future__ import annotations

import torch

from ..capture.layer import feed_group
from .awq_block import _capture_group, quantised_error
from .awq_clip import GramAccumulator, clip_error, group_width


@torch.no_grad()
def scale_guard(layer, block, group, linears: dict, quantised: dict, hold, s: torch.Tensor, scale_dtype):
    """None when scale s does at least as well as s = 1 on the held-out samples, else why it was dropped."""
    data = _capture_group(layer, block, linears[group.linears[0]], hold, None)  # every held-out sample
    if data.tokens == 0:  # pooled: a rank may hold none of the held-out samples while others do
        return None  # nothing held out reaches this group (an expert): nothing to judge by
    error, _ = quantised_error(block, group, linears, quantised, data, scale_dtype)
    chosen, plain = error(s), error(torch.ones_like(s))
    if chosen <= plain:
        return None
    return f"rtn scales: held-out error {chosen:.4g} > {plain:.4g} without scaling"


def held_out_grams(layer, todo: dict, hold) -> dict:
    """Per Linear, the Gram blocks of its inputs on the held-out samples (empty without a hold-out)."""
    if hold is None:
        return {}
    grams = {m: GramAccumulator(m.in_features, group_width(sch, m.in_features), m.weight.device)
             for m, (_, _, sch) in todo.items()}
    feed_group(layer, list(todo), hold, lambda m, x: grams[m].add(x))
    return {m: g.pooled() for m, g in grams.items()}


@torch.no_grad()
def guard_clip(w: torch.Tensor, ratio: torch.Tensor, gram: torch.Tensor, scheme, scale_dtype):
    """RATIO with every group whose clip raises the held-out output error set back to 1; and how many were."""
    keep = clip_error(w, gram, scheme, ratio, scale_dtype) <= clip_error(w, gram, scheme, 1.0, scale_dtype)
    reverted = int((~keep & (ratio < 1)).sum())
    return torch.where(keep, ratio, torch.ones_like(ratio)), reverted
