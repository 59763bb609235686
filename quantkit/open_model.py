"""Open a model for decoding as the commands do: threads, dtype, tokenizer, model, drafter, compilation.

generate, serve, the playground's base model and the bench scripts all need the same steps in the same order;
this is the one copy of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .drafts import drafter_factory
from .dtypes import parse_dtype
from .runtime import build
from .runtime.checkpoint import load


@dataclass
class OpenedModel:
    model: object
    tokenizer: object
    make_drafter: Callable[[], object] | None
    dtype: object  # the torch dtype asked for (None: the runtime's float32)
    compiled: bool


def open_model(path: str, *, dtype: str | None = None, threads: int | None = None, draft: str | None = None,
               prompt_lookup: int | None = None, compile: bool = False,
               warn: Callable[[str], None] = print, device: str = "cpu") -> OpenedModel:
    """PATH: a quantkit checkpoint, a Hugging Face model folder, or 'embedded'. warn receives the note shown
    when --compile leaves the model eager. device: as quantkit.load takes it."""
    build.set_threads(threads)
    dt = parse_dtype(dtype)
    tok = build.load_tokenizer(path)  # first: a broken tokenizer should not wait for the model to load
    model = load(path, device=device, dtype=dt)
    make_drafter = drafter_factory(model, tok, draft=draft, prompt_lookup=prompt_lookup, dtype=dt,
                                    device=device)
    compiled = False
    if compile:  # after the drafter: a self-w4 draft copies the eager model
        compiled = build.compile_decode(model)
        if not compiled:
            warn(build.STAYS_EAGER_NOTE)
    return OpenedModel(model, tok, make_drafter, dt, compiled)
