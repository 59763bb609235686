"""A draft model: a small model sharing the target's tokenizer, its drafter, and the check that it does share it."""
from __future__ import annotations

import torch

from ..errors import UserError
from ..runtime import sampling
from ..runtime.forward import forward
from ..runtime.kv_cache import crop_to, new_decode_cache


class ModelDrafter:
    """A small model sharing the target's tokenizer drafts k tokens autoregressively with its own KV cache."""

    deterministic = False

    def __init__(self, model):
        self.model = model
        self.cache = new_decode_cache(model)
        self.n_cached = 0

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.n_cached += ids.shape[0]
        return forward(self.model, ids, self.cache, last_only=True)[-1]

    def propose(self, ids: torch.Tensor, k: int, params, generator) -> tuple[list[int], torch.Tensor | None]:
        logits = self._logits(ids[self.n_cached:])
        draft, qs = [], []
        for i in range(k):
            t, q = sampling.draft_token(logits, params, generator)
            qs += [] if q is None else [q]
            draft.append(t)
            if i + 1 < k:
                logits = self._logits(torch.tensor([t]))
        return draft, (torch.stack(qs) if qs else None)

    def rollback(self, valid_len: int) -> None:
        if self.n_cached > valid_len:
            crop_to(self.cache, valid_len)
            self.n_cached = valid_len


def vocab_rows(model) -> int:
    """Rows of the output head, read from its size (a PackedLinear's weight would be rebuilt to read its shape)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", 0) or head.weight.shape[0])


def check_vocab(target, draft, target_tok=None, draft_tok=None) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    tv, dv = vocab_rows(target), vocab_rows(draft)
    if tv != dv:
        raise UserError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv}); "
                        "use a draft trained with the same tokenizer, or --prompt-lookup / --draft self-w4")
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise UserError("the draft model's tokenizer maps tokens to different ids than the target's; "
                        "use a draft with the same tokenizer, or --prompt-lookup / --draft self-w4")
