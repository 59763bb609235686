"""Shared bench helpers: prompt sets, model loading, timing."""
from __future__ import annotations

import contextlib

import json
import time
from pathlib import Path

import torch

PROMPTS = Path(__file__).parent / "prompts"
SETS = ("code_edit", "summarise_quotes", "open_prose")


def prompt_ids(tok, name: str, limit: int | None = None) -> list[list[int]]:
    rows = [json.loads(line) for line in (PROMPTS / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    out = []
    for r in rows[:limit]:
        text = r["instruction"] + ("\n\n" + r["input"] if r["input"] else "")
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        # A started answer (e.g. the code fence and first line) keeps a 135M model on task.
        prefix = tok(r.get("response_prefix", ""), add_special_tokens=False)["input_ids"]
        out.append(list(ids) + list(prefix))
    return out


def _best_seconds(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes moved per second by a large tensor copy (read + write both counted), best of reps."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), reps)


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes read per second by a reduction over a large tensor, best of reps: what a decode step does with its
    weights (reads them once, writes almost nothing), so the honest denominator of the weight-reading limit."""
    src = torch.randn(nbytes // 4)
    return nbytes / _best_seconds(src.sum, reps)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer once; a tied embedding is read once
    (as lm_head), and the embedding lookup itself only touches one row."""
    from quantkit.linear.opaque import OpaqueLinear

    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or not t.is_floating_point() and t.dtype not in (torch.int32, torch.int8, torch.uint8):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    total += sum(m.nbytes for m in model.modules() if isinstance(m, OpaqueLinear))  # oneDNN / FBGEMM layouts
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if isinstance(head, OpaqueLinear) or emb.data_ptr() != head.weight.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def decode_ours(model, prompts, params, k, make_drafter, eos):
    """quantkit's decode loop over prompts: (decode tok/s, tok/s with prefill, tokens per target forward, outputs).
    Decode leaves out the prefill and the token it yields: speculation and loop overhead change only the rest."""
    from quantkit.runtime.generate import generate

    toks = fwd = dec_toks = 0
    dec_secs = 0.0
    t = time.perf_counter()
    outs = []
    for ids in prompts:
        seq = generate(model, ids, params, drafter=make_drafter() if make_drafter else None,
                       num_speculative_tokens=k, eos=eos)
        m = seq.metrics
        toks += m.output_tokens
        fwd += m.target_forwards
        dec_toks += m.output_tokens - 1
        dec_secs += m.t_last - m.t_first
        outs.append(seq.output_ids())
    return dec_toks / dec_secs, toks / (time.perf_counter() - t), toks / fwd, outs


def decode_hf(model, prompts, n, **kw):
    """As decode_ours, for transformers' greedy generate (kw: its options): its prefill is timed separately on
    the same prompt (one forward keeping the last logits, as generate does) and taken off, with the one token
    it yields. Tokens per forward is None: generate does not report it."""
    toks = dec_toks = 0
    total = dec_secs = 0.0
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        t = time.perf_counter()
        model(x, logits_to_keep=1)
        pre = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(x, do_sample=False, max_new_tokens=n, pad_token_id=0, **kw)
        secs = time.perf_counter() - t
        new = out[0, len(ids):].tolist()
        toks += len(new)
        dec_toks += len(new) - 1
        total += secs
        dec_secs += secs - pre
        outs.append(new)
    return dec_toks / dec_secs, toks / total, None, outs


@contextlib.contextmanager
def half_weights(allowed: bool):
    """Load with or without FBGEMM's float16 weights (relayout.py asks half_weight_linear.available)."""
    from quantkit.linear import half_weight as half_weight_linear

    real = half_weight_linear.available
    if not allowed:
        half_weight_linear.available = lambda: False
    try:
        yield
    finally:
        half_weight_linear.available = real
