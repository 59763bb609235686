"""KV-cache helpers: make one per sequence and roll it back after a rejected speculation."""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache


def new_cache(model, kind: str = "auto"):
    """A fresh cache: "auto" keeps the model dtype; "fp8" stores e4m3 codes with the checkpoint's KV scales."""
    if kind == "fp8":
        from .fp8_kv_cache import FP8KVCache

        return FP8KVCache.from_model(model)
    return DynamicCache(config=model.config)


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep only the first `length` positions (a negative argument to crop means 'remove this many')."""
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


def forward(model, ids: torch.Tensor, cache: DynamicCache, last_only: bool) -> torch.Tensor:
    """Logits [n, V] for the 1-D ids appended to the cache (only the last row when last_only)."""
    step = getattr(model, "_quantkit_decode", None)  # build.compile_decode's compiled forward, if any
    if step is None or cache.get_seq_length() == 0:
        step = model
    out = step(input_ids=ids.unsqueeze(0), use_cache=True, logits_to_keep=1 if last_only else 0,
               **{_cache_kw(model): cache})
    return out.logits[0]
