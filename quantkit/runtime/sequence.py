"""The decode state machine: one request's `Sequence` (ids, KV cache, drafter, sampler, stop rules, metrics).

Prefill once, then one verify forward per step. `step()` runs one target forward and returns the tokens it
produced: exactly one without speculation, 1..k+1 with it. A scheduler that batches requests splits a step in
two: `next_feed()` gives the ids to feed, and `finish(rows, seconds)` takes that forward's logits
(engine.py); `generate()` (generate.py) loops `step()` for one prompt.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import UserError
from . import sampling
from .forward import forward_many
from .kv_cache import crop_to, new_decode_cache, release
from .rows import Rows
from .metrics import RequestMetrics
from .sampling import SamplingParams
from .spec_governor import SpeculationGovernor
from .speculative import accept as speculative_accept
from .text import Detokenizer

clock = time.perf_counter  # step timing for the speculation governor (tests replace it)


@dataclass
class TokenInfo:
    id: int
    logprob: float  # under the model's own distribution (temperature 1), as OpenAI reports it
    drafted: bool  # an accepted drafted token (not produced by the target itself)
    text: str = ""


class NonFiniteLogits(RuntimeError):
    """The model computed NaN or +inf logits: its weights are damaged (the loader's checks make this rare)."""


def check_logits(logits: torch.Tensor, position: int) -> None:
    """NaN or +inf logits would become NaN probabilities (a failed draw) or NaN logprobs (invalid JSON); -inf
    is a token the model rules out, which log_softmax and sampling handle."""
    if not bool((logits < float("inf")).all()):
        raise NonFiniteLogits(f"the model computed non-finite logits at output token {position}; its weights may "
                              "be damaged: check the checkpoint with quantkit inspect, or quantise it again")


def context_limit(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)


def eos_ids(model, tokenizer=None) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is not None:
            ids.update(e if isinstance(e, (list, tuple)) else [e])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Sequence:
    def __init__(self, model, prompt_ids: list[int], params: SamplingParams, *, drafter=None,
                 num_speculative_tokens: int = 4, tokenizer=None, eos: set[int] | None = None,
                 kv_cache: str = "auto", cost_aware: bool = True):
        """cost_aware: the governor also times steps and pauses drafting while drafting steps emit tokens more
        slowly than plain ones (spec_governor.py); off, it pauses only on rejected drafts, so every step that
        can draft does (what a test of the acceptance rule wants)."""
        if not prompt_ids:
            raise UserError("the prompt is empty; give at least one token of text")
        limit = context_limit(model)
        if len(prompt_ids) >= limit:
            raise UserError(f"the prompt has {len(prompt_ids)} tokens but the model's context is {limit}; "
                            "shorten the prompt")
        self.model = model
        self.params = params.validate()
        self.max_tokens = min(params.max_tokens, limit - len(prompt_ids))
        self.ids = torch.tensor(prompt_ids, dtype=torch.long)
        self.n_prompt = len(prompt_ids)
        self.cache = new_decode_cache(model, kv_cache)
        self._draft: list[int] = []
        self._q = None
        self._draft_s = 0.0
        self._prefill_step = False
        self.drafter = drafter
        self.governor = SpeculationGovernor()
        self.cost_aware = cost_aware
        self.k = num_speculative_tokens
        self.gen = None if params.greedy else params.make_generator()
        self.eos = set() if params.ignore_eos else (eos if eos is not None else eos_ids(model, tokenizer))
        self.detok = Detokenizer(tokenizer, params.stop) if tokenizer is not None else None
        self.metrics = RequestMetrics(prompt_tokens=len(prompt_ids))
        self.finish_reason: str | None = None
        self.tokens: list[TokenInfo] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def n_generated(self) -> int:
        return self.ids.shape[0] - self.n_prompt

    def _choose(self, logits: torch.Tensor) -> int:
        check_logits(logits, self.n_generated)
        if self.params.greedy:
            return int(logits.argmax())
        return int(sampling.pick(sampling.probs(logits, self.params), self.gen))

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        check_logits(logits, self.n_generated)
        return sampling.probs(logits, self.params)

    @property
    def prefilled(self) -> bool:
        return self.cache.get_seq_length() > 0

    def next_feed(self, speculate: bool = True) -> torch.Tensor:
        """The ids the next target forward feeds: the whole prompt first, then the last token plus any draft.
        Call `finish(rows, forward_s)` with that forward's logits (every row; only the last is used for the
        prefill) and the seconds it took."""
        self._draft, self._q, self._draft_s = [], None, 0.0
        self._prefill_step = not self.prefilled
        if self._prefill_step:
            return self.ids
        k = min(self.k, self.max_tokens - self.n_generated - 1)
        if speculate and self.drafter is not None and k > 0 and self.governor.allow():
            t = clock()
            self._draft, self._q = self.drafter.propose(self.ids, k, self.params, self.gen)
            self._draft_s = clock() - t
        draft = self._draft
        return torch.cat([self.ids[-1:], torch.tensor(draft, dtype=torch.long)]) if draft else self.ids[-1:]

    def finish(self, rows: Rows, forward_s: float | None = None) -> list[TokenInfo]:
        """rows: the forward's logits (forward.forward_many), computed as far as acceptance needs them.
        forward_s: the seconds that forward took (shared by all its rows when requests share a step). The
        governor is given this sequence's own time, its draft plus the forward plus its acceptance, not the
        wall time since next_feed(), which in a shared step would include the other requests' drafting."""
        t = clock()
        timed = self.cost_aware and forward_s is not None and self.drafter is not None
        self.metrics.target_forwards += 1
        draft = self._draft
        if not draft:
            logits = rows.all()
            out = self._emit([self._choose(logits[-1])], logits, [False])
            if timed and not self._prefill_step:
                self.governor.plain_step(forward_s + clock() - t)
            return out
        n_ctx = self.ids.shape[0]
        n, extra = speculative_accept(lambda i: self._probs(rows.upto(i + 1)[i]), self._q, draft, self.gen,
                                      self.params.greedy)
        logits = rows.upto(n + 1)
        # The cache now holds every fed token; keep the context (minus the pending last) plus accepted drafts.
        crop_to(self.cache, n_ctx + n)
        self.drafter.rollback(n_ctx + n)
        seconds = self._draft_s + forward_s + clock() - t if timed else None
        self.governor.update(n, len(draft), seconds, self._draft_s)
        self.metrics.spec_steps += 1
        self.metrics.drafted += len(draft)
        self.metrics.accepted += n
        return self._emit(draft[:n] + [extra], logits[: n + 1], [True] * n + [False])

    def step(self, speculate: bool = True) -> list[TokenInfo]:
        """One target forward; the first call is the prefill. Returns the new tokens (empty when done)."""
        if self.done:
            return []
        prefill = not self.prefilled
        feed = self.next_feed(speculate)
        t = clock()
        rows = forward_many(self.model, [(self.cache, feed)], last_only=prefill)[0]
        return self.finish(rows, clock() - t)

    def _emit(self, new: list[int], logits: torch.Tensor, drafted: list[bool]) -> list[TokenInfo]:
        check_logits(logits[-len(new):], self.n_generated)
        rows = logits[-len(new):].float().log_softmax(-1)
        lps = rows.gather(-1, torch.tensor(new, device=rows.device).unsqueeze(-1)).squeeze(-1).tolist()
        out: list[TokenInfo] = []
        for tok, lp, d in zip(new, lps, drafted):
            info = TokenInfo(tok, lp, d)
            out.append(info)
            if tok in self.eos:
                self.finish_reason = "stop"
                break
            if self.detok is not None:
                info.text = self.detok.add(tok)
                if self.detok.stopped:
                    self.finish_reason = "stop"
                    break
            if self.n_generated + len(out) >= self.max_tokens:
                self.finish_reason = "length"
                break
        self.ids = torch.cat([self.ids, torch.tensor([t.id for t in out], dtype=torch.long)])
        if self.done and self.detok is not None and out:
            out[-1].text += self.detok.flush()
        if self.done:
            self.release()
        self.metrics.on_tokens(len(out))
        self.tokens.extend(out)
        return out

    def release(self) -> None:
        """Give back this sequence's KV cache slots (its own and its draft model's) now, not at collection."""
        release(self.cache)
        if self.drafter is not None and hasattr(self.drafter, "cache"):
            release(self.drafter.cache)

    def output_ids(self) -> list[int]:
        return self.ids[self.n_prompt:].tolist()

    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""
