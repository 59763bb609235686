"""GPTQ onto the FP8 (E4M3) grid: `--scheme fp8|fp8-dynamic --method gptq`.

E4M3 keeps 3 mantissa bits, so absmax rounding leaves every weight with up to 6% relative error; on a small
model that alone moves perplexity by 0-2% depending on which way the roundings happen to fall. GPTQ's column-by-
column error compensation works for any grid, so the weight scale is fixed up front (per tensor or per output
channel, exactly RTN's fp8 scale) and each column is rounded to E4M3 with its error pushed onto the columns not
yet quantised. Static schemes also choose their input scale from the same calibration batches (fp8_input_scale.py).
"""
from __future__ import annotations

import torch

from ..qweight import QWeight
from ..schemes import Scheme
from .base import SolveOptions
from .fp8_input_scale import InputScale
from .gptq_solver import GPTQSolver
from .gptq_options import GPTQOptions


class FP8GPTQSolver(GPTQSolver):
    input_scale_class = InputScale  # the grid the static input scale is searched on (w8a8.py: INT8)
    balance_tokens = False  # measured with power-weighted H (docs/benchmarks.md); integer GPTQ balances tokens
    keeps_column_order = True

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: SolveOptions | None = None,
                 gptq: GPTQOptions | None = None):
        super().__init__(name, weight, scheme, options, gptq)
        self.inputs = self.input_scale_class(name, weight) if scheme.activations == "static" else None

    def add_batch(self, x: torch.Tensor) -> None:
        super().add_batch(x)
        if self.inputs is not None:
            self.inputs.add(x)

    def add_holdout(self, x: torch.Tensor) -> None:
        super().add_holdout(x)
        if self.inputs is not None:  # the input scale is not judged by the guard: it learns from every sample
            self.inputs.add(x)

    def shared_statistics(self):
        # a static input scale is gathered beside the Hessian, per Linear (base.share_inputs merges them later)
        return None if self.inputs is not None else super().shared_statistics()

    def reduce(self, pool) -> None:
        super().reduce(pool)
        if self.inputs is not None:
            self.inputs.reduce(pool)

    def solve(self) -> QWeight:
        qw = super().solve()
        if self.inputs is not None:
            self.inputs.attach(qw, self.options.scale_dtype)
        return qw
