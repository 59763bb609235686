"""GPTQ's held-out guard: act-order, and GPTQ itself, must not lose on calibration samples they never saw.

GPTQ fits its codes to the Hessian of the calibration tokens; act-order (columns by decreasing Hessian
diagonal) leans on that Hessian even more, since it decides which columns absorb everyone else's error. With one
domain's text, what helps there can hurt elsewhere (issue 23 measured act-order closing 40-96% of the RTN gap
depending on model and text). So the calibration hold-out (recipe calibration.holdout, capture/holdout.py) feeds a
second Hessian instead of the solve, and the solve's result is compared there with the alternatives it could
have chosen: the same GPTQ without act-order, and plain rounding. The one with the lowest held-out output error
is kept; when that is not the first choice, quantkit.json says which won and by how much (gptq_guard). A GPTQ
winner is then solved again from every calibration token, held-out ones included (the choice was made on
data its fit never saw; the final fit need not waste that data), so the guard costs no calibration tokens.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..qweight import QWeight
from .gptq_factor import output_energy, relative_output_error


def choose(w: torch.Tensor, H_hold: torch.Tensor, first: tuple[str, QWeight],
           others: list[tuple[str, Callable[[], QWeight]]]) -> tuple[str, QWeight]:
    """(label, codes) of the candidate with the lowest held-out output error; FIRST wins ties (it is what the
    user asked for). Every candidate's error goes into the winner's stats, so quantkit.json shows the margin."""
    label, best = first
    w = w.float()
    den = output_energy(w, H_hold)

    def held_out_error(qw: QWeight) -> float:
        return relative_output_error(w, qw.dequantize().float(), H_hold, den)

    errors = {label: held_out_error(best)}
    best_label = label
    for name, make in others:
        qw = make()
        errors[name] = held_out_error(qw)
        if errors[name] < errors[best_label]:
            best, best_label = qw, name
    best.stats["held_out_error"] = {k: round(v, 6) for k, v in errors.items()}
    best.stats["gptq_guard"] = None if best_label == label else (
        f"{best_label}: held-out error {errors[best_label]:.4g} < {errors[label]:.4g} with {label}")
    return best_label, best


def merged(H: torch.Tensor, n: int, H_hold: torch.Tensor, n_hold: int) -> torch.Tensor:
    """The Hessian of all n + n_hold tokens from the two running means."""
    return (H * n + H_hold * n_hold) / (n + n_hold)
