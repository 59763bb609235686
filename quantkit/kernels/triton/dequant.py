"""Triton dequantisation of checkpoint tensors as written: packed INT4/INT8 (groups, zero points, g_idx) and
FP8 E4M3, to float16 / bfloat16 / float32."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import UserError
from ...formats.pack import unpacked_width
from ._args import int_layout, require_same_device
from ._tile import dequant_tile

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dequant_int_kernel(wp_ptr, s_ptr, zp_ptr, gidx_ptr, out_ptr, N, K, KW, G, GROUP_SPAN,
                        BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr, PER_K_GROUP: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = dequant_tile(wp_ptr, s_ptr, zp_ptr, gidx_ptr, offs_n, k0, N, K, KW, G, GROUP_SPAN,
                     BITS, BLOCK_K, BLOCK_N, HAS_ZP, HAS_GIDX, PER_K_GROUP)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = out_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))


def dequantize_int(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                   weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                   group_size: int = 128, bits: int = 4, in_features: int | None = None,
                   out_dtype: torch.dtype = torch.float16, out: torch.Tensor | None = None) -> torch.Tensor:
    """[out, in] weight in out_dtype (or written into `out`, a reusable buffer of that shape)."""
    in_features = unpacked_width(weight_packed, bits, in_features)
    require_same_device(weight_packed, weight_scale, weight_zero_point, g_idx)
    lay = int_layout(weight_packed, weight_scale, weight_zero_point, g_idx, group_size, bits, in_features, 64)
    if out is None:
        if out_dtype not in _OUT_DTYPES:
            raise UserError(f"dequantize_int cannot produce {out_dtype}; use float16, bfloat16 or float32")
        out = torch.empty(lay.n, lay.k, dtype=out_dtype, device=weight_packed.device)
    elif tuple(out.shape) != (lay.n, lay.k) or not out.is_contiguous():
        raise UserError(f"out buffer must be contiguous [{lay.n}, {lay.k}], got {tuple(out.shape)}")
    block_n = 32
    grid = (triton.cdiv(lay.n, block_n), triton.cdiv(lay.k, lay.block_k))
    _dequant_int_kernel[grid](
        weight_packed.contiguous(), weight_scale.contiguous(),
        weight_packed if weight_zero_point is None else weight_zero_point.contiguous(),
        weight_packed if g_idx is None else g_idx.to(torch.int32).contiguous(), out,
        lay.n, lay.k, weight_packed.shape[1], lay.groups, lay.group_span,
        BITS=bits, BLOCK_K=lay.block_k, BLOCK_N=block_n, HAS_ZP=weight_zero_point is not None,
        HAS_GIDX=g_idx is not None, PER_K_GROUP=lay.per_k_group)
    return out


@triton.jit
def _e4m3_to_f32(b):
    """Decode E4M3 (fn: no infinities, S.1111.111 is NaN) from its bits, identically on GPU and interpreter."""
    b = b.to(tl.int32)
    sign = b >> 7
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (sign << 31) | ((e + 120) << 23) | (m << 20)  # rebias 7 -> 127
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))  # subnormal m*2^-9
    val = tl.where((e == 0) & (sign == 1), -val, val)
    return tl.where((e == 15) & (m == 7), float("nan"), val)


@triton.jit
def _dequant_fp8_kernel(w_ptr, s_ptr, out_ptr, N, K, PER_CHANNEL: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    idx = offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    v = _e4m3_to_f32(tl.load(w_ptr + idx, mask=mask, other=0))
    if PER_CHANNEL:
        s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    else:
        s = tl.load(s_ptr).to(tl.float32)
    tl.store(out_ptr + idx, (v * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[out, in] weight in out_dtype from float8_e4m3fn (or its uint8 bits) and a [out, 1] or [1] scale."""
    if weight.dim() != 2 or weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise UserError("dequantize_fp8 needs a 2-D float8_e4m3fn weight [out, in]")
    if out_dtype not in _OUT_DTYPES:
        raise UserError(f"dequantize_fp8 cannot produce {out_dtype}; use float16, bfloat16 or float32")
    require_same_device(weight, weight_scale)
    n, k = weight.shape
    per_channel = weight_scale.numel() > 1
    if per_channel and weight_scale.numel() != n:
        raise UserError(f"fp8 weight_scale must be [{n}, 1] or [1], got {tuple(weight_scale.shape)}")
    bits = weight.contiguous().view(torch.uint8)
    out = torch.empty(n, k, dtype=out_dtype, device=weight.device)
    grid = (triton.cdiv(n, 32), triton.cdiv(k, 64))
    _dequant_fp8_kernel[grid](bits, weight_scale.reshape(-1).contiguous(), out, n, k,
                              PER_CHANNEL=per_channel, BLOCK_N=32, BLOCK_K=64)
    return out
