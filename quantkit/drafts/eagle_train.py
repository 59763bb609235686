"""Training an EAGLE head for a target: teacher-forced from the target's own features, one target forward per batch.

Each token sequence goes through the target once (no grad) for its final-norm features F and the distribution
its head gives at every position. The head then learns, at every position j at once, to turn
(embedding(x_j), F_{j-1}) into F_j: a smooth-L1 loss on the feature (EAGLE's regression) plus the KL divergence
from the target's distribution to the one its frozen output head gives the predicted feature (what acceptance
depends on). Nothing is sampled, so a step costs one pass of a one-layer head and the output head's products.
The held-out split reports the same loss and top-1 agreement (the head's argmax equals the target's: the
greedy acceptance rate of a one-token draft); training stops when the held-out loss stops improving, keeps the
best head, and writes a resumable state at every evaluation.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import draft_vocab
from .eagle_head import EagleHead, new_head, save_head

STATE = "train_state.pt"


@dataclass
class TrainOptions:
    steps: int = 300
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    heldout: float = 0.1  # share of the sequences kept for evaluation
    eval_every: int = 25
    patience: int = 3  # evaluations without improvement before stopping
    cls_weight: float = 1.0
    reg_weight: float = 1.0
    cls_rows: int = 512  # positions per batch whose full-vocabulary loss is computed (those products dominate)
    resume: bool = True
    vocab: int = 0  # draft among this many most frequent tokens (drafts/draft_vocab.py); 0 or >= V: all of them


@torch.no_grad()
def target_features(target, samples: list[torch.Tensor], batch_size: int) -> torch.Tensor:
    """[N, T, D] final-norm features of equal-length sequences, batch_size sequences per target forward."""
    out = []
    for i in range(0, len(samples), batch_size):
        ids = torch.stack(samples[i: i + batch_size]).to(target.get_input_embeddings().weight.device)
        out.append(target.model(input_ids=ids).last_hidden_state.float())
    return torch.cat(out)


def _loss(head: EagleHead, emb_w, out, ids, feats, top1, opts: TrainOptions, gen=None):
    """(loss, top-1 agreement) over positions 1..T-1 of a batch: ids, top1 [B, T] (top1: the target's argmax
    over the whole vocabulary), feats [B, T, D]; out = (weight, bias, ids) of the output rows the head drafts
    over (ids None: all of them)."""
    w_out, b_out, sub = out
    B, T = ids.shape
    pos = torch.arange(1, T, device=ids.device).expand(B, T - 1)
    g = head(F.embedding(ids[:, 1:], emb_w), feats[:, :-1], pos)
    want = feats[:, 1:]
    reg = F.smooth_l1_loss(g, want)
    g2, w2, t2 = g.reshape(-1, g.shape[-1]), want.reshape(-1, want.shape[-1]), top1[:, 1:].reshape(-1)
    # with a reduced vocabulary every position is cheap enough; the full one samples cls_rows of them
    if gen is not None and sub is None and g2.shape[0] > opts.cls_rows:
        pick = torch.randperm(g2.shape[0], generator=gen)[: opts.cls_rows].to(g2.device)
        g2, w2, t2 = g2[pick], w2[pick], t2[pick]
    bias = 0.0 if b_out is None else b_out
    # On a subset S the target's side is its distribution renormalised on S, p_S. Why not the full p with the
    # mass outside S counted: the draft can put no mass there whatever it learns, and the q on S that keeps the
    # most drafts (acceptance sum_t min(p, q)) is exactly p_S, where KL(p_S || q) is 0; the full-p form equals
    # p(S) * KL(p_S || q) plus a constant, i.e. the same target weighted by p(S), and p(S) needs the whole
    # 49k-row product this option exists to avoid (at the N chosen, p(S) is near 1 at most positions anyway).
    with torch.no_grad():
        logp = (w2 @ w_out.T + bias).log_softmax(-1)
        p = logp.exp()
    logq = (g2 @ w_out.T + bias).log_softmax(-1)
    cls = (p * (logp - logq)).sum(-1).mean()  # KL(target || head): 0 for a perfect head, unlike the cross-entropy
    drafted = logq.argmax(-1)
    agree = ((drafted if sub is None else sub[drafted]) == t2).float().mean()  # the greedy keep rate
    return opts.reg_weight * reg + opts.cls_weight * cls, float(agree)


@torch.no_grad()
def _evaluate(head, emb_w, out, ids, feats, top1, opts) -> tuple[float, float]:
    tot_l = tot_a = 0.0
    n = 0
    for i in range(0, ids.shape[0], opts.batch_size):
        part = slice(i, i + opts.batch_size)
        loss, agree = _loss(head, emb_w, out, ids[part], feats[part], top1[part], opts)
        b = ids[i: i + opts.batch_size].shape[0]
        tot_l, tot_a, n = tot_l + float(loss) * b, tot_a + agree * b, n + b
    return tot_l / n, tot_a / n


@torch.no_grad()
def _target_top1(feats: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    """[N, T] the target's argmax at every position, over its whole vocabulary: once per data set, one sequence
    at a time (all of them at once would be N*T*V floats)."""
    return torch.stack([(f @ w.T + (0.0 if b is None else b)).argmax(-1) for f in feats])


def _prepare(target, samples: list[torch.Tensor], opts: TrainOptions) -> dict:
    """The data a run needs: sequences in the seeded order (held-out first), the target's features and argmax,
    the embedding, and the output rows the head drafts over (the most used ones when opts.vocab cuts them)."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(opts.seed)).tolist()
    dev = target.get_input_embeddings().weight.device  # trained where the target runs (a GPU when it is on one)
    ids = torch.stack([samples[i] for i in order]).to(dev)
    t0 = time.perf_counter()
    feats = target_features(target, list(ids), opts.batch_size)
    w, b = draft_vocab.output_matrix(target)
    top1 = _target_top1(feats, w, b)
    n_held = max(1, round(len(samples) * opts.heldout))
    sub = None
    if 0 < opts.vocab < w.shape[0]:  # chosen from the training split only: the held-out text stays unseen
        sub = draft_vocab.choose_vocab(ids[n_held:], top1[n_held:], opts.vocab, w.shape[0]).to(dev)
        w, b = w.index_select(0, sub), (None if b is None else b.index_select(0, sub))
    return {"ids": ids, "feats": feats, "top1": top1, "n_held": n_held, "out": (w, b, sub),
            "emb_w": target.get_input_embeddings().weight.detach().float(), "feature_s": time.perf_counter() - t0}


def train_head(target, samples: list[torch.Tensor], out_dir, opts: TrainOptions, progress=None) -> dict:
    """Train (or resume) a head for `target` on equal-length token sequences; write it to out_dir.

    progress(step, total, info) is called after every step (info: the latest train loss and held-out figures)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(opts.seed)
    d = _prepare(target, samples, opts)
    ids, n = d["ids"], d["n_held"]
    sub = d["out"][2]
    head = new_head(target, opts.seed, {"train_seq_len": int(ids.shape[1])},
                    vocab_ids=None if sub is None else sub.cpu()).to(ids.device).train()
    optim = torch.optim.AdamW(head.parameters(), lr=opts.lr, weight_decay=0.0)
    st = {"step": 0, "best": math.inf, "bad": 0, "history": [], "best_state": None, "gen": None}
    if opts.resume and (out / STATE).is_file():
        saved = torch.load(out / STATE, weights_only=False, map_location="cpu")
        head.load_state_dict(saved["head"])
        optim.load_state_dict(saved["optim"])
        st = saved["state"]
    gen = torch.Generator().manual_seed(opts.seed)
    if st["gen"] is not None:
        gen.set_state(st["gen"])
    train = (ids[n:], d["feats"][n:], d["top1"][n:])
    held = (d["emb_w"], d["out"], ids[:n], d["feats"][:n], d["top1"][:n])
    start_step = st["step"]
    if not st["history"]:  # the untrained head's held-out figures: what training is measured against
        _checkpoint(head, optim, st, gen, held, opts, out)
    t1 = time.perf_counter()
    while st["step"] < opts.steps and st["bad"] < opts.patience:
        rows = torch.randint(0, train[0].shape[0], (opts.batch_size,), generator=gen)
        for group in optim.param_groups:  # a short warm-up: the first steps' Adam estimates are noisy
            group["lr"] = opts.lr * min(1.0, (st["step"] + 1) / 20)
        loss, agree = _loss(head, d["emb_w"], d["out"], *(t[rows] for t in train), opts, gen)
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optim.step()
        st["step"] += 1
        info = {"loss": float(loss.detach()), "agree": agree}
        if st["step"] % opts.eval_every == 0 or st["step"] == opts.steps:
            _checkpoint(head, optim, st, gen, held, opts, out)
            info.update(st["history"][-1])
        if progress is not None:
            progress(st["step"], opts.steps, info)
    head.load_state_dict(st["best_state"])
    head.cfg["quantkit_draft"].update(steps=st["step"], heldout_loss=st["best"],
                                      heldout_top1=max(h["heldout_top1"] for h in st["history"]))
    save_head(head.eval(), out)
    return {"steps": st["step"], "resumed_from": start_step, "history": st["history"], "best_loss": st["best"],
            "feature_s": d["feature_s"], "train_s": time.perf_counter() - t1, "train_tokens": int(train[0].numel()),
            "heldout_tokens": int(n * ids.shape[1]), "stopped_early": st["bad"] >= opts.patience,
            "draft_vocab": int(head.cfg.get("draft_vocab_size") or head.cfg["vocab_size"])}


def _checkpoint(head, optim, st, gen, held, opts, out: Path) -> None:
    """Evaluate on the held-out split, keep the best head, and write everything a resumed run needs."""
    head.eval()
    loss, agree = _evaluate(head, *held, opts)
    head.train()
    st["history"].append({"step": st["step"], "heldout_loss": loss, "heldout_top1": agree})
    if loss < st["best"] - 1e-4:
        st["best"], st["bad"] = loss, 0
        st["best_state"] = {k: v.detach().clone() for k, v in head.state_dict().items()}
    else:
        st["bad"] += 1
    st["gen"] = gen.get_state()
    tmp = out / (STATE + ".tmp")
    torch.save({"head": head.state_dict(), "optim": optim.state_dict(), "state": st}, tmp)
    tmp.replace(out / STATE)
