"""The FP4 checkpoint layouts, as compressed-tensors (0.17 and later) writes and reads them.

Per quantised Linear `p`, both formats: p.weight_packed (uint8 [out, in / 2], two E2M1 codes a byte, the even
column in the low nibble) and p.weight_scale ([out, in / group]).
- `nvfp4-pack-quantized` (strategy tensor_group, group 16): weight_scale float8_e4m3fn and p.weight_global_scale
  (float32 [1]), stored as a divisor: weight = e2m1 * weight_scale / weight_global_scale.
- `mxfp4-pack-quantized` (strategy group, group 32): weight_scale uint8 E8M0 codes, 2^(code - 127).
nvfp4 with activations (`nvfp4-a4`) adds p.input_global_scale (float32 [1], a divisor like the weights'); the
per-16 activation scales are computed at run time (compressed-tensors' dynamic `local`).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .. import fp4
from ..qweight import QWeight
from ..schemes import Scheme

FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
# Linears engines fuse into one matmul (vLLM's qkv_proj and gate_up_proj), by name under one parent module
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def is_nvfp4(weights: dict) -> bool:
    """A config group's `weights` entry (or a Scheme's) is NVFP4 (a per-tensor global scale), not MXFP4."""
    return weights.get("strategy") == "tensor_group"


def fp4_tensors(prefix: str, qw: QWeight) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.weight_packed": fp4.pack(qw.q)}
    if qw.global_scale is not None:
        out[f"{prefix}.weight_scale"] = qw.scale.to(torch.float8_e4m3fn).contiguous()
        out[f"{prefix}.weight_global_scale"] = qw.global_scale.float().reshape(1).contiguous()
        if qw.input_scale is not None:
            out[f"{prefix}.input_global_scale"] = qw.input_scale.float().reshape(1).contiguous()
    else:
        out[f"{prefix}.weight_scale"] = fp4.e8m0_encode(torch.log2(qw.scale).round().to(torch.int32)).contiguous()
    return out


def fp4_weights_args(s: Scheme) -> dict:
    nv = s.strategy == "tensor_group"
    return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": s.strategy, "group_size": s.group_size,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
            "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8"}


def fp4_input_args(s: Scheme) -> dict | None:
    """nvfp4-a4's activations: E2M1 per 16 with E4M3 scales found at run time under a static global scale."""
    if s.activations is None:
        return None
    return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
            "block_structure": None, "dynamic": "local", "actorder": None, "observer": "static_minmax",
            "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn"}


def fp4_format(s: Scheme) -> str:
    return FORMATS["nvfp4" if s.strategy == "tensor_group" else "mxfp4"]


def share_global_scales(qweights: dict[str, QWeight]) -> dict[str, QWeight]:
    """qweights with every fused set of NVFP4 Linears (FUSED) on one global scale, the smallest of theirs.

    An engine that fuses them reads one global scale for the fused matmul (vLLM takes the largest stored divisor
    and warns), so separate ones would mis-scale all but one of them. The solver's global scales are powers of
    two (fp4.nvfp4_global_scale), so moving a Linear to a smaller one multiplies its E4M3 group scales by a
    power of two: exact while they stay E4M3 values, which fails only for groups whose absmax is below about
    2^-7 of the largest group's times the ratio; those are rounded to E4M3 and counted in the Linear's stats."""
    out = dict(qweights)
    for name, qw in qweights.items():
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED if leaf == g[0]), None)
        members = [f"{parent}.{m}" if parent else m for m in group or ()]
        fused = [qweights[m] for m in members if m in qweights and qweights[m].global_scale is not None]
        if len(fused) < 2:
            continue
        shared = torch.stack([q.global_scale.float().reshape(()) for q in fused]).min().reshape(1)
        for m in members:
            q = qweights.get(m)
            if q is None or q.global_scale is None:
                continue
            wanted = q.scale.float() * (shared / q.global_scale.float())
            scale = fp4.e4m3_scale(wanted)
            inexact = int((scale != wanted).sum())
            out[m] = replace(q, scale=scale, global_scale=shared.clone(),
                             stats={**q.stats, "global_scale_shared_with": members, "rescaled_inexact": inexact})
    return out

