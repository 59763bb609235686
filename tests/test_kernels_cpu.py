"""CPU paths: the one-time repacks for torch's int4/int8 ops and the buffered dequantise, against float64."""
import pytest
import torch

from quantkit.kernels import cpu, reference
from quantkit.testing.packed import make_packed


def _rel_err(y, x, p):
    truth = x.double() @ p.w64.t()
    return (y.double() - truth).abs().max().item() / truth.abs().max().item()


@pytest.mark.parametrize("n", [48, 33])  # 33: padded to 48 rows for torch's N % 16 rule
@pytest.mark.parametrize("group_size,g_idx", [(32, None), (64, None), (128, None), (-1, None), (64, "actorder")])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_repack_matches_float64(n, group_size, g_idx, symmetric):
    p = make_packed(n, 256, 4, group_size, symmetric, g_idx, seed=n + group_size)
    pack = cpu.repack_int4(p.weight_packed, p.weight_scale, p.weight_zero_point, p.g_idx, group_size, 256)
    assert pack is not None
    assert (pack.perm is not None) == (g_idx == "actorder")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    # float32 end to end: zero = scale * (8 - u_zero) is exact in float32, so only accumulation order differs
    assert _rel_err(cpu.int4_matmul(pack, x), x, p) < 1e-5
    # bfloat16 activations: inputs, scale/zero and output all rounded to 8 bits of mantissa (2^-8 = 4e-3)
    yb = cpu.int4_matmul(pack, x.bfloat16())
    assert yb.dtype == torch.bfloat16 and yb.shape == (5, n)
    assert _rel_err(yb, x.bfloat16(), p) < 2e-2


def test_int4_repack_declines_what_torch_cannot_run():
    ragged = make_packed(32, 128, 4, 32, True, "ragged", seed=2)
    assert cpu.repack_int4(*ragged.args[:5], 128) is None
    odd_k = make_packed(32, 48, 4, 16, True, seed=3)  # K % 32 != 0
    assert cpu.repack_int4(*odd_k.args[:5], 48) is None


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_int8_repack_matches_float64(symmetric, dtype, tol):
    p = make_packed(37, 96, 8, -1, symmetric, seed=4)
    pack = cpu.repack_int8(p.weight_packed, p.weight_scale, p.weight_zero_point, 96)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5)).to(dtype)
    y = cpu.int8_matmul(pack, x)
    assert y.dtype == dtype
    # asymmetric adds rowsum(x) * scale * zero, exact algebra; bf16 tolerance as for int4
    assert _rel_err(y, x, p) < tol


def test_int8_repack_declines_groups():
    p = make_packed(16, 128, 8, 64, True, seed=6)
    assert cpu.repack_int8(p.weight_packed, p.weight_scale, None, 128) is None


@pytest.mark.parametrize("bits,group_size,symmetric,g_idx", [(4, 32, False, "ragged"), (8, 64, True, None),
                                                             (4, -1, False, None), (8, 128, False, "actorder")])
def test_dequantize_into_matches_reference(bits, group_size, symmetric, g_idx):
    p = make_packed(300, 256, bits, group_size, symmetric, g_idx, seed=7)  # 300 rows: two chunks
    out = cpu.weight_buffer(300, 256, torch.float32, torch.device("cpu"))
    cpu.dequantize_into(out, *p.args)
    assert torch.equal(out, reference.dequantize(*p.args, in_features=256))


def test_weight_buffer_is_reused_across_layers():
    a = cpu.weight_buffer(64, 64, torch.float16, torch.device("cpu"))
    b = cpu.weight_buffer(32, 64, torch.float16, torch.device("cpu"))
    assert a.data_ptr() == b.data_ptr() and b.shape == (32, 64)


def test_shared_buffer_survives_switching_out_of_inference_mode():
    from quantkit.kernels import cpu

    with torch.inference_mode():
        a = cpu.weight_buffer(4, 8, torch.float32, torch.device("cpu"))
        a.fill_(1.0)
    b = cpu.weight_buffer(4, 8, torch.float32, torch.device("cpu"))
    b.copy_(torch.arange(32.0).view(4, 8))  # an inference tensor would refuse this in-place write
    assert b[3, 7].item() == 31.0
