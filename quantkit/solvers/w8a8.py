"""W8A8 INT8 (`w8a8`, `w8a8-static`): per-channel symmetric INT8 weights, INT8 activations.

The weights are solved as any per-channel INT8 weights are (RTN from rtn.py, or GPTQ onto the same grid); the
activations are quantised at run time, per token (`w8a8`: nothing to solve) or with one calibrated scale per
tensor (`w8a8-static`: int8_input_scale.py). The solvers are the FP8 ones with the INT8 weight grid and the INT8
input-scale search, so the pipeline treats both families alike (shared input scales for q/k/v and gate/up
included: base.share_inputs).
"""
from __future__ import annotations

import torch

from ..qweight import QWeight
from .fp8 import FP8Solver
from .fp8_gptq import FP8GPTQSolver
from .int8_input_scale import Int8InputScale
from .rtn import rtn_quantize


class W8A8Solver(FP8Solver):
    """RTN INT8 weights; a static scheme also gets its input scale from the calibration inputs."""

    input_scale_class = Int8InputScale

    def quantize_weight(self, scale_dtype: torch.dtype) -> QWeight:
        return rtn_quantize(self.weight, self.scheme, clip_search=self.options.clip_search,
                            scale_dtype=scale_dtype)


class W8A8DynamicSolver(W8A8Solver):
    """Per-token activations: the class itself says no data is needed (the pipeline asks the class)."""

    needs_data = False


class W8A8GPTQSolver(FP8GPTQSolver):
    """GPTQ onto the INT8 grid (gptq.py picks the grid from the scheme); static input scales as above."""

    input_scale_class = Int8InputScale
    keeps_column_order = False  # an integer grid: act-order as for weight-only schemes


def solver_class(method: str, static: bool) -> type:
    if method in ("gptq", "awq+gptq"):
        return W8A8GPTQSolver
    return W8A8Solver if static else W8A8DynamicSolver
