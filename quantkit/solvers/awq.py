"""AWQ: activation-aware per-channel scaling before quantisation, as a LayerTransform.

For each ScaleGroup of the architecture's map (awq_maps.py) the Linears' weight columns are multiplied by
s = mean|x|^a (or, 'duo', mean|x|^a / mean|w|^(1-a)), normalised to a geometric mean of 1 over its extremes, and
the previous operation's output is divided by s (awq_fold.py), so the float model is unchanged while the
channels that carry large activations get finer quantisation steps. a is picked on a grid in [0, 1] by the
output error of the measured block (attention, MLP, or a Linear) on calibration inputs when its targeted Linears
are fake-quantised with their own scheme (RTN from rtn.py), each token's error taken relative to its own output
(awq_block.py). After all groups are folded, each targeted Linear's groups are clamped to the range that
minimises its output error, every token weighing the same, with a ridge term and the Gram's off-diagonal part
shrunk the more the fewer calibration tokens it was measured on (awq_clip.py); the later RTN or GPTQ solve then
sees the clipped range.

Memory and time: mean|x| and the clip Gram matrices use every calibration token, but the alpha search runs the
block on whole samples up to SEARCH_TOKENS tokens (attention mixes tokens, so samples are kept whole; at least
one sample is always kept), which bounds it to (grid + 1) x (SEARCH_TOKENS tokens through one block) per group
and keeps only those samples' block inputs in memory. 2048 tokens: the search is most of AWQ's cost on a CPU
(about 40 GFLOP per alpha per layer of SmolLM2-135M at 4096 tokens); bench/awq_quality.py --search-tokens
measures what a larger budget buys.

FP8-targeted Linears in a group are left unquantised during the search and are not clipped.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from ..capture.holdout import HOLDOUT
from ..capture.layer import feed_group, split_inputs
from .. import heap
from ..errors import UserError
from ..schemes import Scheme, scale_dtype_for
from .awq_clip import GramAccumulator, apply_clip, group_width, search_clip
from .decorrelation import decorrelation
from .awq_fold import fold_scales, prev_width
from .awq_block import _capture_group, _GroupData, quantised_error
from .awq_guard import guard_clip, held_out_grams, scale_guard
from .awq_maps import ArchMap, ScaleGroup, map_for, mapped_architectures
from .awq_options import SEARCH_TOKENS, AWQOptions
from .base import LayerTransform

CLIP_GRID = 20
CLIP_MAX_SHRINK = 0.5
# floor of mean|x| and mean|w| before the power: a dead channel must not get a zero (or infinite) scale
_FLOOR = 1e-4


def normalised_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """s per input channel for one alpha: mean|x|^a (/ mean|w|^(1-a) for duo), geometric midpoint 1."""
    s = x_mean.clamp_min(_FLOOR).pow(alpha)
    if w_mean is not None:
        s = s / w_mean.clamp_min(_FLOOR).pow(1 - alpha)
    s = s.clamp_min(_FLOOR)
    return s / (s.max() * s.min()).sqrt()


def weight_profile(weights: list[torch.Tensor], gs: int) -> torch.Tensor:
    """mean over output rows of |w| relative to its group's max |w|: the duo form's per-column weight size."""
    w = torch.cat([x.float() for x in weights], 0)
    out, n_in = w.shape
    wg = w.abs().reshape(out, n_in // gs, gs)
    wg = wg / wg.amax(-1, keepdim=True).clamp_min(1e-12)
    return wg.reshape(out, n_in).mean(0)


def pick_alpha(error, candidates, keep_baseline: bool = True, min_gain: float = 0.0):
    """(alpha, s, error, baseline error) of the best (alpha, s) candidate by error(s); alpha None when no
    candidate beats s = 1 (keep_baseline), else the best candidate even when it does not.

    min_gain > 0: the first candidate (the mildest scaling, candidates ascend in alpha) whose error is within
    that share of the best: a stronger scaling must gain more than min_gain over every milder one, and a gain
    smaller than that on calibration text is more likely fitted to it."""
    first = candidates[0][1]
    base = error(torch.ones_like(first))
    scored = [(error(s), alpha, s) for alpha, s in candidates if torch.isfinite(s).all()]
    best = (base, None, None) if keep_baseline else (float("inf"), None, None)
    for e, alpha, s in scored:
        if e < best[0] or (best[1] is None and e <= best[0]):  # alpha 0 ties the baseline: record it
            best = (e, alpha, s)
    if min_gain > 0 and best[1] is not None:
        best = next(c for c in scored if c[0] <= best[0] * (1 + min_gain))
    e, alpha, s = best
    return (None if alpha is None else round(alpha, 4)), s, e, base


class AWQTransform(LayerTransform):
    # quantkit.json keys: the chosen alpha, the block error with it and without scaling
    STAT_ALPHA, STAT_ERROR, STAT_BASE = "awq_alpha", "awq_block_error", "rtn_block_error"

    def __init__(self, model, options: AWQOptions | None = None, scale_dtype: torch.dtype | None = None,
                 holdout: float = HOLDOUT):
        """holdout: recipe calibration.holdout, the share of samples kept out of the search to check its choices
        (awq_guard.py)."""
        o = options or AWQOptions()
        super().__init__(model, o)
        self.grid, self.duo, self.clip, self.min_gain = o.grid, o.duo, o.clip, o.min_gain
        self.search_tokens, self.holdout, self.clip_prior = o.search_tokens, holdout, o.clip_prior_tokens
        # the dtype the checkpoint stores scales in (the plan's rule); None: the layer's own, float16 for float32
        self.scale_dtype = scale_dtype
        cfg = model.config
        self.arch: ArchMap | None = map_for(cfg)
        self.model_type = getattr(cfg, "model_type", type(model).__name__)
        if self.arch is None:
            mapped = ", ".join(mapped_architectures())
            if o.fallback != "rtn":
                raise UserError(f"AWQ has no scaling map for model type '{self.model_type}' (mapped: {mapped}); "
                                "use --method rtn or gptq, or --set quant.awq.fallback=rtn to quantise it without AWQ scaling")
            warnings.warn(f"AWQ has no scaling map for model type '{self.model_type}' (mapped: {mapped}); "
                          "its Linears are quantised without AWQ scaling or clipping (quant.awq.fallback rtn)",
                          stacklevel=2)

    def apply(self, layer_index: int, layer, inputs, targets: dict) -> dict:
        if self.arch is None:
            note = f"no AWQ map for '{self.model_type}': quantised without AWQ scaling"
            return {"stats": {n: {"awq_alpha": None, "awq_note": note} for n, _ in targets.values()}, "tensors": {}}
        by_rel = {}
        for name, mod in layer.named_modules():
            if mod in targets:
                by_rel[name] = targets[mod]
        stats: dict[str, dict] = {}
        search, hold = split_inputs(inputs, self.holdout)
        for group in self.arch.groups:
            self._scale(layer, group, search, hold, by_rel, stats)
            heap.trim()  # each search's freed temporaries, before the next piles on them (heap.py)
        if self.clip:
            self._clip(layer, search, hold, by_rel, stats)
            heap.trim()
        return {"stats": stats, "tensors": {}}

    # ---------------------------------------------------------------------------------------------------------
    def _scale(self, layer, group: ScaleGroup, inputs, hold, by_rel: dict, stats: dict) -> None:
        missing = [n for n in (group.prev, group.block, *group.linears) if not _has(layer, n)]
        if missing:
            warnings.warn(f"AWQ map for '{self.model_type}' names {', '.join(missing)}, which this model's layer "
                          "lacks; that group is left unscaled", stacklevel=2)
            return
        linears = {n: layer.get_submodule(n) for n in group.linears}
        quantised = {n: by_rel[n][1] for n in linears if n in by_rel and self.searchable(by_rel[n][1])}
        full = {n: by_rel[n][0] for n in linears if n in by_rel}
        if not quantised:
            return
        widths = {m.weight.shape[-1] for m in linears.values()}  # a router is not an nn.Linear
        if len(widths) != 1 or prev_width(layer, group) not in widths:
            for n in full.values():  # e.g. v_proj -> o_proj under grouped-query attention
                stats.setdefault(n, {}).update({self.STAT_ALPHA: None, self.STAT_ALPHA.replace("alpha", "note"):
                                                f"not scaled: {group.prev} output width != input width of "
                                                f"{', '.join(group.linears)}"})
            return
        block = layer.get_submodule(group.block)
        data = _capture_group(layer, block, linears[group.linears[0]], inputs, self.search_tokens)
        if data.tokens == 0:  # an expert routing gave no calibration token: nothing to judge a scale by
            for n in full.values():
                stats.setdefault(n, {}).update({self.STAT_ALPHA: None, "awq_note": "no calibration tokens"})
            return
        alpha, s, err, base = self._search(block, group, linears, quantised, data)
        heap.trim()
        guard = None
        if alpha is not None and hold is not None:
            guard = scale_guard(layer, block, group, linears, quantised, hold, s,
                                self._scale_dtype(next(iter(linears.values())).weight.dtype))
            if guard is not None:
                alpha = None  # the search's choice lost to plain RTN scales on held-out calibration samples
        if alpha is not None:
            fold_scales(layer, group, s, self.arch.norm_offset)
        for n in full.values():
            stats.setdefault(n, {}).update({self.STAT_ALPHA: alpha, self.STAT_ERROR: err, self.STAT_BASE: base,
                                            "awq_guard": guard})

    def searchable(self, scheme: Scheme) -> bool:
        """Whether a Linear with this scheme is quantised during the search (FP8 ones are left in float)."""
        return not scheme.is_fp8

    def _scale_dtype(self, weight_dtype: torch.dtype) -> torch.dtype:
        """Searches score the scales the checkpoint will hold: on a CPU the model computes in float32 while a
        bfloat16 model's scales are stored in bfloat16, so the weight's own dtype is the wrong guide."""
        return self.scale_dtype if self.scale_dtype is not None else scale_dtype_for(weight_dtype)

    @torch.no_grad()
    def _search(self, block, group: ScaleGroup, linears: dict, quantised: dict, data: _GroupData):
        scale_dtype = self._scale_dtype(next(iter(linears.values())).weight.dtype)
        error, originals = quantised_error(block, group, linears, quantised, data, scale_dtype)
        gs = group_width(next(iter(quantised.values())), next(iter(linears.values())).weight.shape[-1])
        w_mean = weight_profile([originals[n] for n in quantised], gs) if self.duo else None
        return pick_alpha(error, [(a, normalised_scales(data.x_mean, w_mean, a))
                                  for a in torch.linspace(0, 1, self.grid).tolist()], min_gain=self.min_gain)

    @torch.no_grad()
    def _clip(self, layer, inputs, hold, by_rel: dict, stats: dict) -> None:
        todo = {layer.get_submodule(n): (n, *by_rel[n]) for n in by_rel
                if not by_rel[n][1].is_fp8 and n not in self.arch.no_clip}
        if not todo:
            return
        grams = {m: GramAccumulator(m.in_features, group_width(sch, m.in_features), m.weight.device)
                 for m, (_, _, sch) in todo.items()}
        feed_group(layer, list(todo), inputs, lambda m, x: grams[m].add(x))
        grams = {m: g.pooled() for m, g in grams.items()}
        held = held_out_grams(layer, todo, hold)
        for m, (_, full, sch) in todo.items():
            if grams[m].tokens == 0:  # an expert no calibration token reached keeps its full range
                continue
            w, sd = m.weight.data.float(), self._scale_dtype(m.weight.dtype)
            decorrelate = decorrelation(grams[m].tokens, self.clip_prior)
            ratio = search_clip(w, grams[m].gram, sch, CLIP_GRID, CLIP_MAX_SHRINK, sd, decorrelate=decorrelate)
            reverted = 0
            if m in held and held[m].tokens:
                ratio, reverted = guard_clip(w, ratio, held[m].gram, sch, sd)
            m.weight.data = apply_clip(w, ratio, sch).to(m.weight.dtype)
            stats.setdefault(full, {}).update(awq_clip_mean=round(float(ratio.mean()), 4),
                                              awq_clip_min=round(float(ratio.min()), 4),
                                              awq_clip_reverted=reverted,
                                              awq_clip_decorrelate=round(decorrelate, 4))


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
        return True
    except AttributeError:
        return False
