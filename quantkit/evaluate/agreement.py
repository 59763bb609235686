"""Distances from the baseline: per-token KL, top-1 token agreement, whole-answer agreement, exact match.

KL is KL(P_base || P_variant) = sum_v p_base(v) (log p_base(v) - log p_variant(v)) at each position, the
information lost by serving the variant in place of the baseline. Everything is computed in float32 from
log-probabilities; tails (p95, p99, max) matter more than the mean because quantisation hurts unevenly.
"""
from __future__ import annotations

import math

import torch


def kl_per_token(base_logp: torch.Tensor, var_logp: torch.Tensor) -> torch.Tensor:
    """[n] KL for rows of log-probabilities [n, V]; exact zeros where the rows are equal."""
    base_logp, var_logp = base_logp.float(), var_logp.float()
    kl = (base_logp.exp() * (base_logp - var_logp)).sum(-1)
    # A true KL is >= 0; rounding can leave -1e-7 when the rows are (nearly) equal.
    return kl.clamp_min(0.0)


def top1_agreement(base_logp: torch.Tensor, var_logp: torch.Tensor) -> torch.Tensor:
    """[n] bool: does the variant's most likely token equal the baseline's at each position."""
    return base_logp.argmax(-1) == var_logp.argmax(-1)


def percentile(values, q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default method), q in [0, 100]; None for no values."""
    v = sorted(float(x) for x in values)
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def kl_stats(values) -> dict:
    v = [float(x) for x in values]
    if not v:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    return {"n": len(v), "mean": sum(v) / len(v), "p50": percentile(v, 50), "p95": percentile(v, 95),
            "p99": percentile(v, 99), "max": max(v)}


def answer_line(text: str) -> str:
    """The answer part of a plain completion: its first non-empty line, without surrounding spaces."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def exact_match(generated: str, reference: str) -> bool:
    """The first line equals the reference, or starts with it and the next character ends a word.

    Completions run on ("Paris. It is...", "579 is the sum"); a word boundary keeps "5790" from matching "579".
    """
    pred, ref = answer_line(generated), reference.strip()
    if not ref:
        return pred == ""
    if pred == ref:
        return True
    return pred.startswith(ref) and not pred[len(ref)].isalnum()


def same_answer(a: str, b: str) -> bool:
    return answer_line(a) == answer_line(b)
