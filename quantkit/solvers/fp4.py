"""The FP4 solvers, `--scheme nvfp4|mxfp4|nvfp4-a4`: rounding with searched group scales (RTN) or GPTQ onto the
same grid (fp4_grid.py has the maths). AWQ is refused: its scale search assumes an integer grid.

nvfp4-a4 also quantises activations: per 16 at run time, under one static global input scale per Linear, the
power of two at or below 448 x 6 / (the calibration inputs' absmax), as fp4.nvfp4_global_scale picks the
weights'. Linears that read one tensor (q/k/v, gate/up) see the same inputs, so they choose the same one, as an
engine that fuses them needs."""
from __future__ import annotations

import torch

from .. import fp4
from ..errors import UserError
from ..qweight import QWeight
from ..schemes import Scheme
from .base import LinearSolver, SolveOptions
from .fp4_grid import fp4_quantize
from .fp8_gptq import FP8GPTQSolver


class InputAbsmax:
    """The largest input magnitude a Linear saw in calibration, and the global input scale it gives (the calls of
    fp8_input_scale.InputScale, so FP8GPTQSolver and share_inputs drive it)."""

    def __init__(self, name: str, weight: torch.Tensor | None = None):
        self.name = name
        self.amax = torch.zeros(())

    def add(self, x: torch.Tensor) -> None:
        self.amax = torch.maximum(self.amax, x.detach().abs().amax().float().cpu())

    def merged(self, others: list["InputAbsmax"]) -> "InputAbsmax":
        out = InputAbsmax(self.name)
        out.amax = torch.stack([self.amax, *(o.amax for o in others)]).max()
        return out

    def attach(self, qw: QWeight, scale_dtype=None) -> QWeight:
        if not bool(torch.isfinite(self.amax)) or not self.amax > 0:
            raise UserError(f"the calibration inputs of {self.name} are all zero or not finite; no FP4 input scale "
                            "can be chosen from them: check the calibration text, or --ignore the layer")
        qw.input_scale = fp4.nvfp4_global_scale(self.amax)
        return qw


class FP4Solver(LinearSolver):
    needs_data = False

    def solve(self) -> QWeight:
        return fp4_quantize(self.weight, self.scheme)


class FP4StaticSolver(FP4Solver):
    """FP4Solver for nvfp4-a4: the weights by rounding, the global input scale from the calibration inputs."""

    needs_data = True

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: SolveOptions | None = None):
        super().__init__(name, weight, scheme, options)
        self.inputs = InputAbsmax(name)

    def add_batch(self, x: torch.Tensor) -> None:
        self.inputs.add(x)

    def solve(self) -> QWeight:
        return self.inputs.attach(super().solve())


class FP4GPTQSolver(FP8GPTQSolver):
    """GPTQ in column order onto FP4Grid (gptq.py picks the grid by scheme); for nvfp4-a4 also the global input
    scale from the same calibration batches (FP8GPTQSolver's input hooks, with InputAbsmax)."""

    input_scale_class = InputAbsmax


def solver_class(method: str, scheme: Scheme | None = None) -> type[LinearSolver]:
    if method.startswith("awq"):
        raise UserError(f"--method {method} does not support the FP4 schemes; use --method rtn or gptq")
    if method == "gptq":
        return FP4GPTQSolver
    return FP4StaticSolver if scheme is not None and scheme.activations else FP4Solver
