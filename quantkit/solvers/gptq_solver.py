"""GPTQ as the pipeline runs it: the solver that gathers a Linear's Hessian from its calibration inputs, solves
with gptq.py's algorithm and lets the held-out guard (gptq_guard.py) judge the result."""
from __future__ import annotations

import logging
import warnings

import torch

from .. import heap
from ..qweight import QWeight
from ..schemes import Scheme
from . import gptq_guard
from .base import LinearSolver, SolveOptions, unit_rms
from .decorrelation import decorrelation, toward_diagonal
from .gptq import _check_finite, gptq_quantize, round_to_nearest
from .gptq_options import GPTQOptions

log = logging.getLogger(__name__)


def _mean32(S: torch.Tensor, scale: float, rows: int = 256) -> torch.Tensor:
    """(S * scale) in float32, made a block of rows at a time: the whole float64 product would briefly add
    8 in² bytes (19 MB on a 1536-wide down_proj) to the solve's peak."""
    out = torch.empty(S.shape, dtype=torch.float32, device=S.device)
    for i in range(0, S.shape[0], rows):
        out[i:i + rows] = S[i:i + rows] * scale
    return out


class GPTQSolver(LinearSolver):
    """Accumulates H = 2 X Xᵀ / n over every calibration token (a running mean, one matmul per batch), then solves.

    gptq: GPTQOptions, its own knobs (actorder off falls back to scheme.actorder; the calibration hold-out the
    pipeline sends to add_holdout judges the solve, gptq_guard.py); options: what every solver
    shares (scale dtype, clip search). balance_tokens: every token enters H at unit RMS (base.py:
    unit_rms); on SmolLM2 it took GPTQ from 33/11/35% of the RTN gap on three held-out texts to 70/50/57%.
    The solve reads H with prior / (prior + tokens) of its off-diagonal part given up (decorrelation.py): on a
    few thousand tokens GPTQ then leans less on one domain's channel correlations; on many it is plain GPTQ.
    """

    needs_data = True
    balance_tokens = True
    # FP8 and FP4 grids keep column order: on FP8 act-order gave better KL but worse perplexity (docs/benchmarks.md)
    keeps_column_order = False

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: SolveOptions | None = None,
                 gptq: GPTQOptions | None = None):
        super().__init__(name, weight, scheme, options)
        n = weight.shape[1]
        # Sums of x xᵀ in float64, products included: float32's rounding of a sum depends on how the tokens were
        # split into batches and across ranks, and GPTQ carries a moved rounding along the row (one rank against
        # two differed in 5% of a tiny model's codes on an AMD EPYC); in float64 the sum rounds to the same
        # float32 H whatever the split. H (the float32 mean 2 XᵀX / tokens) is made from it once, for the solve.
        self._sum = torch.zeros(n, n, dtype=torch.float64, device=weight.device)
        self._hold_sum: torch.Tensor | None = None
        self.H: torch.Tensor | None = None
        self.H_hold: torch.Tensor | None = None
        self.tokens, self.hold_tokens = 0, 0
        self.decorrelate = 0.0  # the share of H's off-diagonal part the last solve gave up
        self.gptq = gptq or GPTQOptions()

    def _accumulate(self, S: torch.Tensor, seen: int, x: torch.Tensor) -> int:
        n = S.shape[0]
        if x.shape[-1] != n:
            raise ValueError(f"layer '{self.name}': input has {x.shape[-1]} features, expected {n}")
        x = x.reshape(-1, n).to(S.device, torch.float32)
        if x.shape[0] == 0:
            return seen
        _check_finite(x, "inputs", self.name)
        x = (unit_rms(x) if self.balance_tokens else x).double()
        S.addmm_(x.t(), x)
        return seen + x.shape[0]

    def add_batch(self, x: torch.Tensor) -> None:
        self.tokens = self._accumulate(self._sum, self.tokens, x)

    def add_holdout(self, x: torch.Tensor) -> None:
        if self._hold_sum is None:
            self._hold_sum = torch.zeros_like(self._sum)
        self.hold_tokens = self._accumulate(self._hold_sum, self.hold_tokens, x)

    def shared_statistics(self):
        return ("hessian", self.balance_tokens)

    def adopt(self, leader: "GPTQSolver") -> None:
        # the sums are only read from here on (hessian() makes new tensors), so both can hold the same ones
        self._sum, self._hold_sum = leader._sum, leader._hold_sum
        self.tokens, self.hold_tokens = leader.tokens, leader.hold_tokens

    def reduce(self, pool) -> None:
        self.tokens = pool.count(self.tokens)
        pool.sum(self._sum)
        # every rank joins, whether or not its share held any samples out (none anywhere: one count, no sum)
        held = self._hold_sum if self._hold_sum is not None else torch.zeros_like(self._sum)
        self.hold_tokens = pool.count(self.hold_tokens)
        pool.sum(held)
        self._hold_sum = held if self.hold_tokens else None

    def hessian(self) -> torch.Tensor:
        """The float32 H every add_batch so far makes (after it, the sums are gone: call once all are in)."""
        self._means()
        return self.H

    def _means(self) -> None:
        """H and H_hold, the float32 means 2 XᵀX / tokens, from the float64 sums (once, before the solve)."""
        if self._sum is None:
            return
        self.H = _mean32(self._sum, 2.0 / max(self.tokens, 1))
        if self._hold_sum is not None and self.hold_tokens:
            self.H_hold = _mean32(self._hold_sum, 2.0 / self.hold_tokens)
        self._sum = self._hold_sum = None
        heap.trim()  # the float64 sums, gone before the solve's own in² work is allocated (quantkit/heap.py)

    def actorder(self) -> str | None:
        """'weight' or None (column order): the options' act-order, else the scheme's."""
        if self.keeps_column_order:
            return None
        return "weight" if self.gptq.actorder == "weight" else self.scheme.actorder

    def _rtn(self) -> QWeight:
        return round_to_nearest(self.weight, self.scheme, self.options.clip_search, self.options.scale_dtype)

    def _gptq(self, actorder: str | None) -> QWeight:
        o, g = self.options, self.gptq
        self.decorrelate = decorrelation(self.tokens, g.prior_tokens)
        H = toward_diagonal(self.H, self.decorrelate)
        return gptq_quantize(self.weight, H, self.scheme, damp=g.damp, block_size=g.block_size,
                             actorder=actorder, static_groups=g.static_groups, scale_dtype=o.scale_dtype,
                             clip_search=o.clip_search, name=self.name)

    def _guarded(self, actorder: str | None, qw: QWeight) -> QWeight:
        """The guard's pick among GPTQ as asked, without act-order and RTN; a GPTQ pick refitted on every token."""
        others = [("act-order off", lambda: self._gptq(None))] if actorder else []
        label, qw = gptq_guard.choose(self.weight, self.H_hold, (f"act-order {actorder or 'off'}", qw),
                                      others + [("rtn", self._rtn)])
        guard = {k: qw.stats[k] for k in ("held_out_error", "gptq_guard")}
        if label != "rtn":
            self.H = gptq_guard.merged(self.H, self.tokens, self.H_hold, self.hold_tokens)
            self.tokens += self.hold_tokens
            qw = self._gptq(None if label == "act-order off" else actorder)
        qw.stats.update(guard, holdout_tokens=self.hold_tokens)
        return qw

    def solve(self) -> QWeight:
        self._means()
        actorder = self.actorder()
        if self.tokens == 0:
            msg = f"GPTQ on layer '{self.name}': no calibration tokens reached it; this layer falls back to RTN"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.warning(msg)
            qw = self._rtn()
            qw.stats.update(fallback="rtn", tokens=0)
            return qw
        qw = self._gptq(actorder)
        if self.hold_tokens and qw.stats.get("fallback") is None:
            qw = self._guarded(actorder, qw)
        qw.stats.update(tokens=self.tokens, hessian_decorrelate=round(self.decorrelate, 4))
        self.H = self.H_hold = None  # the Hessians can be large (in² floats); free them once the layer is done
        return qw
