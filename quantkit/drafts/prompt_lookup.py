"""Prompt lookup: draft the tokens that followed an earlier occurrence of the context's last n-gram."""
from __future__ import annotations

import torch

from ..errors import UserError


class PromptLookupDrafter:
    """Propose the tokens that followed an earlier occurrence of the context's last n-gram.

    Tries n = max_ngram down to min_ngram. Among the occurrences of an n-gram, the earliest one with k tokens
    after it wins (the latest occurrence otherwise): in an edit the source text sits in the prompt, before any
    copy of it the answer has made, and a match inside the answer's own recent tokens has too little after it
    to fill a draft. A single matching token is weak evidence: in open prose almost every token has occurred
    before, and each such draft costs a k+1-row verify that is then rejected, so one-token matches are used only
    when asked for (min_ngram=1). No model, no cache, q is one-hot (deterministic draft).

    A long draft (k > SHORT_DRAFT) is cut to `per_matched` tokens per token of context that matches before the
    occurrence (at least SHORT_DRAFT): an answer copying its input matches tens of tokens back and takes whole
    12-token drafts, while a 2-3 token match is mostly a coincidence whose draft is rejected within a token or two
    (code edits, k=12: 8 of 11 drafts after a match of 2-3 kept at most 2 tokens; 9 of 10 after a match of 9 or
    more kept 8-12). Each verify row costs ~10% of a step here, so the rows such drafts waste are worth saving.
    """

    deterministic = True
    SHORT_DRAFT = 4

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, per_matched: int = 2):
        if max_ngram < 1:
            raise UserError(f"--prompt-lookup needs an n-gram size of at least 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = max(1, min(min_ngram, max_ngram))
        self.per_matched = per_matched

    def propose(self, ids: torch.Tensor, k: int, params, generator) -> tuple[list[int], None]:
        L = ids.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            tail = ids[L - n:]
            windows = ids[: L - 1].unfold(0, n, 1)  # windows ending before the tail's own position
            hits = (windows == tail).all(-1).nonzero().flatten()
            if hits.numel():
                full = hits[hits + n + k <= L]
                start = int(full[0] if full.numel() else hits[-1]) + n
                return ids[start: start + self._draft_len(ids, start, k)].tolist(), None
        return [], None

    def _draft_len(self, ids: torch.Tensor, start: int, k: int) -> int:
        """k, or fewer where the context matches only a few tokens before the occurrence (class docstring)."""
        if k <= self.SHORT_DRAFT or not self.per_matched:
            return k
        need = -(-k // self.per_matched)  # a match this long earns the whole draft; no need to look further
        span = min(need, start)
        before, recent = ids[start - span: start].flip(0), ids[ids.shape[0] - span:].flip(0)
        matched = int((before == recent).int().cumprod(0).sum())
        return min(k, max(self.SHORT_DRAFT, self.per_matched * matched))

    def rollback(self, valid_len: int) -> None:
        pass
