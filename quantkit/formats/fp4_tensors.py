"""The FP4 checkpoint layouts, as compressed-tensors (0.17 and later) writes and reads them.

Per quantised Linear `p`, both formats: p.weight_packed (uint8 [out, in / 2], two E2M1 codes a byte, the even
column in the low nibble) and p.weight_scale ([out, in / group]).
- `nvfp4-pack-quantized` (strategy tensor_group, group 16): weight_scale float8_e4m3fn and p.weight_global_scale
  (float32 [1]), stored as a divisor: weight = e2m1 * weight_scale / weight_global_scale.
- `mxfp4-pack-quantized` (strategy group, group 32): weight_scale uint8 E8M0 codes, 2^(code - 127).
"""
from __future__ import annotations

import torch

from .. import fp4
from ..qweight import QWeight
from ..schemes import Scheme

FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}


def is_nvfp4(weights: dict) -> bool:
    """A config group's `weights` entry (or a Scheme's) is NVFP4 (a per-tensor global scale), not MXFP4."""
    return weights.get("strategy") == "tensor_group"


def fp4_tensors(prefix: str, qw: QWeight) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.weight_packed": fp4.pack(qw.q)}
    if qw.global_scale is not None:
        out[f"{prefix}.weight_scale"] = qw.scale.to(torch.float8_e4m3fn).contiguous()
        out[f"{prefix}.weight_global_scale"] = qw.global_scale.float().reshape(1).contiguous()
    else:
        out[f"{prefix}.weight_scale"] = fp4.e8m0_encode(torch.log2(qw.scale).round().to(torch.int32)).contiguous()
    return out


def fp4_weights_args(s: Scheme) -> dict:
    nv = s.strategy == "tensor_group"
    return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": s.strategy, "group_size": s.group_size,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
            "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8"}


def fp4_format(s: Scheme) -> str:
    return FORMATS["nvfp4" if s.strategy == "tensor_group" else "mxfp4"]
