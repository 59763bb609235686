"""A self-draft: the target's own W4 RTN quantisation, made here and handed to the runtime as a ready model.

The runtime only reads checkpoints and never quantises; `--draft self-w4` needs a quantised copy of the model
being served, so it is built in this layer, above both the solvers and the runtime.
"""
from __future__ import annotations

import copy

import torch

from ..linear.half_head import use_half_head
from ..linear.opaque import OpaqueLinear
from ..linear.quant import QuantLinear
from ..linear.relayout import float_linear
from ..schemes import fitting_group_size, get_scheme
from ..solvers.rtn import rtn_quantize


def self_w4_draft(model, group_size: int = 128, packed: bool = False):
    """A copy of `model` whose Linear weights are its own W4 RTN quantisation (lm_head kept).

    packed=False: fake quantisation, the dequantised values in float Linears; the same draft tokens as the W4
    checkpoint up to activation rounding, at the float model's speed. packed=True (what `--draft self-w4` uses
    on a CPU): QuantLinear modules holding the packed codes, run by torch's int4 op with bf16 activations, and
    a float16 copy of a float32 head, as the runtime loads a W4 checkpoint.
    """
    draft = copy.deepcopy(model)
    head = draft.get_output_embeddings()
    with torch.no_grad():
        for name, mod in list(draft.named_modules()):
            if not (type(mod) is torch.nn.Linear or isinstance(mod, OpaqueLinear)) or mod is head:
                continue
            weight = mod.weight.detach()  # a re-laid-out Linear rebuilds it: read it once
            gs = fitting_group_size([mod.in_features], group_size) or -1  # as quantize chooses; else per channel
            qw = rtn_quantize(weight, get_scheme("w4a16").with_options(group_size=gs))
            if packed:
                draft.set_submodule(name, QuantLinear.from_qweight(qw, mod.bias, weight.dtype))
            elif isinstance(mod, OpaqueLinear):  # held as the runtime would hold these weights
                deq = qw.dequantize().to(weight.dtype)
                draft.set_submodule(name, float_linear(deq, mod.bias) or _plain_linear(deq, mod.bias))
            else:
                mod.weight.data = qw.dequantize().to(weight.dtype)
    if packed:
        use_half_head(draft)
    return draft


def _plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin.requires_grad_(False)
