"""Rows to token ids, the one place that knows about special tokens and chat templates."""
from __future__ import annotations

import hashlib

import torch


def prefix_special_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before any text (BOS for llama, none for GPT-2 or SmolLM2).

    Found by encoding a probe with and without special tokens rather than trusting bos_token_id, because
    many tokenizers define a BOS they never add.
    """
    plain = tokenizer.encode("hello", add_special_tokens=False)
    full = tokenizer.encode("hello", add_special_tokens=True)
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return list(full[:i])
    return []


class Encoder:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.prefix = prefix_special_ids(tokenizer)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        eos = tokenizer.eos_token_id
        # Independent documents are separated by EOS, as the model saw them in pre-training.
        self.doc_separator = [eos] if eos is not None else self.encode(["\n\n"])[0]

    def render(self, row) -> str | None:
        """Text for a row; chats go through the chat template (which adds its own special tokens)."""
        if isinstance(row, list):
            if self.has_chat_template:
                return self.tok.apply_chat_template(row, tokenize=False)
            # No template (a base model): a neutral transcript is the best stand-in.
            return "\n".join(f"{m['role']}: {m['content']}" for m in row)
        return row

    def encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"]]

    def describe(self) -> dict:
        return {"tokenizer": getattr(self.tok, "name_or_path", "") or type(self.tok).__name__,
                "vocab_size": len(self.tok), "prefix_special_ids": self.prefix,
                "chat_template": "tokenizer" if self.has_chat_template else "plain role: content lines"}


def sha256_of(samples: list[torch.Tensor]) -> str:
    """Hash of the token tensors: each sample's length then its int64 little-endian ids, so that different
    cuts of the same tokens cannot collide."""
    h = hashlib.sha256()
    for s in samples:
        h.update(int(s.numel()).to_bytes(8, "little"))
        h.update(s.to(torch.int64).contiguous().numpy().astype("<i8").tobytes())
    return h.hexdigest()
