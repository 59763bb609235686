"""A float16 copy of a float32 output head, for decoding quantised checkpoints on a CPU.

The head is usually left in float (`ignore: [lm_head]`), so in a W4 checkpoint it is most of what a decode
step reads: SmolLM2-135M's 49152 x 576 float32 head is 113 MB of 173 MB per token. Read in float16 it is half
that. Where torch has FBGEMM (x86), the copy is a HalfWeightLinear (half_weight.py): float32 inputs
and logits, float16 weights, 2.2-2.4 ms for one row and 8 ms for a 13-row verify on one core here; elsewhere
HalfHead below runs torch's float16 product (3.3-3.6 ms for one row, but row by row: 41 ms for 13, with
inputs and logits rounded to float16 too). float16 keeps 11 significant bits: the logits move by ~3e-4
relative, less than the bf16 activations the packed int4 layers of the same fast path already take. A tied
embedding keeps its float32 table for the lookups; the copy costs half the head's bytes in memory once.
"""
from __future__ import annotations

import torch
from torch import nn

from . import half_weight as half
from .packed import PackedLinear

# Beyond this the float16 copy could overflow (max 65504); such a head stays as it is.
SAFE_ABSMAX = 1e4


class HalfHead(nn.Module):
    """torch's own float16 product, where FBGEMM's is missing."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.out_dtype = head.weight.dtype
        self.register_buffer("weight", head.weight.detach().to(torch.float16).clone())
        self.register_buffer("bias", None if head.bias is None else head.bias.detach().to(torch.float16).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x.to(torch.float16), self.weight, self.bias)
        return y.to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float16 copy"


def half_copy(head: nn.Module) -> nn.Module | None:
    """The float16 copy of a float32 CPU output head (a HalfWeightLinear where FBGEMM is, else a HalfHead), or
    None where it does not apply, or the head already reads float16 weights."""
    if type(head) not in (nn.Linear, PackedLinear):  # not a subclass either: a quantised head has its own forward
        return None
    w = head.weight
    if w.device.type != "cpu" or w.dtype != torch.float32 or float(w.detach().abs().max()) > SAFE_ABSMAX:
        return None
    return half.HalfWeightLinear(w, head.bias, lossless=False) if half.available() else HalfHead(head)


def use_half_head(model) -> bool:
    """Swap the model's output head for half_copy's; False (nothing changed) where there is none."""
    copy = half_copy(model.get_output_embeddings())
    if copy is None:
        return False
    model.set_output_embeddings(copy)
    return True
