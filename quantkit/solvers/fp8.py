"""FP8 (E4M3) weights by absmax scaling: one scale per tensor (`fp8`) or per output channel (`fp8-dynamic`).

E4M3 is a floating-point grid, so the absmax scale loses nothing to the rounding of small values the way an
integer grid does; there is nothing to search. Schemes with static activations (`fp8`) also get one input
scale per Linear: the absmax of its calibration inputs (seen through add_batch) with a margin.
"""
from __future__ import annotations

import torch

from .. import e4m3
from ..errors import UserError
from ..qweight import QWeight
from ..schemes import Scheme
from .base import LinearSolver


def fp8_weight_scale(w: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The absmax weight scale: [1] (strategy 'tensor') or [out, 1] (per channel), never zero."""
    w = w.detach().float()
    if scheme.strategy == "tensor":
        amax = w.abs().amax().reshape(1)
    elif scheme.strategy == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        raise ValueError(f"FP8 weights support the 'tensor' and 'channel' strategies, not '{scheme.strategy}'")
    return e4m3.scale_for(amax, dtype=scale_dtype)


def fp8_quantize(w: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype = torch.float16) -> QWeight:
    """QWeight with float8_e4m3fn codes; scale [1] (strategy 'tensor') or [out, 1] (per channel)."""
    w = w.float()
    scale = fp8_weight_scale(w, scheme, scale_dtype)
    q = e4m3.quantize(w, scale)
    qw = QWeight(scheme=scheme, q=q, scale=scale)
    deq = qw.dequantize()
    qw.stats["weight_rel_error"] = ((deq - w).norm() / w.norm().clamp_min(1e-12)).item()
    return qw


# Static input scale = calibration absmax x INPUT_MARGIN / 448. Run-time inputs exceed what a calibration set saw:
# on SmolLM2-135M, 95 of 210 Linears met larger inputs in held-out prose than in 2.5k calibration tokens, up to
# 2.24x (bench/fp8_error_split.py), and a saturated outlier is ruinous (clipping at half the absmax: +63%
# perplexity). E4M3 keeps its relative precision in every binade, so one binade of headroom only pushes the
# smallest values one binade nearer the subnormals.
INPUT_MARGIN = 2.0


class InputAmax:
    """Running absmax of a Linear's calibration inputs, for the static FP8 input scale."""

    def __init__(self, name: str):
        self.name = name
        self.amax = torch.zeros(())
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        if not torch.isfinite(x).all():
            raise UserError(f"NaN or Inf in the calibration inputs of {self.name}; load the model in float32 "
                            "(--dtype float32) or check the source weights")
        self.amax = torch.maximum(self.amax, x.abs().amax().float().cpu())
        self.tokens += x.shape[0]

    def attach(self, qw: QWeight, scale_dtype: torch.dtype) -> None:
        if self.tokens == 0:
            raise UserError(f"{self.name} saw no calibration tokens, so it has no static FP8 input scale; "
                            "leave it in --ignore or use the fp8-dynamic scheme")
        qw.input_scale = e4m3.scale_for(self.amax.reshape(1), INPUT_MARGIN, dtype=scale_dtype)
        qw.stats["input_amax"] = float(self.amax)
        qw.stats["input_margin"] = INPUT_MARGIN
        qw.stats["calib_tokens"] = self.tokens


class FP8Solver(LinearSolver):
    """Weights as above; with static activations, also the input scale from the calibration inputs.

    The class says it needs data (so the pipeline, which asks the class, collects calibration data for a
    static scheme); each instance narrows that to its own scheme, so dynamic schemes are not fed tokens.
    """

    needs_data = True

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: dict):
        super().__init__(name, weight, scheme, options)
        self.needs_data = scheme.activations == "static"
        self.inputs = InputAmax(name)

    def add_batch(self, x: torch.Tensor) -> None:
        if self.needs_data:
            self.inputs.add(x)

    def solve(self) -> QWeight:
        scale_dtype = self.options.get("scale_dtype", torch.float16)
        qw = fp8_quantize(self.weight, self.scheme, scale_dtype)
        if self.scheme.activations == "static":
            self.inputs.attach(qw, scale_dtype)
        return qw


class FP8DynamicSolver(FP8Solver):
    """FP8Solver for schemes without static activations: the class itself says no data is needed, so the
    pipeline (which asks the class) does not load calibration data for fp8-dynamic alone."""

    needs_data = False


def solver_class(scheme: Scheme, method: str = "rtn") -> type[LinearSolver]:
    if method in ("gptq", "awq+gptq"):
        from .fp8_gptq import FP8GPTQSolver

        return FP8GPTQSolver
    return FP8Solver if scheme.activations == "static" else FP8DynamicSolver
