"""The interface the pipeline drives: one LinearSolver per quantised Linear, and what the plan hands each one."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..qweight import QWeight
from ..schemes import Scheme


@dataclass(frozen=True)
class SolveOptions:
    """What plan.build_plan hands every LinearSolver, whatever its algorithm: the dtype the checkpoint stores
    scales in (the plan's rule, schemes.scale_dtype_for) and whether rounding searches each group's clipping range
    (recipe quant.clip_search). An algorithm's own knobs travel in its own options model (GPTQOptions to the GPTQ
    solvers). SolveOptions() is what a solver built bare (in a test) gets: float16 scales, no clip search."""

    scale_dtype: torch.dtype = torch.float16
    clip_search: bool = False


def unit_rms(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, features] with every token scaled to RMS 1, so that each weighs the same in a Gram matrix or
    Hessian: a few tokens with outsized activations (attention sinks, chat markers) otherwise dominate it and
    the solve fits them rather than the text (docs/benchmarks.md, "Every token counts the same")."""
    return x / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)


class LinearSolver:
    """Feed it the Linear's inputs with add_batch (if needs_data), then call solve once.

    name is the module's full name, used in warnings and errors; options: the plan's SolveOptions.
    """

    needs_data: bool = False

    def __init__(self, name: str, weight: torch.Tensor, scheme: Scheme, options: SolveOptions | None = None):
        self.name = name
        self.weight = weight
        self.scheme = scheme
        self.options = options or SolveOptions()

    def add_batch(self, x: torch.Tensor) -> None:  # x: [tokens, in_features]
        pass

    def add_holdout(self, x: torch.Tensor) -> None:
        """A held-out sample's inputs; a solver without a guard learns from them like any other."""
        self.add_batch(x)

    def shared_statistics(self):
        """A key for what add_batch gathers: Linears that read one tensor (q/k/v, gate/up) and whose solvers give
        equal keys need it gathered once, so the pipeline feeds the first and the others adopt() its statistics.
        None: this solver gathers its own."""
        return None

    def adopt(self, leader: "LinearSolver") -> None:
        """Take LEADER's statistics as this solver's own (LEADER was fed the tensor this Linear reads)."""
        raise NotImplementedError

    def reduce(self, pool) -> None:
        """Data-parallel runs: pool the statistics gathered from this rank's samples with every other rank's
        (pool: distributed.Pool, in-place sum and max); after it, each rank holds what one process fed every
        sample would. A solver that keeps no statistics has nothing to pool."""

    def solve(self) -> QWeight:
        raise NotImplementedError


def pooled_mean(mean: torch.Tensor, seen: int, pool) -> tuple[torch.Tensor, int]:
    """A running mean over SEEN tokens made the mean over every rank's tokens: each rank's share weighs it."""
    total = pool.count(seen)
    if total:
        mean.mul_(seen / total)
        pool.sum(mean)
    return mean, total


def share_inputs(solvers: list[LinearSolver]) -> None:
    """Give the static-activation solvers of Linears that read one tensor (q/k/v, gate/up) one set of input
    statistics, once all batches are in, so they choose one input scale.

    Engines that fuse those Linears into one matmul quantise the shared input once: vLLM keeps the largest of the
    fused Linears' input scales, which would re-round the inputs of every Linear whose own scale was smaller.
    """
    static = [s for s in solvers if getattr(s, "inputs", None) is not None and s.scheme.activations == "static"]
    if len(static) < 2:
        return
    merged = static[0].inputs.merged([s.inputs for s in static[1:]])
    for s in static:
        s.inputs = merged


class LayerTransform:
    """A change applied to a whole decoder layer before its Linears are solved (AWQ scaling, KV observers).

    apply() receives the layer, its calibration inputs (capture.LayerInputs) and {module: (name, Scheme)} of
    the layer's targeted Linears; it may modify the layer's float weights in place (keeping the float function
    unchanged) and returns {"stats": {linear_name: {...}}, "tensors": {checkpoint_key: tensor}}. options: the
    transform's own options model (AWQOptions, SignRoundOptions, SmoothQuantOptions), None for one without
    knobs.
    """

    def __init__(self, model, options=None):
        self.model = model
        self.options = options

    def apply(self, layer_index: int, layer, inputs, targets: dict) -> dict:
        raise NotImplementedError


class Presolved(LinearSolver):
    """Hands over codes a LayerTransform already chose for this Linear (learned rounding solves a whole layer)."""

    def __init__(self, name: str, qweight: QWeight):
        super().__init__(name, qweight.dequantize(), qweight.scheme, {})
        self.qweight = qweight

    def solve(self) -> QWeight:
        return self.qweight
