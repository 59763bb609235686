"""Python side of the CUDA kernels: the one-time JIT build and argument checks around the binding."""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from ...errors import UserError
from ...formats.pack import unpacked_width

SOURCES = ("binding.cpp", "dequant.cu", "gemv_w4a16.cu")
GEMV_MAX_ROWS = 4
_DTYPES = {torch.float16, torch.bfloat16}


@functools.lru_cache(maxsize=1)
def load():
    """Build (first call: about a minute, then cached by torch in TORCH_EXTENSIONS_DIR) and import the module."""
    from torch.utils.cpp_extension import load as jit_load

    here = Path(__file__).parent
    return jit_load(name="quantkit_cuda_kernels", sources=[str(here / s) for s in SOURCES],
                    extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "--use_fast_math"],
                    verbose=os.environ.get("QUANTKIT_CUDA_VERBOSE") == "1")


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _opt_i32(t):
    return None if t is None else t.to(torch.int32).contiguous()


def gemv_supported(in_features: int, group_size: int, g_idx_present: bool, bits: int, rows: int,
                   dtype: torch.dtype) -> bool:
    """The GEMV's preconditions: 4 bits, 1-4 half/bf16 rows, K % 32 == 0 (16-byte loads), groups of 8n codes."""
    return (bits == 4 and 1 <= rows <= GEMV_MAX_ROWS and dtype in _DTYPES and in_features % 32 == 0
            and (group_size <= 0 or group_size % 8 == 0 or g_idx_present))


def gemv_w4a16(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
               group_size: int = 128, bias: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    if not gemv_supported(k, group_size, g_idx is not None, 4, x2.shape[0], x.dtype):
        raise UserError(f"CUDA W4A16 GEMV needs 1-{GEMV_MAX_ROWS} fp16/bf16 rows, in_features % 32 == 0 and "
                        f"group_size % 8 == 0 (got rows={x2.shape[0]}, dtype={x.dtype}, in={k}, group={group_size}); "
                        "use QUANTKIT_KERNEL=triton or reference")
    y = torch.empty(x2.shape[0], weight_packed.shape[0], dtype=x.dtype, device=x.device)
    load().gemv_w4a16(x2, weight_packed.contiguous(), weight_scale.to(x.dtype).contiguous(),
                      _opt_i32(weight_zero_point), _opt_i32(g_idx),
                      None if bias is None else bias.to(x.dtype).contiguous(), y,
                      -1 if g_idx is not None else group_size, _stream(x.device))
    return y.reshape(*x.shape[:-1], -1)


def dequantize_int(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                   weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                   group_size: int = 128, bits: int = 4, in_features: int | None = None,
                   out_dtype: torch.dtype = torch.float16, out: torch.Tensor | None = None) -> torch.Tensor:
    in_features = unpacked_width(weight_packed, bits, in_features)
    if out is None:
        out = torch.empty(weight_packed.shape[0], in_features, dtype=out_dtype, device=weight_packed.device)
    load().dequant_int(weight_packed.contiguous(), weight_scale.to(out.dtype).contiguous(),
                       _opt_i32(weight_zero_point), _opt_i32(g_idx), out, bits,
                       -1 if g_idx is not None else group_size, _stream(out.device))
    return out


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    out = torch.empty(weight.shape, dtype=out_dtype, device=weight.device)
    load().dequant_fp8(weight.contiguous(), weight_scale.float().reshape(-1).contiguous(), out,
                       _stream(weight.device))
    return out
