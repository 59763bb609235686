"""The quantisation job: pick the target Linears, solve them layer by layer, hand the results to the writer.

Solvers are chosen by method (rtn, gptq, awq, awq+gptq) and by scheme (fp8 has its own solver); methods that
need calibration data run through capture.py one decoder layer at a time, everything else is solved directly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from . import capture
from .errors import UserError
from .models.hf import decoder_layers
from .qweight import QWeight
from .recipe import Recipe
from .schemes import Scheme, get_scheme
from .solvers.base import LayerTransform, LinearSolver, share_inputs
from .targets import matches


def _scheme_for(recipe: Recipe, base: Scheme, group_size, symmetric) -> Scheme:
    q = recipe.quant
    gs = group_size if group_size is not None else base.group_size
    if base.is_fp8:
        return base
    actorder = None if q.gptq.actorder == "off" or q.method not in ("gptq", "awq+gptq") else q.gptq.actorder
    return base.with_options(group_size=gs, symmetric=symmetric, actorder=actorder)


def default_group_size(model: nn.Module, recipe: Recipe) -> int | None:
    """The group size when the user gave none: the scheme's, or the largest of 128/64/32 dividing every target.

    SmolLM2's 576-wide projections, for one, do not divide by 128.
    """
    q = recipe.quant
    base = get_scheme(q.scheme)
    if q.group_size is not None or base.is_fp8 or base.group_size == -1:
        return q.group_size
    widths = {m.in_features for n, m in model.named_modules()
              if isinstance(m, nn.Linear) and not any(matches(p, n, m) for p in q.ignore)}
    for g in (base.group_size, 64, 32):
        if all(w % g == 0 for w in widths):
            return g
    return base.group_size


def plan_targets(model: nn.Module, recipe: Recipe) -> dict[str, Scheme]:
    """{module name: Scheme} for every Linear to quantise, in model order; checks group sizes fit."""
    q = recipe.quant
    default = _scheme_for(recipe, get_scheme(q.scheme), default_group_size(model, recipe), q.symmetric)
    plan = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or any(matches(p, name, mod) for p in q.ignore):
            continue
        scheme = default
        for t in q.targets:
            if matches(t.match, name, mod):
                scheme = _scheme_for(recipe, get_scheme(t.scheme), t.group_size,
                                     q.symmetric if t.symmetric is None else t.symmetric)
                break
        gs = scheme.group_size
        if not scheme.is_fp8 and gs != -1 and mod.in_features % gs:
            fits = [str(g) for g in (32, 64, 128, 256) if mod.in_features % g == 0] + ["-1"]
            raise UserError(f"{name} has in_features={mod.in_features}, not divisible by group size {gs}; "
                            f"use --group-size {' or '.join(fits)}")
        plan[name] = scheme
    if not plan:
        raise UserError("no Linear layer is left to quantise after --ignore; loosen the ignore patterns")
    return plan


def solver_for(method: str, scheme: Scheme) -> type[LinearSolver]:
    if scheme.is_fp8:
        from .solvers.fp8 import solver_class

        # fp8-dynamic weights by rounding need no calibration; static input scales and GPTQ do
        return solver_class(scheme, method)
    if method in ("gptq", "awq+gptq"):
        from .solvers.gptq import GPTQSolver

        return GPTQSolver
    from .solvers.rtn import RTNSolver

    return RTNSolver


def transforms_for(model, recipe: Recipe) -> list[LayerTransform]:
    out: list[LayerTransform] = []
    if recipe.quant.method in ("awq", "awq+gptq"):
        from .solvers.awq import AWQTransform

        out.append(AWQTransform(model, recipe.quant.awq.model_dump()))
    if recipe.quant.kv_cache == "fp8":
        from .solvers.kv_scales import KVScaleObserver

        out.append(KVScaleObserver(model, {}))
    return out


def needs_calibration(recipe: Recipe, plan: dict[str, Scheme]) -> bool:
    """Whether the run needs calibration activations: a layer transform, or a solver that reads inputs."""
    q = recipe.quant
    return q.method in ("awq", "awq+gptq") or q.kv_cache is not None or any(
        solver_for(q.method, s).needs_data for s in plan.values())


def solver_options(recipe: Recipe, dtype: torch.dtype) -> dict:
    q = recipe.quant
    g = q.gptq
    return {"clip_search": q.clip_search, "damp": g.damp, "block_size": g.block_size,
            "actorder": None if g.actorder == "off" else g.actorder, "static_groups": g.static_groups,
            "scale_dtype": dtype if dtype != torch.float32 else torch.float16}


@dataclass
class QuantizeResult:
    qweights: dict[str, QWeight]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # extra checkpoint tensors (k_scale, ...)
    stats: dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0


class _Progress:
    """Thin wrapper so the pipeline runs the same with or without a rich Progress."""

    def __init__(self, progress, n_layers: int, n_samples: int):
        self.p = progress
        if progress is not None:
            self.layers = progress.add_task("layers", total=n_layers)
            self.samples = progress.add_task("calibration samples", total=n_samples, visible=n_samples > 0)

    def sample(self):
        if self.p is not None:
            self.p.advance(self.samples)

    def layer(self, desc: str):
        if self.p is not None:
            self.p.advance(self.layers)
            self.p.update(self.layers, description=desc)
            self.p.reset(self.samples)


def quantize_model(model: nn.Module, recipe: Recipe, calib_samples: list[torch.Tensor] | None = None,
                   progress=None, device: str | None = None, weights=None,
                   storage_dtype: torch.dtype | None = None) -> QuantizeResult:
    """Quantise model in place (its targeted Linear weights become their dequantised values) and return the codes.

    weights: a models.lazy.LazyWeights when the decoder layers are still on the meta device; each layer is then
    read just before it is processed and its quantised Linears' float weights are dropped right after.
    storage_dtype: the dtype scales will be written in, when the model computes in a wider one; codes are
    solved against scales rounded to it.
    """
    t0 = time.time()
    device = device or recipe.device
    dtype = next(model.parameters()).dtype
    plan = plan_targets(model, recipe)
    modules = dict(model.named_modules())
    opts = solver_options(recipe, storage_dtype or dtype)
    transforms = transforms_for(model, recipe)
    needs_data = needs_calibration(recipe, plan)
    if needs_data and not calib_samples:
        raise UserError(f"method '{recipe.quant.method}' needs calibration data; pass --calib SPEC")
    result = QuantizeResult({})

    def solve(name: str, solver: LinearSolver):
        t = time.time()
        qw = solver.solve()
        qw.stats.setdefault("seconds", round(time.time() - t, 4))
        qw.stats["scheme"] = plan[name].name
        mod = modules[name]
        mod.weight.data = qw.dequantize().to(mod.weight.device, mod.weight.dtype)
        result.qweights[name] = qw

    def make(name: str) -> LinearSolver:
        w = modules[name].weight.detach().float()
        if not torch.isfinite(w).all():
            raise UserError(f"NaN or Inf in the weights of {name}; the source model is broken")
        return solver_for(recipe.quant.method, plan[name])(name, w, plan[name], opts)

    layers_name, layers = decoder_layers(model)
    in_layers = {n for n in plan if n.startswith(layers_name + ".")}
    prog = _Progress(progress, len(layers), len(calib_samples or []) if needs_data else 0)
    stream = _Stream(weights, plan, layers_name)
    if not needs_data:
        for i, layer in enumerate(layers):
            stream.load(i)
            for n in stream.targets(i):
                solve(n, make(n))
            stream.release(i)
            prog.layer(f"layer {i + 1}/{len(layers)}")
    else:
        _sequential(model, layers, layers_name, plan, modules, calib_samples, transforms, make, solve, result,
                    prog, device, stream)
    for n in plan:  # Linears outside the decoder layers (e.g. an un-ignored lm_head): no activations kept
        if n not in in_layers:
            solver = make(n)
            if solver.needs_data:  # rounding on the scheme's own grid (a static fp8 one still needs its inputs)
                solver = solver_for("rtn", plan[n])(n, solver.weight, plan[n], opts)
            solve(n, solver)
    result.seconds = time.time() - t0
    for n, qw in result.qweights.items():
        result.stats.setdefault(n, {}).update(qw.stats)
    return result


class _Stream:
    """The per-layer load/release calls of lazy loading; does nothing for a fully loaded model."""

    def __init__(self, weights, plan: dict[str, Scheme], layers_name: str):
        self.weights = weights
        self.plan = plan
        self.layers_name = layers_name

    def targets(self, i: int) -> list[str]:
        return [n for n in self.plan if n.startswith(f"{self.layers_name}.{i}.")]

    def load(self, i: int) -> None:
        if self.weights is not None:
            self.weights.load_layer(i)

    def release(self, i: int) -> None:
        if self.weights is not None:
            self.weights.release(self.targets(i))


def _sequential(model, layers, layers_name, plan, modules, samples, transforms, make, solve, result, prog, device,
                stream):
    names_of = {m: n for n, m in modules.items()}
    on_device = device != "cpu"
    if on_device:  # everything outside the decoder layers (embeddings, rotary) lives on the device
        for n, m in model.named_modules():
            if n != layers_name and not n.startswith(layers_name + "."):
                for k, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                    t.data = t.data.to(device)
    inputs = capture.first_layer_inputs(model, layers, samples, device)
    for i, layer in enumerate(layers):
        where = f"{layers_name}.{i}"
        stream.load(i)
        if on_device:
            layer.to(device)
        capture.check_finite(inputs.hidden, f"the input of {where}")
        targets = {m: (names_of[m], plan[names_of[m]]) for m in layer.modules() if names_of.get(m) in plan}
        for t in transforms:
            out = t.apply(i, layer, inputs, targets) or {}
            for n, s in out.get("stats", {}).items():
                result.stats.setdefault(n, {}).update(s)
            result.tensors.update(out.get("tensors", {}))
        names = {m: names_of[m] for m in targets}
        for group in capture.linear_groups(layer, names, inputs):
            solvers = {m: make(names[m]) for m in group}
            if any(s.needs_data for s in solvers.values()):
                capture.feed_group(layer, group, inputs,
                                   lambda mod, x: solvers[mod].add_batch(x.reshape(-1, x.shape[-1])), prog.sample)
                share_inputs(list(solvers.values()))
            for m, s in solvers.items():
                solve(names[m], s)
        inputs = capture.LayerInputs(capture.run_layer(layer, inputs), inputs.kwargs)
        capture.check_finite(inputs.hidden, f"the output of {where}")
        if on_device:
            layer.to("cpu")
        stream.release(i)  # after run_layer: the next layer's inputs come from this quantised layer
        prog.layer(f"layer {i + 1}/{len(layers)}")


def _load(recipe: Recipe, lazy: bool):
    """(model, tokenizer, source, LazyWeights or None, plan): layer-by-layer loading unless only a full load works."""
    from .models.hf import load_float_model
    from .models.lazy import open_lazy

    # A CPU has no fast float16/bfloat16 matmul (calibration passes ran 13x slower in float16 than in float32 on
    # SmolLM2), so the model computes in float32 there; the checkpoint is still written in the storage dtype.
    compute = "float32" if recipe.device == "cpu" else recipe.dtype
    opened = open_lazy(recipe.model, compute) if lazy else None
    if opened is not None:
        model, tok, src, weights = opened
        plan = plan_targets(model, recipe)
        self_calib = (recipe.calibration.spec or "self") == "self"
        if not (self_calib and needs_calibration(recipe, plan)):
            return model, tok, src, weights, plan
        del model, weights, opened  # self-generated calibration samples text from the whole model
    model, tok, src = load_float_model(recipe.model, compute, recipe.device)
    return model, tok, src, None, plan_targets(model, recipe)


def quantize_to_checkpoint(recipe: Recipe, progress=None, log=print, lazy: bool = True) -> dict:
    """The whole job: load the float model, calibrate if the method needs it, solve, write OUT. Returns a summary.

    lazy: read one decoder layer at a time from the safetensors files (see models/lazy.py); the whole model is
    loaded instead when the checkpoint's key names need converting, it is not safetensors, or calibration
    text is sampled from the model itself.
    """
    from pathlib import Path

    from .formats.output import OutputClaim
    from .models.hf import resolve_model_dir

    if not recipe.output:
        raise UserError("no output folder; pass -o OUT")
    get_scheme(recipe.quant.scheme)
    for t in recipe.quant.targets:
        get_scheme(t.scheme)
    # OUT is claimed (checked, writable, locked) before any work, and held until the checkpoint is in place
    with OutputClaim(Path(recipe.output), resolve_model_dir(recipe.model), recipe.overwrite) as claim:
        return _job(recipe, claim, progress, lazy)


def _job(recipe: Recipe, claim, progress, lazy: bool) -> dict:
    import platform

    import transformers

    from . import __version__
    from .formats.writer import write_checkpoint
    from .models.hf import read_config, resolve_dtype, resolve_model_dir
    from .models.lazy import meta_tensors

    t0 = time.time()
    storage = resolve_dtype(recipe.dtype, read_config(resolve_model_dir(recipe.model)))
    model, tok, src, weights, plan = _load(recipe, lazy)
    source_bytes = sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=storage).element_size()
    calib, calib_meta = None, None
    if needs_calibration(recipe, plan):
        from .data import load_calibration

        c = recipe.calibration
        if tok is None:
            raise UserError(f"'{src}' has no tokenizer; calibration needs one (save the tokenizer beside the model)")
        cs = load_calibration(spec=c.spec, tokenizer=tok, num_samples=c.num_samples, seq_len=c.seq_len,
                              seed=c.seed, cut=c.cut, text_field=c.text_field, min_tokens=c.min_tokens, model=model)
        calib, calib_meta = cs.samples, cs.meta
    result = quantize_model(model, recipe, calib, progress=progress, weights=weights, storage_dtype=storage)
    dropped = {f"{n}.weight" for n in result.qweights}
    stray = [k for k in meta_tensors(model) if k not in dropped]
    if stray:  # a bug, not bad input: the writer would save empty tensors
        raise RuntimeError(f"tensors never read from the source model: {', '.join(stray[:5])}")
    resolved = recipe.model_copy(deep=True)
    resolved.quant.group_size = default_group_size(model, recipe)
    meta = {
        "quantkit_version": __version__,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "source_model": str(src),
        "source_bytes": source_bytes,
        "recipe": resolved.model_dump(mode="json"),
        "calibration": calib_meta or {"spec": None, "reason": "method needs no calibration data"},
        "seeds": {"calibration": recipe.calibration.seed},
        "layers": {n: {**result.stats.get(n, {}), "scheme": plan[n].to_dict()} for n in plan},
        "quantize_seconds": round(result.seconds, 2),
        "dtypes": {"compute": str(next(model.parameters()).dtype), "storage": str(storage)},
    }
    kv = None
    if recipe.quant.kv_cache == "fp8":
        kv = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False,
              "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
              "observer_kwargs": {}}
    path = write_checkpoint(claim.out, model, result.qweights, plan, tok, meta, result.tensors, kv,
                            recipe.overwrite, dtype=storage, claim=claim)
    errs = [s.get("weight_rel_error") for s in result.stats.values() if s.get("weight_rel_error") is not None]
    return {"output": str(path), "source": str(src), "layers": len(plan), "method": recipe.quant.method,
            "scheme": recipe.quant.scheme, "group_size": resolved.quant.group_size,
            "mean_weight_rel_error": sum(errs) / len(errs) if errs else None,
            "seconds": round(time.time() - t0, 2), "calibration": calib_meta,
            "loading": "layer by layer" if weights is not None else "whole model"}
