"""The KV cache eval runs with: the runtime's, and an FP8 one when the checkpoint carries KV scales.

An `fp8-kv` variant is only measured as served if its keys and values really pass through FP8, so a model
whose attention modules hold k_scale/v_scale (attached by the loader) gets FP8KVCache even where the runtime's
default cache factory does not choose it yet.
"""
from __future__ import annotations


def has_kv_scales(model) -> bool:
    return any(getattr(m, "k_scale", None) is not None for m in model.modules())


def eval_cache(model):
    from ..runtime.kv_cache import new_cache

    cache = new_cache(model)
    if has_kv_scales(model):
        from ..runtime.fp8_kv_cache import FP8KVCache

        if not isinstance(cache, FP8KVCache):
            cache = FP8KVCache.from_model(model)
    return cache


def kv_cache_kind(model) -> str:
    return "fp8" if has_kv_scales(model) else "model dtype"
