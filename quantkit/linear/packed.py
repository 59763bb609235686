"""float32 and bfloat16 Linear weights in oneDNN's blocked layout, for the CPU models the runtime loads itself.

A CPU decode step is a matrix product of a few rows (1 when decoding, k+1 when verifying a draft, one per request
when requests share a step) with every weight. MKL's float32 product, which nn.Linear calls, is fast for one row
but close to compute-bound from a handful of rows on: over SmolLM2-135M's 30 layers on one core of this machine,
1 row took 27-36 ms and 13 rows 72-80 ms. oneDNN's product over a weight reordered once into its blocked layout
took 28 ms for 1 row padded to 4, 23-29 ms for 4-5 rows, 40 ms for 13 and 77 ms for 32; the 49152 x 576 head
10 ms for 13 rows against 24-28 ms (docs/benchmarks.md, issue 8). So a 13-row verify costs about 1.5 plain steps
instead of 3, and that is what speculative decoding and batched requests pay for. The price: in a real one-row
decode step the padded product is ~10% slower than MKL's one row over a transposed copy (28.7 vs 25.9 ms a
step in torch.profiler), and one copy of the weights cannot have both layouts.

The reordered weight is an opaque tensor: the module holds it instead of its float weight (no second copy),
`weight` rebuilds the plain [out, in] matrix on demand, and a deepcopy clones it. A head tied to the input
embedding is held twice: oneDNN's copy, and a plain transposed one that the embedding looks its rows up in and
that one-row products read (faster there with MKL).
In bfloat16 (`--dtype bfloat16`, where the CPU has bf16 instructions) the same products read half the bytes:
SmolLM2's 30 layers took 16 ms for 1-4 rows and 24 ms for 13, against 26 and 42 ms in float32, and float16's
13 ms for one row but 147 ms for 13 (torch's CPU float16 product runs row by row).
Below 4 rows oneDNN takes a slower path (the head: 7.3 ms for 1 row, 5.7 ms for 4), so fewer rows are padded
to 4; each output row of oneDNN's product depends only on its input row, so the padding changes no number.
"""
from __future__ import annotations

import copy
from functools import lru_cache

import torch
import torch.nn.functional as F

from .opaque import OpaqueLinear

MIN_ROWS = 4
PACKABLE = (torch.float32, torch.bfloat16)
_LINEAR = torch.ops.mkldnn._linear_pointwise
PACK_ROWS_HINT = 8  # the row count oneDNN is told to expect when reordering; 4, 13 and 32 measured alike


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if rows < MIN_ROWS:
        y = _LINEAR(torch.constant_pad_nd(x2, (0, 0, 0, MIN_ROWS - rows)), packed, bias, "none", [], "")[:rows]
    else:
        y = _LINEAR(x2.contiguous(), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], out_features)


@torch.library.custom_op("quantkit::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., in] times the reordered weight: [..., out]. A custom op so that torch.compile calls it as one
    opaque kernel (inductor cannot take the opaque weight as an input of its own kernels); eager calls skip the
    op's dispatch (~10 us a call, 2 ms of a step over 210 Linears)."""
    return _product(x, packed, bias, out_features)


@packed_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@lru_cache(maxsize=None)
def available(dtype: torch.dtype = torch.float32) -> bool:
    """This torch build (and, for bfloat16, this CPU) has oneDNN's reorder-and-multiply ops for `dtype`, and
    they give the plain product."""
    if dtype not in PACKABLE or not torch.backends.mkldnn.is_available() \
            or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False  # emulated without the CPU's bf16 instructions: slower than the plain product
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 16, generator=g).to(dtype), torch.randn(3, 16, generator=g).to(dtype)
    try:
        y = packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT), None, 24)
    except (RuntimeError, NotImplementedError):
        return False
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 output: 8 significant bits
    return bool(torch.allclose(y.float(), x.float() @ w.float().t(), rtol=tol, atol=tol))


class PackedLinear(OpaqueLinear):
    """An inference-only nn.Linear whose float32 or bfloat16 weight lives in oneDNN's layout. Moved or cast by
    `.to()`, `.half()` and the like to another dtype or device, it holds a plain weight and computes as
    nn.Linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_transposed: bool = False):
        """keep_transposed: also hold the weight as a plain [in, out] tensor, for products of fewer than
        MIN_ROWS rows (relayout.py: a head tied to the embedding, whose table needs a plain copy anyway)."""
        super().__init__(weight, bias)
        self.transposed = weight.detach().t().contiguous() if keep_transposed else None

    def _set_weight(self, w: torch.Tensor) -> None:
        if w.device.type == "cpu" and available(w.dtype):
            self.packed, self.plain = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS_HINT), None
        else:
            self.packed, self.plain = None, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None:
            return F.linear(x, self.plain, self.bias)
        if torch.compiler.is_compiling():
            return packed_linear(x, self.packed, self.bias, self.out_features)
        if self.transposed is not None and x.numel() < MIN_ROWS * self.in_features:
            # MKL reads a [in, out] float32 matrix faster than oneDNN's layout for one row (the 49152 x 576
            # head: 4.5-5.6 vs 5.3-7.5 ms), and slower for several (23-28 vs 9.5-11 ms for 13 rows); such rows
            # differ from the same rows of a longer product in the last bits
            y = x @ self.transposed
            return y if self.bias is None else y + self.bias
        return _product(x, self.packed, self.bias, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight (rebuilt from oneDNN's layout: a new tensor each call, so read it once)."""
        return self.plain if self.plain is not None else self.packed.to_dense()

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held (a kept transposed copy is a tensor of its own, counted apart)."""
        w = self.plain if self.plain is not None else self.packed
        return w.numel() * w.element_size()

    @property
    def layout(self) -> str:
        return "oneDNN layout" if self.packed is not None else "plain"

    def _apply_extra(self, fn) -> None:
        if self.transposed is not None:
            self.transposed = fn(self.transposed)

    def _loaded(self, w: torch.Tensor) -> None:
        if self.transposed is not None:
            self.transposed.copy_(w.t())

    def __getstate__(self):  # pickling (torch.save of a whole model): the plain weight, repacked on load
        state = self.__dict__.copy()
        if self.packed is not None:
            state["packed"], state["plain"] = None, self.packed.to_dense()
            state["_repack"] = True
        return state

    def __setstate__(self, state):
        repack = state.pop("_repack", False)
        self.__dict__.update(state)
        if repack:
            self._set_weight(self.plain)

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if k != "packed"}
        new.__dict__.update(copy.deepcopy(state, memo))
        # opaque tensors have no storage for deepcopy to copy
        new.packed = self.packed.clone() if self.packed is not None else None
        return new
