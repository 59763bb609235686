"""Calibration text sampled from the model itself, so any model can be calibrated with nothing downloaded.

Each sample starts from a different first token, drawn without replacement from the model's own
next-token distribution after its start token (natural openings, no duplicates), then continues by
temperature + top-p sampling. All randomness comes from seeded CPU generators (one for the openings, one per
sample for its continuation), so a seed, model and tokenizer give the same tokens however many rows are
sampled at once. Rows are generated in batches with a KV cache: no padding is needed
because every row has the same length.
"""
from __future__ import annotations

import hashlib

import torch

from .. import heap
from .tokens import prefix_special_ids

DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "batch_size": 32}


def _top_p_sample(logits: torch.Tensor, temperature: float, top_p: float,
                  gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row, row i drawn with gens[i]."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p (the token that crosses the line stays in).
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    pick = torch.cat([torch.multinomial(sorted_p[i:i + 1], 1, generator=gen) for i, gen in enumerate(gens)])
    return order.gather(-1, pick).squeeze(-1)


def _row_generator(seed: int, index: int) -> torch.Generator:
    """Sample INDEX's own generator: its text then does not depend on how many rows are sampled at once (which
    the memory cap sets), and two seeds share no stream."""
    digest = hashlib.sha256(f"quantkit-selfgen:{seed}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _first_tokens(model, tokenizer, context: list[int], n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    device = next(model.parameters()).device
    if context:
        logits = model(input_ids=torch.tensor([context], device=device)).logits[0, -1, :vocab].float().cpu()
        probs = torch.softmax(logits, -1)
    else:
        probs = torch.ones(vocab)
    special = [i for i in tokenizer.all_special_ids if i < vocab]
    if len(set(special)) < vocab:  # a vocabulary of special tokens only (tiny test tokenizers) keeps them
        probs[special] = 0.0
    # The candidates are the most likely openings, a pool a few times larger than needed, so that the
    # draw without replacement gives distinct yet plausible first tokens.
    k = min(max(4 * n, 1024), int((probs > 0).sum()))
    top_p, top_i = probs.topk(k)
    picks = torch.multinomial(top_p, n, replacement=n > k, generator=g)
    return top_i[picks]


def _cache_kwargs(out) -> dict:
    # transformers 5.x renamed past_key_values to cache (the old name still works, with a warning).
    if "cache" in out:
        return {"cache": out["cache"]}
    return {"past_key_values": out.past_key_values}


@torch.no_grad()
def sample_from_model(model, tokenizer, num_samples: int, seq_len: int, seed: int,
                      temperature: float = DEFAULTS["temperature"], top_p: float = DEFAULTS["top_p"],
                      batch_size: int = DEFAULTS["batch_size"], opening_model=None) -> tuple[list[torch.Tensor], dict]:
    """NUM_SAMPLES rows of SEQ_LEN tokens sampled from MODEL. opening_model: the model whose next-token
    distribution after the start picks each row's first token, when that should not be MODEL (a memory-capped
    run samples from an RTN copy but takes the float model's openings: models/streamed_forward.py says why)."""
    device = next(model.parameters()).device
    vocab = min(len(tokenizer), model.get_output_embeddings().weight.shape[0])
    prefix = prefix_special_ids(tokenizer)
    # Without a prefix the model still needs something to condition the first token on: BOS, else EOS
    # (a document boundary); that start token is not kept in the sample.
    start = [t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None][:1]
    context = prefix or start
    g = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        firsts = _first_tokens(opening_model or model, tokenizer, context, num_samples, vocab, g)
        n_new = seq_len - len(prefix) - 1
        samples = []
        for b in range(0, num_samples, batch_size):
            first = firsts[b:b + batch_size]
            gens = [_row_generator(seed, b + i) for i in range(len(first))]
            ids = torch.cat([torch.tensor(context).repeat(len(first), 1), first[:, None]], 1).long()
            out = model(input_ids=ids.to(device), use_cache=True)
            new = []
            for step in range(n_new):
                # each step's KV cache outgrows the last and the freed blocks are not reused (heap.py): trimmed every
                # 16 steps they stacked up to 50 MiB on SmolLM2 (7 rows of 128 tokens); every step costs no
                # measurable time (70.5 against 70.8 s for a whole capped run, 2-core AMD EPYC, 2026-12-04)
                heap.trim()
                nxt = _top_p_sample(out.logits[:, -1, :vocab].cpu(), temperature, top_p, gens)
                new.append(nxt)
                if step + 1 < n_new:
                    out = model(input_ids=nxt[:, None].to(device), use_cache=True, **_cache_kwargs(out))
            rows = torch.cat([ids[:, len(context) - len(prefix):]] + [t[:, None] for t in new], 1)
            samples.extend(r.clone() for r in rows)
    finally:
        model.train(was_training)
    meta = {"kind": "self", "model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
            "temperature": temperature, "top_p": top_p, "batch_size": batch_size,
            "start_context_ids": context}
    return samples, meta
