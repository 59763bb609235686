"""Linears whose weights are held in float16 and multiplied in float32, by FBGEMM's float16-weight product.

A float model's decode step reads every weight once per token, so the bytes a weight takes are the step's time
on a CPU. Many float checkpoints store float16 (SmolLM2-135M among them): loaded in float32 for exact products,
each weight then takes 4 bytes for what fits in 2. FBGEMM (in torch's x86 builds, behind
`torch.ops.quantized.linear_dynamic_fp16`) keeps the weight in float16 panels, widens it to float32 in
registers and accumulates in float32, so a weight that is exactly a float16 number gives the float32 product up
to summation order while half the bytes are read. On one core of this machine the embedded SmolLM2 decoded at
39-44 tok/s this way against 20-22 tok/s with float32 weights in oneDNN's layout (docs/benchmarks.md).
It is also fast for several rows, where torch's own float16 product runs row by row: the 49152 x 576 head
took 8 ms for 13 rows against 40 ms (F.linear in float16); and each output row depends only on its own input
row, so rows computed together equal the same rows computed alone.

The runtime holds a weight this way only where it loses nothing (relayout.py: every value exactly a float16
number), and for the head of a quantised checkpoint, which half_head.py rounds to float16 on purpose.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from .opaque_linear import OpaqueLinear

HOLDABLE = (torch.float32, torch.float16)


@lru_cache(maxsize=None)
def available() -> bool:
    """This torch build has FBGEMM's float16-weight product and it gives the float32 product of the float16
    weight (x86 builds; not ARM's)."""
    ops = torch.ops.quantized
    if "fbgemm" not in torch.backends.quantized.supported_engines or not hasattr(ops, "linear_prepack_fp16"):
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=g).half().float()
    x, b = torch.randn(3, 16, generator=g), torch.randn(24, generator=g)
    try:
        y = ops.linear_dynamic_fp16(x, ops.linear_prepack_fp16(w, b))
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, x @ w.t() + b, rtol=1e-5, atol=1e-5))


def exact_in_float16(w: torch.Tensor) -> bool:
    """Every value of w is a finite float16 number (in range, no lost bits), so holding it in float16 loses
    nothing (FBGEMM saturates infinities to 65504, so they do not count)."""
    if not bool(torch.isfinite(w).all()):
        return False
    return w.dtype == torch.float16 or bool(torch.equal(w.to(torch.float16).to(w.dtype), w))


class HalfWeightLinear(OpaqueLinear):
    """An inference-only nn.Linear holding its weight in float16 in FBGEMM's layout. Inputs of any float dtype
    are multiplied in float32 and the output is returned in the weight's original dtype (float32, or float16 for
    a float16 model). Moved or cast to what FBGEMM cannot hold (a GPU, bfloat16), it holds a plain weight and
    computes as nn.Linear.

    lossless (relayout.py): only weights that are float16 numbers are held in float16; any other weight (one
    loaded later through load_state_dict, say) is held plain, so no value is ever rounded. lossless=False
    (half_head.py) rounds on purpose."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lossless: bool = True):
        self.lossless = lossless  # read by _set_weight, which the base class calls
        super().__init__(weight, bias)

    def _set_weight(self, w: torch.Tensor) -> None:
        holdable = w.device.type == "cpu" and w.dtype in HOLDABLE and available()
        if holdable and (not self.lossless or exact_in_float16(w)):
            # The pack gets a copy, because FBGEMM clamps out-of-range values in the tensor it is given, which may
            # be the caller's. The bias stays out of it, a parameter added after the product: a pack holds a
            # reference to the bias tensor it was given, which in-place updates and copies of the pack would share.
            packed = torch.ops.quantized.linear_prepack_fp16(w.to(torch.float32, copy=True), None)
            self.packed, self.plain = packed, None
        else:
            self.packed, self.plain = None, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None:
            return F.linear(x, self.plain, self.bias)
        y = torch.ops.quantized.linear_dynamic_fp16(x if x.dtype == torch.float32 else x.float(), self.packed)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == self.dtype else y.to(self.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight, the float16 values in the original dtype (a new tensor each call)."""
        if self.plain is not None:
            return self.plain
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0].to(self.dtype)

    @property
    def nbytes(self) -> int:
        if self.plain is not None:
            return self.plain.numel() * self.plain.element_size()
        return self.out_features * self.in_features * 2

    @property
    def layout(self) -> str:
        return "float16 weights, float32 products (FBGEMM)" if self.packed is not None else "plain"
