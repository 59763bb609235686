"""KV caches: make one per sequence, give it back, roll it back after a rejected speculation.

Two kinds of cache: a slot in the model's shared SlotPool, driven by our own Llama-family forward (llama_step.py:
batched across sequences, rollback by length), and transformers' own caches for every other model, for the FP8
KV cache and for the evaluation code that wants a plain transformers forward. Running a forward through either
is forward.py's.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

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
