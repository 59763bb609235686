"""Solve a model's planned Linears layer by layer, feeding each layer the previous layer's quantised output.

Layers whose solvers read no activations are solved straight from their weights; otherwise capture/ records
each layer's inputs, the layer transforms (AWQ scaling, KV-scale observers) run, the Linears that read one
tensor are fed together, and the quantised layer's output becomes the next layer's input (true sequential).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import distributed, heap
from ..errors import UserError
from ..models.hf import decoder_layers
from ..plan import Plan
from ..qweight import QWeight
from ..capture import holdout
from ..capture import layer as capture
from ..capture import spill as spilling
from ..solvers.base import LayerTransform, LinearSolver, Presolved, share_inputs
from . import stages
from .progress import LayerProgress
from .stream import LayerStream


@dataclass
class QuantizeResult:
    qweights: dict[str, QWeight]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # extra checkpoint tensors (k_scale, ...)
    stats: dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0
    activations: str | None = None  # where the calibration activations were kept: "memory" or "disk"


def transforms_for(model: nn.Module, plan: Plan) -> list[LayerTransform]:
    out: list[LayerTransform] = []
    if plan.smooth is not None:
        from ..solvers.smoothquant import SmoothQuantTransform

        out.append(SmoothQuantTransform(model, plan.smooth, plan.options.scale_dtype))
    if plan.awq is not None:
        from ..solvers.awq import AWQTransform

        out.append(AWQTransform(model, plan.awq, plan.options.scale_dtype, plan.recipe.calibration.holdout))
    if plan.signround is not None:
        from ..solvers.signround import SignRoundTransform

        out.append(SignRoundTransform(model, plan.signround, plan.options.scale_dtype,
                                      plan.recipe.calibration.holdout))
    if plan.kv_scheme is not None:
        from ..solvers.kv_scales import KVScaleObserver

        out.append(KVScaleObserver(model))
    return out


class _Solve:
    """Makes each Linear's solver and applies its result: the codes are kept, the float weight becomes their
    dequantised value so later layers see the quantised model."""

    def __init__(self, model: nn.Module, plan: Plan, result: QuantizeResult, keep=None):
        self.modules = dict(model.named_modules())
        self.plan = plan
        self.result = result
        self.keep = keep or (lambda qw: qw)
        self.solved: dict[str, QWeight] = {}  # codes a layer transform already chose (learned rounding)

    def make(self, name: str, method: str | None = None) -> LinearSolver:
        if method is None and name in self.solved:
            return Presolved(name, self.solved.pop(name))
        w = self.modules[name].weight.detach().float()
        if not torch.isfinite(w).all():
            raise UserError(f"NaN or Inf in the weights of {name}; the source model is broken")
        return self.plan.make_solver(name, w, method)

    def __call__(self, name: str, solver: LinearSolver) -> None:
        self.apply(name, self.solved_by(name, solver))

    def all(self, jobs: list[tuple[str, LinearSolver]]) -> None:
        """Solve and apply each (name, solver). With several ranks, each Linear is solved once, on the rank it
        is dealt by cost, and broadcast, so every rank goes on with the same quantised layer."""
        if not distributed.active():
            for name, solver in jobs:
                self(name, solver)
            return
        ranks = distributed.owners([_cost(s) for _, s in jobs])
        mine = {name: self.solved_by(name, s) for (name, s), r in zip(jobs, ranks) if r == distributed.rank()}
        for (name, _), r in zip(jobs, ranks):
            self.apply(name, distributed.broadcast(mine.get(name), r))

    def solved_by(self, name: str, solver: LinearSolver) -> QWeight:
        t = time.time()
        qw = solver.solve()
        heap.trim()  # the solve's float64/float32 work (quantkit/heap.py)
        qw.stats["seconds"] = round(time.time() - t, 4)  # the whole solve: a guard's candidates included
        qw.stats["scheme"] = self.plan.schemes[name].name
        return qw

    def apply(self, name: str, qw: QWeight) -> None:
        mod = self.modules[name]
        mod.weight.data = qw.dequantize().to(mod.weight.device, mod.weight.dtype)
        self.result.qweights[name] = self.keep(qw)


def _cost(solver: LinearSolver) -> float:
    """Relative solve time: GPTQ-like solvers factor an in x in Hessian and sweep it over every output row."""
    out_features, in_features = solver.weight.shape
    return out_features * in_features * (in_features if solver.needs_data else 1)


def quantize_model(model: nn.Module, plan: Plan, calib_samples: list[torch.Tensor] | None = None,
                   progress=None, device: str = "cpu", weights=None, keep=None,
                   spill: spilling.Spill | None = None) -> QuantizeResult:
    """Quantise model in place (its planned Linear weights become their dequantised values); return the codes.

    weights: a models.lazy.LazyWeights when the decoder layers are still on the meta device; each layer is then
    read just before it is processed and its quantised Linears' float weights are dropped right after.
    keep: QWeight -> QWeight, applied to each solved Linear's codes before they are kept (formats/code_spool.py
    moves them to disk, so a streamed run's memory does not grow with the layers solved).
    spill: where the calibration activations go when they would not fit (capture/spill.py); None: memory.
    """
    t0 = time.time()
    if plan.needs_data and not calib_samples:
        raise UserError(f"method '{plan.method}' needs calibration data; pass --calib SPEC")
    result = QuantizeResult({})
    solve = _Solve(model, plan, result, keep)
    layers_name, layers = decoder_layers(model)
    prog = LayerProgress(progress, len(layers), len(calib_samples or []) if plan.needs_data else 0)
    stream = LayerStream(weights, plan.schemes, layers_name)
    if plan.needs_data:
        spill = spill or spilling.Spill(None, None)
        _sequential(model, layers, layers_name, plan, calib_samples, solve, prog, device, stream, spill)
        result.activations = "disk" if spill.on_disk else "memory"
    else:
        for i in range(len(layers)):
            stream.load(i)
            solve.all([(n, solve.make(n)) for n in stream.targets(i)])
            stream.release(i)
            prog.layer(f"layer {i + 1}/{len(layers)}")
    outside = []
    for n in plan.schemes:  # Linears outside the decoder layers (e.g. an un-ignored lm_head): no activations kept
        if not n.startswith(layers_name + "."):
            solver = solve.make(n)
            # rounding on the scheme's own grid (a static fp8 one still needs its inputs)
            outside.append((n, solve.make(n, "rtn") if solver.needs_data else solver))
    solve.all(outside)
    result.seconds = time.time() - t0
    for n, qw in result.qweights.items():
        result.stats.setdefault(n, {}).update(qw.stats)
    return result


def _to_device(model: nn.Module, layers_name: str, device: str) -> None:
    """Everything outside the decoder layers (embeddings, rotary) lives on the device for the whole run."""
    for n, m in model.named_modules():
        if n != layers_name and not n.startswith(layers_name + "."):
            for _, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                t.data = t.data.to(device)


def _state_bytes(model: nn.Module, samples: list[torch.Tensor]) -> int:
    """What one set of hidden states (every sample's input to a layer) takes, in the dtype the model computes."""
    hidden = model.config.get_text_config().hidden_size
    size = next(model.parameters()).element_size()
    return sum(s.numel() for s in samples) * hidden * size


def _sequential(model, layers, layers_name, plan: Plan, samples, solve: _Solve, prog, device, stream,
                spill: spilling.Spill):
    names_of = {m: n for n, m in solve.modules.items()}
    transforms = transforms_for(model, plan)
    on_device = device != "cpu"
    if on_device:
        _to_device(model, layers_name, device)
    spill.decide(_state_bytes(model, samples))
    inputs = capture.first_layer_inputs(model, layers, samples, device, spill.new(device))
    for i, layer in enumerate(layers):
        where = f"{layers_name}.{i}"
        stream.load(i)
        if on_device:
            layer.to(device)
        capture.check_finite(inputs.hidden, f"the input of {where}")
        targets = {m: (names_of[m], plan.schemes[names_of[m]]) for m in layer.modules()
                   if names_of.get(m) in plan.schemes}
        for t in transforms:
            out = t.apply(i, layer, inputs, targets) or {}
            for n, s in out.get("stats", {}).items():
                solve.result.stats.setdefault(n, {}).update(s)
            solve.result.tensors.update(out.get("tensors", {}))
            solve.solved.update(out.get("solved", {}))
        _solve_layer(layer, {m: names_of[m] for m in targets}, inputs, solve, prog)
        outputs = capture.run_layer(layer, inputs, spill.new(device))
        spilling.release(inputs.hidden)
        inputs = capture.LayerInputs(outputs, inputs.kwargs)
        capture.check_finite(inputs.hidden, f"the output of {where}")
        if on_device:
            layer.to("cpu")
        stream.release(i)  # after run_layer: the next layer's inputs come from this quantised layer
        prog.layer(f"layer {i + 1}/{len(layers)}")
    spilling.release(inputs.hidden)


def _solve_layer(layer, names: dict, inputs, solve: _Solve, prog) -> None:
    experts = stages.expert_linears(layer)
    groups = _groups(layer, names, inputs)
    for stage in stages.stages(groups, names):
        solvers = {m: solve.make(names[m]) for m in stage}
        fed = dict.fromkeys(stage, 0)
        if any(s.needs_data for s in solvers.values()):
            # the calibration hold-out goes to the solvers' guards (gptq_guard.py): the samples AWQ keeps out
            held = set(holdout.split(len(inputs.hidden), solve.plan.recipe.calibration.holdout)[1] or ())
            sample = [0]
            leader_of = _leaders(groups, solvers)
            seen: dict = {}  # leader -> the tensor it was fed in this sample, which its followers must read too

            def sink(mod, x):
                x = x.reshape(-1, x.shape[-1])
                fed[mod] += x.shape[0]
                lead = leader_of.get(mod)
                if lead is not None:
                    if seen.get(lead) != (x.data_ptr(), x.shape):
                        raise RuntimeError(f"{names[mod]} did not read the tensor {names[lead]} read; "
                                           "its statistics cannot be shared")
                    return
                seen[mod] = (x.data_ptr(), x.shape)
                if sample[0] in held:
                    solvers[mod].add_holdout(x)
                else:
                    solvers[mod].add_batch(x)

            def next_sample():
                sample[0] += 1
                prog.sample()

            with stages.ExpertFeed(stage, experts, solve.plan.moe.get("calibrate_all_experts", False)):
                capture.feed_group(layer, stage, inputs, sink, next_sample)
            if distributed.active():  # each rank fed its share of the samples: pool what the solvers saw
                for m, s in solvers.items():
                    if m not in leader_of:
                        s.reduce(distributed.Pool)
                fed = {m: distributed.Pool.count(n) for m, n in fed.items()}
            for m, lead in leader_of.items():
                solvers[m].adopt(solvers[lead])
            share_inputs(list(solvers.values()))
        jobs = []
        for m, s in solvers.items():
            if m in experts:
                s = _expert_solver(m, s, fed[m], experts[m], names[m], solve)
            jobs.append((names[m], s))
        solve.all(jobs)


def _leaders(groups: list[list], solvers: dict) -> dict:
    """{follower: leader} among this stage's solvers: Linears of one input group whose solvers gather the same
    statistics (LinearSolver.shared_statistics) are fed once, through the first of them; q/k/v's Hessian is then
    summed once, not three times."""
    out = {}
    for g in groups:
        first: dict = {}
        for m in g:
            s = solvers.get(m)
            key = None if s is None or not s.needs_data else s.shared_statistics()
            if key is not None:
                lead = first.setdefault(key, m)
                if lead is not m:
                    out[m] = lead
    return out


def _groups(layer, names: dict, inputs) -> list[list]:
    """The layer's Linears grouped by shared input, found by running its first sample; with several ranks,
    rank 0's (each rank's first sample routes to other experts, and every rank must solve in one order)."""
    groups = capture.linear_groups(layer, names, inputs)
    if not distributed.active():
        return groups
    by_name = {n: m for m, n in names.items()}
    return [[by_name[n] for n in g] for g in distributed.broadcast([[names[m] for m in g] for g in groups], 0)]


def _expert_solver(mod, solver: LinearSolver, tokens: int, owner, name: str, solve: _Solve) -> LinearSolver:
    """The solver for one expert's Linear: its own, or rounding when routing fed it too few tokens to solve
    from (the rule and its threshold: recipe quant.moe.min_tokens); the counts go into quantkit.json."""
    experts, e = owner
    stats = solve.result.stats.setdefault(name, {})
    stats.update({"routed_tokens": int(experts.routed[e]), "calibration_tokens": tokens})
    if not solver.needs_data or tokens >= solve.plan.moe.get("min_tokens", 0):
        return solver
    fallback = solve.make(name, "rtn")
    if fallback.needs_data:
        raise UserError(f"{name} saw {tokens} calibration tokens and its scheme needs calibrated input scales; "
                        "pass --set quant.moe.calibrate_all_experts=true (every expert sees every token) or "
                        "more --num-samples")
    stats["fallback"] = f"rtn (fewer than {solve.plan.moe['min_tokens']} calibration tokens)"
    return fallback
