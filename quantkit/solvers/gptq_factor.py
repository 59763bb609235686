"""GPTQ's preparation of the Hessian: dead channels, the inverse Cholesky factor and its damping fallback."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Dampening is raised x10 at most this many times before the layer falls back to RTN: from the default 1% of the
# mean diagonal that ends at 10x the mean diagonal, where GPTQ is little more than RTN with a small correction.
MAX_DAMP_RAISES = 3


def drop_dead_channels(W: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """A channel that never fires has no curvature: any weight there is free, so it is zeroed and given a unit
    diagonal that keeps H invertible without coupling it to the others (as in the GPTQ paper's code). W and H
    are changed in place; returns the mask of dead channels."""
    dead = H.diagonal() == 0
    if bool(dead.any()):
        H.diagonal()[dead] = 1
        W[:, dead] = 0
    return dead


def inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor | None:
    """Upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹, or None where that matrix is not positive definite."""
    Hd = H.clone()
    Hd.diagonal().add_(damp * H.diagonal().mean())
    L, info = torch.linalg.cholesky_ex(Hd)
    # each in² intermediate is let go as soon as the next is made: on a wide down_proj they are the solve's peak
    del Hd
    if int(info) != 0:
        return None
    inverse = torch.cholesky_inverse(L)
    del L
    U, info = torch.linalg.cholesky_ex(inverse, upper=True)
    del inverse
    if int(info) != 0 or not bool(torch.isfinite(U).all()):
        return None
    return U


def damp_steps(damp: float) -> list[float]:
    base = max(damp, 0.01)  # a zero damp would stay zero when multiplied
    return [damp] + [base * 10 ** k for k in range(1, MAX_DAMP_RAISES + 1)]


def factor(H: torch.Tensor, damp: float, name: str) -> tuple[torch.Tensor | None, float]:
    """(U, the damp that worked), raising the damp until H is positive definite; U is None if it never is."""
    used = damp
    for used in damp_steps(damp):
        U = inverse_cholesky(H, used)
        if U is not None:
            return U, used
        log.info("layer %s: Hessian not positive definite with damp %g, raising it", name, used)
    return None, used


def relative_output_error(w: torch.Tensor, deq: torch.Tensor, H: torch.Tensor,
                          den: torch.Tensor | None = None) -> float:
    """tr(D H Dᵀ) / tr(W H Wᵀ) with D = W - Q: the calibration outputs' relative squared error, up to H's scale.
    den: output_energy(w, H), when several Q of one W are compared (it is the same for all)."""
    d = w - deq
    num = ((d @ H) * d).sum()
    return float(num / (output_energy(w, H) if den is None else den))


def output_energy(w: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """tr(W H Wᵀ), kept away from zero: relative_output_error's denominator."""
    return ((w @ H) * w).sum().clamp_min(1e-30)


def output_error_from_updates(err_sq, damp_abs: float, w, deq, dead, H) -> float:
    """relative_output_error without its second O(out·in²) matmul: the scaled errors e_j = (w_j - q_j) / U_jj
    add up to Σ‖e_j‖² = tr(D H_d Dᵀ) for the damped H_d = H + λI (OBQ's loss), so tr(D H Dᵀ) = Σ‖e‖² - λ‖D‖².
    Dead columns drop out: their rows of H are zero, and GPTQ zeroed them before D was measured."""
    d = w - deq
    d[:, dead] = 0
    num = max(float(err_sq) - damp_abs * float(d.double().pow(2).sum()), 0.0)
    den = float(((w @ H) * w).sum().clamp_min(1e-30))
    return num / den
