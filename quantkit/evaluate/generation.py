"""Greedy answers to the task prompts on quantkit's own decode loop, timed per request.

A task's answer is one line, so decoding stops at the first line break that follows some text (or at EOS or
max_new_tokens); this keeps requests short without cutting an answer that starts after a newline.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Answer:
    ids: list[int]
    text: str
    seconds: float
    ttft_s: float | None


def _line_done(text: str) -> bool:
    head = text.lstrip()
    return "\n" in head


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def greedy_answer(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, device) -> Answer:
    from ..runtime.sequence import Sequence
    from ..runtime.sampling import SamplingParams

    _sync(device)
    t0 = time.perf_counter()
    from .cache import eval_cache

    seq = Sequence(model, prompt_ids, SamplingParams(max_tokens=max_new_tokens), tokenizer=tokenizer)
    seq.cache = eval_cache(model)  # before the first step, so prefill already writes to the cache eval chose
    while not seq.done:
        seq.step()
        if _line_done(seq.text()):
            break
    _sync(device)
    seconds = time.perf_counter() - t0
    ttft = None if seq.metrics.t_first is None else seq.metrics.t_first - t0
    return Answer(ids=seq.output_ids(), text=seq.text(), seconds=seconds, ttft_s=ttft)


@torch.inference_mode()
def answer_logprobs(model, prompt_ids: list[int], answer_ids: list[int], device) -> torch.Tensor:
    """[len(answer), V] log-probabilities at the positions that predict each answer token (teacher forcing)."""
    from ..runtime.forward import forward
    from .cache import eval_cache

    ids = torch.tensor(prompt_ids + answer_ids, dtype=torch.long, device=device)
    logits = forward(model, ids, eval_cache(model), last_only=False)
    n = len(prompt_ids)
    return logits[n - 1:n - 1 + len(answer_ids)].float().log_softmax(-1)
