"""The 4-bit float formats: E2M1 elements, their nibble packing, and the two scale encodings that go with them.

E2M1 (1 sign, 2 exponent, 1 mantissa bit) holds ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}; it has no infinity and no NaN.
- NVFP4: one E4M3 scale per 16 elements and one float32 global scale per tensor; compressed-tensors stores the
  global scale as a divisor (dequantised = e2m1 * weight_scale / weight_global_scale).
- MXFP4 (OCP MX v1.0): one E8M0 scale per 32 elements, a bare biased exponent: 2^(code - 127); code 255 is NaN.

Rounding is to nearest, ties to the even mantissa (the OCP spec's roundTiesToEven; compressed-tensors' casts make
the same choices), saturating at ±6. ±inf saturates like any large value. NaN has no code: `round_e2m1` refuses
it (ValueError), since a silent zero would hide a broken tensor. No imports from the rest of quantkit but e4m3.
"""
from __future__ import annotations

import torch

from . import e4m3

E2M1_MAX = 6.0
# magnitude of each 3-bit code; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E8M0_NAN = 255
NVFP4_GROUP, MXFP4_GROUP = 16, 32
# E2M1's largest exponent: the OCP spec's shared exponent is floor(log2(amax)) - 2
E2M1_EMAX = 2
# the smallest positive E4M3 value (a subnormal): the floor of an NVFP4 group scale, so no group divides by 0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
GLOBAL_EXP_LIMIT = 14


def _check_no_nan(x: torch.Tensor) -> None:
    if bool(torch.isnan(x).any()):
        raise ValueError("NaN has no E2M1 code; the tensor being quantised holds NaN")


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) rounded to the nearest E2M1 value, ties to even, saturating at ±6; float32.

    The grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6; within each such binade the even multiples of the
    spacing are exactly the even mantissas, so torch.round's half-to-even on x / spacing is the format's rule.
    """
    _check_no_nan(x)
    x = x.float()
    a = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, x)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) of E2M1 values v (as round_e2m1 gives): magnitude index, sign in bit 3."""
    twice = (v.abs() * 2).to(torch.long)  # 0, 1, 2, 3, 4, 6, 8, 12
    index = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.long, device=v.device)[twice]
    return (index | (torch.signbit(v).to(torch.long) << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit codes (inverse of e2m1_codes; code 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack(v: torch.Tensor) -> torch.Tensor:
    """E2M1 values [rows, cols] (cols even) -> uint8 [rows, cols / 2]: column 2i in the low nibble, 2i+1 in the
    high one (compressed-tensors' nvfp4/mxfp4 `weight_packed`)."""
    rows, cols = v.shape
    if cols % 2:
        raise ValueError(f"FP4 packing needs an even number of columns, got {cols}")
    c = e2m1_codes(v).reshape(rows, cols // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols / 2] -> float32 E2M1 values [rows, cols]."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return e2m1_values(codes.reshape(packed.shape[0], -1))


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 codes of integer exponents, clamped to the format's finite range [-127, 127]."""
    return (exponent.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 2^(code - 127); the NaN code 255 decodes to NaN, as the spec has it."""
    v = torch.exp2(codes.float() - E8M0_BIAS)
    return torch.where(codes == E8M0_NAN, torch.full_like(v, float("nan")), v)


def mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The OCP spec's shared exponent of a group, floor(log2(amax)) - 2 (its largest element then rounds to
    [4, 8), values over 6 saturating); 2^-127 for an all-zero group. int32, within E8M0's range."""
    safe = torch.where(amax > 0, amax.double(), torch.full_like(amax, 2.0 ** -200, dtype=torch.float64))
    return (torch.floor(torch.log2(safe)) - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor divisor: the power of two at or below 448 * 6 / amax, float32 [1].

    compressed-tensors takes 448 * 6 / amax itself, which maps the tensor's largest group scale onto E4M3's top;
    rounding it down to a power of two keeps that within a factor of 2 and makes the ratio of any two tensors'
    global scales a power of two, so Linears an engine fuses (q/k/v) can be given one shared global scale
    exactly. Kept within [2^-14, 2^14], so it is exact in float16 too (quantkit's loader casts float tensors to
    the model dtype): below 0.16 amax the group scales then use less of E4M3's range, which costs nothing while
    they stay normal (group amax above 6e-6). 1 for an all-zero tensor."""
    a = float(amax)
    if not a > 0:
        return torch.ones(1)
    exp = torch.floor(torch.log2(torch.tensor(e4m3.E4M3_MAX * E2M1_MAX / a, dtype=torch.float64)))
    return torch.exp2(exp.clamp(-GLOBAL_EXP_LIMIT, GLOBAL_EXP_LIMIT)).float().reshape(1)


def nvfp4_group_scale(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The E4M3 group scale (as float32) mapping amax onto 6 under global_scale, never below E4M3's smallest
    value (an all-zero group then quantises to zeros, not 0/0)."""
    return e4m3_scale(amax.float() * global_scale.float() / E2M1_MAX)


def e4m3_scale(s: torch.Tensor) -> torch.Tensor:
    """s rounded to an E4M3 value (as float32), saturating at 448 and never below E4M3's smallest value."""
    return s.float().clamp(E4M3_MIN_SUBNORMAL, e4m3.E4M3_MAX).to(e4m3.FP8).float().clamp(min=E4M3_MIN_SUBNORMAL)


def nvfp4_fake_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 16) rounded through NVFP4 and back, in float32: each run of 16 along the last
    dim gets a scale from its absmax, (amax / 6) * global_scale rounded to E4M3 (compressed-tensors' dynamic
    `local` activations, in its order of operations), divided by the static global scale."""
    x = x.float()
    g = global_scale.float()
    xg = x.unflatten(-1, (x.shape[-1] // NVFP4_GROUP, NVFP4_GROUP))
    local = e4m3_scale(xg.abs().amax(-1, keepdim=True) / E2M1_MAX * g)
    eff = local / g
    return (round_e2m1(xg / eff) * eff).flatten(-2)
