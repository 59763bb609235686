"""The candidate CPU paths of each Linear kind the runtime loads, handed to kernels/path_choice.py to check
against the float64 reference and time (dispatch.py calls these once the weights are on the CPU).

- a quantised Linear (QuantLinear, 4 or 8 bits): torch's packed int4 / int8 op with bf16 activations where the
  weight repacks into it, dequantise into a reused buffer + float matmul (always), and at 4 bits on an AVX2 CPU
  quantkit's W4A8 op (kernels/cpu_w4a8.py);
- a float model's Linear: float16 weights with float32 products (FBGEMM, half_weight.py) when every weight is a
  float16 number, oneDNN's blocked layout (packed.py), nn.Linear as it is: relayout.py's order of preference;
- a quantised checkpoint's float32 output head: its float16 copy (half_head.py), or the head as it is.
Each key names the kind, the shape and the activation dtype: one decision per distinct key, at one row.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_w4a8, dispatch as kernel_dispatch
from ..kernels.path_choice import Candidate, Choice, Chooser
from . import half_weight as half
from .half_head import half_copy
from .packed import PackedLinear, available as onednn_available
from .quant import QuantLinear

ROWS_CHECKED = (1, 5)  # one row is what decode times; five catch a kernel that is only right for one
BATCH_ROWS = 16  # a quantised kind's paths are also timed on this many rows: 16 concurrent sequences' decode step
# max|y - truth| / max|truth| each path is documented to stay within:
BF16_TOL = 2e-2  # bf16 activations, scales and outputs: 8 significant bits each, a few roundings deep
HALF_COPY_TOL = 3e-3  # a float32 weight rounded to float16 (11 bits): ~5e-4 per weight, summed in float32
W4A8_TOL = 2e-2  # int8 activations per block of 32 (kernels/cpu_w4a8.py): ~5e-3 measured, the bf16 path's bound
FLOAT_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # the activation dtype's own


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _inputs(k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rows, k, generator=g).to(dtype) for rows in ROWS_CHECKED]


def _truth(weight_fn, bias: torch.Tensor | None):
    """The float64 product with weight_fn()'s float weight, dequantised or copied only when first needed."""
    w64 = functools.cache(lambda: weight_fn().double())

    def truth(x: torch.Tensor) -> torch.Tensor:
        y = x.double() @ w64().t()
        return y if bias is None else y + bias.double()

    return truth


def _forced(module: QuantLinear, path: str):
    """The module run on PATH. The path is set on each call, not when built: the chooser builds every
    candidate before timing them in interleaved rounds, and they share the one module."""
    def run(x):
        module._cpu_path = path  # decide() honours it; the final choice is set after all are tried
        return module(x)

    return lambda: run


def choose_quant(module: QuantLinear, chooser: Chooser, name: str) -> Choice:
    dtype = module.weight_scale.dtype if module.weight_scale.dtype in FLOAT_TOL else torch.float32
    kind = (f"w{module.bits} g{module.group_size}" + (" asym" if module.weight_zero_point is not None else "")
            + (" act-order" if module.weight_g_idx is not None else ""))
    key = f"{kind} {module.out_features}x{module.in_features} {dtype_name(dtype)}"
    cands = [Candidate(path, _forced(module, path), BF16_TOL)
             for path, pack in (("cpu-int4pack", module._cpu_int4), ("cpu-int8pack", module._cpu_int8))
             if pack is not None]
    cands.append(Candidate("torch-dequant-matmul", _forced(module, "torch-dequant-matmul"), FLOAT_TOL[dtype]))
    if module.bits == 4 and cpu_w4a8.cpu_supported():  # last: where timings tie, the layouts that fuse and prefill
        cands.append(Candidate("cpu-w4a8", _w4a8(module), W4A8_TOL))
    with torch.inference_mode():
        choice = chooser.pick(key, name, cands, _inputs(module.in_features, dtype),
                              _truth(lambda: module.dequantized_weight(), module.bias), batch_rows=BATCH_ROWS)
    kernel_dispatch.use_cpu_path(module, choice.path)
    return choice


def _w4a8(module: QuantLinear):
    """cpu_w4a8's op on MODULE, its layout made (and the library built, once per machine) only when checked."""
    def build():
        if kernel_dispatch.w4a8_pack(module) is None:
            raise RuntimeError("the W4A8 op is not available here or does not take this layout")
        return _forced(module, "cpu-w4a8")()

    return build


def _plain(weight: torch.Tensor, bias: torch.Tensor | None):
    return lambda: (lambda x: F.linear(x, weight, bias))


def float_layout(module: nn.Linear, chooser: Chooser, name: str, tied: bool = False) -> nn.Module | None:
    """The module a float CPU Linear of a float model computes in: the fastest correct of relayout.py's
    layouts, or None (nn.Linear as it is)."""
    w, b = module.weight.detach(), module.bias
    dtype = w.dtype if w.dtype in FLOAT_TOL else torch.float32
    makers = {}
    if w.dtype in half.HOLDABLE and half.available() and half.exact_in_float16(w):
        makers["fbgemm-fp16"] = lambda: half.HalfWeightLinear(w, b)
    if onednn_available(w.dtype):
        # MKL's one-row product over a plain transposed copy beats oneDNN's in float32 only (relayout.py)
        makers["onednn"] = lambda: PackedLinear(w, b, keep_transposed=tied and w.dtype == torch.float32)
    cands = [Candidate(p, make, FLOAT_TOL[dtype]) for p, make in makers.items()]
    cands.append(Candidate("plain", _plain(w, b), FLOAT_TOL[dtype]))
    key = f"float {module.out_features}x{module.in_features} {dtype_name(w.dtype)}" + (" tied" if tied else "")
    with torch.inference_mode():
        choice = chooser.pick(key, name, cands, _inputs(module.in_features, dtype), _truth(lambda: w, b))
    return makers[choice.path]() if choice.path in makers else None


def head_layout(module: nn.Module, chooser: Chooser, name: str) -> nn.Module:
    """A quantised checkpoint's float head: its float16 copy where that is faster, else itself."""
    copy = half_copy(module)
    if copy is None:
        return module
    w, b = module.weight.detach(), module.bias
    cands = [Candidate("float16-copy", lambda: copy, HALF_COPY_TOL),
             Candidate("plain", lambda: module, FLOAT_TOL[torch.float32])]
    key = f"head {module.out_features}x{module.in_features} {dtype_name(w.dtype)}"
    with torch.inference_mode():
        choice = chooser.pick(key, name, cands, _inputs(module.in_features, w.dtype), _truth(lambda: w, b))
    return copy if choice.path == "float16-copy" else module
