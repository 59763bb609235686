"""Seeded packed weights for kernel tests and benchmarks: RTN codes packed exactly as the checkpoint writer does."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.formats.pack import pack_int32
from quantkit.schemes import Scheme
from quantkit.solvers.rtn import rtn_quantize


@dataclass
class Packed:
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None
    group_size: int
    bits: int
    w64: torch.Tensor  # float64 dequantised weight from the unpacked codes: the independent truth

    @property
    def args(self):
        return (self.weight_packed, self.weight_scale, self.weight_zero_point, self.g_idx, self.group_size, self.bits)


def make_packed(n: int, k: int, bits: int, group_size: int, symmetric: bool, g_idx: str | None = None,
                seed: int = 0, scale_dtype=torch.float16, weight: torch.Tensor | None = None) -> Packed:
    """g_idx: None, "actorder" (a permutation: every group has group_size columns) or "ragged" (random groups).
    weight: a real [n, k] weight to quantise instead of a random one."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) if weight is None else weight.float().reshape(n, k)
    # symmetric 2-4 bit: the full-range grid checkpoints carry by default, so kernels meet negative scales
    scheme = Scheme("t", bits, "int", symmetric, group_size, full_range=symmetric and bits <= 4)
    qw = rtn_quantize(w, scheme, scale_dtype=scale_dtype)
    scale = qw.scale.to(scale_dtype)
    groups = scale.shape[1]
    gi = None
    if g_idx == "actorder":
        gi = (torch.randperm(k, generator=gen) // (k // groups)).to(torch.int32)
    elif g_idx == "ragged":
        gi = torch.randint(0, groups, (k,), generator=gen, dtype=torch.int32)
    cols = gi.long() if gi is not None else torch.arange(k) // (k // groups)
    q = qw.q.double()
    if qw.zero is not None:
        q = q - qw.zero.double()[:, cols]
    w64 = q * scale.double()[:, cols]
    zp = None if qw.zero is None else pack_int32(qw.zero, bits, dim=0)
    return Packed(pack_int32(qw.q, bits), scale, zp, gi, group_size, bits, w64)


class FakeQuantLinear(torch.nn.Module):
    """The attributes QuantLinear exposes to the kernels, without a checkpoint behind them."""

    def __init__(self, p: Packed, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = p.w64.shape
        self.bits, self.group_size = p.bits, p.group_size
        self.weight_packed, self.weight_scale = p.weight_packed, p.weight_scale
        self.weight_zero_point, self.weight_g_idx = p.weight_zero_point, p.g_idx
        self.bias = bias

    def forward(self, x):
        from quantkit.kernels import dispatch

        return dispatch.linear_forward(self, x)
