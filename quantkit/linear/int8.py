"""Int8Linear: W8A8 INT8 (compressed-tensors `int-quantized`): int8 weights [out, in] with one scale per output
channel, activations quantised to int8 per token at run time (dynamic) or with the checkpoint's `input_scale`.

The product is an exact int8 x int8 -> int32 matrix product, torch._int_mm (oneDNN's VNNI/AMX kernels on an x86
CPU, cuBLASLt INT8 on a GPU), scaled once at the end by the token's and the channel's scales in float32. Where
_int_mm refuses the shapes (it wants more than 16 rows on CUDA and dimensions in multiples of 8) the same codes
are multiplied in float32 instead, which is exact as well up to 2^24 per dot product and differs otherwise by
float32 rounding only.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UserError

QMAX = 127


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [tokens, in] and float32 scales [tokens, 1]: each row's absmax maps onto 127 (vLLM's
    dynamic per-token rule); an all-zero row gets scale 1 and zero codes."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(xf / scale).clamp(-QMAX, QMAX).to(torch.int8), scale


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes with one static scale; inputs beyond 127 x scale saturate."""
    return torch.round(x.float() / scale.float()).clamp(-QMAX - 1, QMAX).to(torch.int8)


def int_matmul(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """int8 [m, k] x int8 [n, k]^T as float32 [m, n]: torch._int_mm where it takes the shapes."""
    try:
        return torch._int_mm(xq, wq.t()).float()
    except RuntimeError:  # shape or device limits of the int8 kernels
        return xq.float() @ wq.float().t()


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, has_input_scale: bool, bias: bool = False,
                 dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=dtype, device=device))
        self.register_buffer("input_scale", torch.empty(1, dtype=dtype, device=device) if has_input_scale else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    @classmethod
    def from_group(cls, linear: nn.Linear, group: dict, dtype: torch.dtype, has_input_scale: bool, device=None):
        """Built from a compressed-tensors config group (ours or another tool's) for the Linear it replaces."""
        w, act = group["weights"], group.get("input_activations") or {}
        if w.get("num_bits") != 8 or w.get("strategy") != "channel" or not w.get("symmetric", True) \
                or not act.get("symmetric", True):
            raise UserError(f"INT8 activations with {w.get('num_bits')}-bit '{w.get('strategy')}' weights "
                            f"(symmetric {w.get('symmetric')}) are not supported; quantkit runs W8A8 with symmetric "
                            "per-channel weights and symmetric activations")
        if not act.get("dynamic") and not has_input_scale:
            raise UserError("a static INT8 activation scheme needs input_scale tensors and the checkpoint has none; "
                            "re-run quantkit quantize")
        return cls(linear.in_features, linear.out_features, has_input_scale, bias=linear.bias is not None,
                   dtype=dtype, device=device)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in]."""
        return self.weight.float() * self.weight_scale.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.input_scale is not None:
            xs = self.input_scale.float().reshape(1, 1)
            xq = quantize_per_tensor(x2, xs)
        else:
            xq, xs = quantize_per_token(x2)
        y = int_matmul(xq, self.weight) * xs * self.weight_scale.float().reshape(1, -1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"activations={'static' if self.input_scale is not None else 'dynamic per token'}")
