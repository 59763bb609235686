"""FP8Linear: a Linear whose weight stays float8_e4m3fn in memory (compressed-tensors `float-quantized` layout).

Activations are quantised to e4m3 as well: per token at run time (dynamic), or with the checkpoint's
calibrated `input_scale` (static). On a GPU with FP8 tensor cores the product is one torch._scaled_mm;
anywhere else it is emulated exactly: the same activation codes, dequantised, multiplied in float32 and cast
to the activation dtype. _scaled_mm also multiplies exact e4m3 products, accumulates in float32 and scales once
at the end, so both paths differ only by float32 summation order.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import e4m3
from ..errors import UserError
from ..qweight import dequantize_fp8


def fp8_matmul_supported(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class FP8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, per_channel: bool, has_input_scale: bool,
                 bias: bool = False, dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=e4m3.FP8, device=device))
        self.register_buffer("weight_scale", torch.empty((out_features, 1) if per_channel else (1,), dtype=dtype,
                                                         device=device))
        self.register_buffer("input_scale", torch.empty(1, dtype=dtype, device=device) if has_input_scale else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.use_scaled_mm: bool | None = None  # None: decide by device at the first call; tests force False

    @classmethod
    def from_group(cls, linear: nn.Linear, group: dict, dtype: torch.dtype, has_input_scale: bool, device=None):
        """Built from a compressed-tensors config group (ours or another tool's) for the Linear it replaces."""
        w = group["weights"]
        if w.get("num_bits") != 8 or w.get("strategy") not in ("tensor", "channel"):
            raise UserError(f"float weights with num_bits={w.get('num_bits')} and strategy '{w.get('strategy')}' "
                            "are not supported; quantkit runs FP8 E4M3 with 'tensor' or 'channel' scales")
        act = group.get("input_activations") or None
        if act is not None and not act.get("dynamic") and not has_input_scale:
            raise UserError("a static FP8 activation scheme needs input_scale tensors and the checkpoint has none; "
                            "re-run quantkit quantize")
        return cls(linear.in_features, linear.out_features, w["strategy"] == "channel", has_input_scale,
                   bias=linear.bias is not None, dtype=dtype, device=device)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in]."""
        return dequantize_fp8(self.weight, self.weight_scale)

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 codes [tokens, in], float32 scale [tokens, 1] or [1])."""
        if self.input_scale is not None:
            s = self.input_scale.float().reshape(1)
            return e4m3.quantize(x, s), s
        return e4m3.quantize_per_token(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = self.quantize_input(x2)
        use = self.use_scaled_mm
        if use is None:
            use = fp8_matmul_supported(x.device)
        if use and self._scaled_mm_fits():
            y = self._scaled_mm(xq, xs, x.dtype)
        else:
            y = (xq.float() * xs) @ self.dequantized_weight().t()
            if self.bias is not None:
                y = y + self.bias.float()
            y = y.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _scaled_mm_fits(self) -> bool:
        # cuBLASLt's FP8 GEMM needs both matrix dimensions of the weight divisible by 16
        return self.in_features % 16 == 0 and self.out_features % 16 == 0

    def _scaled_mm(self, xq: torch.Tensor, xs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        ws = self.weight_scale.float()
        m = xq.shape[0]
        if xs.numel() == 1 and ws.numel() == 1:  # per tensor x per tensor: scalar scales, any output dtype
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs.reshape(()), scale_b=ws.reshape(()),
                                 out_dtype=out_dtype)
        else:  # row-wise: one scale per token and one per output channel, bf16 output only
            sa = xs.reshape(-1, 1).expand(m, 1).contiguous()
            sb = ws.reshape(1, -1).expand(1, self.out_features).contiguous()
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            y = y.to(out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_scale={'channel' if self.weight_scale.numel() > 1 else 'tensor'}, "
                f"activations={'static' if self.input_scale is not None else 'dynamic'}")
