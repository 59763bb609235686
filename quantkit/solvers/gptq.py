"""GPTQ: quantise a Linear column by column, pushing each column's rounding error onto the columns not yet
quantised so that the layer's *output* on the calibration inputs moves as little as possible.

With H = 2 X Xᵀ / n (X: the Linear's inputs, [in, tokens]) and U the upper Cholesky factor of H⁻¹, quantising
column j with error e = (w_j - q_j) / U[j, j] is compensated by w_k -= e · U[j, k] for k > j; this equals OBQ's
update with the inverse Hessian downdated after each column, without ever downdating it. Updates are applied
lazily per block of columns (one matmul per block for the columns after it), which is what makes it fast.

Grid and rounding come from rtn.py, so GPTQ and RTN quantise onto the same grid and the RTN fallback is the same
code; FP8 schemes round onto the E4M3 grid with the absmax scale of solvers/fp8.py, fixed before the first column
(solvers/fp8_gptq.py; FP4 onto E2M1 with searched group scales, solvers/fp4_grid.py; the grids are in gptq_grid.py,
the Hessian's factor and its damping fallback in gptq_factor.py; the knobs and their defaults in gptq_options.py).
Group scales are fixed when the group's first column comes up, from the group's weights as they are at that moment
(already updated by earlier columns), except for act-order "weight" with static groups, whose scales come from the
original weights so that column i keeps group i // group_size and no g_idx is needed. The solver the pipeline
feeds (Hessian from the calibration inputs, the held-out guard) is gptq_solver.py.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, replace

import torch

from ..errors import UserError
from ..qweight import QWeight
from ..schemes import Scheme
from .fp4_grid import FP4Grid, fp4_quantize
from .fp8 import fp8_quantize
from .gptq_factor import drop_dead_channels, factor, output_error_from_updates, relative_output_error
from .gptq_grid import FP8Grid, IntGrid
from .rtn import rtn_quantize

log = logging.getLogger(__name__)

def _check_finite(t: torch.Tensor, what: str, name: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise UserError(f"{what} of layer '{name}' contain NaN or Inf; check the model loads correctly in its dtype "
                        f"(try --dtype float32 or bfloat16) and that the calibration text is sane")


def round_to_nearest(w: torch.Tensor, scheme: Scheme, clip_search: bool, scale_dtype) -> QWeight:
    """GPTQ's fallback: the same grid without error compensation (absmax E4M3 for fp8, RTN otherwise)."""
    if scheme.is_fp8:
        return fp8_quantize(w, scheme, scale_dtype)
    if scheme.is_fp4:
        return fp4_quantize(w, scheme)
    qw = rtn_quantize(w, scheme, clip_search=clip_search, scale_dtype=scale_dtype)
    qw.scheme = replace(scheme, actorder=None)
    return qw


@dataclass
class _Order:
    """The processing order of the columns and, per processing position, its group."""
    perm: torch.Tensor  # processing position -> original column
    inv: torch.Tensor  # original column -> processing position
    gid: list[int]  # group of each processing position
    members: list[torch.Tensor]  # processing positions of each group's columns


def _order(H: torch.Tensor, actorder: str | None, gs: int) -> _Order:
    n = H.shape[0]
    perm = torch.arange(n, device=H.device)
    if actorder is not None:
        # Columns with the largest inputs first: their errors then land on the many columns still free to absorb them.
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
    inv = torch.argsort(perm)
    # groups keep their original columns wherever those are processed, so no g_idx is ever written
    members = [torch.sort(inv[g * gs:(g + 1) * gs]).values for g in range(n // gs)]
    return _Order(perm, inv, (perm // gs).tolist(), members)


def _check_inputs(w, H, scheme: Scheme, block_size: int, name: str) -> int:
    """The group size the loop uses (FP8 has one scale per tensor or per output row: a single group)."""
    if block_size < 1:
        raise UserError(f"block_size must be at least 1, got {block_size}")
    n = w.shape[1]
    gs = n if scheme.group_size == -1 or scheme.is_fp8 else scheme.group_size
    if n % gs:
        raise UserError(f"layer '{name}': in_features {n} is not divisible by group size {gs}; choose a group size "
                        f"that divides it or -1 (per channel)")
    if tuple(H.shape) != (n, n):
        raise ValueError(f"layer '{name}': Hessian shape {tuple(H.shape)} does not match in_features {n}")
    _check_finite(w, "weights", name)
    _check_finite(H, "inputs (Hessian)", name)
    return gs


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
    if actorder not in (None, "weight"):  # GPTQOptions refuses 'group' to users; this guards direct callers
        raise UserError(f"unknown actorder '{actorder}'; choose None (off) or 'weight'")
    gs = _check_inputs(w, H, scheme, block_size, name)
    out, n = w.shape
    w0 = w.detach().float()
    H0 = H.detach().to(w0.device, torch.float32)
    W, Hp = w0.clone(), H0.clone()
    dead = drop_dead_channels(W, Hp)
    static = scheme.is_fp8 or (actorder == "weight" and static_groups)
    if scheme.is_fp8:
        grid = FP8Grid(scheme, scale_dtype, W)
    elif scheme.is_fp4:  # group scales searched as each group comes up, never up front
        grid = FP4Grid(scheme, W, n // gs)
    else:
        grid = IntGrid(scheme, scale_dtype, clip_search, n, out, n // gs, W.device)
        if static:
            grid.fix_all(W, Hp.diagonal().clone())
    order = _order(Hp, actorder, gs)
    W, Hp = W[:, order.perm], Hp[order.perm[:, None], order.perm]  # one gather: one in² copy, not two
    U, used = factor(Hp, damp, name)
    if U is None:
        return _fallback(w0, H0, scheme, clip_search, scale_dtype, used, int(dead.sum()), name, t0)
    # Columns are kept as rows ([n, out]) so that every per-column read and rank-1 update touches contiguous
    # memory; on a CPU that halves the time of the loop below.
    deq_t, err_sq = _column_loop(W.t().contiguous(), U, grid, order, [static] * (n // gs), Hp.diagonal(),
                                 block_size)
    deq = deq_t[order.inv].t()
    stats = {
        "damp": used,
        "output_rel_error": output_error_from_updates(err_sq, used * float(Hp.diagonal().mean()), w0, deq, dead,
                                                      H0),
        "weight_rel_error": float((deq - w0).norm() / w0.norm().clamp_min(1e-12)),
        "dead_channels": int(dead.sum()),
        "actorder": actorder,
        "fallback": None,
        "seconds": time.perf_counter() - t0,
    }
    return grid.result(order.inv, deq, stats, actorder)


def _fallback(w0, H0, scheme, clip_search, scale_dtype, used, n_dead, name, t0) -> QWeight:
    msg = (f"GPTQ on layer '{name}': the Hessian is not positive definite even with damp {used:g}; "
           f"this layer falls back to RTN")
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    log.warning(msg)
    qw = round_to_nearest(w0, scheme, clip_search, scale_dtype)
    qw.stats.update(fallback="rtn", damp=None, dead_channels=n_dead, actorder=None,
                    output_rel_error=relative_output_error(w0, qw.dequantize(), H0),
                    seconds=time.perf_counter() - t0)
    return qw


def _column_loop(Wt, U, grid, order: _Order, fixed: list[bool], pdiag, block_size: int):
    """Round column after column (rows of Wt), pushing each one's error onto the columns not yet rounded;
    updates are applied lazily per block of columns. Returns (dequantised rows, Σ‖scaled error‖²).

    The loop runs once per input column of every Linear, so each step is the fewest tensor calls that give the
    same values: rounding writes straight into the grid's codes and the result rows, the error is divided by
    U's diagonal as a Python float (the same float32 value), and no temporary is allocated."""
    n, out = Wt.shape
    deq_t = torch.empty(n, out, device=Wt.device)
    err_sq = torch.zeros((), dtype=torch.float64, device=Wt.device)
    gid, diag = order.gid, U.diagonal().tolist()
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = Wt[i1:i2]  # a view: the block is updated in place
        E1 = torch.empty(i2 - i1, out, device=Wt.device)
        U1t = U[i1:i2, i1:i2].t().unsqueeze(-1)  # U1t[i, k] = U1[k, i]: column i's factors as [rows, 1] views
        for i in range(i2 - i1):
            pos = i1 + i
            g = gid[pos]
            if not fixed[g]:
                cols = order.members[g]
                grid.fit(g, _current_rows(Wt, E1, U, i1, i2, i, cols), pdiag[cols])
                fixed[g] = True
            row, err = W1[i], E1[i]
            dq = grid.round(pos, row, g, deq_t[pos])
            torch.sub(row, dq, out=err).div_(diag[pos])
            # addmm_ with an outer-product shape: torch 2.13 CPU addr_ is ~100x slower on these blocks
            W1[i:].addmm_(U1t[i:, i], err.unsqueeze(0), alpha=-1)
        err_sq += E1.double().pow(2).sum()
        if i2 < n:
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), E1, alpha=-1)
    return deq_t, err_sq


def _current_rows(Wt, E1, U, i1: int, i2: int, i: int, cols: torch.Tensor) -> torch.Tensor:
    """The weights of processing positions cols (all >= i1 + i, as rows) as the column-by-column algorithm has them
    now: inside the block Wt is up to date; past it, the block's pending lazy update so far is applied here."""
    cur = Wt[cols]
    later = cols >= i2
    if i and bool(later.any()):
        cur[later] -= U[i1:i1 + i][:, cols[later]].t() @ E1[:i]
    return cur
