"""reference.py against float64 dequantisation of the unpacked codes (an independent path through QWeight's maths)."""
import pytest
import torch

from quantkit.kernels import reference
from quantkit.testing.packed import make_packed


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("g_idx", [None, "actorder", "ragged"])
def test_dequantize_matches_float64(bits, group_size, symmetric, g_idx):
    p = make_packed(33, 256, bits, group_size, symmetric, g_idx, seed=bits + group_size)
    w = reference.dequantize(*p.args, in_features=256)
    # codes are exact small integers and scales fp16: the float32 product is within 1 ulp of float64
    torch.testing.assert_close(w.double(), p.w64, rtol=2 ** -23, atol=0)


def test_matmul_with_bias_matches_float64():
    p = make_packed(40, 128, 4, 32, False, seed=3)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    b = torch.randn(40, generator=torch.Generator().manual_seed(5))
    y = reference.matmul(x, *p.args, in_features=128, bias=b)
    # float32 accumulation over K=128 terms of size ~|x||w|: 1e-5 relative to the output scale is ample
    torch.testing.assert_close(y.double(), x.double() @ p.w64.t() + b.double(), rtol=0,
                               atol=1e-5 * (x.abs().max() * p.w64.abs().max() * 128).item())


def test_dequantize_fp8_per_channel_and_tensor():
    gen = torch.Generator().manual_seed(6)
    w8 = (torch.randn(24, 64, generator=gen) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(24, 1, generator=gen) + 0.1
    assert torch.equal(reference.dequantize_fp8(w8, s), w8.float() * s)
    assert torch.equal(reference.dequantize_fp8(w8, torch.tensor([0.5])), w8.float() * 0.5)
