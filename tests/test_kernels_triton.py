"""Triton dequant and W4A16/W8A16 matmul against float64 truth, run in the Triton interpreter on CPU."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere: no GPU here

import pytest  # noqa: E402
import torch  # noqa: E402

from quantkit.errors import UserError  # noqa: E402
from quantkit.kernels import reference  # noqa: E402
from quantkit.testing.packed import make_packed  # noqa: E402
from quantkit.kernels.triton import dequantize_fp8, dequantize_int, w4a16_matmul, wna16_matmul  # noqa: E402

# K per group size: a multiple of the group, and for -1 not a multiple of the 64/128 K tile (masking)
K_FOR_GROUP = {32: 96, 64: 192, 128: 256, -1: 160}
# fp16 in/out: the output is rounded to fp16 (2^-11 relative) and the GEMM feeds fp16-rounded weights to the
# dot, so allow 3e-3 of the output's magnitude; fp32 differs from float64 only by float32 accumulation order.
REL_TOL = {torch.float16: 3e-3, torch.float32: 2e-5}


def _check(y, x, p, bias=None):
    truth = x.double() @ p.w64.t()
    if bias is not None:
        truth = truth + bias.double()
    scale = truth.abs().max().item()
    assert y.dtype == x.dtype
    err = (y.double() - truth).abs().max().item()
    assert err <= REL_TOL[x.dtype] * scale, f"max error {err:.3g} vs output scale {scale:.3g}"


# each kernel shape meets both dtypes and odd row counts without running the full cross product
@pytest.mark.parametrize("variant,rows,dtype", [("gemv", 1, torch.float16), ("gemv", 3, torch.float32),
                                                ("gemm", 5, torch.float32), ("gemm", 19, torch.float16)])
@pytest.mark.parametrize("g_idx", [None, "actorder"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_matches_reference(bits, group_size, symmetric, g_idx, variant, rows, dtype):
    k = K_FOR_GROUP[group_size]
    p = make_packed(40 if symmetric else 33, k, bits, group_size, symmetric, g_idx, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = wna16_matmul(x, *p.args, variant=variant)
    _check(y, x, p)


@pytest.mark.parametrize("variant", ["gemv", "gemm"])
def test_ragged_act_order_bias_and_leading_dims(variant):
    p = make_packed(48, 128, 4, 32, False, "ragged", seed=11)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 128, generator=gen)
    bias = torch.randn(48, generator=gen)
    y = w4a16_matmul(x, p.weight_packed, p.weight_scale, p.weight_zero_point, p.g_idx, 32, bias=bias,
                     variant=variant)
    assert y.shape == (2, 3, 48)
    _check(y.reshape(6, 48), x.reshape(6, 128), p, bias)


def test_gemv_handles_more_than_four_rows_in_slices():
    p = make_packed(32, 128, 4, 64, True, seed=13)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(14))
    _check(wna16_matmul(x, *p.args, variant="gemv"), x, p)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("g_idx", [None, "ragged"])
@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 32, False), (4, -1, True), (8, 128, False),
                                                        (8, 64, True)])
def test_dequantize_int_matches_reference(bits, group_size, symmetric, g_idx, out_dtype):
    k = K_FOR_GROUP[group_size]
    p = make_packed(33, k, bits, group_size, symmetric, g_idx, seed=k + bits)
    w = dequantize_int(*p.args, in_features=k, out_dtype=out_dtype)
    ref = reference.dequantize(*p.args, in_features=k)
    # identical float32 arithmetic, then one rounding to out_dtype
    assert torch.equal(w, ref.to(out_dtype))


def test_dequantize_int_writes_into_reused_buffer():
    p = make_packed(16, 64, 4, 32, True, seed=15)
    buf = torch.full((16, 64), float("nan"))
    out = dequantize_int(*p.args, in_features=64, out=buf)
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(buf, reference.dequantize(*p.args, in_features=64))


def test_dequantize_fp8_decodes_every_code():
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    w8 = codes.view(torch.float8_e4m3fn)
    scale = torch.linspace(0.5, 2.0, 8).reshape(8, 1)
    for s in (scale, torch.tensor([0.75])):
        got = dequantize_fp8(w8, s, torch.float32)
        want = reference.dequantize_fp8(w8, s)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got.nan_to_num(), want.nan_to_num())  # all 256 codes exactly, subnormals included
    half = dequantize_fp8(w8, scale, torch.float16)
    assert torch.equal(half.nan_to_num(), reference.dequantize_fp8(w8, scale).half().nan_to_num())


def test_bad_inputs_raise_user_error():
    p = make_packed(16, 64, 4, 32, True, seed=16)
    with pytest.raises(UserError, match="in_features"):
        wna16_matmul(torch.randn(2, 72), *p.args)
    with pytest.raises(UserError, match="groups"):
        wna16_matmul(torch.randn(2, 64), p.weight_packed, p.weight_scale, None, None, 16, 4)
    with pytest.raises(UserError, match="activations"):
        wna16_matmul(torch.randn(2, 64).to(torch.float64), *p.args)
