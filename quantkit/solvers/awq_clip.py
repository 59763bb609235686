"""AWQ's per-group clip search, judged by the Linear's own output error on the calibration inputs.

For a group g of columns the output error of a weight change dw over the tokens is sum_t (x_t,g . dw_g)^2 =
dw_g^T G_g dw_g with G_g = sum_t x_t,g x_t,g^T, the group's block of the Gram matrix. Accumulating G once
(tokens x in x group_size) makes each candidate ratio cost out x in x group_size, whatever the token count,
so every calibration token counts. Cross-group terms are left out, as each group's range is chosen on its own.

Three choices make the clip carry over to text other than the calibration's (docs/benchmarks.md, "Every token
counts the same" and "A clip that carries across domains"): each token's input is scaled to unit RMS before it
enters G, so a few tokens with outsized activations do not decide every range; G's off-diagonal part is shrunk
towards zero by decorrelation(tokens) (decorrelation.py, the rule GPTQ's Hessian follows too), because how a
group's channels move together is a trait of the calibration text's domain while how large each channel is
carries to other text: G is estimated as if CLIP_PRIOR_TOKENS (awq_options.py) more
tokens had uncorrelated channels (a covariance shrunk towards its diagonal, the weight of the target falling as
the calibration text grows); and G is damped towards its mean diagonal (ridge, CLIP_DAMP of it), so a direction
the calibration text never excites still costs something when a clip moves weight along it.
"""
from __future__ import annotations

import torch

from ..distributed import Pool
from ..schemes import Scheme
from .base import unit_rms
from .rtn import dequantize_groups, qparams, quantize_groups


def group_width(scheme: Scheme, in_features: int) -> int:
    return in_features if scheme.group_size == -1 else scheme.group_size


CLIP_DAMP = 0.1


class GramAccumulator:
    """Block-diagonal X^T X of one Linear's inputs, one [gs, gs] block per group, read in float32; every token
    scaled to unit RMS first. The blocks are summed in float64, so that the order the samples arrive in (one
    process, or several ranks pooled) does not move the clip search's near-ties."""

    def __init__(self, in_features: int, gs: int, device):
        self.gs = gs
        self.total = torch.zeros(in_features // gs, gs, gs, device=device, dtype=torch.float64)
        self.tokens = 0

    @property
    def gram(self) -> torch.Tensor:
        return self.total.float()

    def pooled(self) -> "GramAccumulator":
        """Every rank's Gram blocks and tokens (distributed.Pool), as one process fed every sample would hold."""
        Pool.sum(self.total)
        self.tokens = Pool.count(self.tokens)
        return self

    def add(self, x: torch.Tensor) -> None:
        xg = unit_rms(x.reshape(-1, x.shape[-1]).float()).reshape(-1, self.total.shape[0], self.gs)
        self.total += torch.einsum("ngi,ngj->gij", xg, xg)
        self.tokens += xg.shape[0]


def _bounds(wg: torch.Tensor, scheme: Scheme, ratio: torch.Tensor | float):
    if scheme.symmetric:
        hi = wg.abs().amax(-1) * ratio
        return -hi, hi
    return wg.amin(-1) * ratio, wg.amax(-1) * ratio


@torch.no_grad()
def clip_error(w: torch.Tensor, gram: torch.Tensor, scheme: Scheme, ratio, scale_dtype=torch.float16) -> torch.Tensor:
    """[out, groups]: each group's output error dw^T G dw when its range is shrunk by RATIO (a float, or a
    tensor [out, groups]) and it is then rounded as RTN will round it after apply_clip."""
    out, n_in = w.shape
    gs = group_width(scheme, n_in)
    wg = w.float().reshape(out, n_in // gs, gs)
    lo, hi = _bounds(wg, scheme, ratio)
    wc = torch.clamp(wg, lo.unsqueeze(-1), hi.unsqueeze(-1))
    s, z = qparams(lo, hi, scheme, scale_dtype)
    dw = dequantize_groups(quantize_groups(wc, s, z, scheme), s, z) - wg
    return (torch.einsum("ogi,gij->ogj", dw, gram) * dw).sum(-1)


@torch.no_grad()
def damped(gram: torch.Tensor, damp: float, decorrelate: float = 0.0) -> torch.Tensor:
    """Each group's Gram block with its off-diagonal entries scaled by 1 - DECORRELATE, plus DAMP x its mean
    diagonal on the diagonal."""
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)
    if decorrelate:
        gram = (1 - decorrelate) * gram + decorrelate * torch.diag_embed(diag)
    if not damp:
        return gram
    d = diag.mean(-1)
    return gram + damp * d[:, None, None] * torch.eye(gram.shape[-1], device=gram.device, dtype=gram.dtype)


@torch.no_grad()
def search_clip(w: torch.Tensor, gram: torch.Tensor, scheme: Scheme, grid: int = 20, max_shrink: float = 0.5,
                scale_dtype=torch.float16, damp: float = CLIP_DAMP,
                decorrelate: float = 0.0) -> torch.Tensor:
    """The ratio [out, groups] of each group's range (1 = unclipped) with the least output error under the
    decorrelated and damped Gram."""
    gram = damped(gram, damp, decorrelate)
    best_err, best = None, None
    for i in range(grid):
        ratio = 1.0 - max_shrink * i / grid
        err = clip_error(w, gram, scheme, ratio, scale_dtype)
        if best is None:
            best_err, best = err, torch.full_like(err, ratio)
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, ratio), best)
    return best


@torch.no_grad()
def apply_clip(w: torch.Tensor, ratio: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """w with each group clamped to its shrunk range, so that min/max (RTN) or GPTQ's group scales see it."""
    out, n_in = w.shape
    gs = group_width(scheme, n_in)
    wg = w.float().reshape(out, n_in // gs, gs)
    lo, hi = _bounds(wg, scheme, ratio)
    return torch.clamp(wg, lo.unsqueeze(-1), hi.unsqueeze(-1)).reshape(out, n_in)
