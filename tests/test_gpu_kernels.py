"""The CUDA and Triton kernels on a real GPU against the float64 truth (the GEMV at 1-4 rows, the tensor-core GEMM
at 1-64): every supported row count, dtype, group
size (vector-aligned, per-word and act-order), zero points or not; dequantisation exact; the ops inside a
compiled graph; the dispatcher's CUDA choices. Collected everywhere, run where a GPU is (bench/gpu_check.sh)."""
import os

import pytest
import torch

from quantkit.errors import UserError
from quantkit.kernels import dispatch, reference
from quantkit.testing.packed import FakeQuantLinear, make_packed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU; bench/gpu_check.sh runs it on one")]
K = 1536  # a multiple of 32, 48, 64, 96, 128 and 512
N = 200  # not a multiple of the GEMV's 16 rows per block: the tail block is exercised
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}  # output rounding + 16-bit weights, relative to max |y|


def _cuda(p, dtype):
    dev = "cuda"
    zp = None if p.weight_zero_point is None else p.weight_zero_point.to(dev)
    gi = None if p.g_idx is None else p.g_idx.to(dev)
    return p.weight_packed.to(dev), p.weight_scale.to(dev, dtype), zp, gi


def _close(y, x, p, dtype):
    truth = x.double().cpu() @ p.w64.t()
    err = (y.double().cpu() - truth).abs().max().item()
    assert err <= TOL[dtype] * truth.abs().max().item(), f"max error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size,g_idx", [(32, None), (128, None), (-1, None), (48, None), (96, None),
                                              (128, "actorder"), (64, "ragged")])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cuda_gemv_matches_float64(dtype, group_size, g_idx, symmetric):
    from quantkit.kernels import cuda as qc

    p = make_packed(N, K, 4, group_size, symmetric, g_idx, seed=group_size + 7, scale_dtype=dtype)
    wp, sc, zp, gi = _cuda(p, dtype)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
        bias = torch.randn(N, generator=torch.Generator().manual_seed(9)).to(dtype)
        y = qc.gemv_w4a16(x.cuda(), wp, sc, zp, gi, group_size, bias.cuda())
        assert y.dtype == dtype and y.shape == (rows, N)
        _close(y.float() - bias.cuda().float(), x, p, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cuda_tensor_core_gemm_matches_float64(dtype, group_size, symmetric):
    from quantkit.kernels import cuda as qc

    p = make_packed(N, K, 4, group_size, symmetric, seed=group_size + 11, scale_dtype=dtype)
    wp, sc, zp, _ = _cuda(p, dtype)
    for rows in (1, 5, 16, 17, 33, 64):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
        y = qc.gemm_w4a16_tc(x.cuda(), wp, sc, zp, group_size)
        assert y.dtype == dtype and y.shape == (rows, N)
        _close(y, x, p, dtype)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits,group_size,g_idx", [(4, 128, None), (4, 48, None), (8, 64, "actorder"), (8, -1, None)])
def test_cuda_dequant_is_exact(out_dtype, bits, group_size, g_idx):
    from quantkit.kernels import cuda as qc

    p = make_packed(N, K, bits, group_size, False, g_idx, seed=bits, scale_dtype=out_dtype)
    wp, sc, zp, gi = _cuda(p, out_dtype)
    got = qc.dequantize_int(wp, sc, zp, gi, group_size, bits, K, out_dtype=out_dtype)
    want = reference.dequantize(*p.args, in_features=K).to(out_dtype)
    assert torch.equal(got.cpu(), want)


def test_cuda_fp8_dequant_decodes_every_code():
    from quantkit.kernels import cuda as qc

    w8 = torch.arange(256, dtype=torch.uint8).reshape(8, 32).view(torch.float8_e4m3fn)
    s = torch.linspace(0.5, 2.0, 8)
    got = qc.dequantize_fp8(w8.cuda(), s.cuda(), torch.float32).cpu()
    want = reference.dequantize_fp8(w8, s.reshape(8, 1))
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())


def test_compiled_graph_runs_the_op():
    from quantkit.kernels import cuda as qc  # noqa: F401  (builds and registers the ops)

    p = make_packed(N, K, 4, 128, False, seed=3, scale_dtype=torch.float16)
    wp, sc, zp, _ = _cuda(p, torch.float16)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(4)).half().cuda()

    def layer(x):
        return torch.relu(torch.ops.quantkit.gemv_w4a16(x, wp, sc, zp, None, None, 128)) * 2

    eager = layer(x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), eager)


def test_misaligned_activations_are_refused():
    from quantkit.kernels import cuda as qc

    p = make_packed(N, K, 4, 128, True, seed=5, scale_dtype=torch.float16)
    wp, sc, _, _ = _cuda(p, torch.float16)
    x = torch.randn(K + 1, device="cuda", dtype=torch.float16)[1:].view(1, K)
    with pytest.raises(UserError, match="16-byte boundary"):
        qc.gemv_w4a16(x, wp, sc, None, None, 128)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="Triton is in interpreter mode here")
@pytest.mark.parametrize("group_size", [48, 96, 128])
@pytest.mark.parametrize("variant,rows", [("gemv", 3), ("gemm", 40)])
def test_triton_on_gpu_reads_no_scale_past_the_end(group_size, variant, rows):
    from quantkit.kernels.triton import wna16_matmul

    k = 2 * group_size if group_size != 128 else 384
    p = make_packed(N, k, 4, group_size, False, seed=6, scale_dtype=torch.float16)
    wp, sc, zp, _ = _cuda(p, torch.float16)
    padded = torch.full((sc.numel() + 4096,), float("nan"), dtype=sc.dtype, device="cuda")
    padded[:sc.numel()] = sc.reshape(-1)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).half()
    y = wna16_matmul(x.cuda(), wp, padded[:sc.numel()].view(sc.shape), zp, None, group_size, 4, variant=variant)
    assert not y.isnan().any()
    _close(y, x, p, torch.float16)


@pytest.mark.parametrize("rows,expected,forced", [(1, "cuda-gemv", None), (4, "cuda-gemv", None),
                                                  (8, "triton-gemm", None), (100, "triton-dequant-matmul", None),
                                                  (24, "cuda-tc", "cuda"), (100, "cuda-dequant-matmul", "cuda")])
def test_dispatch_on_cuda(monkeypatch, rows, expected, forced):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    if forced:
        monkeypatch.setenv(dispatch.ENV, forced)
    if os.environ.get("TRITON_INTERPRET") == "1" and expected.startswith("triton"):
        pytest.skip("Triton is in interpreter mode here")
    p = make_packed(N, K, 4, 128, False, seed=8, scale_dtype=torch.float16)
    m = FakeQuantLinear(p)
    for name in ("weight_packed", "weight_scale", "weight_zero_point"):
        setattr(m, name, getattr(m, name).cuda())
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).half()
    assert dispatch.choose(m, rows, x.cuda()) == expected
    _close(m(x.cuda()), x, p, torch.float16)
