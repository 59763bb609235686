"""QuantLinear: a Linear whose weight stays packed (INT4/INT8, compressed-tensors layout) in memory.

It holds exactly the checkpoint tensors; kernels.dispatch picks how to multiply by device and row count.
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats.pack import pack_int32, packed_words
from ..kernels import dispatch, reference


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, symmetric: bool = True,
                 has_g_idx: bool = False, bias: bool = False, dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        groups = 1 if group_size == -1 else in_features // group_size
        kw = {"device": device}
        self.register_buffer("weight_packed", torch.empty(out_features, packed_words(in_features, bits), dtype=torch.int32, **kw))
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=dtype, **kw))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int32))
        self.register_buffer("weight_zero_point", None if symmetric else
                             torch.empty(packed_words(out_features, bits), groups, dtype=torch.int32, **kw))
        self.register_buffer("weight_g_idx", torch.empty(in_features, dtype=torch.int32, **kw) if has_g_idx else None)
        self.cpu_bf16_activations = False  # set by the loader; see kernels.dispatch.choose
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, **kw), requires_grad=False) if bias else None

    @classmethod
    def from_group(cls, linear: nn.Linear, weights: dict, has_g_idx: bool, dtype: torch.dtype, device=None):
        gs = weights.get("group_size") if weights.get("strategy") == "group" else -1
        return cls(linear.in_features, linear.out_features, weights["num_bits"], gs or -1,
                   symmetric=weights.get("symmetric", True), has_g_idx=has_g_idx, bias=linear.bias is not None,
                   dtype=dtype, device=device)

    @classmethod
    def from_qweight(cls, qw, bias: torch.Tensor | None, dtype: torch.dtype) -> "QuantLinear":
        """A symmetric integer QWeight held packed, as a loaded checkpoint holds it; on a CPU it runs through
        torch's int4/int8 op with bf16 activations, as the loader sets it (for the self-draft and the sampling copy)."""
        if not qw.scheme.symmetric or qw.scheme.type != "int":
            raise ValueError(f"from_qweight takes symmetric integer codes, got {qw.scheme}")
        out, n_in = qw.q.shape
        m = cls(n_in, out, qw.scheme.num_bits, qw.scheme.group_size, bias=bias is not None, dtype=dtype,
                device=qw.q.device)
        m.weight_packed = pack_int32(qw.q, qw.scheme.num_bits)
        m.weight_scale = qw.scale.to(dtype).reshape(out, -1)
        if bias is not None:
            m.bias.data.copy_(bias.data)
        m.cpu_bf16_activations = qw.q.device.type == "cpu"
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear_forward(self, x)

    def dequantized_weight(self) -> torch.Tensor:
        return reference.dequantize(self.weight_packed, self.weight_scale, self.weight_zero_point, self.weight_g_idx,
                                    self.group_size, self.bits, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, asym={self.weight_zero_point is not None}, "
                f"g_idx={self.weight_g_idx is not None}")
