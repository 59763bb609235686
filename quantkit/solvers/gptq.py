"""GPTQ: quantise a Linear column by column, pushing each column's rounding error onto the columns not yet
quantised so that the layer's *output* on the calibration inputs moves as little as possible.

With H = 2 X Xᵀ / n (X: the Linear's inputs, [in, tokens]) and U the upper Cholesky factor of H⁻¹, quantising
column j with error e = (w_j - q_j) / U[j, j] is compensated by w_k -= e · U[j, k] for k > j; this equals OBQ's
update with the inverse Hessian downdated after each column, without ever downdating it. Updates are applied
lazily per block of columns (one matmul per block for the columns after it), which is what makes it fast.

Grid and rounding come from rtn.py, so GPTQ and RTN quantise onto the same grid and the RTN fallback is the
same code; FP8 schemes round onto the E4M3 grid with the absmax scale of solvers/fp8.py, fixed before the
first column (solvers/fp8_gptq.py). Group scales are fixed when the group's first column comes up, from the
group's weights as they are at that moment (already updated by earlier columns), except for act-order "weight"
with static groups, whose scales come from the original weights so that column i keeps group i // group_size
and no g_idx is needed.
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import replace

import torch

from ..errors import UserError
from ..qweight import QWeight
from ..schemes import Scheme
from .. import e4m3
from .base import LinearSolver
from .fp8 import fp8_quantize, fp8_weight_scale
from .rtn import dequantize_groups, quantize_groups, rtn_quantize

log = logging.getLogger(__name__)

ACTORDERS = (None, "weight", "group")
# Dampening is raised x10 at most this many times before the layer falls back to RTN: from the default 1% of the
# mean diagonal that ends at 10x the mean diagonal, where GPTQ is little more than RTN with a small correction.
MAX_DAMP_RAISES = 3


def normalise_actorder(value) -> str | None:
    """The CLI says off/weight/group; recipes may say null, false or true (true means "group", as elsewhere)."""
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("off", "none", "")):
        return None
    if value is True:
        return "group"
    if isinstance(value, str) and value.lower() in ("weight", "group"):
        return value.lower()
    raise UserError(f"unknown actorder '{value}'; choose one of: off, weight, group")


def _check_finite(t: torch.Tensor, what: str, name: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise UserError(f"{what} of layer '{name}' contain NaN or Inf; check the model loads correctly in its dtype "
                        f"(try --dtype float32 or bfloat16) and that the calibration text is sane")


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor | None:
    """Upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹, or None where that matrix is not positive definite."""
    Hd = H.clone()
    Hd.diagonal().add_(damp * H.diagonal().mean())
    L, info = torch.linalg.cholesky_ex(Hd)
    if int(info) != 0:
        return None
    U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if int(info) != 0 or not bool(torch.isfinite(U).all()):
        return None
    return U


def _damp_steps(damp: float) -> list[float]:
    base = max(damp, 0.01)  # a zero damp would stay zero when multiplied
    return [damp] + [base * 10 ** k for k in range(1, MAX_DAMP_RAISES + 1)]


def _relative_output_error(w: torch.Tensor, deq: torch.Tensor, H: torch.Tensor) -> float:
    """tr(D H Dᵀ) / tr(W H Wᵀ) with D = W - Q: the calibration outputs' relative squared error, up to H's scale."""
    d = w - deq
    num = ((d @ H) * d).sum()
    den = ((w @ H) * w).sum().clamp_min(1e-30)
    return float(num / den)


def _output_error_from_updates(err_sq, damp_abs: float, w, deq, dead, H) -> float:
    """_relative_output_error without its second O(out·in²) matmul: the scaled errors e_j = (w_j - q_j) / U_jj
    add up to Σ‖e_j‖² = tr(D H_d Dᵀ) for the damped H_d = H + λI (OBQ's loss), so tr(D H Dᵀ) = Σ‖e‖² - λ‖D‖².
    Dead columns drop out: their rows of H are zero, and GPTQ zeroed them before D was measured."""
    d = w - deq
    d[:, dead] = 0
    num = max(float(err_sq) - damp_abs * float(d.double().pow(2).sum()), 0.0)
    den = float(((w @ H) * w).sum().clamp_min(1e-30))
    return num / den


def round_to_nearest(w: torch.Tensor, scheme: Scheme, clip_search: bool, scale_dtype) -> QWeight:
    """GPTQ's fallback: the same grid without error compensation (absmax E4M3 for fp8, RTN otherwise)."""
    if scheme.is_fp8:
        return fp8_quantize(w, scheme, scale_dtype)
    qw = rtn_quantize(w, scheme, clip_search=clip_search, scale_dtype=scale_dtype)
    qw.scheme = replace(scheme, actorder=None)
    return qw


def _group_params(wg: torch.Tensor, scheme: Scheme, scale_dtype, clip_search: bool, importance: torch.Tensor):
    """scale [out, groups] and zero (float, or None) for wg's groups, on exactly RTN's grid."""
    qw = rtn_quantize(wg, scheme, clip_search=clip_search, importance=importance.clamp_min(0),
                      scale_dtype=scale_dtype)
    return qw.scale, (None if qw.zero is None else qw.zero.float())


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, scheme: Scheme, damp: float = 0.01, block_size: int = 128,
                  actorder: str | None = None, static_groups: bool = True, scale_dtype=torch.float16,
                  clip_search: bool = False, name: str = "<linear>") -> QWeight:
    """Quantise w [out, in] given the Hessian H [in, in] of its inputs. Everything returned is in original column
    order, and QWeight.dequantize() gives exactly the weights GPTQ settled on.

    static_groups matters only for actorder "weight": True fixes every group's scale from the original weights
    up front; False fixes each group's scale when its first column comes up in act-order, from its columns'
    weights as updated by then. Either way groups keep their original columns, so no g_idx is written.
    """
    t0 = time.perf_counter()
    actorder = normalise_actorder(actorder)
    if block_size < 1:
        raise UserError(f"block_size must be at least 1, got {block_size}")
    out, n = w.shape
    fp8 = scheme.is_fp8
    # FP8 has one scale per tensor or per output row, so it is a single group whose scale is fixed up front
    gs = n if scheme.group_size == -1 or fp8 else scheme.group_size
    if n % gs:
        raise UserError(f"layer '{name}': in_features {n} is not divisible by group size {gs}; choose a group size "
                        f"that divides it or -1 (per channel)")
    if tuple(H.shape) != (n, n):
        raise ValueError(f"layer '{name}': Hessian shape {tuple(H.shape)} does not match in_features {n}")
    _check_finite(w, "weights", name)
    _check_finite(H, "inputs (Hessian)", name)
    w0 = w.detach().float()
    H0 = H.detach().to(w0.device, torch.float32)
    out_scheme = replace(scheme, actorder=actorder)

    W = w0.clone()
    H = H0.clone()
    # A channel that never fires has no curvature: any weight there is free, so it is zeroed and given a unit
    # diagonal that keeps H invertible without coupling it to the others (as in the GPTQ paper's code).
    dead = H.diagonal() == 0
    n_dead = int(dead.sum())
    if n_dead:
        H.diagonal()[dead] = 1
        W[:, dead] = 0

    groups = n // gs
    diag = H.diagonal().clone()
    static = fp8 or (actorder == "weight" and static_groups)
    scale = torch.zeros(out, groups, device=W.device)
    zero = None if scheme.symmetric or fp8 else torch.zeros(out, groups, device=W.device)
    if fp8:
        fp8_scale = fp8_weight_scale(W, scheme, scale_dtype)  # [1] or [out, 1], as RTN's fp8 would choose
        scale = fp8_scale.reshape(-1, 1).expand(out, 1).clone()
    elif static:
        scale, zero = _group_params(W, scheme, scale_dtype, clip_search, diag)

    perm = torch.arange(n, device=W.device)
    if actorder is not None:
        # Columns with the largest inputs first: their errors then land on the many columns still free to absorb them.
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]

    U, used = None, damp
    for used in _damp_steps(damp):
        U = _inverse_cholesky(H, used)
        if U is not None:
            break
        log.info("layer %s: Hessian not positive definite with damp %g, raising it", name, used)
    if U is None:
        msg = (f"GPTQ on layer '{name}': the Hessian is not positive definite even with damp {used:g}; "
               f"this layer falls back to RTN")
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        log.warning(msg)
        qw = round_to_nearest(w0, scheme, clip_search, scale_dtype)
        deq = qw.dequantize()
        qw.stats.update(fallback="rtn", damp=None, dead_channels=n_dead, actorder=None,
                        output_rel_error=_relative_output_error(w0, deq, H0),
                        seconds=time.perf_counter() - t0)
        return qw

    inv = torch.argsort(perm)
    # group of each processing position, and the processing positions of each group's members
    if actorder == "weight":
        gid = perm // gs
        members = [torch.sort(inv[g * gs:(g + 1) * gs]).values for g in range(groups)]
    else:
        gid = torch.arange(n, device=W.device) // gs
        members = [torch.arange(g * gs, (g + 1) * gs, device=W.device) for g in range(groups)]
    gid_list = gid.tolist()
    fixed = [static] * groups
    sub_scheme = replace(scheme, group_size=-1)
    pdiag = H.diagonal()

    # Columns are kept as rows ([n, out]) so that every per-column read and rank-1 update touches contiguous
    # memory; on a CPU that halves the time of the loop below.
    Wt = W.t().contiguous()
    del W
    scale_t = scale.t().contiguous()
    zero_t = None if zero is None else zero.t().contiguous()
    codes_t = None if fp8 else torch.empty(n, out, device=Wt.device)
    deq_t = torch.empty(n, out, device=Wt.device)
    err_sq = torch.zeros((), dtype=torch.float64, device=Wt.device)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = Wt[i1:i2]  # a view: the block is updated in place
        E1 = torch.empty(i2 - i1, out, device=Wt.device)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = gid_list[i1 + i]
            if not fixed[g]:
                cols = members[g]
                cur = _current_rows(Wt, E1, U, i1, i2, i, cols)
                s, z = _group_params(cur.t(), sub_scheme, scale_dtype, clip_search, pdiag[cols])
                scale_t[g] = s[:, 0]
                if zero_t is not None:
                    zero_t[g] = z[:, 0]
                fixed[g] = True
            s = scale_t[g]
            z = None if zero_t is None else zero_t[g]
            row = W1[i]
            if fp8:
                dq = e4m3.fake_quantize(row, s)  # the codes are recovered from deq at the end, exactly
            else:
                qc = quantize_groups(row.unsqueeze(1), s, z, scheme)
                dq = dequantize_groups(qc, s, z)[:, 0]
                codes_t[i1 + i] = qc[:, 0]
            deq_t[i1 + i] = dq
            err = (row - dq).div_(U1[i, i])
            E1[i] = err
            # addmm_ with an outer-product shape: torch 2.13 CPU addr_ is ~100x slower on these blocks
            W1[i:].addmm_(U1[i, i:].unsqueeze(1), err.unsqueeze(0), alpha=-1)
        err_sq += E1.double().pow(2).sum()
        if i2 < n:
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), E1, alpha=-1)

    codes = None if fp8 else codes_t[inv].t()
    deq = deq_t[inv].t()
    scale = scale_t.t().contiguous()
    zero = None if zero_t is None else zero_t.t()
    g_idx = None
    if actorder == "group" and groups > 1:
        g_idx = (inv // gs).to(torch.int32)
    stats = {
        "damp": used,
        "output_rel_error": _output_error_from_updates(err_sq, used * float(pdiag.mean()), w0, deq, dead, H0),
        "weight_rel_error": float((deq - w0).norm() / w0.norm().clamp_min(1e-12)),
        "dead_channels": n_dead,
        "actorder": actorder,
        "fallback": None,
        "seconds": time.perf_counter() - t0,
    }
    if fp8:
        # deq / scale is an e4m3 value by construction, so quantising it again is exact
        return QWeight(scheme=scheme, q=e4m3.quantize(deq, fp8_scale), scale=fp8_scale, stats=stats)
    return QWeight(scheme=out_scheme, q=codes.to(torch.int8), scale=scale,
                   zero=None if zero is None else zero.to(torch.int8), g_idx=g_idx, stats=stats)


def _current_rows(Wt, E1, U, i1: int, i2: int, i: int, cols: torch.Tensor) -> torch.Tensor:
    """The weights of processing positions cols (all >= i1 + i, as rows) as the column-by-column algorithm has them
    now: inside the block Wt is up to date; past it, the block's pending lazy update so far is applied here."""
    cur = Wt[cols]
    later = cols >= i2
    if i and bool(later.any()):
        cur[later] -= U[i1:i1 + i][:, cols[later]].t() @ E1[:i]
    return cur


class GPTQSolver(LinearSolver):
    """Accumulates H = 2 X Xᵀ / n over every calibration token (a running mean, one matmul per batch), then solves.

    options: damp, block_size, actorder (None/"off" | "weight" | "group"; falls back to scheme.actorder),
    static_groups, scale_dtype, clip_search.
    """

    needs_data = True

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: dict):
        super().__init__(name, weight, scheme, options)
        n = weight.shape[1]
        self.H = torch.zeros(n, n, dtype=torch.float32, device=weight.device)
        self.tokens = 0

    def add_batch(self, x: torch.Tensor) -> None:
        n = self.H.shape[0]
        if x.shape[-1] != n:
            raise ValueError(f"layer '{self.name}': input has {x.shape[-1]} features, expected {n}")
        x = x.reshape(-1, n).to(self.H.device, torch.float32)
        if x.shape[0] == 0:
            return
        _check_finite(x, "inputs", self.name)
        total = self.tokens + x.shape[0]
        # running mean keeps H's magnitude independent of how many tokens were seen (no float32 overflow)
        self.H.mul_(self.tokens / total)
        x = x * math.sqrt(2.0 / total)
        self.H.addmm_(x.t(), x)
        self.tokens = total

    def solve(self) -> QWeight:
        o = self.options
        actorder = normalise_actorder(o.get("actorder")) or normalise_actorder(self.scheme.actorder)
        if self.tokens == 0:
            msg = f"GPTQ on layer '{self.name}': no calibration tokens reached it; this layer falls back to RTN"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.warning(msg)
            qw = round_to_nearest(self.weight, self.scheme, o.get("clip_search", False),
                                  o.get("scale_dtype", torch.float16))
            qw.stats.update(fallback="rtn", tokens=0)
            return qw
        qw = gptq_quantize(self.weight, self.H, self.scheme, damp=o.get("damp", 0.01),
                           block_size=o.get("block_size", 128), actorder=actorder,
                           static_groups=o.get("static_groups", True),
                           scale_dtype=o.get("scale_dtype", torch.float16),
                           clip_search=o.get("clip_search", False), name=self.name)
        qw.stats["tokens"] = self.tokens
        self.H = None  # the Hessian can be large (in² floats); free it as soon as the layer is done
        return qw
