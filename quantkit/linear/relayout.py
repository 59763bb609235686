"""Which layout a float Linear of a model the runtime loads gets: the choice of product for its weights
(dispatch.py applies it to every Linear of a float model).

In order of preference, on a CPU:
1. float16 weights with float32 products (half_weight.py), for a float32 or float16 weight whose every
   value is a float16 number: half the bytes of float32 for the same products up to summation order, and fast
   for any number of rows. A float16 checkpoint loaded in float32 is exactly this case.
2. oneDNN's blocked layout (packed.py) for other float32 and (with bf16 instructions) bfloat16 weights:
   fast for several rows, where MKL's product is close to compute-bound.
3. nn.Linear as it is.
"""
from __future__ import annotations

import torch
from torch import nn

from . import half_weight as half
from .opaque import OpaqueLinear
from .packed import PackedLinear, available as onednn_available


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
