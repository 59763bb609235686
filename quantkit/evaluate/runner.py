"""The eval run: baseline first, then each variant alone on the very same windows and prompts.

The baseline's log-probabilities at every scored position are stored (store.py) so a variant never shares
memory with it; KL, token agreement, perplexity, exact match, latency and memory are gathered per variant,
then summarised overall and per task.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from . import agreement as A
from .cache import kv_cache_kind
from .generation import answer_logprobs, greedy_answer
from .latency import latency_stats
from .memory import PeakMemory, checkpoint_bytes, config_of, kv_bytes_per_token
from .models import ModelSpec
from .perplexity import nll, perplexity, scored_positions, window_logprobs
from .store import LogProbStore

WORST_N = 10
_CONTEXT_CHARS = 80


@dataclass
class _Tokens:
    """Per scored position of one model: KL from the base, agreement, and where it was (for the worst list)."""
    kl: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    where: list[tuple] = field(default_factory=list)  # (kind, key, position, base_top, variant_top)


def _dtype_for(device: str, dtype):
    if dtype is not None:
        return dtype
    # CPUs have slow half-precision matmuls; float32 computes the same model at least as exactly.
    return "float32" if str(device) == "cpu" else None


def _compare(store: LogProbStore, key: str, logp: torch.Tensor, is_base: bool, tokens: _Tokens, kind: str,
             first: int = 0):
    if is_base:
        store.put(key, logp)
        kl = torch.zeros(logp.shape[0])
        agree = torch.ones(logp.shape[0], dtype=torch.bool)
        top = logp.argmax(-1).cpu()
        base_top = top
    else:
        base = store.get(key).to(logp.device)
        if base.shape != logp.shape:
            raise UserError(f"variant vocabulary ({logp.shape[-1]}) differs from the baseline's ({base.shape[-1]}); "
                            "compare checkpoints of the same model")
        kl = A.kl_per_token(base, logp).cpu()
        agree = A.top1_agreement(base, logp).cpu()
        base_top, top = base.argmax(-1).cpu(), logp.argmax(-1).cpu()
    tokens.kl += kl.tolist()
    tokens.agree += agree.tolist()
    tokens.where += [(kind, key, first + i, int(b), int(t)) for i, (b, t) in enumerate(zip(base_top, top))]
    return kl


def _eval_windows(model, windows, body, stride, device, store, is_base, tokens) -> dict:
    total, n = 0.0, 0
    for i, w in enumerate(windows):
        logp = window_logprobs(model, w, device)
        k = scored_positions(len(w), i, stride, body)
        logp = logp[-k:]
        total += float(nll(logp, w[-k:]).double().sum())
        n += k
        _compare(store, f"w{i}", logp, is_base, tokens, "text", first=len(w) - k)
    return {"ppl": perplexity(total, n), "nll_tokens": n}


def _eval_tasks(model, tok, tasks, prompts, max_new, device, store, is_base, base_answers, tokens) -> dict:
    # One untimed request first: the first forward pays for lazy initialisation (kernels, allocator).
    greedy_answer(model, tok, prompts[0], 2, device)
    answers, per_item = [], []
    for t, p in zip(tasks, prompts):
        ans = greedy_answer(model, tok, p, max_new, device)
        answers.append(ans)
        ref_ids = ans.ids if is_base else base_answers[t.id]["ids"]
        start = len(tokens.kl)
        if ref_ids:
            kl = _compare(store, f"t:{t.id}", answer_logprobs(model, p, ref_ids, device), is_base, tokens, "task")
        else:
            kl = torch.zeros(0)
        agree = tokens.agree[start:]
        base_text = ans.text if is_base else base_answers[t.id]["text"]
        per_item.append({
            "id": t.id, "task": t.task, "output": ans.text, "tokens": len(ans.ids),
            "exact_match": None if t.answer is None else A.exact_match(ans.text, t.answer),
            "same_answer": A.same_answer(ans.text, base_text),
            "token_agreement": (sum(agree) / len(agree)) if agree else None,
            "kl": kl.tolist(),
        })
    lat = latency_stats([a.seconds for a in answers], [len(a.ids) for a in answers], [a.ttft_s for a in answers])
    return {"items": per_item, "answers": answers, "latency": lat}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _task_summary(items: list[dict]) -> dict:
    def summ(group):
        kls = [k for it in group for k in it["kl"]]
        em = [it["exact_match"] for it in group if it["exact_match"] is not None]
        st = A.kl_stats(kls)
        return {"n": len(group), "n_with_answer": len(em), "exact_match": _mean([float(x) for x in em]),
                "answer_agreement": _mean([float(it["same_answer"]) for it in group]),
                "token_agreement": _mean([it["token_agreement"] for it in group]),
                "kl_mean": st["mean"], "kl_p99": st["p99"], "kl_max": st["max"]}

    by: dict[str, list] = {}
    for it in items:
        by.setdefault(it["task"], []).append(it)
    return {"all": summ(items), "per_task": {name: summ(g) for name, g in sorted(by.items())}}


def _worst(tokens: _Tokens, tok, windows, task_ctx) -> list[dict]:
    order = sorted(range(len(tokens.kl)), key=lambda i: -tokens.kl[i])[:WORST_N]
    out = []
    for i in order:
        kind, key, pos, base_top, var_top = tokens.where[i]
        if kind == "text":
            w = windows[int(key[1:])].tolist()
            ctx_ids, nxt = w[:pos], w[pos]
        else:
            prompt, ids = task_ctx[key[2:]]
            ctx_ids, nxt = prompt + ids[:pos], ids[pos]
        out.append({"kl": tokens.kl[i], "source": "text window" if kind == "text" else "task",
                    "where": key[1:] if kind == "text" else key[2:], "position": pos,
                    "context": tok.decode(ctx_ids, skip_special_tokens=True)[-_CONTEXT_CHARS:],
                    "next_token": tok.decode([nxt]), "base_top": tok.decode([base_top]),
                    "variant_top": tok.decode([var_top])})
    return out


def evaluate_model(spec: ModelSpec, *, is_base: bool, tok, windows, body, stride, tasks, prompts, max_new,
                   device, dtype, store, base_answers, log) -> dict:
    from ..runtime.checkpoint import load

    peak = PeakMemory(device)
    gc.collect()
    peak.reset()
    t0 = time.time()
    model = load(spec.path, device=device, dtype=dtype, exact=True)  # scored as stored, not re-laid
    log(f"{spec.label}: loaded in {time.time() - t0:.1f} s")
    cfg = config_of(spec.path)
    dtype_bytes = next(p.element_size() for p in model.parameters() if p.is_floating_point())
    tokens = _Tokens()
    if spec.gguf is not None:  # scored as its dequantised float folder; described and sized as the file
        from ..inspect_gguf import describe

        quant, weight_bytes = describe(spec.gguf), spec.gguf.stat().st_size
    else:
        quant, weight_bytes = _describe_quant(cfg), checkpoint_bytes(spec.path)
    row = {"label": spec.label, "path": str(spec.gguf or spec.path), "is_base": is_base, "quantized": spec.quantized,
           "quantization": quant, "weight_bytes": weight_bytes,
           "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype_bytes), "kv_cache": kv_cache_kind(model)}
    if windows:
        row.update(_eval_windows(model, windows, body, stride, device, store, is_base, tokens))
        row["kl_text"] = A.kl_stats(tokens.kl)
        log(f"{spec.label}: perplexity {row['ppl']:.4f} over {row['nll_tokens']} tokens")
    n_text = len(tokens.kl)
    task_out = None
    if tasks:
        task_out = _eval_tasks(model, tok, tasks, prompts, max_new, device, store, is_base, base_answers, tokens)
        row.update(_task_summary(task_out["items"]))
        row["kl_tasks"] = A.kl_stats(tokens.kl[n_text:])
        row["latency"] = task_out["latency"]
        log(f"{spec.label}: {len(tasks)} tasks, exact match {row['all']['exact_match']}")
    row["kl"] = A.kl_stats(tokens.kl)
    row["token_agreement"] = _mean([float(x) for x in tokens.agree])
    row["peak_memory_bytes"] = peak.read()
    row["peak_memory_kind"] = peak.kind
    task_ctx = {t.id: (p, (task_out["answers"][i].ids if is_base else base_answers[t.id]["ids"]))
                for i, (t, p) in enumerate(zip(tasks or [], prompts or []))}
    row["worst"] = [] if is_base else _worst(tokens, tok, windows, task_ctx)
    del model
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return {"row": row, "items": task_out["items"] if task_out else [], "kl": tokens.kl,
            "answers": {t.id: {"ids": a.ids, "text": a.text} for t, a in zip(tasks, task_out["answers"])}
            if task_out else {}}


def _describe_quant(cfg: dict) -> str:
    qc = cfg.get("quantization_config")
    if not qc:
        return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float")
    parts = []
    for g in (qc.get("config_groups") or {}).values():
        w = g.get("weights") or {}
        a = g.get("input_activations")
        s = f"{'fp' if w.get('type') == 'float' else 'int'}{w.get('num_bits')}"
        s += f" g{w['group_size']}" if w.get("group_size") else ""
        s += " a8" if a else ""
        parts.append(s)
    if qc.get("kv_cache_scheme"):
        parts.append("fp8 kv")
    return ", ".join(parts) or "quantized"
