"""Turning logits into a next token: greedy, or sampling with temperature, top-k and top-p; before that,
OpenAI's logit_bias and presence/frequency penalties (`adjust`).

Speculative decoding needs the *distribution* the sampler draws from (p for the target, q for the draft),
not just a token, so `probs` is the single place that defines it; `pick` draws from it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import UserError

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (SamplingParams.greedy)


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # record each token's logprob and this many alternatives (None: do not)

    @property
    def greedy(self) -> bool:
        # Below this the division by the temperature overflows float32 logits (1e-300 made them inf, then NaN
        # probabilities); vLLM treats such temperatures as greedy as well.
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> "SamplingParams":
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(f"temperature must be a number >= 0 (0 is greedy), got {self.temperature}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise UserError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise UserError("logit_bias values must be between -100 and 100")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 64:  # what torch's generator takes
            raise UserError(f"seed must be a 64-bit integer, got {self.seed}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        return self

    def make_generator(self) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def adjust(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None) -> torch.Tensor:
    """Logits [V] after OpenAI's definitions, with c[j] how often token j was generated so far (counts [V]):
    mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty + logit_bias[j]."""
    logits = logits.float()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        logits = logits.index_add(-1, ids, torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype,
                                                        device=logits.device))
    if counts is not None and (params.frequency_penalty or params.presence_penalty):
        logits = logits - counts * params.frequency_penalty - (counts > 0).to(logits.dtype) * params.presence_penalty
    return logits


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution [..., V] (float32) for logits [..., V]; one-hot on the argmax when greedy."""
    logits = logits.float()
    if params.greedy:
        # One-hot keeps speculative acceptance exact for greedy: p/q is 1 on agreement and 0 otherwise.
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        sorted_p = sorted_logits.softmax(-1)
        # Drop a token when the mass *before* it already reaches top_p. The top token always survives, also when
        # top_p is below float32's smallest number (1e-300 compares as 0): a top_p that small is greedy.
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits.softmax(-1)


def pick(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of p [..., V] (long [...], on p's device).

    Drawn on the CPU: the seeded generator is a CPU one, and a seed then gives the same tokens whichever device
    computed p (a CUDA generator draws a different stream)."""
    flat = p.reshape(-1, p.shape[-1]).cpu()
    out = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return out.reshape(p.shape[:-1]).to(p.device)


def draft_token(logits: torch.Tensor, params, generator) -> tuple[int, torch.Tensor | None]:
    """A drafter's next token from its LOGITS: the argmax when greedy, else a sample from the distribution the
    target's acceptance rule compares against, returned with it (None when greedy)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = probs(logits, params)
    return int(pick(q, generator)), q
