"""The one place that decides which module computes each Linear of a loaded model.

The loader (runtime/loader.py) asks this module, and only this module, at two moments:
- before the weights are read, `stored` turns a quantised nn.Linear into the module its checkpoint tensors load
  into, by its config group's weight type: QuantLinear (quant.py) for integer weights, FP8Linear (fp8.py) for
  float ones, Int8Linear (int8.py) for integer weights with integer activations (W8A8);
- once they are loaded and on their final device, `choose` gives each Linear-like module the module to compute
  with, from the checkpoint's schemes and the caller's options (`apply` does it for a whole model): a
  QuantLinear is prepared for its kernels (kernels/dispatch.py; with cpu_fast, torch's packed int ops with bf16
  activations); with cpu_fast, an int checkpoint's float32 head becomes a float16 copy (half_head.py); with
  relayout, a float model's CPU Linears take relayout.py's layout (half_weight.py, packed.py). On the CPU each
  of these is the fastest correct candidate measured on this machine (path_candidates.py,
  kernels/path_choice.py), recorded on the model for kernel_paths.
Everything else stays as loaded: an FP8 checkpoint's layers, and the float layers a quantised checkpoint keeps
(a head, ignored layers), which re-laid out would cost the whole model its --compile (runtime/build.py) and pad
each step to 4 rows (runtime/llama_step.py) for little.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import dispatch as kernel_dispatch
from ..kernels.path_choice import Chooser, describe, header
from . import path_candidates
from .fp4 import FP4Linear
from .fp8 import FP8Linear
from .half_head import half_copy
from .int8 import Int8Linear
from .packed import PackedLinear
from .quant import QuantLinear
from .relayout import float_linear

CHOICES_ATTR = "_qk_kernel_choices"  # the load's kernel_paths records, kept on the model

INT, FLOAT = "int", "float"  # weight types as compressed-tensors config groups name them


def stored(linear: nn.Linear, group: dict, *, has_g_idx: bool, has_input_scale: bool,
           dtype: torch.dtype) -> nn.Module:
    """The empty module a quantised Linear's checkpoint tensors are loaded into, by its config group."""
    if group["weights"]["type"] == FLOAT and group["weights"].get("num_bits") == 4:  # NVFP4 / MXFP4
        return FP4Linear.from_group(linear, group, dtype)
    if group["weights"]["type"] == FLOAT:
        return FP8Linear.from_group(linear, group, dtype, has_input_scale=has_input_scale)
    if group.get("input_activations"):  # W8A8 INT8 (`int-quantized`): int8 x int8 products
        return Int8Linear.from_group(linear, group, dtype, has_input_scale=has_input_scale)
    return QuantLinear.from_group(linear, group["weights"], has_g_idx, dtype)


def schemes(model: nn.Module) -> set[str]:
    """The weight types the model's quantised Linears hold: empty for a float model."""
    kinds = set()
    for m in model.modules():
        if isinstance(m, (QuantLinear, Int8Linear)):
            kinds.add(INT)
        elif isinstance(m, (FP8Linear, FP4Linear)):
            kinds.add(FLOAT)
    return kinds


def choose(module: nn.Module, kinds: set[str], *, cpu_fast: bool = False, relayout: bool = False,
           head: bool = False, tied: bool = False, chooser: Chooser | None = None, name: str = "") -> nn.Module:
    """The module to compute with in place of `module`, a Linear-like module whose weights are loaded and on
    their final device; `module` itself where nothing applies. kinds: schemes() of its model. head: it is the
    output head. tied: its weight is also the input embedding's table. chooser: the load's measured choice
    (path_candidates.py) for CPU modules; without one, each kind's preferred layout. name: the module's."""
    on_cpu = chooser is not None and _on_cpu(module)
    if isinstance(module, QuantLinear):
        # kernel choices need the weights on their final device, which is why this waits until after loading
        module.cpu_bf16_activations = cpu_fast
        kernel_dispatch.prepare(module)
        if on_cpu and cpu_fast:
            path_candidates.choose_quant(module, chooser, name)
        return module
    if head and cpu_fast and INT in kinds:
        return path_candidates.head_layout(module, chooser, name) if on_cpu else (half_copy(module) or module)
    if relayout and not kinds and type(module) is nn.Linear:
        if on_cpu:
            return path_candidates.float_layout(module, chooser, name, tied=tied) or module
        return float_linear(module.weight, module.bias, tied=tied) or module
    return module


def _on_cpu(module: nn.Module) -> bool:
    t = next(iter(module.buffers()), None) if isinstance(module, QuantLinear) else getattr(module, "weight", None)
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def apply(model: nn.Module, *, cpu_fast: bool = False, relayout: bool = False) -> int:
    """choose() for every module of `model`, each replacement set in place; returns how many were replaced."""
    kinds = schemes(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    table = getattr(emb, "weight", None)
    swapped = 0
    chooser = Chooser() if cpu_fast or relayout else None
    for name, mod in list(model.named_modules()):
        tied = table is not None and type(mod) is nn.Linear and mod.weight is table
        new = choose(mod, kinds, cpu_fast=cpu_fast, relayout=relayout, head=mod is head, tied=tied,
                     chooser=chooser, name=name)
        if new is mod:
            continue
        if isinstance(new, PackedLinear) and new.transposed is not None:
            # the embedding looks its rows up in the head's plain copy: one float table, not two
            emb.weight = nn.Parameter(new.transposed.t(), requires_grad=False)
        model.set_submodule(name, new)
        swapped += 1
    if chooser is not None and chooser.choices:
        chooser.save()
        setattr(model, CHOICES_ATTR, list(chooser.choices.values()))
    return swapped


def kernel_paths(model: nn.Module) -> list[str]:
    """What `quantkit generate --explain` and `serve` print: the machine, then each Linear kind's CPU path
    and why (empty for a model with no CPU choices: a GPU model, or one loaded exact)."""
    choices = getattr(model, CHOICES_ATTR, None)
    return [header(), *describe(choices)] if choices else []


def relayout_model(model: nn.Module) -> int:
    """Swap every float CPU nn.Linear of `model` (a float model only the runtime uses) for relayout.py's
    choice; returns how many were swapped. A quantised checkpoint is left alone (see the module's docstring);
    its head gets half_head.py's copy instead, when loaded with cpu_fast."""
    return 0 if schemes(model) else apply(model, relayout=True)
