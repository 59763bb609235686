"""A reduced draft vocabulary: the head drafts only among the N tokens its training text uses most.

Each drafted token costs one product with the target's output head; for SmolLM2 that head has 49,152 rows and
the product is ~20% of a target step on a CPU, more than the head's own layer. Restricting the draft to N rows
(EAGLE-3's and FR-Spec's idea) divides that cost by 49152/N. Exactness is untouched: the draft distribution q
is still a distribution over the whole vocabulary, zero outside the subset, and the acceptance rule
min(1, p/q) with the residual max(0, p - q) is exact for any q. What the cut costs is acceptance: a token
outside the subset is never drafted, so a position where the target wants one is always refused.

The subset is stored as EAGLE-3 stores it (vLLM's Eagle3LlamaForCausalLM): `d2t`, int64 [N], with target id
= i + d2t[i], and `draft_vocab_size` in the config.
"""
from __future__ import annotations

import torch

D2T = "d2t"


def choose_vocab(samples: torch.Tensor, target_top1: torch.Tensor | None, n: int, vocab_size: int) -> torch.Tensor:
    """The N ids (sorted) used most by the training text `samples` and by the target's own greedy choices on it
    (`target_top1`, the same shape): the tokens it reads and the tokens it produces. Ties, and any slots left
    when the text uses fewer than N distinct tokens, go to the lowest ids: a BPE vocabulary is numbered in merge
    order, so low ids are the tokenizer corpus's frequent pieces (SmolLM2's specials, bytes, common words)."""
    if not 0 < n < vocab_size:
        raise ValueError(f"a draft vocabulary has 1 to {vocab_size - 1} tokens, got {n}")
    counts = torch.bincount(samples.reshape(-1).cpu(), minlength=vocab_size).double()
    if target_top1 is not None:
        counts += torch.bincount(target_top1.reshape(-1).cpu(), minlength=vocab_size).double()
    order = torch.sort(-counts, stable=True).indices  # stable: equal counts (zero too) keep id order
    return torch.sort(order[:n]).values


def to_d2t(ids: torch.Tensor) -> torch.Tensor:
    return (ids - torch.arange(ids.numel())).long()


def from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    return (torch.arange(d2t.numel()) + d2t).long()


def output_matrix(target) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's output head as float32 (weight [V, D], bias [V] or None), dequantised when it is packed."""
    head = target.get_output_embeddings()
    w = head.dequantized_weight() if hasattr(head, "dequantized_weight") else head.weight
    bias = getattr(head, "bias", None)
    return w.detach().float(), (None if bias is None else bias.detach().float())


def gathered_rows(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output head's rows for `ids`: a copy made once (at load or before training), so that a drafted
    token's product reads N rows rather than gathering them again every step."""
    w, b = output_matrix(target)
    ids = ids.to(w.device)
    return w.index_select(0, ids).contiguous(), (None if b is None else b.index_select(0, ids).contiguous())


def spread(sub_logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over the subset -> logits over the whole vocabulary, -inf outside it: every sampler setting
    (temperature, top-k, top-p) then gives a distribution that is exactly zero outside the subset."""
    out = sub_logits.new_full(sub_logits.shape[:-1] + (vocab_size,), float("-inf"))
    return out.index_copy_(-1, ids.to(out.device), sub_logits)
