"""The FP4 solvers, `--scheme nvfp4|mxfp4`: rounding with searched group scales (RTN) or GPTQ onto the same grid
(fp4_grid.py has the maths). AWQ is refused: its scale search assumes an integer grid."""
from __future__ import annotations

import torch

from ..errors import UserError
from ..qweight import QWeight
from ..schemes import Scheme
from .base import LinearSolver
from .fp4_grid import fp4_quantize
from .gptq import GPTQSolver


class FP4Solver(LinearSolver):
    needs_data = False

    def solve(self) -> QWeight:
        return fp4_quantize(self.weight, self.scheme)


class FP4GPTQSolver(GPTQSolver):
    """GPTQ in column order onto FP4Grid (gptq.py picks the grid by scheme)."""

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: dict):
        super().__init__(name, weight, scheme, {**options, "actorder": None})


def solver_class(method: str) -> type[LinearSolver]:
    if method.startswith("awq"):
        raise UserError(f"--method {method} does not support the FP4 schemes; use --method rtn or gptq")
    return FP4GPTQSolver if method == "gptq" else FP4Solver
