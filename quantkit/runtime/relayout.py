"""Which layout each float Linear of a model the runtime loads gets: the choice of product for its weights.

In order of preference, on a CPU:
1. float16 weights with float32 products (half_weight_linear.py), for a float32 or float16 weight whose every
   value is a float16 number: half the bytes of float32 for the same products up to summation order, and fast
   for any number of rows. A float16 checkpoint loaded in float32 is exactly this case.
2. oneDNN's blocked layout (packed_linear.py) for other float32 and (with bf16 instructions) bfloat16 weights:
   fast for several rows, where MKL's product is close to compute-bound.
3. nn.Linear as it is.
"""
from __future__ import annotations

import torch
from torch import nn

from . import half_weight_linear as half
from .opaque_linear import OpaqueLinear
from .packed_linear import PackedLinear, available as onednn_available


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None, tied: bool = False) -> nn.Module | None:
    """The module to hold a float CPU weight in (its values unchanged), or None where nn.Linear is best.
    tied: the weight is also an embedding table, which keeps its own plain copy either way."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype in half.HOLDABLE and half.available() and half.exact_in_float16(weight):
        return half.HalfWeightLinear(weight, bias)
    if onednn_available(weight.dtype):
        # MKL's one-row product over a plain transposed copy beats oneDNN's in float32 only (bf16: 10 ms)
        return PackedLinear(weight, bias, keep_transposed=tied and weight.dtype == torch.float32)
    return None


def layer_layouts(model: nn.Module) -> set[type]:
    """The kinds of re-laid-out Linear (OpaqueLinear subclasses) the model computes with before its output head.
    The head is left out: it runs after the decoder layers, and a quantised checkpoint's float16 head copy
    (half_head.py) changes neither what compiles nor how a step's rows cost."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {type(m) for m in model.modules() if isinstance(m, OpaqueLinear) and m is not head}


def relayout_model(model: nn.Module) -> int:
    """Swap every float CPU nn.Linear of `model` (a float model only the runtime uses) for float_linear's
    choice; returns how many were swapped. A quantised checkpoint is left alone: the few Linears it keeps in
    float (a head, ignored layers) would cost the whole model its --compile (build.compile_decode) and pad each
    step to 4 rows (llama_step.py) for little; its head gets half_head.py's copy instead."""
    from ..nn import QuantLinear
    from ..nn_fp8 import FP8Linear

    if any(isinstance(m, (QuantLinear, FP8Linear)) for m in model.modules()):
        return 0
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    swapped = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear:
            continue
        tied = emb is not None and getattr(emb, "weight", None) is mod.weight
        new = float_linear(mod.weight, mod.bias, tied=tied)
        if new is None:
            continue
        if isinstance(new, PackedLinear) and new.transposed is not None:
            # the embedding looks its rows up in the head's plain copy: one float table, not two
            emb.weight = nn.Parameter(new.transposed.t(), requires_grad=False)
        model.set_submodule(name, new)
        swapped += 1
    return swapped
