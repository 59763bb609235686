"""The grids GPTQ's column loop rounds onto: integer groups on RTN's grid, or E4M3 with a fixed scale.

The loop asks a grid three things: fix a group's parameters (once, when its first column comes up, unless
they were fixed up front), round one column, and turn what the loop settled on into a QWeight. Keeping FP8
behind the same three calls is what lets one loop serve both.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .. import e4m3
from ..qweight import QWeight
from ..schemes import Scheme
from .fp8 import fp8_weight_scale
from .rtn import rtn_quantize


def group_params(wg: torch.Tensor, scheme: Scheme, scale_dtype, clip_search: bool, importance: torch.Tensor):
    """scale [out, groups] and zero (float, or None) for wg's groups, on exactly RTN's grid."""
    qw = rtn_quantize(wg, scheme, clip_search=clip_search, importance=importance.clamp_min(0),
                      scale_dtype=scale_dtype)
    return qw.scale, (None if qw.zero is None else qw.zero.float())


class IntGrid:
    """Integer codes per group; scale/zero kept transposed ([groups, out]) so a group's are one row."""

    def __init__(self, scheme: Scheme, scale_dtype, clip_search: bool, n: int, out: int, groups: int, device):
        self.scheme, self.scale_dtype, self.clip_search = scheme, scale_dtype, clip_search
        self.sub = replace(scheme, group_size=-1)
        self.scale_t = torch.zeros(groups, out, device=device)
        self.zero_t = None if scheme.symmetric else torch.zeros(groups, out, device=device)
        self.codes_t = torch.empty(n, out, device=device)

    def fix_all(self, W: torch.Tensor, importance: torch.Tensor) -> None:
        scale, zero = group_params(W, self.scheme, self.scale_dtype, self.clip_search, importance)
        self.scale_t = scale.t().contiguous()
        self.zero_t = None if zero is None else zero.t().contiguous()

    def fit(self, g: int, rows: torch.Tensor, importance: torch.Tensor) -> None:
        """Fix group g from its columns' current weights (rows: [members, out])."""
        s, z = group_params(rows.t(), self.sub, self.scale_dtype, self.clip_search, importance)
        self.scale_t[g] = s[:, 0]
        if self.zero_t is not None:
            self.zero_t[g] = z[:, 0]

    def round(self, pos: int, row: torch.Tensor, g: int, out: torch.Tensor) -> torch.Tensor:
        # quantize_groups then dequantize_groups, step by step in place (the same values, no temporaries)
        s, q = self.scale_t[g], self.codes_t[pos]
        torch.div(row, s, out=q).round_()
        if self.zero_t is None:
            q.clamp_(self.scheme.qmin, self.scheme.qmax)
            return torch.mul(q, s, out=out)
        z = self.zero_t[g]
        q.add_(z).clamp_(self.scheme.qmin, self.scheme.qmax)
        return torch.sub(q, z, out=out).mul_(s)

    def result(self, inv: torch.Tensor, deq: torch.Tensor, stats: dict, actorder) -> QWeight:
        codes = self.codes_t[inv].t()
        zero = None if self.zero_t is None else self.zero_t.t().to(torch.int8)
        return QWeight(scheme=replace(self.scheme, actorder=actorder), q=codes.to(torch.int8),
                       scale=self.scale_t.t().contiguous(), zero=zero, stats=stats)


class FP8Grid:
    """E4M3 with the absmax scale RTN's fp8 would choose ([1] or [out, 1]), fixed before the first column:
    one group spanning every column, so nothing is ever refitted."""

    def __init__(self, scheme: Scheme, scale_dtype, W: torch.Tensor):
        self.scheme = scheme
        self.scale = fp8_weight_scale(W, scheme, scale_dtype)
        self.scale_t = self.scale.reshape(-1, 1).expand(W.shape[0], 1).t().contiguous()  # [1, out]

    def round(self, pos: int, row: torch.Tensor, g: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(e4m3.fake_quantize(row, self.scale_t[g]))  # the codes come back from deq at the end, exactly

    def result(self, inv: torch.Tensor, deq: torch.Tensor, stats: dict, actorder) -> QWeight:
        # deq / scale is an e4m3 value by construction, so quantising it again is exact
        return QWeight(scheme=self.scheme, q=e4m3.quantize(deq, self.scale), scale=self.scale, stats=stats)
