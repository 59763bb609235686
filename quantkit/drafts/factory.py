"""From --draft / --prompt-lookup to a function making one drafter per sequence."""
from __future__ import annotations

from typing import Callable

from ..errors import UserError
from ..runtime.build import load_tokenizer
from ..runtime.checkpoint import load
from .eagle_draft import EagleDrafter
from .eagle_head import is_head_dir, load_head
from .early_exit import PREFIX as EARLY_EXIT, early_exit_draft, parse_layers
from .model_draft import ModelDrafter, check_vocab
from .prompt_lookup import PromptLookupDrafter
from .self_w4 import self_w4_draft


def drafter_factory(target, tokenizer, *, draft: str | None = None, prompt_lookup: int | None = None,
                    dtype=None, device: str = "cpu") -> Callable[[], object] | None:
    """A function making one drafter per sequence (a model drafter holds that sequence's draft KV cache)."""
    if draft and prompt_lookup:
        raise UserError("choose one draft source: --draft or --prompt-lookup, not both")
    if prompt_lookup:
        PromptLookupDrafter(prompt_lookup)  # validates the n-gram size now rather than on the first request
        return lambda: PromptLookupDrafter(prompt_lookup)
    if not draft:
        return None
    if draft == "self-w4":
        draft_model = self_w4_draft(target, packed=True)
    elif draft.startswith(EARLY_EXIT):
        draft_model = early_exit_draft(target, parse_layers(draft, target.config.num_hidden_layers))
    elif is_head_dir(draft):
        head = load_head(draft, target)
        return lambda: EagleDrafter(target, head)
    else:
        draft_model = load(draft, device=device, dtype=dtype)  # beside the target: drafts and verifies share tokens
        check_vocab(target, draft_model, tokenizer, load_tokenizer(draft))
    return lambda: ModelDrafter(draft_model)
