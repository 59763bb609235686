"""FP4Linear: a Linear holding NVFP4 or MXFP4 weights as stored (formats/fp4_tensors.py), for CPU runs.

There is no FP4 arithmetic on a CPU, so this is an emulation: each call unpacks the E2M1 codes, applies the
group (and nvfp4's global) scales in float32 and multiplies in float32, then casts to the activation dtype.
Activations stay in their own dtype, except for nvfp4 with activations (`nvfp4-a4`), whose inputs are rounded
through NVFP4 first (fp4.nvfp4_fake_quantize: per 16, under the checkpoint's input_global_scale), as
compressed-tensors does. Nothing is cached: the packed weight is all that stays in memory, which keeps the 4-bit
footprint honest at the cost of a dequantisation per call.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import fp4
from ..errors import UserError
from ..formats.fp4_tensors import is_nvfp4
from ..qweight import dequantize_fp4


class FP4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group_size: int, nvfp4: bool, bias: bool = False,
                 dtype: torch.dtype = torch.float16, device=None, fp4_inputs: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer("weight_packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8,
                                                          device=device))
        scale_dtype = torch.float8_e4m3fn if nvfp4 else torch.uint8
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=scale_dtype, device=device))
        self.register_buffer("weight_global_scale", torch.empty(1, dtype=dtype, device=device) if nvfp4 else None)
        self.register_buffer("input_global_scale", torch.empty(1, dtype=dtype, device=device) if fp4_inputs else None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    @classmethod
    def from_group(cls, linear: nn.Linear, group: dict, dtype: torch.dtype, device=None) -> "FP4Linear":
        w = group["weights"]
        gs = w.get("group_size")
        nv = is_nvfp4(w)
        if (nv and gs != fp4.NVFP4_GROUP) or (not nv and gs != fp4.MXFP4_GROUP) or not w.get("symmetric", True):
            raise UserError(f"4-bit float weights with strategy '{w.get('strategy')}' and group size {gs} are not "
                            "supported; quantkit runs nvfp4 (tensor_group, 16) and mxfp4 (group, 32)")
        act = group.get("input_activations") or None
        if act is not None and not (nv and is_nvfp4(act) and act.get("group_size") == fp4.NVFP4_GROUP
                                    and act.get("num_bits") == 4 and act.get("dynamic") == "local"):
            raise UserError("of FP4 activations quantkit runs only NVFP4's (tensor_group, 16, dynamic local with a "
                            f"static global scale), not {act}")
        if linear.in_features % gs:
            raise UserError(f"a Linear with in_features={linear.in_features} cannot hold groups of {gs}; re-run "
                            "quantkit quantize")
        return cls(linear.in_features, linear.out_features, gs, nv, bias=linear.bias is not None, dtype=dtype,
                   device=device, fp4_inputs=act is not None)

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in]."""
        values = fp4.unpack(self.weight_packed)
        if self.weight_global_scale is None:
            return dequantize_fp4(values, fp4.e8m0_decode(self.weight_scale), None)
        return dequantize_fp4(values, self.weight_scale.float(), self.weight_global_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if self.input_global_scale is None else fp4.nvfp4_fake_quantize(x, self.input_global_scale)
        y = xf @ self.dequantized_weight().t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        kind = "nvfp4" if self.weight_global_scale is not None else "mxfp4"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"
