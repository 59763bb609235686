"""Speculative decoding's rejection rule, which keeps the target's output distribution (the drafters are in
quantkit/drafts: prompt lookup, a draft model, EAGLE heads, early exit, self-W4).

A drafter proposes k tokens (and, for a model drafter that samples, the distribution q each came from);
the target scores all of them in one forward giving p; `accept` keeps a prefix and adds one token of its own,
so every verify forward yields between 1 and k+1 tokens whose joint law is exactly the target's.
"""
from __future__ import annotations

import torch

from . import sampling


def accept(p, q: torch.Tensor | None, draft: list[int], generator: torch.Generator | None,
           greedy: bool) -> tuple[int, int]:
    """Number of drafted tokens kept, and the token the target adds after them.

    p: [k+1, V] target distributions at the k drafted positions plus the one after, or a function giving row i
    (asked for in order, and only up to the first refusal, so that a caller can compute them lazily);
    q: [k, V] the draft's distributions, or None for a deterministic draft (q is then one-hot on the drafted
    token).
    Rule: keep draft i with probability min(1, p_i(t)/q_i(t)); at the first refusal draw from
    normalise(max(0, p_i - q_i)); if all k are kept draw the extra token from p_k.
    """
    k = len(draft)
    row = p if callable(p) else p.__getitem__
    if greedy:
        # p is one-hot on the argmax, so the rule reduces to "keep while the draft equals the argmax".
        n = 0
        while n < k and draft[n] == int(row(n).argmax()):
            n += 1
        return n, int(row(n).argmax())
    u = torch.rand(k, generator=generator).tolist() if k else []
    for i, t in enumerate(draft):
        pi = row(i)
        pt = pi[t].item()
        qt = 1.0 if q is None else q[i, t].item()
        if qt > 0 and u[i] * qt < pt:  # u < p/q without dividing; p >= q always accepts since u < 1
            continue
        if q is None:
            residual = pi.clone()
            residual[t] = 0.0
        else:
            residual = torch.clamp(pi - q[i], min=0.0)
        total = residual.sum()
        # A zero residual needs p == q, where refusal has probability 0; guard rounding anyway.
        residual = pi if total <= 0 else residual / total
        return i, int(sampling.pick(residual, generator))
    return k, int(sampling.pick(row(k), generator))
