"""SmoothQuant before W8A8: per-channel scales that move activation outliers into the weights, as a LayerTransform.

INT8 activations with one scale per token lose every channel but the largest to rounding when a few channels
carry outliers 100x the rest (SmolLM2's residual stream does). Dividing input channel j by
s_j = max|x_j|^a / max|w_j|^(1-a) (max over calibration tokens and over the group's Linears' rows) and multiplying
the Linears' column j by s_j flattens the activations at the cost of the weights; the division is folded into the
previous norm's gain or previous Linear's rows with AWQ's per-architecture maps (awq_maps.py, awq_fold.py), so the
float model is unchanged.

The migration strength a is searched per scale group like AWQ's, on an 11-point grid in [0, 1]: the measured
block (awq_maps.ScaleGroup.block) is run on SEARCH_TOKENS calibration tokens with its w8a8 Linears quantised
exactly as they will run (INT8 RTN weights per channel, INT8 inputs per token, or per tensor for w8a8-static with
the batch's absmax standing in for the calibrated scale), and the a with the least output error is kept; none,
when no smoothing beats the unsmoothed error. A fixed alpha (SmoothQuantOptions.alpha, recipe
quant.smoothquant.alpha) skips the search. The chosen a is recorded per Linear in quantkit.json (smooth_alpha).
"""
from __future__ import annotations

import torch

from ..errors import UserError
from ..linear.int8 import QMAX, quantize_per_token
from ..schemes import Scheme
from .awq import AWQTransform, pick_alpha
from .awq_block import block_error, fake_quantize, measured_copy
from .awq_maps import ScaleGroup, map_for, mapped_architectures
from .base import LayerTransform
from .smoothquant_options import SmoothQuantOptions

GRID = 11
# Calibration tokens (whole samples) the alpha search runs each block on; max|x| uses every token. A quarter of
# AWQ's budget: the search is most of the cost (12 block runs per scale group) and W8A8's error is smooth in alpha.
SEARCH_TOKENS = 512
_FLOOR = 1e-5  # max|x| and max|w| floors: a dead channel keeps a finite, non-zero scale


def smooth_scales(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s per input channel: max|x|^a / max|w|^(1-a)."""
    return (x_max.clamp_min(_FLOOR).pow(alpha) / w_max.clamp_min(_FLOOR).pow(1 - alpha)).clamp_min(_FLOOR)


def fake_quantize_input(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """x after INT8 quantisation and back: per token (the runtime's rule, linear/int8.py) or one scale for the
    whole tensor."""
    if per_token:
        q, s = quantize_per_token(x.reshape(-1, x.shape[-1]))
        return (q.float() * s).reshape(x.shape).to(x.dtype)
    s = (x.abs().amax().float() / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.round(x.float() / s).clamp(-QMAX - 1, QMAX) * s).to(x.dtype)


class SmoothQuantTransform(AWQTransform):
    STAT_ALPHA, STAT_ERROR, STAT_BASE = "smooth_alpha", "smooth_block_error", "unsmoothed_block_error"

    def __init__(self, model, options: SmoothQuantOptions | None = None, scale_dtype: torch.dtype | None = None):
        """options: recipe quant.smoothquant (alpha None: searched per layer); scale_dtype as AWQTransform's."""
        o = options or SmoothQuantOptions()
        LayerTransform.__init__(self, model, o)
        self.alpha = o.alpha
        self.grid, self.duo, self.clip = GRID, False, False
        self.holdout = 0.0  # AWQ's held-out guard scores weight-only scaling; SmoothQuant's error is W8A8's
        self.search_tokens = SEARCH_TOKENS
        self.scale_dtype = scale_dtype
        self.model_type = getattr(model.config, "model_type", type(model).__name__)
        self.arch = map_for(model.config)
        if self.arch is None:
            raise UserError(f"SmoothQuant has no scaling map for model type '{self.model_type}' (mapped: "
                            f"{', '.join(mapped_architectures())}); drop quant.smooth")

    def searchable(self, scheme: Scheme) -> bool:
        return scheme.is_int_activations

    @torch.no_grad()
    def _search(self, block, group: ScaleGroup, linears: dict, quantised: dict, data):
        # weighted by output power, as measured for W8A8 (docs/benchmarks.md); AWQ weighs tokens equally
        work, copies, originals, refs, weights = measured_copy(block, group, linears, data, per_token=False)
        scale_dtype = self._scale_dtype(next(iter(linears.values())).weight.dtype)
        w_max = torch.cat([originals[n] for n in quantised]).abs().amax(0)
        current = {}

        def quantised_input(mod, args):
            # the Linear's input after smoothing (x / s), on the INT8 grid it will run on
            return (fake_quantize_input(args[0] / current["s"], mod.per_token),)

        handles = []
        for n, sch in quantised.items():
            copies[n].per_token = sch.activations == "dynamic"
            handles.append(copies[n].register_forward_pre_hook(quantised_input))

        def error(s: torch.Tensor) -> float:
            current["s"] = s
            for n, sch in quantised.items():
                copies[n].weight.data = fake_quantize(originals[n] * s, sch, scale_dtype)
            return block_error(work, data, refs, weights)

        alphas = [self.alpha] if self.alpha is not None else torch.linspace(0, 1, self.grid).tolist()
        try:
            return pick_alpha(error, [(a, smooth_scales(data.abs_max, w_max, a)) for a in alphas],
                              keep_baseline=self.alpha is None)
        finally:
            for h in handles:
                h.remove()
