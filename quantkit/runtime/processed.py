"""A sequence whose sampler needs more than the current logits: OpenAI's logit_bias and presence/frequency
penalties (which depend on the tokens generated so far), and the logprobs of the distribution each token was
actually drawn from (after those adjustments, temperature, top-k and top-p), with the top alternatives.

It decodes without speculation: the verify path (speculative.accept) draws from `sampling.probs` of the raw
logits of several positions at once, while penalties change the distribution after every accepted token;
running these requests one token per step keeps them exactly OpenAI's definitions at a modest cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import sampling
from .forward import forward_many
from .sequence import Sequence, check_logits

PROMPT_CHUNK = 64  # prompt tokens per forward when their logprobs are wanted: bounds the [rows, vocab] logits


@dataclass
class TokenLogprob:
    id: int
    logprob: float  # may be -inf: a token top-k or top-p cut away (only among alternatives)
    top: list[tuple[int, float]]  # the most likely tokens of that distribution, most likely first


def _record(logprobs: torch.Tensor, token: int, n_top: int) -> TokenLogprob:
    top = torch.topk(logprobs, n_top) if n_top else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
    return TokenLogprob(token, float(logprobs[token]), pairs)


class ProcessedSequence(Sequence):
    """prompt_logprobs: also record each prompt token's logprob (from the prefill's rows, under the model's own
    distribution: nothing was sampled there), for `echo` with `logprobs`."""

    def __init__(self, model, prompt_ids, params, *, prompt_logprobs: bool = False, **kw):
        kw["drafter"] = None
        super().__init__(model, prompt_ids, params, **kw)
        self.counts: torch.Tensor | None = None  # [V] times each token was generated
        self.logprobs: list[TokenLogprob] = []  # one per token in self.tokens
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # None for the first prompt token
        self._want_prompt = prompt_logprobs
        self._pending: TokenLogprob | None = None

    def _choose(self, logits: torch.Tensor) -> int:
        check_logits(logits, self.n_generated)
        if self.counts is None:
            self.counts = torch.zeros(logits.shape[-1], device=logits.device)
        params = self.params
        adjusted = sampling.adjust(logits, params, self.counts)
        if params.greedy:
            token = int(adjusted.argmax())
            # Greedy draws from no distribution; its logprobs are those of the adjusted logits at temperature 1,
            # whose most likely token is the one chosen (top-k and top-p cannot change an argmax).
            logprobs = adjusted.log_softmax(-1) if params.logprobs is not None else None
        else:
            p = sampling.probs(adjusted, params)
            token = int(sampling.pick(p, self.gen))
            logprobs = p.log() if params.logprobs is not None else None
        self._pending = _record(logprobs, token, params.logprobs) if logprobs is not None else None
        return token

    def finish(self, rows, forward_s: float | None = None):
        out = super().finish(rows, forward_s)
        for t in out:  # without a drafter a step emits at most one token: the one _choose picked
            self.counts[t.id] += 1
            if self._pending is not None:
                self.logprobs.append(self._pending)
        return out

    def step(self, speculate: bool = True):
        if self._want_prompt and not self.prefilled and not self.done:
            return self._prefill_with_logprobs()
        return super().step(speculate)

    def _prefill_with_logprobs(self):
        """The prefill in chunks of PROMPT_CHUNK tokens through the cache (the same attention as one forward),
        so a long prompt never holds a [prompt, vocab] logits tensor at once."""
        ids = self.next_feed(False)  # the whole prompt; next_feed also resets the step's state for finish()
        n_top = self.params.logprobs or 0
        records: list[TokenLogprob | None] = [None]  # nothing predicts the first prompt token
        for start in range(0, ids.shape[0], PROMPT_CHUNK):
            rows = forward_many(self.model, [(self.cache, ids[start:start + PROMPT_CHUNK])])[0]
            check_logits(rows.all(), 0)
            logprobs = rows.all().float().log_softmax(-1)
            nxt = ids[start + 1:start + 1 + PROMPT_CHUNK]  # row j predicts token j + 1
            records += [_record(row, int(t), n_top) for row, t in zip(logprobs, nxt)]
        self.prompt_logprobs = records
        return self.finish(rows)
