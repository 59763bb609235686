"""E4M3 rounding and saturation against a float64 reference, the FP8 solver, and FP8Linear's CPU emulation.

The reference enumerates every finite e4m3fn value from its bit fields (not from torch's float8 dtype) and
rounds by nearest value, ties to the even code; the other FP8 test files import it from here.
"""
from __future__ import annotations

import pytest
import torch

from quantkit import e4m3
from quantkit.errors import UserError
from quantkit.linear.fp8 import FP8Linear
from quantkit.schemes import get_scheme
from quantkit.solvers.base import SolveOptions
from quantkit.solvers.fp8 import INPUT_MARGIN, FP8Solver, fp8_quantize


def e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """(values, codes) of the non-negative finite e4m3fn numbers, float64, ascending: 1 sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent 0 is subnormal; S.1111.111 is NaN and there is no infinity."""
    vals, codes = [], []
    for code in range(0x7F):  # 0x7F = 0.1111.111 is NaN
        exp, man = code >> 3, code & 7
        v = (man / 8) * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        vals.append(v)
        codes.append(code)
    return torch.tensor(vals, dtype=torch.float64), torch.tensor(codes)


def e4m3_round_ref(x: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) rounded to e4m3fn in float64: nearest, ties to even code, saturating at ±448."""
    vals, codes = e4m3_table()
    a = x.double().abs().clamp(max=448.0).reshape(-1, 1)
    d = (a - vals.reshape(1, -1)).abs()
    best = d.min(dim=1, keepdim=True).values
    tied = d == best
    # among the (at most two) nearest values prefer the even code: its mantissa's last bit is 0
    pref = torch.where(tied & (codes % 2 == 0), 0, torch.where(tied, 1, 2))
    idx = pref.argmin(dim=1)
    return (vals[idx] * x.double().sign().reshape(-1)).reshape(x.shape)


def test_table_matches_torch_bit_patterns():
    """The hand-built table is the e4m3fn format torch implements (so the reference checks the right grid)."""
    vals, codes = e4m3_table()
    as_fp8 = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    assert torch.equal(as_fp8, vals)
    assert vals.max() == 448.0 and vals[1] == 2.0 ** -9


def _test_values(g: torch.Generator) -> torch.Tensor:
    vals, _ = e4m3_table()
    mids = (vals[1:] + vals[:-1]) / 2  # exact ties: every midpoint between neighbours (exact in float32)
    spread = torch.randn(4000, generator=g) * torch.exp(torch.randn(4000, generator=g) * 4)  # 1e-5 .. 1e5
    outliers = torch.tensor([448.0, 449.0, 463.9, 464.0, 465.0, 480.0, 1e4, 3e38, 2.0 ** -10, 2.0 ** -11, 0.0])
    x = torch.cat([spread, mids.float(), -mids.float(), outliers, -outliers])
    return x.float()


def test_rounding_and_saturation_match_float64_reference():
    g = torch.Generator().manual_seed(0)
    x = _test_values(g)
    got = e4m3.quantize(x, torch.ones(1)).double()
    ref = e4m3_round_ref(x)
    assert not torch.isnan(got).any()
    bad = (got != ref).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. x={x[bad[:5]].tolist()} got={got[bad[:5]].tolist()}"
    assert got.abs().max() == 448.0  # the outliers saturated instead of becoming NaN


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaled_quantisation_is_reference_of_x_over_scale(scale_dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, generator=g) * 3
    x[7] = 250.0  # an outlier far above the rest
    s = e4m3.scale_for(x.abs().amax() * 0.5, dtype=scale_dtype)  # half the range: the outlier must saturate
    assert s == s.to(scale_dtype).float()  # representable in its storage dtype, so written == measured
    codes = e4m3.quantize(x, s).double()
    assert torch.equal(codes, e4m3_round_ref(x / s))  # x / s in float32, as the code and any FP8 kernel do
    assert codes[7] == 448.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scales_are_never_zero(dtype):
    for amax in [torch.tensor(0.0), torch.tensor(1e-30), torch.tensor(float("nan"))]:
        s = e4m3.scale_for(amax, dtype=dtype)
        assert s > 0 and torch.isfinite(s)
        assert torch.equal(e4m3.quantize(torch.zeros(4), s).float(), torch.zeros(4))
    q, s = e4m3.quantize_per_token(torch.zeros(3, 8))
    assert (s > 0).all() and torch.equal(q.float(), torch.zeros(3, 8))


# ---------------------------------------------------------------------------------------------------------------
# The solver


@pytest.mark.parametrize("name", ["fp8", "fp8-dynamic"])
def test_solver_codes_are_reference_rounding_of_w_over_absmax_scale(name):
    scheme = get_scheme(name)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=g) * torch.exp(torch.randn(48, 1, generator=g))  # rows of unequal size
    w[3, 5] = 40.0  # an outlier weight
    w[10] = 0.0  # a dead output channel
    qw = fp8_quantize(w, scheme, scale_dtype=torch.float16)
    assert qw.q.dtype == torch.float8_e4m3fn
    amax = w.abs().amax() if name == "fp8" else w.abs().amax(1, keepdim=True)
    expect_scale = (amax / 448).clamp(min=torch.finfo(torch.float16).tiny).half().float()
    assert qw.scale.shape == ((1,) if name == "fp8" else (48, 1))
    assert torch.equal(qw.scale.reshape(expect_scale.shape), expect_scale)
    assert torch.equal(qw.q.double(), e4m3_round_ref(w / qw.scale.reshape(-1, 1) if name != "fp8" else w / qw.scale))
    assert (qw.q[10].float() == 0).all()
    # each channel's (or the tensor's) largest weight lands on the top of the grid, give or take the fp16
    # rounding of the scale (one e4m3 step near 448 is 32, far more than that rounding)
    top = qw.q.float().abs().amax() if name == "fp8" else qw.q.float().abs().amax(1)[torch.arange(48) != 10]
    assert (top >= 416).all()
    # E4M3 keeps about 3 significant bits: 2^-4 relative error per weight at worst, far less on average
    assert qw.stats["weight_rel_error"] < 0.04


def test_static_solver_input_scale_covers_the_calibration_absmax_with_the_margin():
    """The scale is searched (tests/test_fp8_input_scale.py); here: every batch counts towards the absmax, and the
    scale keeps at least INPUT_MARGIN of headroom over it and at most one octave more."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 32, generator=g)
    s = FP8Solver("model.layers.0.mlp.up_proj", w, get_scheme("fp8"), SolveOptions(scale_dtype=torch.bfloat16))
    assert s.needs_data
    batches = [torch.randn(10, 32, generator=g) * k for k in (1.0, 7.0, 2.0)]
    for b in batches:
        s.add_batch(b)
    qw = s.solve()
    amax = max(b.abs().max() for b in batches)
    low = float((amax * INPUT_MARGIN / 448).to(torch.bfloat16))
    assert low <= float(qw.input_scale) < 2 * low and qw.input_scale.shape == (1,)
    assert torch.equal(qw.input_scale.to(torch.bfloat16).float(), qw.input_scale)
    assert INPUT_MARGIN == 2.0
    assert qw.stats["calib_tokens"] == 30 and qw.stats["input_amax"] == pytest.approx(float(amax))


def test_dynamic_solver_needs_no_data_and_static_without_data_is_a_user_error():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    dyn = FP8Solver("x", w, get_scheme("fp8-dynamic"))
    assert not dyn.needs_data and dyn.solve().input_scale is None
    with pytest.raises(UserError, match="fp8-dynamic"):
        FP8Solver("lm_head", w, get_scheme("fp8")).solve()


def test_non_finite_calibration_input_is_a_user_error_naming_the_layer():
    s = FP8Solver("model.layers.1.self_attn.q_proj", torch.randn(4, 4), get_scheme("fp8"))
    with pytest.raises(UserError, match="layers.1.self_attn.q_proj"):
        s.add_batch(torch.tensor([[1.0, float("inf"), 0.0, 2.0]]))


# ---------------------------------------------------------------------------------------------------------------
# FP8Linear on the CPU: exact emulation of the FP8 x FP8 product


def _fp8_linear(g, n_in, n_out, per_channel, static, dtype, bias=False):
    w = torch.randn(n_out, n_in, generator=g) * 0.1
    qw = fp8_quantize(w, get_scheme("fp8-dynamic" if per_channel else "fp8"), scale_dtype=dtype)
    lin = FP8Linear(n_in, n_out, per_channel, static, bias=bias, dtype=dtype)
    lin.weight.copy_(qw.q)
    lin.weight_scale.copy_(qw.scale.reshape(lin.weight_scale.shape).to(dtype))
    if static:
        lin.input_scale.fill_(e4m3.scale_for(torch.tensor(2.5), dtype=dtype).item())
    if bias:
        lin.bias.copy_(torch.randn(n_out, generator=g).to(dtype))
    lin.use_scaled_mm = False
    return lin, qw


@pytest.mark.parametrize("per_channel,static", [(True, False), (False, True), (True, True), (False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_float64_reference(per_channel, static, dtype):
    g = torch.Generator().manual_seed(5)
    lin, qw = _fp8_linear(g, 64, 48, per_channel, static, dtype, bias=True)
    x = (torch.randn(2, 7, 64, generator=g) * torch.exp(torch.randn(2, 7, 1, generator=g))).to(dtype)
    x[0, 0, 0] = 30.0  # beyond the static range (2.5): must saturate, not turn into NaN
    y = lin(x)
    assert y.dtype == dtype and y.shape == (2, 7, 48)
    xd = x.float()
    if static:
        s = lin.input_scale.float()
    else:
        s = xd.abs().amax(-1, keepdim=True) / 448
    x_ref = e4m3_round_ref(xd / s) * s.double()
    ref = x_ref @ qw.dequantize().double().t() + lin.bias.double()
    # float32 accumulation over 64 products (about 1e-6 relative) plus, for bf16, the one final rounding of
    # the output (2^-8 relative): the tolerance covers the latter with a factor 2 to spare
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert torch.isfinite(y).all()


def test_dynamic_activation_quantisation_is_per_token():
    """Scaling one token must not change any other token's output (its own scale absorbs the change exactly,
    as the factor is a power of two)."""
    g = torch.Generator().manual_seed(6)
    lin, _ = _fp8_linear(g, 32, 16, True, False, torch.float32)
    x = torch.randn(5, 32, generator=g)
    y1 = lin(x)
    x2 = x.clone()
    x2[2] *= 1024.0
    y2 = lin(x2)
    keep = torch.arange(5) != 2
    assert torch.equal(y1[keep], y2[keep])
    assert torch.allclose(y2[2], y1[2] * 1024.0, rtol=1e-6)


@pytest.mark.parametrize("per_channel,static", [(True, False), (False, True), (True, True), (False, False)])
def test_scaled_mm_path_agrees_with_emulation(per_channel, static):
    """The GPU path's torch._scaled_mm call (scale layouts, transposed weight, bias), run by torch's CPU
    implementation of the same op. Row-wise scaling returns bf16, so those cases agree to bf16 rounding of the
    output (2^-8 relative, with a factor 2 to spare); per-tensor x per-tensor returns float32 directly."""
    g = torch.Generator().manual_seed(7)
    lin, _ = _fp8_linear(g, 64, 48, per_channel, static, torch.float32, bias=True)
    x = torch.randn(3, 64, generator=g)
    emulated = lin(x)
    lin.use_scaled_mm = True
    fused = lin(x)
    rowwise = per_channel or not static
    tol = 2 ** -7 if rowwise else 1e-5
    assert torch.allclose(fused, emulated, rtol=tol, atol=tol * emulated.abs().max().item())
