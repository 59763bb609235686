"""Decode one prompt to completion with our own loop: a `Sequence` (sequence.py) stepped until it is done."""
from __future__ import annotations

import torch

from .sampling import SamplingParams
from .sequence import Sequence


@torch.inference_mode()
def generate(model, prompt_ids: list[int], params: SamplingParams, *, drafter=None, num_speculative_tokens: int = 4,
             tokenizer=None, eos: set[int] | None = None, speculate: bool = True, kv_cache: str = "auto",
             cost_aware: bool = True) -> Sequence:
    """Decode one prompt to completion; returns the finished Sequence (ids, text, tokens, metrics)."""
    seq = Sequence(model, prompt_ids, params, drafter=drafter, num_speculative_tokens=num_speculative_tokens,
                   tokenizer=tokenizer, eos=eos, kv_cache=kv_cache, cost_aware=cost_aware)
    while not seq.done:
        seq.step(speculate=speculate)
    return seq
