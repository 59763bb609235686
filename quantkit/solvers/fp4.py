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
from .base import LinearSolver
from .fp4_grid import fp4_quantize
from .gptq import GPTQSolver


class InputAbsmax:
    """The largest input magnitude a Linear saw in calibration, and the global input scale it gives."""

    def __init__(self):
        self.amax = torch.zeros(())

    def add(self, x: torch.Tensor) -> None:
        self.amax = torch.maximum(self.amax, x.detach().abs().amax().float().cpu())

    def attach(self, qw: QWeight, name: str) -> QWeight:
        if not bool(torch.isfinite(self.amax)) or not self.amax > 0:
            raise UserError(f"the calibration inputs of {name} are all zero or not finite; no FP4 input scale can "
                            "be chosen from them: check the calibration text, or --ignore the layer")
        qw.input_scale = fp4.nvfp4_global_scale(self.amax)
        return qw


class FP4Solver(LinearSolver):
    needs_data = False

    def solve(self) -> QWeight:
        return fp4_quantize(self.weight, self.scheme)


class FP4StaticSolver(FP4Solver):
    """FP4Solver for nvfp4-a4: the weights by rounding, the global input scale from the calibration inputs."""

    needs_data = True

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: dict):
        super().__init__(name, weight, scheme, options)
        self.input_absmax = InputAbsmax()

    def add_batch(self, x: torch.Tensor) -> None:
        self.input_absmax.add(x)

    def solve(self) -> QWeight:
        return self.input_absmax.attach(super().solve(), self.name)


class FP4GPTQSolver(GPTQSolver):
    """GPTQ in column order onto FP4Grid (gptq.py picks the grid by scheme); for nvfp4-a4 also the global input
    scale from the same calibration batches."""

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: dict):
        super().__init__(name, weight, scheme, {**options, "actorder": None})
        self.input_absmax = InputAbsmax() if scheme.activations else None

    def add_batch(self, x: torch.Tensor) -> None:
        super().add_batch(x)
        if self.input_absmax is not None:
            self.input_absmax.add(x)

    def solve(self) -> QWeight:
        qw = super().solve()
        return qw if self.input_absmax is None else self.input_absmax.attach(qw, self.name)


def solver_class(method: str, scheme: Scheme | None = None) -> type[LinearSolver]:
    if method.startswith("awq"):
        raise UserError(f"--method {method} does not support the FP4 schemes; use --method rtn or gptq")
    if method == "gptq":
        return FP4GPTQSolver
    return FP4StaticSolver if scheme is not None and scheme.activations else FP4Solver
