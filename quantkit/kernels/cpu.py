"""CPU paths: torch's packed int4/int8 matmul ops after a one-time repack, else dequantise into a reused buffer.

torch 2.13 has `aten._weight_int4pack_mm_for_cpu(x, w, group, scale_and_zero)` computing
w = (u - 8) * scale + zero with u the unsigned nibble, group in {32, 64, 128, 256}, N % 16 == 0 and
scale_and_zero [K/group, N, 2]. Our w = scale * (u - u_zero) maps onto it exactly with zero = scale * (8 - u_zero)
(u_zero = 8 when symmetric). Per-channel scales are repeated into groups of 256/128/64/32; act-order g_idx is
handled by permuting the columns once (and the activations per call) when every group has the same size;
N is padded to a multiple of 16 with zero rows. `aten._weight_int8pack_mm(x, q_int8, scale[N])` covers
per-channel INT8; an asymmetric zero point adds the exact correction -rowsum(x) * scale * zero.
Anything else (grouped INT8, ragged act-order groups, K % 32 != 0) dequantises per call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UserError
from ..formats.pack import unpack_int32
from .reference import unpack_zero_points

_TORCH_GROUPS = (256, 128, 64, 32)
_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Int4Pack:
    packed: torch.Tensor  # torch's opaque int4 layout, [N_pad, K/2] uint8
    group: int
    scale_zero: torch.Tensor  # float32 [K/group, N_pad, 2]
    n: int
    perm: torch.Tensor | None  # column order after act-order sorting, or None
    by_dtype: dict = field(default_factory=dict)

    def scale_zero_for(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.by_dtype:
            self.by_dtype[dtype] = self.scale_zero.to(dtype)
        return self.by_dtype[dtype]


@dataclass
class Int8Pack:
    q: torch.Tensor  # int8 [N, K], signed codes
    scale: torch.Tensor  # float32 [N]
    zero_scale: torch.Tensor | None  # float32 [N]: scale * signed zero, asymmetric only
    by_dtype: dict = field(default_factory=dict)

    def scale_for(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.by_dtype:
            self.by_dtype[dtype] = self.scale.to(dtype)
        return self.by_dtype[dtype]


def _contiguous_groups(g_idx: torch.Tensor | None, groups: int, k: int):
    """(group width, column permutation or None) making groups contiguous and equal, or None if impossible."""
    if groups == 1:
        return k, None
    if g_idx is None:
        return None
    gi = g_idx.long()
    if k % groups or not torch.all(torch.bincount(gi, minlength=groups) == k // groups):
        return None
    perm = torch.argsort(gi, stable=True)
    return k // groups, None if torch.equal(perm, torch.arange(k)) else perm


def group_runs(weight_scale, g_idx, group_size: int, k: int) -> tuple[int, torch.Tensor | None] | None:
    """(group width, input order) of a weight whose groups the packed CPU layouts can take as contiguous runs
    of a width dividing K (a per-channel scale: one run of K; a g_idx: runs after reordering the inputs by perm,
    None when none is needed); None where K is not a multiple of 32 or the groups are not such runs."""
    groups = weight_scale.shape[1] if weight_scale.dim() == 2 else 1
    if k % 32:
        return None
    if g_idx is not None or groups == 1:
        return _contiguous_groups(g_idx, groups, k)
    return (group_size, None) if groups * group_size == k else None


def repack_int4(weight_packed, weight_scale, weight_zero_point, g_idx, group_size, in_features) -> Int4Pack | None:
    n, k = weight_packed.shape[0], in_features
    groups = weight_scale.shape[1] if weight_scale.dim() == 2 else 1
    runs = group_runs(weight_scale, g_idx, group_size, k)
    if runs is None:
        return None
    width, perm = runs
    group = next((t for t in _TORCH_GROUPS if width % t == 0), None)
    if group is None:
        return None
    u = unpack_int32(weight_packed, 4, k).to(torch.int32) + 8
    scale = weight_scale.float().reshape(n, groups)
    zero_u = (unpack_zero_points(weight_zero_point, 4, n).float() + 8) if weight_zero_point is not None \
        else torch.full_like(scale, 8.0)
    if perm is not None:
        u = u[:, perm]
    rep = width // group
    scale = scale.repeat_interleave(rep, dim=1)
    zero = scale * (8.0 - zero_u.repeat_interleave(rep, dim=1))
    n_pad = -(-n // 16) * 16
    if n_pad != n:  # zero rows: u = 8, scale = 0, zero = 0 give w = 0
        u = torch.cat([u, torch.full((n_pad - n, k), 8, dtype=torch.int32)])
        scale = torch.cat([scale, scale.new_zeros(n_pad - n, scale.shape[1])])
        zero = torch.cat([zero, zero.new_zeros(n_pad - n, zero.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 2)
    scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
    return Int4Pack(packed, group, scale_zero, n, perm)


def repack_int8(weight_packed, weight_scale, weight_zero_point, in_features) -> Int8Pack | None:
    n = weight_packed.shape[0]
    groups = weight_scale.shape[1] if weight_scale.dim() == 2 else 1
    if groups != 1:
        return None
    q = unpack_int32(weight_packed, 8, in_features).contiguous()
    scale = weight_scale.float().reshape(n)
    zero_scale = None
    if weight_zero_point is not None:
        zero_scale = scale * unpack_zero_points(weight_zero_point, 8, n).float().reshape(n)
    return Int8Pack(q, scale, zero_scale)


def int4_matmul(pack: Int4Pack, x2: torch.Tensor) -> torch.Tensor:
    if pack.perm is not None:
        x2 = x2[:, pack.perm]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), pack.packed, pack.group,
                                                     pack.scale_zero_for(x2.dtype))
    return y[:, :pack.n] if y.shape[1] != pack.n else y


def int8_matmul(pack: Int8Pack, x2: torch.Tensor) -> torch.Tensor:
    y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), pack.q, pack.scale_for(x2.dtype))
    if pack.zero_scale is not None:
        y = (y.float() - x2.float().sum(-1, keepdim=True) * pack.zero_scale).to(x2.dtype)
    return y


_BUFFERS: dict[tuple, torch.Tensor] = {}
_CHUNK_ROWS = 256  # bounds the int32 temporaries of unpacking to 256 x K


def weight_buffer(n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One scratch weight per (dtype, device), grown to the largest layer and shared by all of them."""
    key = (dtype, str(device))
    buf = _BUFFERS.get(key)
    # a buffer made under torch.inference_mode cannot be written outside it (and vice versa is fine): remake it
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or stale or buf.numel() < n * k:
        buf = torch.empty(n * k, dtype=dtype, device=device)
        _BUFFERS[key] = buf
    return buf[: n * k].view(n, k)


def dequantize_into(out: torch.Tensor, weight_packed, weight_scale, weight_zero_point, g_idx, group_size,
                    bits) -> torch.Tensor:
    """Dequantise in row chunks straight into `out` [N, K] (any device), in out's dtype via float32."""
    n, k = out.shape
    per, mask = 32 // bits, (1 << bits) - 1
    groups = weight_scale.shape[1] if weight_scale.dim() == 2 else 1
    shifts = torch.arange(per, dtype=torch.int32, device=out.device) * bits
    zero_u = None
    if weight_zero_point is not None:
        zero_u = unpack_zero_points(weight_zero_point, bits, n).float() + (1 << (bits - 1))
    contiguous = g_idx is None and (groups == 1 or groups * group_size == k)
    gi = None if contiguous else (g_idx.long() if g_idx is not None else torch.arange(k, device=out.device) // group_size)
    for r0 in range(0, n, _CHUNK_ROWS):
        r1 = min(n, r0 + _CHUNK_ROWS)
        if 32 % bits:  # 3-bit codes straddle words: the general unpacker
            u = unpack_int32(weight_packed[r0:r1], bits, k).float() + (1 << (bits - 1))
        else:
            u = ((weight_packed[r0:r1].unsqueeze(-1) >> shifts) & mask).reshape(r1 - r0, -1)[:, :k].float()
        s = weight_scale[r0:r1].float().reshape(r1 - r0, groups)
        z = zero_u[r0:r1] if zero_u is not None else torch.full_like(s, float(1 << (bits - 1)))
        if contiguous:
            w = (u.view(r1 - r0, groups, -1) - z.unsqueeze(-1)) * s.unsqueeze(-1)
            out[r0:r1].copy_(w.view(r1 - r0, k))
        else:
            out[r0:r1].copy_((u - z[:, gi]) * s[:, gi])
    return out


def check_activation(x: torch.Tensor):
    if x.dtype not in _ACT_DTYPES:
        raise UserError(f"quantised Linear got {x.dtype} activations; use float32, float16 or bfloat16")
