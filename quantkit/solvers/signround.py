"""Learned rounding (SignRound / AutoRound): signed-gradient descent on each weight's rounding offset and each
group's clip factors, against the decoder layer's own float output, one layer at a time (true sequential).

Per layer, every targeted integer Linear gets a LearnedRounding (signround_quant.py). A step runs `batch`
calibration samples through a float32 copy of the layer whose Linears compute with their fake-quantised weights
and moves every parameter by lr_t * sign(grad) of the output MSE, with lr_t decaying linearly to 0 over `iters`
steps (the AutoRound paper's recipe: v in [-0.5, 0.5], clip factors in [0.5, 1], lr 1/iters). The calibration
hold-out (recipe calibration.holdout, the samples every guard judges on: capture/holdout.py) is never stepped
on: the learned codes must beat plain RTN's block error there, or the layer falls back to RTN (recorded in
quantkit.json). The accepted codes go to the pipeline as already-solved QWeights, so the writer packs exactly
what was learned.

Cost: iters x batch sample-passes through one layer, forward and backward (a step's samples run as one batch
when they share their length), plus forward passes over the calibration samples for the reported losses. The
defaults (iters 40, batch 2) are a fifth of the paper's steps at a quarter of its batch, chosen for CPU time;
on SmolLM2-135M they took 1.7x GPTQ's CPU time (docs/benchmarks.md, "Learned rounding").
"""
from __future__ import annotations

import copy
import os

import torch
from torch.func import functional_call
from torch.utils._pytree import tree_map

from ..schemes import Scheme
from ..capture import holdout as calib_holdout
from ..capture import spill
from ..distributed import Pool
from .base import LayerTransform
from .signround_options import SignRoundOptions
from .signround_quant import LearnedRounding


def learnable(scheme: Scheme) -> bool:
    """Integer weight grids only: FP8/FP4 and INT8-activation Linears keep their own solvers."""
    return not (scheme.is_fp8 or scheme.is_fp4 or scheme.is_int_activations)


def _f32(obj):
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, obj)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


class _Block:
    """A float32, frozen copy of one decoder layer run with substituted weights; the targets it must hit: the
    layer's float output on its own (quantised model's) inputs. Fitting the unquantised model's output instead
    (AutoRound's choice) measured no better on SmolLM2-135M (docs/benchmarks.md) and needs a second float
    stream. When every sample has the same length and the same layer arguments (positions, mask), a step's
    samples go through the layer as one batch."""

    def __init__(self, layer, inputs, paths: list[str]):
        self.work = copy.deepcopy(layer).float()
        for p in self.work.parameters():
            p.requires_grad_(False)
        # spilled calibration states (capture/spill.py) stay on disk: the float32 copies and the targets are read
        # one sample at a time, and the targets are written beside them
        self.hidden = spill.mapped(inputs.hidden, lambda h: h.float())
        self.kwargs = [_f32(kw) for kw in inputs.kwargs]
        self.paths = paths
        shapes = spill.shapes(inputs.hidden)
        self.batchable = all(s == shapes[0] and s[0] == 1 for s in shapes) and \
            all(_same(kw, self.kwargs[0]) for kw in self.kwargs[1:])
        self.refs = spill.beside(inputs.hidden, f"signround-targets-{os.getpid()}-{id(self)}.bin")
        with torch.no_grad():
            for i, kw in enumerate(self.kwargs):
                self.refs.append(_first(self.work(self.hidden[i], **kw)).float().detach())

    def close(self) -> None:
        spill.release(self.refs)

    def loss(self, idx: list[int], weights: dict) -> torch.Tensor:
        """Mean squared error over the samples IDX (each sample's mean, averaged)."""
        if self.batchable:
            h = torch.cat([self.hidden[i] for i in idx])
            out = _first(functional_call(self.work, weights, (h,), self.kwargs[0]))
            return (out - torch.cat([self.refs[i] for i in idx])).pow(2).mean()
        return sum((_first(functional_call(self.work, weights, (self.hidden[i],), self.kwargs[i]))
                    - self.refs[i]).pow(2).mean() for i in idx) / len(idx)

    @torch.no_grad()
    def mean_loss(self, idx: list[int], rounders: dict) -> float:
        """Over the samples IDX of every rank (under torchrun each holds its share)."""
        weights = {p + ".weight": r.fake() for p, r in rounders.items()}
        return Pool.total(sum(float(self.loss([i], weights)) for i in idx)) / max(Pool.count(len(idx)), 1)


def _backward(block: _Block, picked: list[int], mine: dict[int, int], weights: dict, params: list) -> None:
    """The gradient of the step's mean loss over PICKED (whole-set sample numbers) into params' .grad. Under
    torchrun each rank differentiates the samples it holds (MINE: whole-set number -> its own index), weighted
    by their share of the step, and the gradients are summed over ranks in one all-reduce, so every rank takes
    the same step one process would (up to float32 summation order)."""
    if not Pool.active():
        block.loss(picked, weights).backward()
        return
    local = [mine[g] for g in picked if g in mine]
    if local:
        (block.loss(local, weights) * (len(local) / len(picked))).backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = Pool.sum(torch.cat([g.reshape(-1) for g in grads]))
    for p, g in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = g.view_as(p)


def sign_descent(block: _Block, rounders: dict, train: list[int], iters: int, lr: float, batch: int,
                 seed: int = 0) -> None:
    """iters signed-gradient steps on the rounders' parameters, batch training samples per step; ends on the
    last step (the hold-out guard judges it), not on the lowest batch loss as AutoRound does. Batches are drawn
    from the whole calibration set's training samples (numbered 0.. across ranks: the hold-out is the last
    ones, capture/holdout.py) by a seeded permutation every rank draws alike."""
    params = [p for r in rounders.values() for p in r.params()]
    mine = {Pool.index(j): j for j in train}
    n_train = Pool.count(len(train))
    # whole-set numbers of the training samples: under torchrun the first n_train of the set (the hold-out is
    # its last samples), in one process TRAIN itself
    everyone = list(range(n_train)) if Pool.active() else train
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    for t in range(iters):
        step = lr * (1 - t / iters)
        picked = []
        while len(picked) < min(batch, n_train):
            if not order:
                order = [everyone[j] for j in torch.randperm(n_train, generator=gen).tolist()]
            picked.append(order.pop())
        weights = {p + ".weight": r.fake() for p, r in rounders.items()}
        _backward(block, picked, mine, weights, params)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.sub_(step * torch.sign(p.grad))
                    p.grad = None
        for r in rounders.values():
            r.clamp_()


class SignRoundTransform(LayerTransform):
    """Finds the codes of a layer's integer Linears and hands them over as {"solved": {name: QWeight}}."""

    def __init__(self, model, options: SignRoundOptions | None = None, scale_dtype: torch.dtype | None = None,
                 holdout: float = calib_holdout.HOLDOUT):
        """holdout: recipe calibration.holdout, the share of samples the descent never sees."""
        o = options or SignRoundOptions()
        super().__init__(model, o)
        self.iters, self.batch, self.clip, self.holdout = o.iters, o.batch, o.clip, holdout
        self.lr = o.lr or 1.0 / self.iters
        self.scale_dtype = scale_dtype or torch.float16

    def apply(self, layer_index: int, layer, inputs, targets: dict) -> dict:
        paths = {m: p for p, m in layer.named_modules()}
        learn = {paths[m]: (n, s) for m, (n, s) in targets.items() if learnable(s)}
        if not learn:
            return {}
        block = _Block(layer, inputs, list(learn))
        rounders = {p: LearnedRounding(block.work.get_submodule(p).weight, s, self.scale_dtype, self.clip)
                    for p, (_n, s) in learn.items()}
        train, held = calib_holdout.split(len(block.hidden), self.holdout)
        # no hold-out anywhere (one sample): the guard can only check the fit itself. A rank whose share holds
        # none of the held-out samples still judges on its (empty) part of them, as the pooled losses need.
        judge = train if held is None else held
        held = held or []
        try:
            initial, rtn_held = block.mean_loss(train, rounders), block.mean_loss(judge, rounders)
            sign_descent(block, rounders, train, self.iters, self.lr, self.batch, seed=layer_index)
            final, learned_held = block.mean_loss(train, rounders), block.mean_loss(judge, rounders)
        finally:
            block.close()
        keep = learned_held <= rtn_held
        common = {"signround_iters": self.iters, "signround_initial_loss": initial, "signround_final_loss": final,
                  "signround_heldout_rtn_loss": rtn_held, "signround_heldout_loss": learned_held,
                  "signround_heldout_samples": Pool.count(len(held))}
        stats = {n: {**common, "signround_mean_abs_v": rounders[p].mean_abs_v(),
                     "signround_fallback": None if keep else "rtn (learned rounding lost on held-out samples)"}
                 for p, (n, _s) in learn.items()}
        solved = {n: rounders[p].qweight() for p, (n, _s) in learn.items()} if keep else {}
        return {"stats": stats, "solved": solved}
