"""Fused W4A16 / W8A16 matmul on the checkpoint tensors as written: y = x @ dequant(W)^T (+ bias).

Two shapes of kernel: a GEMV for 1-4 rows (no tensor cores: each program owns BLOCK_N outputs and streams
their packed words once, optionally split along K), and a tiled GEMM for more rows (dequantise a K x N tile
to the activation dtype in registers and feed tl.dot). Both accumulate in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import UserError
from ._args import int_layout, require_same_device
from ._tile import dequant_tile

GEMV_MAX_ROWS = 4
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gemv_kernel(x_ptr, wp_ptr, s_ptr, zp_ptr, gidx_ptr, b_ptr, y_ptr, M, N, K, KW, G, GROUP_SPAN, K_PER_SPLIT,
                 BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr, PER_K_GROUP: tl.constexpr,
                 HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k_begin = tl.program_id(1) * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        w = dequant_tile(wp_ptr, s_ptr, zp_ptr, gidx_ptr, offs_n, k0, N, K, KW, G, GROUP_SPAN,
                         BITS, BLOCK_K, BLOCK_N, HAS_ZP, HAS_GIDX, PER_K_GROUP)
        acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    if ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask)  # float32 partial sums; the wrapper adds bias and casts
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(x_ptr, wp_ptr, s_ptr, zp_ptr, gidx_ptr, b_ptr, y_ptr, M, N, K, KW, G, GROUP_SPAN,
                 BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr, PER_K_GROUP: tl.constexpr,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        w = dequant_tile(wp_ptr, s_ptr, zp_ptr, gidx_ptr, offs_n, k0, N, K, KW, G, GROUP_SPAN,
                         BITS, BLOCK_K, BLOCK_N, HAS_ZP, HAS_GIDX, PER_K_GROUP)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")  # float32 activations: no silent TF32
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + rows[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def _gemv_split(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> int:
    """Split K only when the N blocks alone cannot fill the GPU; never under the interpreter (pointless)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split < 2 * sms and k // (block_k * split * 2) >= 4:
        split *= 2
    return split


def wna16_matmul(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                 group_size: int = 128, bits: int = 4, bias: torch.Tensor | None = None,
                 variant: str = "auto") -> torch.Tensor:
    """x [..., in] (fp16/bf16/fp32) times the packed weight; returns [..., out] in x.dtype.

    variant: "gemv" (any rows, efficient at 1-4), "gemm" (tiled, tensor cores) or "auto" (gemv at <= 4 rows).
    """
    if x.dtype not in _ACT_DTYPES:
        raise UserError(f"activations must be float16, bfloat16 or float32, got {x.dtype}")
    require_same_device(x, weight_packed, weight_scale, weight_zero_point, g_idx, bias)
    in_features = x.shape[-1]
    x2 = x.reshape(-1, in_features).contiguous()
    m = x2.shape[0]
    if variant == "auto":
        variant = "gemv" if m <= GEMV_MAX_ROWS else "gemm"
    if variant not in ("gemv", "gemm"):
        raise UserError(f"unknown matmul variant '{variant}'; use gemv, gemm or auto")
    block_k = 128 if variant == "gemv" else 64
    lay = int_layout(weight_packed, weight_scale, weight_zero_point, g_idx, group_size, bits, in_features, block_k)
    n, k = lay.n, lay.k
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    wp, sc = weight_packed.contiguous(), weight_scale.contiguous()
    zp = wp if weight_zero_point is None else weight_zero_point.contiguous()
    gi = wp if g_idx is None else g_idx.to(torch.int32).contiguous()
    b = wp if bias is None else bias.contiguous()
    flags = dict(BITS=bits, HAS_ZP=weight_zero_point is not None, HAS_GIDX=g_idx is not None,
                 PER_K_GROUP=lay.per_k_group)
    if variant == "gemv":
        block_n = 32
        for r0 in range(0, m, GEMV_MAX_ROWS):  # the GEMV is sized for <= 4 rows; more rows go in slices
            xs, ys = x2[r0:r0 + GEMV_MAX_ROWS], y[r0:r0 + GEMV_MAX_ROWS]
            rows = xs.shape[0]
            split = _gemv_split(n, k, block_n, lay.block_k, x.device)
            k_per_split = triton.cdiv(triton.cdiv(k, split), lay.block_k) * lay.block_k
            split = triton.cdiv(k, k_per_split)
            target = torch.zeros(rows, n, dtype=torch.float32, device=x.device) if split > 1 else ys
            _gemv_kernel[(triton.cdiv(n, block_n), split)](
                xs, wp, sc, zp, gi, b, target, rows, n, k, wp.shape[1], lay.groups, lay.group_span, k_per_split,
                BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=lay.block_k,
                HAS_BIAS=bias is not None, ATOMIC=split > 1, **flags)
            if split > 1:
                if bias is not None:
                    target += bias.float()
                ys.copy_(target)
    else:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n = 64
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _gemm_kernel[grid](x2, wp, sc, zp, gi, b, y, m, n, k, wp.shape[1], lay.groups, lay.group_span,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=lay.block_k, HAS_BIAS=bias is not None,
                           IEEE=x.dtype == torch.float32, **flags)
    return y.reshape(*x.shape[:-1], n)


def w4a16_matmul(x, weight_packed, weight_scale, weight_zero_point=None, g_idx=None, group_size=128,
                 bias=None, variant="auto"):
    return wna16_matmul(x, weight_packed, weight_scale, weight_zero_point, g_idx, group_size, 4, bias, variant)


def w8a16_matmul(x, weight_packed, weight_scale, weight_zero_point=None, g_idx=None, group_size=128,
                 bias=None, variant="auto"):
    return wna16_matmul(x, weight_packed, weight_scale, weight_zero_point, g_idx, group_size, 8, bias, variant)
