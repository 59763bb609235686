"""Where a model's torch.compile'd decode steps live (`--compile`): beside the model, not on it.

A compiled step belongs to one model: ours skips dynamo's guards on modules and globals, so run by another model
(a copy.deepcopy of a compiled model, e.g. a self-w4 draft made after compiling) it would compute with the
first model's weights. Kept in a weak map keyed by the model object, a copy simply has none.
"""
from __future__ import annotations

import weakref
from typing import Callable

_STEPS: "weakref.WeakKeyDictionary[object, dict[str, Callable]]" = weakref.WeakKeyDictionary()


def set_step(model, kind: str, fn: Callable) -> None:
    """kind: "decode" (transformers' forward) or "slot" (llama_step.layers_forward)."""
    _STEPS.setdefault(model, {})[kind] = fn


def step(model, kind: str) -> Callable | None:
    steps = _STEPS.get(model)
    return steps.get(kind) if steps else None
