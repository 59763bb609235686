"""FP4 (E2M1) weights, `nvfp4` and `mxfp4`: group scales searched per group, for rounding (fp4.py's solvers) and
for GPTQ's column loop (FP4Grid).

With only 15 values, the absmax scale is often not the best one: letting the largest value of a group clip can
place the rest of the group on a finer grid. So every group tries a few scales and keeps the one with the
smallest squared error (weighted by the input channels' importance when GPTQ supplies it):
- nvfp4: absmax times each of SHRINKS, rounded to E4M3 under the tensor's power-of-two global scale (fp4.py);
- mxfp4: the OCP spec's power of two (largest value rounds to [4, 8), over 6 saturates) and the next one up
  (no saturation, half the resolution): E8M0 scales are powers of two, so these are the two that matter.
Plain rounding of mxfp4 does not search: unweighted squared error prefers the OCP power whenever the rest of
the group gains more than the saturated largest value loses, and that value matters most to the outputs
(measured on SmolLM2, docs/benchmarks.md: perplexity 51.5 with the search, 47.9 with the rule below, the rule
llm-compressor also uses). It takes the power of two that puts the largest value in [3.5, 7): at most a 7 -> 6
saturation. GPTQ, which weights each column by its Hessian diagonal, keeps the search (39.7 against 40.8).
GPTQ fixes each group's scale when its first column comes up, from the weights as GPTQ has updated them by then
(FP4Grid, the same three calls as gptq_grid.py's grids); the nvfp4 global scale is fixed up front.
"""
from __future__ import annotations

import torch

from .. import fp4
from ..qweight import QWeight
from ..schemes import Scheme

SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def _candidates(amax: torch.Tensor, scheme: Scheme, global_scale: torch.Tensor | None) -> list[torch.Tensor]:
    """The stored group scales to try for groups with absmax amax (E4M3 values or powers of two, float32)."""
    if global_scale is not None:
        return [fp4.nvfp4_group_scale(amax * r, global_scale) for r in SHRINKS]
    e = fp4.mx_exponent(amax)
    return [torch.exp2(e.float()), torch.exp2((e + 1).clamp(max=fp4.E8M0_BIAS).float())]


def mx_nearest_scale(amax: torch.Tensor) -> torch.Tensor:
    """mxfp4's scale for plain rounding: 2^e with the group's largest value in [3.5, 7) (float32)."""
    e = fp4.mx_exponent(amax)
    up = amax.double() >= 7 * torch.exp2(e.double())
    return torch.exp2(torch.where(up, e + 1, e).clamp(max=fp4.E8M0_BIAS).float())


def search_scales(wg: torch.Tensor, scheme: Scheme, global_scale: torch.Tensor | None,
                  importance: torch.Tensor | None = None) -> torch.Tensor:
    """The stored scale [out, groups] with the smallest (importance-weighted) squared error for each group of
    wg [out, groups, group]; importance [groups, group] or None."""
    div = 1.0 if global_scale is None else global_scale.float()
    best, best_err = None, None
    for s in _candidates(wg.abs().amax(-1), scheme, global_scale):
        eff = (s / div).unsqueeze(-1)
        err = (fp4.round_e2m1(wg / eff) * eff - wg).pow(2)
        err = (err * importance).sum(-1) if importance is not None else err.sum(-1)
        if best is None:
            best, best_err = s, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


def global_scale_for(w: torch.Tensor, scheme: Scheme) -> torch.Tensor | None:
    return fp4.nvfp4_global_scale(w.abs().amax()) if scheme.weight_strategy_override == "tensor_group" else None


def fp4_quantize(w: torch.Tensor, scheme: Scheme) -> QWeight:
    """QWeight with E2M1 values [out, in], searched group scales [out, in / group] and nvfp4's global scale."""
    w = w.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("FP4 quantisation needs finite weights; this tensor holds NaN or Inf")
    out, n = w.shape
    gs = scheme.group_size
    if n % gs:
        raise ValueError(f"in_features {n} is not divisible by {scheme.name}'s group of {gs}")
    wg = w.reshape(out, n // gs, gs)
    g = global_scale_for(w, scheme)
    scale = search_scales(wg, scheme, g) if g is not None else mx_nearest_scale(wg.abs().amax(-1))
    eff = (scale if g is None else scale / g).unsqueeze(-1)
    qw = QWeight(scheme=scheme, q=fp4.round_e2m1(wg / eff).reshape(out, n), scale=scale, global_scale=g)
    qw.stats["weight_rel_error"] = float((qw.dequantize() - w).norm() / w.norm().clamp_min(1e-12))
    return qw


class FP4Grid:
    """GPTQ's grid for FP4: a group's scale is searched when its first column comes up (fit), each column is
    rounded to E2M1 under it (round); rows of codes and scales are kept transposed as IntGrid keeps them."""

    def __init__(self, scheme: Scheme, W: torch.Tensor, groups: int):
        out, n = W.shape
        self.scheme = scheme
        self.global_scale = global_scale_for(W, scheme)
        self.div = 1.0 if self.global_scale is None else self.global_scale.to(W.device)
        self.scale_t = torch.ones(groups, out, device=W.device)
        self.codes_t = torch.empty(n, out, device=W.device)

    def fit(self, g: int, rows: torch.Tensor, importance: torch.Tensor) -> None:
        wg = rows.t().unsqueeze(1)  # [out, 1, members]
        gscale = None if self.global_scale is None else self.div
        self.scale_t[g] = search_scales(wg, self.scheme, gscale, importance.clamp_min(0).reshape(1, -1))[:, 0]

    def round(self, pos: int, row: torch.Tensor, g: int, out: torch.Tensor) -> torch.Tensor:
        eff = self.scale_t[g] / self.div
        v = fp4.round_e2m1(row / eff)
        self.codes_t[pos] = v
        return torch.mul(v, eff, out=out)

    def result(self, inv: torch.Tensor, deq: torch.Tensor, stats: dict, actorder) -> QWeight:
        g = None if self.global_scale is None else self.global_scale.cpu()
        return QWeight(scheme=self.scheme, q=self.codes_t[inv].t().contiguous(), scale=self.scale_t.t().contiguous(),
                       global_scale=g, stats=stats)
