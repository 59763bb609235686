"""The CUDA GEMV's arithmetic replayed bit for bit in NumPy, so the conversion trick is tested without a GPU.

gemv_w4a16.cu turns a word's eight 4-bit codes into four 16-bit pairs with one lop3 each ((w >> 4t) & 0x000F000F
| magic: magic + code exactly, for fp16 1024 = 0x6400 and bf16 128 = 0x4300), subtracts base + zero, multiplies by
the scale, and pairs the activations to match with byte permutes. The constants are read from qk_common.cuh, the
operations are replayed with the same roundings (one per fp16/bf16 operation, FMA rounded once), and the result
is held against the float64 truth.
"""
import re

import numpy as np
import pytest
import torch

from quantkit.kernels import cuda_library
from quantkit.testing.packed import make_packed

HEADER = (cuda_library.SOURCE_DIR / "qk_common.cuh").read_text()


def _const(name: str):
    value = re.search(rf"constexpr \w+ {name} = (0x[0-9a-fA-F]+)u;|constexpr \w+ {name} = ([0-9.]+)f;", HEADER)
    return int(value.group(1), 16) if value.group(1) else float(value.group(2))


LOW, PAIR_LO, PAIR_HI = _const("kLowNibbles"), _const("kPairLo"), _const("kPairHi")
MAGIC = {torch.float16: (_const("kHalfMagic"), _const("kHalfBase")),
         torch.bfloat16: (_const("kBf16Magic"), _const("kBf16Base"))}


def _halves(u32: np.ndarray, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high 16-bit lanes of uint32 registers as fp16 / bf16 values (low lane = .x)."""
    lo, hi = (u32 & 0xFFFF).astype(np.uint16), (u32 >> 16).astype(np.uint16)
    return tuple(torch.from_numpy(h.view(np.int16).copy()).view(dtype) for h in (lo, hi))


def _round(v: torch.Tensor, dtype) -> torch.Tensor:
    return v.to(dtype)  # float64 -> 16-bit: one round-to-nearest-even


def _byte_perm(x: np.ndarray, y: np.ndarray, sel: int) -> np.ndarray:
    """CUDA's __byte_perm: result byte i is byte (sel >> 4i) & 7 of the 8-byte value y:x."""
    src = (y.astype(np.uint64) << 32) | x.astype(np.uint64)
    out = np.zeros_like(x, dtype=np.uint64)
    for i in range(4):
        b = (sel >> (4 * i)) & 7
        out |= ((src >> (8 * b)) & 0xFF) << (8 * i)
    return out.astype(np.uint32)


def test_magic_number_gives_every_code_exactly():
    codes = np.arange(16, dtype=np.uint32)
    for dtype, (magic, base) in MAGIC.items():
        for t in range(4):  # code at nibble t (low lane) and t + 4 (high lane) of one word
            word = (codes << (4 * t)) | (codes[::-1] << (4 * (t + 4)))
            lo, hi = _halves(((word >> (4 * t)) & LOW) | magic, dtype)
            assert torch.equal(lo.double() - base, torch.from_numpy(codes.astype(np.float64)))
            assert torch.equal(hi.double() - base, torch.from_numpy(codes[::-1].astype(np.float64)))


def _dequant_pairs(words, scale, zp, group_size, dtype, n, per_vec):
    """The kernel's weight pairs w[t] = ((code_t, code_{t+4}) - zero) * scale for every word: [4, 2, N, W]."""
    magic, base = MAGIC[dtype]
    w_idx = np.arange(words.shape[1])
    k0 = (w_idx // 4) * 32 if per_vec else w_idx * 8  # the column whose group the scale is read for
    g = k0 // group_size if group_size > 0 else np.zeros_like(w_idx)
    rows = np.arange(n)[:, None]
    zero = 8.0 if zp is None else ((zp[rows // 8, g] >> ((rows % 8) * 4)) & 0xF).astype(np.float64)
    base_zero = _round(torch.as_tensor(base + zero, dtype=torch.float64).expand(n, len(w_idx)), dtype)
    s = scale[:, g]
    out = []
    for t in range(4):
        pair = _halves(((words >> (4 * t)) & LOW) | magic, dtype)
        diff = [_round(h.double() - base_zero.double(), dtype) for h in pair]  # hsub2
        out.append([_round(d.double() * s.double(), dtype) for d in diff])  # hmul2
    return out


def _gemv_emulated(x, p, dtype, per_vec):
    n, words = p.weight_packed.shape
    wp = p.weight_packed.numpy().view(np.uint32)
    zp = None if p.weight_zero_point is None else p.weight_zero_point.numpy().view(np.uint32)
    w = _dequant_pairs(wp, p.weight_scale, zp, p.group_size, dtype, n, per_vec)
    xr = x.contiguous().view(torch.int32).numpy().view(np.uint32).reshape(x.shape[0], words, 4)  # uint4 per word
    xp = [_byte_perm(xr[..., 0], xr[..., 2], PAIR_LO), _byte_perm(xr[..., 0], xr[..., 2], PAIR_HI),
          _byte_perm(xr[..., 1], xr[..., 3], PAIR_LO), _byte_perm(xr[..., 1], xr[..., 3], PAIR_HI)]
    y = torch.zeros(x.shape[0], n, dtype=torch.float32)
    for m in range(x.shape[0]):
        xs = [_halves(xp[t][m], dtype) for t in range(4)]  # [W] each lane
        if dtype == torch.float16:  # half2 FMAs over the word, then float
            part = [None, None]
            for lane in range(2):
                acc = _round(w[0][lane].double() * xs[0][lane].double(), dtype)
                for t in range(1, 4):
                    acc = _round(w[t][lane].double() * xs[t][lane].double() + acc.double(), dtype)
                part[lane] = acc.float()
            y[m] = (part[0] + part[1]).sum(dim=1)
        else:  # bfloat16: float FMAs
            y[m] = sum(w[t][lane].float() * xs[t][lane].float() for t in range(4) for lane in range(2)).sum(dim=1)
    return y, w


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size,k,symmetric", [(32, 128, False), (128, 256, True), (-1, 96, False),
                                                    (16, 64, True), (48, 96, False)])
def test_gemv_arithmetic_matches_float64(dtype, group_size, k, symmetric):
    p = make_packed(16, k, 4, group_size, symmetric, seed=k + group_size, scale_dtype=dtype)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    per_vec = group_size <= 0 or group_size % 32 == 0  # the kernel's per_vec choice
    y, w = _gemv_emulated(x, p, dtype, per_vec)
    # the dequantised pairs are the float64 weights rounded once, in the (t, t + 4) order of each word
    w64 = p.w64.reshape(16, k // 8, 8)
    for t in range(4):
        for lane, col in ((0, t), (1, t + 4)):
            assert torch.equal(w[t][lane], w64[:, :, col].to(dtype))
    truth = x.double() @ p.w64.t()
    # fp16: weights and word partials rounded to fp16 (2^-11 relative); bf16 rounds the weights to 2^-8 but
    # accumulates in float32. Relative to the output's magnitude.
    tol = 3e-3 if dtype == torch.float16 else 1.5e-2
    assert (y.double() - truth).abs().max() <= tol * truth.abs().max()


def test_tensor_core_gemm_puts_the_pairs_back_in_column_order():
    """gemm_w4a16_tc.cu stores a word's pairs (t, t+4) in column order with four byte permutes
    (w4_pairs.cuh's in_column_order): (c0,c1) (c2,c3) (c4,c5) (c6,c7)."""
    words = np.random.default_rng(5).integers(0, 2**32, size=64, dtype=np.uint64).astype(np.uint32)
    magic, base = MAGIC[torch.float16]
    pairs = [((words >> (4 * t)) & LOW) | magic for t in range(4)]  # (c_t, c_{t+4}) + base
    out = [_byte_perm(pairs[0], pairs[1], PAIR_LO), _byte_perm(pairs[2], pairs[3], PAIR_LO),
           _byte_perm(pairs[0], pairs[1], PAIR_HI), _byte_perm(pairs[2], pairs[3], PAIR_HI)]
    got = torch.stack([torch.stack(_halves(o, torch.float16), dim=1) for o in out], dim=1).reshape(64, 8)
    codes = torch.from_numpy(np.stack([(words >> (4 * j)) & 0xF for j in range(8)], axis=1).astype(np.float64))
    assert torch.equal(got.double() - base, codes)
