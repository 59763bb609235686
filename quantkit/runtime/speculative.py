"""Speculative decoding: draft sources and the rejection rule that keeps the target's output distribution.

A drafter proposes k tokens (and, for a model drafter that samples, the distribution q each came from);
the target scores all of them in one forward giving p; `accept` keeps a prefix and adds one token of its own,
so every verify forward yields between 1 and k+1 tokens whose joint law is exactly the target's.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from . import sampling
from .forward import forward
from .kv_cache import crop_to, new_decode_cache


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


class ModelDrafter:
    """A small model sharing the target's tokenizer drafts k tokens autoregressively with its own KV cache."""

    deterministic = False

    def __init__(self, model):
        self.model = model
        self.cache = new_decode_cache(model)
        self.n_cached = 0

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.n_cached += ids.shape[0]
        return forward(self.model, ids, self.cache, last_only=True)[-1]

    def propose(self, ids: torch.Tensor, k: int, params, generator) -> tuple[list[int], torch.Tensor | None]:
        logits = self._logits(ids[self.n_cached:])
        draft, qs = [], []
        for i in range(k):
            t, q = sampling.draft_token(logits, params, generator)
            qs += [] if q is None else [q]
            draft.append(t)
            if i + 1 < k:
                logits = self._logits(torch.tensor([t]))
        return draft, (torch.stack(qs) if qs else None)

    def rollback(self, valid_len: int) -> None:
        if self.n_cached > valid_len:
            crop_to(self.cache, valid_len)
            self.n_cached = valid_len


def vocab_rows(model) -> int:
    """Rows of the output head, read from its size (a PackedLinear's weight would be rebuilt to read its shape)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", 0) or head.weight.shape[0])


def check_vocab(target, draft, target_tok=None, draft_tok=None) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    tv, dv = vocab_rows(target), vocab_rows(draft)
    if tv != dv:
        raise UserError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv}); "
                        "use a draft trained with the same tokenizer, or --prompt-lookup / --draft self-w4")
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise UserError("the draft model's tokenizer maps tokens to different ids than the target's; "
                        "use a draft with the same tokenizer, or --prompt-lookup / --draft self-w4")
