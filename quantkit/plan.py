"""The plan of a quantisation run, built once from the recipe and the model and handed down unchanged.

Everything the pipeline, the writer and the report need to agree on is decided here and only here, in one call
of build_plan: what `--method auto` becomes and why, which Linears are quantised and with which scheme (each
one's width under `--bits` included), the group size when the user gave none, which solver each one gets,
whether calibration data is needed, each method's own options and the KV-cache scheme. The Plan is frozen.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

import torch
from torch import nn

from .auto_method import AUTO, resolve
from .errors import UserError
from .formats.moe_names import ROUTER_SUFFIXES
from .models.coverage import Uncovered, check_coverage
from .recipe import Recipe
from .recipe.schema import Method
from .schemes import Scheme, fitting_group_size, get_scheme, scale_dtype_for
from .solvers.awq_options import AWQOptions
from .solvers.base import LinearSolver, SolveOptions
from .solvers.gptq_options import GPTQOptions
from .solvers.signround_options import SignRoundOptions
from .solvers.smoothquant_options import SmoothQuantOptions
from .targets import matches

# the compressed-tensors entry for a static FP8 KV cache (one scale per tensor from calibration)
FP8_KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False,
                 "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
                 "observer_kwargs": {}}


# the schema's methods less 'auto', which build_plan settles before any solver is picked
CONCRETE_METHODS = tuple(m for m in get_args(Method) if m != AUTO)


def solver_for(method: str, scheme: Scheme) -> type[LinearSolver]:
    """The solver class for one Linear; the one place a method name and a scheme meet."""
    if method not in CONCRETE_METHODS:  # 'auto' is settled in build_plan
        raise ValueError(f"solver_for needs a concrete method, got {method!r}")
    if scheme.is_int_activations:
        from .solvers.w8a8 import solver_class

        return solver_class(method, scheme.activations == "static")
    if scheme.is_fp4:
        from .solvers.fp4 import solver_class as fp4_solver

        return fp4_solver(method, scheme)
    if scheme.is_fp8:
        from .solvers.fp8 import FP8DynamicSolver, FP8Solver

        if method in ("gptq", "awq+gptq"):
            from .solvers.fp8_gptq import FP8GPTQSolver

            return FP8GPTQSolver
        # fp8-dynamic weights by rounding need no calibration; static input scales do
        return FP8Solver if scheme.activations == "static" else FP8DynamicSolver
    if method in ("gptq", "awq+gptq"):
        from .solvers.gptq_solver import GPTQSolver

        return GPTQSolver
    from .solvers.rtn import RTNSolver

    return RTNSolver


@dataclass(frozen=True)
class Plan:
    schemes: dict[str, Scheme]  # every Linear to quantise, in model order, at the width --bits gave it
    method: str  # never 'auto': build_plan settles it
    group_size: int | None  # the resolved default group size (None for fp8 schemes)
    options: SolveOptions  # what every solver shares: scale dtype, clip search
    needs_data: bool
    recipe: Recipe  # the recipe as run: 'auto' replaced by the method chosen (quantkit.json records it)
    kv_scheme: dict | None = None
    gptq: GPTQOptions | None = None  # GPTQ's options when the method solves with GPTQ (gptq, awq+gptq)
    awq: AWQOptions | None = None  # AWQ's options when the method scales first
    signround: SignRoundOptions | None = None  # learned rounding's options (method signround)
    smooth: SmoothQuantOptions | None = None  # SmoothQuant's options when it runs before a w8a8 scheme
    storage_dtype: torch.dtype = torch.float32
    uncovered: list[Uncovered] = field(default_factory=list)  # matrix weights left in float, not ignored
    moe: dict = field(default_factory=dict)  # recipe.quant.moe: expert calibration knobs
    bit_budget: dict | None = None  # --bits: the target, the average reached, each Linear's width and sensitivity
    method_reason: str | None = None  # why `--method auto` became `method` (auto_method.py); None when given

    def make_solver(self, name: str, weight: torch.Tensor, method: str | None = None) -> LinearSolver:
        from .solvers.gptq_solver import GPTQSolver

        scheme = self.schemes[name]
        cls = solver_for(method or self.method, scheme)
        if issubclass(cls, GPTQSolver):  # the one solver family with knobs of its own
            return cls(name, weight, scheme, self.options, self.gptq)
        return cls(name, weight, scheme, self.options)


def ignore_patterns(recipe: Recipe) -> list[str]:
    """The user's ignore list plus the MoE routers, which stay in float (formats/moe_names.py says why)."""
    return [*recipe.quant.ignore, *ROUTER_SUFFIXES]


def _ignored(recipe: Recipe, name: str, mod: nn.Module) -> bool:
    return any(matches(p, name, mod) for p in ignore_patterns(recipe))


def _linears(model: nn.Module, recipe: Recipe):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not _ignored(recipe, n, m)]


def default_group_size(model: nn.Module, recipe: Recipe) -> int | None:
    """The group size when the user gave none: the scheme's, or half or a quarter of it, whichever first
    divides every target (schemes.fitting_group_size); the scheme's own when none does (then an error names it)."""
    q = recipe.quant
    base = get_scheme(q.scheme)
    if q.group_size is not None or base.is_fp8 or base.is_fp4 or base.group_size == -1:
        return q.group_size
    widths = {m.in_features for _, m in _linears(model, recipe)}
    return fitting_group_size(widths, base.group_size) or base.group_size


def _scheme(recipe: Recipe, name: str, group_size, symmetric) -> Scheme:
    base = get_scheme(name)
    if base.is_fp8:
        return base
    if base.is_fp4:  # act-order would need a g_idx, which the FP4 layouts have no place for
        if recipe.quant.method.startswith("awq"):
            raise UserError(f"--method {recipe.quant.method} does not support the FP4 schemes (AWQ searches on an "
                            "integer grid); use --method rtn or gptq")
        return base.with_options(group_size=group_size, symmetric=symmetric)
    g = recipe.quant.gptq
    gptq = recipe.quant.method in ("gptq", "awq+gptq")
    actorder = g.actorder if gptq and g.actorder != "off" else None
    # 2-4 bit weight-only grids only: 8-bit weight-only has no vLLM CPU kernel to check signed scales against,
    # and gains 1/128 of a step; W8A8's INT8 x INT8 kernels take the weight scale as given by their own rule
    full = recipe.quant.full_range and symmetric and base.num_bits <= 4 and base.activations is None
    return base.with_options(group_size=group_size if group_size is not None else base.group_size,
                             symmetric=symmetric, actorder=actorder, full_range=full)


def _check_fits(name: str, mod: nn.Linear, scheme: Scheme) -> None:
    gs = scheme.group_size
    if scheme.is_int_activations and (gs != -1 or not scheme.symmetric):
        # the engines' INT8 x INT8 kernels take one symmetric weight scale per output channel
        raise UserError(f"{scheme.name} has symmetric per-channel weights; drop --group-size and "
                        f"quant.symmetric=false for {name}")
    if scheme.is_fp4:
        _check_fits_fp4(name, mod, scheme)
    elif not scheme.is_fp8 and gs != -1 and mod.in_features % gs:
        fits = [str(g) for g in (32, 64, 128, 256) if mod.in_features % g == 0] + ["-1"]
        raise UserError(f"{name} has in_features={mod.in_features}, not divisible by group size {gs}; "
                        f"use --group-size {' or '.join(fits)}")


def _check_fits_fp4(name: str, mod: nn.Linear, scheme: Scheme) -> None:
    gs = get_scheme(scheme.name).group_size
    if scheme.group_size != gs or not scheme.symmetric:
        raise UserError(f"{scheme.name} has symmetric groups of {gs} (the format's own); drop --group-size and "
                        f"quant.symmetric=false for {name}")
    if mod.in_features % gs:
        raise UserError(f"{name} has in_features={mod.in_features}, not divisible by {scheme.name}'s group of {gs}; "
                        f"leave it in float with --ignore {name}")


def schemes_for(model: nn.Module, recipe: Recipe, group_size: int | None) -> dict[str, Scheme]:
    q = recipe.quant
    default = _scheme(recipe, q.scheme, group_size, q.symmetric)
    out = {}
    for name, mod in _linears(model, recipe):
        t = next((t for t in q.targets if matches(t.match, name, mod)), None)
        scheme = default if t is None else _scheme(recipe, t.scheme, t.group_size,
                                                   q.symmetric if t.symmetric is None else t.symmetric)
        _check_fits(name, mod, scheme)
        out[name] = scheme
    if not out:
        raise UserError("no Linear layer is left to quantise after --ignore; loosen the ignore patterns")
    return out


def _smooth(q, schemes: dict[str, Scheme]) -> SmoothQuantOptions | None:
    if not q.smooth:
        return None
    if not any(s.is_int_activations for s in schemes.values()):
        raise UserError("quant.smooth moves activation outliers into INT8 weights; use it with --scheme w8a8 "
                        "or w8a8-static")
    return q.smoothquant


def _model_weight(model: nn.Module):
    def read(name: str) -> torch.Tensor:
        w = model.get_submodule(name).weight
        if w.is_meta:
            raise ValueError(f"{name} is not loaded; pass build_plan a read_weight that reads it")
        return w.detach().float()
    return read


def build_plan(model: nn.Module, recipe: Recipe, storage_dtype: torch.dtype | None = None,
               read_weight=None, before_reading=None) -> Plan:
    """The complete plan of a run on MODEL. storage_dtype: the dtype the checkpoint is written in (default: the
    model's). read_weight(name) -> that Linear's float weight, read only for a bit budget (quant.bits); default:
    the model's own weight, so a lazily loaded model needs a reader that fetches it. before_reading(recipe): called
    with the resolved recipe when the run needs calibration data, before a bit budget reads any weight (the
    job's checks that need no weights: preflight.py)."""
    storage = storage_dtype or next(model.parameters()).dtype
    recipe, why = resolve(recipe, getattr(model, "config", None))
    q = recipe.quant
    group_size = default_group_size(model, recipe)
    options = SolveOptions(scale_dtype=scale_dtype_for(storage), clip_search=q.clip_search)
    schemes, budget = schemes_for(model, recipe, group_size), None
    gptq = q.gptq if q.method in ("gptq", "awq+gptq") else None
    awq = q.awq if q.method in ("awq", "awq+gptq") else None
    signround = q.signround if q.method == "signround" else None
    smooth = _smooth(q, schemes)
    # a bit budget only changes integer weight-only widths, which take the same solver: known before it runs
    needs = awq is not None or signround is not None or smooth is not None or q.kv_cache is not None or any(
        solver_for(q.method, s).needs_data for s in schemes.values())
    if needs and before_reading is not None:
        before_reading(recipe)
    if q.bits is not None:
        schemes, budget = _bit_budget(model, recipe, group_size, list(schemes), storage, options.scale_dtype,
                                      read_weight or _model_weight(model))
    uncovered = check_coverage(model, set(schemes), ignore_patterns(recipe))
    return Plan(schemes=schemes, method=q.method, group_size=group_size, options=options, needs_data=needs,
                recipe=recipe, kv_scheme=FP8_KV_SCHEME if q.kv_cache == "fp8" else None, gptq=gptq, awq=awq,
                signround=signround, smooth=smooth, storage_dtype=storage, uncovered=uncovered,
                moe=q.moe.model_dump(), bit_budget=budget, method_reason=why)


def _budget_candidates(recipe: Recipe, group_size: int | None) -> list[Scheme]:
    q = recipe.quant
    if q.targets:
        raise UserError("--bits chooses every Linear's scheme; drop the recipe's targets: or --bits")
    base = get_scheme(q.scheme)
    if base.type != "int" or base.activations is not None:
        raise UserError(f"--bits mixes 3/4/8-bit integer weights; use it with --scheme w4a16, not {q.scheme}")
    # a ladder of widths and group sizes: halving the group costs a quarter bit (16-bit scales at g64) and is
    # often the cheapest step down in error, between the large steps from 3 to 4 and from 4 to 8 bits
    groups = [group_size] if group_size in (None, -1) or group_size // 2 < 32 else [group_size, group_size // 2]
    return [_scheme(recipe, name, g, q.symmetric) for name in ("w3a16", "w4a16") for g in groups] + [
        _scheme(recipe, "w8a16", None, q.symmetric)]


def _bit_budget(model: nn.Module, recipe: Recipe, group_size: int | None, names: list[str], storage: torch.dtype,
                scale_dtype: torch.dtype, read_weight) -> tuple[dict[str, Scheme], dict]:
    """A 3, 4 or 8-bit scheme for each of NAMES so the average stored bits per weight is at most
    recipe.quant.bits (solvers/bit_budget.py), and quantkit.json's record of the choice."""
    from .solvers.bit_budget import Option, choose_widths, rounding_error, stored_bits

    target = recipe.quant.bits
    candidates = _budget_candidates(recipe, group_size)
    scale_bits = 8 * torch.empty((), dtype=storage).element_size()  # scales are written in it
    options = {}
    for name in names:
        mod = model.get_submodule(name)
        fits = [s for s in candidates if s.group_size == -1 or mod.in_features % s.group_size == 0]
        w = read_weight(name)
        options[name] = [Option(s, stored_bits(s, mod.out_features, mod.in_features, scale_bits),
                                rounding_error(w, s, scale_dtype), w.numel()) for s in fits]
    try:
        chosen = choose_widths(options, target)
    except ValueError as e:
        raise UserError(f"--bits {target} is below the cheapest mix ({e} bits per weight, every Linear at its "
                        "fewest bits); raise --bits") from None
    total = sum(o.weights for o in chosen.values())
    record = {
        "target": target, "average_bits": round(sum(o.bits for o in chosen.values()) / total, 4),
        "sensitivity": "squared RTN weight error per width",
        "layers": {n: {"bits": o.scheme.num_bits, "group_size": o.scheme.group_size,
                       "sensitivity": {_width_name(x.scheme): x.error for x in options[n]}}
                   for n, o in chosen.items()}}
    return {n: o.scheme for n, o in chosen.items()}, record


def _width_name(s: Scheme) -> str:
    """'3g64', '4g32', '8' (per channel): a key of quantkit.json's bit_budget sensitivities."""
    return f"{s.num_bits}" if s.group_size == -1 else f"{s.num_bits}g{s.group_size}"
