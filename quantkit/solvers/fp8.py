"""FP8 (E4M3) weights by absmax scaling: one scale per tensor (`fp8`) or per output channel (`fp8-dynamic`).

E4M3 is a floating-point grid, so the absmax weight scale loses nothing to the rounding of small values the way
an integer grid does. Schemes with static activations (`fp8`) also get one input scale per Linear, chosen from
its calibration inputs (seen through add_batch): solvers/fp8_input_scale.py.
"""
from __future__ import annotations

import torch

from .. import e4m3
from ..qweight import QWeight
from ..schemes import Scheme
from .base import LinearSolver, SolveOptions
from .fp8_input_scale import INPUT_MARGIN, InputScale  # noqa: F401  (INPUT_MARGIN: part of this module's API)


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


class FP8Solver(LinearSolver):
    """Weights as above; with static activations, also the input scale from the calibration inputs.

    The class says it needs data (so the pipeline, which asks the class, collects calibration data for a
    static scheme); each instance narrows that to its own scheme, so dynamic schemes are not fed tokens.
    """

    needs_data = True
    input_scale_class = InputScale  # the grid the static input scale is searched on (w8a8.py: INT8)

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: SolveOptions | None = None):
        super().__init__(name, weight, scheme, options)
        self.needs_data = scheme.activations == "static"
        self.inputs = self.input_scale_class(name, weight) if self.needs_data else None

    def add_batch(self, x: torch.Tensor) -> None:
        if self.needs_data:
            self.inputs.add(x)

    def reduce(self, pool) -> None:
        if self.needs_data:
            self.inputs.reduce(pool)

    def solve(self) -> QWeight:
        scale_dtype = self.options.scale_dtype
        qw = self.quantize_weight(scale_dtype)
        if self.scheme.activations == "static":
            self.inputs.attach(qw, scale_dtype)
        return qw

    def quantize_weight(self, scale_dtype: torch.dtype) -> QWeight:
        return fp8_quantize(self.weight, self.scheme, scale_dtype)


class FP8DynamicSolver(FP8Solver):
    """FP8Solver for schemes without static activations: the class itself says no data is needed, so the
    pipeline (which asks the class) does not load calibration data for fp8-dynamic alone."""

    needs_data = False
