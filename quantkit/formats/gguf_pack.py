"""Codes and scales of `gguf_blocks.Blocks` -> the bytes of llama.cpp's block structs (ggml-common.h's
block_q4_0 ... block_q6_K), little-endian, one row of blocks after another."""
from __future__ import annotations

import numpy as np

from .gguf_blocks import Blocks


def _f16(t) -> np.ndarray:
    return t.numpy().astype(np.float16).reshape(-1, 1).view(np.uint8)


def _u8(t) -> np.ndarray:
    return t.numpy().astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 2h) codes < 16 -> (n, h) bytes: value j in the low nibble of byte j, value h + j in its high one."""
    h = q.shape[1] // 2
    return q[:, :h] | (q[:, h:] << 4)


def _bit_planes(bits: np.ndarray, planes: int, width: int) -> np.ndarray:
    """(n, planes * width) small fields of `8 // planes` bits -> (n, width) bytes, plane k at bit k * 8 // planes."""
    n = bits.shape[0]
    step = 8 // planes
    out = np.zeros((n, width), dtype=np.uint8)
    for k, plane in enumerate(np.split(bits.reshape(n, planes, width), planes, axis=1)):
        out |= plane.reshape(n, width) << (k * step)
    return out


def _scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes for eight 6-bit scales and eight 6-bit minimums (ggml's get_scale_min_k4)."""
    lo = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6)], axis=1)
    return np.concatenate([lo, (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)


def _scales_q3(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes for sixteen 6-bit scales: low nibbles two a byte, then the high pairs four a byte."""
    return np.concatenate([(s[:, :8] & 15) | ((s[:, 8:] & 15) << 4), _bit_planes(s >> 4, 4, 4)], axis=1)


def _legacy(b: Blocks, q: np.ndarray) -> list[np.ndarray]:
    name = b.kind.name
    head = [_f16(b.d)] + ([_f16(b.dmin)] if b.kind.affine else [])
    if name == "Q8_0":
        return head + [q.astype(np.int8).view(np.uint8)]
    if name in ("Q5_0", "Q5_1"):
        qh = np.packbits((q >> 4) & 1, axis=1, bitorder="little")
        return head + [qh, _nibbles(q & 15)]
    return head + [_nibbles(q)]


def _kquant(b: Blocks, q: np.ndarray) -> list[np.ndarray]:
    n = q.shape[0]
    name = b.kind.name
    if name == "Q6_K":
        ql = _nibbles(q.reshape(n * 2, 128) & 15).reshape(n, 128)
        qh = _bit_planes((q.reshape(n * 2, 128) >> 4) & 3, 4, 32).reshape(n, 64)
        return [ql, qh, b.sc.numpy().astype(np.int8).view(np.uint8), _f16(b.d)]
    if name == "Q3_K":
        ql = _bit_planes(q.reshape(n * 2, 128) & 3, 4, 32).reshape(n, 64)
        return [_bit_planes((q >> 2) & 1, 8, 32), ql, _scales_q3(_u8(b.sc + 32)), _f16(b.d)]
    qs = _nibbles(q.reshape(n * 4, 64) & 15).reshape(n, 128)
    head = [_f16(b.d), _f16(b.dmin), _scales_k4(_u8(b.sc), _u8(b.mn))]
    return head + ([qs] if name == "Q4_K" else [_bit_planes((q >> 4) & 1, 8, 32), qs])


def pack(b: Blocks) -> np.ndarray:
    """(n, nbytes) uint8."""
    q = b.q.numpy().astype(np.int64)
    q = q.astype(np.int8) if b.kind.name == "Q8_0" else q.astype(np.uint8)
    parts = (_kquant if b.kind.block == 256 else _legacy)(b, q)
    out = np.concatenate(parts, axis=1)
    assert out.shape[1] == b.kind.nbytes, (b.kind.name, out.shape)
    return out
