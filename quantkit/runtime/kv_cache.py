"""KV-cache helpers: make one per sequence, run forwards through it, roll it back after a rejected speculation.

Two kinds of cache: a slot in the model's shared SlotPool, driven by our own Llama-family forward (llama_step.py:
batched across sequences, rollback by length), and transformers' own caches for every other model, for the FP8
KV cache and for the evaluation code that wants a plain transformers forward.
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from . import compiled
from .rows import Rows
from .slot_cache import SlotHandle


def new_cache(model, kind: str = "auto"):
    """A fresh cache: "auto" keeps the model dtype; "fp8" stores e4m3 codes with the checkpoint's KV scales."""
    if kind == "fp8":
        from .fp8_kv_cache import FP8KVCache

        return FP8KVCache.from_model(model)
    return DynamicCache(config=model.config)


def new_decode_cache(model, kind: str = "auto", slots: bool = True):
    """The cache a decoding sequence uses: a SlotPool slot where our own forward supports the model (and the
    cache kind is the model dtype), else `new_cache`. slots=False forces transformers' path."""
    if slots and kind == "auto":
        from . import llama_step

        if llama_step.supports(model):
            return llama_step.pool_for(model).new()
    return new_cache(model, kind)


def release(cache) -> None:
    """Give a finished sequence's slot back at once (a transformers cache is simply dropped)."""
    if isinstance(cache, SlotHandle):
        cache.release()


def crop_to(cache, length: int) -> None:
    """Keep only the first `length` positions (a negative argument to crop means 'remove this many')."""
    if isinstance(cache, SlotHandle):
        cache.crop_to(length)
        return
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


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
