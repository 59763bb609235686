"""The model forward dispatch: logits for ids appended to a sequence's KV cache, whichever kind of cache it is.

A SlotPool slot goes through our own batched Llama-family forward (llama_step.forward_batch); a transformers
cache through the model's own forward, or its compiled decode step (build.compile_decode) once prefilled.
"""
from __future__ import annotations

import inspect

import torch

from . import compiled
from .rows import Rows
from .slot_cache import SlotHandle


def _cache_kw(model) -> str:
    # transformers 5.x renames the argument to `cache` (the old name warns); 4.x only knows the old one.
    kw = getattr(model, "_quantkit_cache_kw", None)
    if kw is None:
        kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model._quantkit_cache_kw = kw
    return kw


def forward(model, ids: torch.Tensor, cache, last_only: bool) -> torch.Tensor:
    """Logits [n, V] for the 1-D ids appended to the cache (only the last row when last_only)."""
    if isinstance(cache, SlotHandle):
        from .llama_step import forward_batch

        return forward_batch(model, [(cache, ids)], last_only)[0].all()
    step = compiled.step(model, "decode")  # build.compile_decode's compiled forward, if any
    if step is None or cache.get_seq_length() == 0:
        step = model
    out = step(input_ids=ids.unsqueeze(0), use_cache=True, logits_to_keep=1 if last_only else 0,
               **{_cache_kw(model): cache})
    return out.logits[0]


def forward_many(model, items: list[tuple[object, torch.Tensor]], last_only: bool = False) -> list[Rows]:
    """`forward` for several sequences of one model, as Rows: the slot caches among them share one batched
    forward, and a multi-token row's logits wait until they are asked for."""
    out: list[Rows | None] = [None] * len(items)
    batch = [j for j, (c, _) in enumerate(items) if isinstance(c, SlotHandle)]
    if batch:
        from .llama_step import forward_batch

        for j, logits in zip(batch, forward_batch(model, [items[j] for j in batch], last_only)):
            out[j] = logits
    for j, (cache, ids) in enumerate(items):
        if out[j] is None:
            out[j] = Rows(forward(model, ids, cache, last_only))
    return out
