"""One matmul for the projections that read the same input (q/k/v; gate/up).

A decode step on a CPU pays per call: each quantised Linear converts its input to bf16 and its output back, and
torch's packed int4 op has a fixed cost per launch. Reading q, k and v (and gate, up) as one wider matrix
halves those calls. torch's CPU int4 layout keeps blocks of output rows independent, so where every module is a
whole number of blocks (checked on a probe row) the fused pack is the modules' packs stacked, and each module's
own pack is then re-pointed at its rows of the stack: no second copy of the weights.

Float weights are concatenated and each module is left a view of its rows (no second copy); weights held in
float16 by FBGEMM (half_weight.py) are packed together the same way. The runtime's float32 CPU models'
Linears in oneDNN's layout (packed.py) are called one by one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu, cpu_w4a8, dispatch
from .half_weight import fuse_modules
from .quant import QuantLinear


class Fused:
    """Calls the projections as one and returns their outputs in order (sizes None: fn returns the tuple)."""

    def __init__(self, fn, sizes: list[int] | None):
        self.fn, self.sizes = fn, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.fn(x)
        return y if self.sizes is None else y.split(self.sizes, dim=-1)


def _int4_fused(mods) -> Fused | None:
    if not all(type(m) is QuantLinear and m.weight_packed.device.type == "cpu" for m in mods):
        return None
    for m in mods:
        if not getattr(m, "_qk_prepared", False):
            dispatch.prepare(m)
    packs = [m._cpu_int4 for m in mods]
    if any(p is None or p.perm is not None or p.packed.shape[0] != p.n for p in packs):
        return None  # act-order column order or padded rows: each module keeps its own call
    if len({p.group for p in packs}) != 1 or not all(m.cpu_bf16_activations for m in mods):
        return None
    if dispatch.forced_kernel() is not None:
        return None
    stacked = torch.cat([p.packed for p in packs])
    pack = cpu.Int4Pack(stacked, packs[0].group, torch.cat([p.scale_zero for p in packs], 1), stacked.shape[0], None)
    # torch's layout keeps blocks of output rows independent (64 rows on this CPU, where a 32-row module
    # would break the stacking); rather than assume a block size, check on one probe row that stacking holds
    probe = torch.randn(1, mods[0].in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    if not torch.equal(cpu.int4_matmul(pack, probe), torch.cat([cpu.int4_matmul(p, probe) for p in packs], 1)):
        return None
    r = 0
    for p in packs:  # each module now reads its rows of the stack (same values), so the weights are held once
        p.packed = stacked[r: r + p.n]
        r += p.n
    bias = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None

    def run(x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = cpu.int4_matmul(pack, x2)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    return Fused(run, [p.n for p in packs])


def _w4a8_fused(mods) -> Fused | None:
    """The W4A8 op's layouts stacked (each output row is computed from its own row of codes and scales, so the
    stack is exact)."""
    if not all(type(m) is QuantLinear and getattr(m, "_cpu_path", None) == "cpu-w4a8" for m in mods):
        return None
    packs = [m._cpu_w4a8 for m in mods]
    if any(p is None or p.perm is not None for p in packs) or len({p.group for p in packs}) != 1:
        return None
    if len({p.zero.numel() == 0 for p in packs}) != 1 or dispatch.forced_kernel() is not None:
        return None
    pack = cpu_w4a8.W4A8Pack(torch.cat([p.codes for p in packs]), torch.cat([p.scale for p in packs]),
                             torch.cat([p.zero for p in packs]), packs[0].group, None)
    r = 0
    for m, p in zip(mods, packs):  # each module now reads its rows of the stack, so the weights are held once
        n = p.codes.shape[0]
        p.codes, p.scale = pack.codes[r: r + n], pack.scale[r: r + n]
        if p.zero.numel():
            p.zero = pack.zero[r: r + n]
        r += n
    sizes = [m.out_features for m in mods]
    bias = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None

    def run(x: torch.Tensor) -> torch.Tensor | tuple:
        y = cpu_w4a8.matmul(pack, x.reshape(-1, x.shape[-1]))
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    return Fused(run, sizes)


def _float_fused(mods) -> Fused | None:
    if not all(type(m) is nn.Linear for m in mods):
        return None
    w0 = mods[0].weight
    if w0.device.type != "cpu" or any(m.weight.dtype != w0.dtype or m.weight.device != w0.device for m in mods):
        return None
    weight = torch.cat([m.weight.detach() for m in mods])
    views = list(weight.split([m.out_features for m in mods]))
    for m, v in zip(mods, views):  # the modules keep working, on views: the weights are held once
        m.weight = nn.Parameter(v, requires_grad=False)
    bias = torch.cat([m.bias.detach() for m in mods]) if mods[0].bias is not None else None
    return Fused(lambda x: F.linear(x, weight, bias), [m.out_features for m in mods])


def _half_fused(mods) -> Fused | None:
    fn = fuse_modules(mods)
    return None if fn is None else Fused(fn, [m.out_features for m in mods])


def fuse(mods: list[nn.Module], relayout: bool) -> Fused:
    """The projections as one call where their kind allows it, else as separate calls. relayout: float
    weights may be replaced by views into one new tensor (the runtime's own models only: a view-laid weight
    cannot be saved by transformers' save_pretrained); int4 fusion leaves the checkpoint tensors as they are."""
    if len({m.bias is None for m in mods}) == 1:  # one fused bias needs all of them or none
        # float16-held weights stay modules with plain state_dicts when packed together, so relayout need not say
        fused = (_int4_fused(mods) or _w4a8_fused(mods) or _half_fused(mods)
                 or (_float_fused(mods) if relayout else None))
        if fused is not None:
            return fused
    return Fused(lambda x: tuple(m(x) for m in mods), None)
