"""Kernel choice for a QuantLinear: CPU paths, forcing with QUANTKIT_KERNEL, logging once, dtype kept."""
import logging
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # forced-triton runs use the interpreter here

import pytest  # noqa: E402
import torch  # noqa: E402

from quantkit.errors import UserError  # noqa: E402
from quantkit.kernels import dispatch  # noqa: E402
from quantkit.testing.packed import FakeQuantLinear, make_packed  # noqa: E402


def _layer(bits=4, group_size=32, symmetric=False, g_idx=None, n=48, k=128, bias=True, seed=0,
           scale_dtype=torch.float16):
    p = make_packed(n, k, bits, group_size, symmetric, g_idx, seed=seed, scale_dtype=scale_dtype)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)) if bias else None
    m = FakeQuantLinear(p, b)
    dispatch.prepare(m)
    return m, p, b


def _truth(x, p, b):
    y = x.double() @ p.w64.t()
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("bits,group_size,g_idx,expected", [
    (4, 32, None, "cpu-int4pack"), (4, 32, "actorder", "cpu-int4pack"), (4, 32, "ragged", "torch-dequant-matmul"),
    (8, -1, None, "cpu-int8pack"), (8, 64, None, "torch-dequant-matmul")])
def test_cpu_choice_and_result_bf16_model(monkeypatch, bits, group_size, g_idx, expected):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    m, p, b = _layer(bits, group_size, g_idx=g_idx, scale_dtype=torch.bfloat16)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert dispatch.choose(m, 6, x) == expected
    y = m(x)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    truth = _truth(x.reshape(6, 128), p, b)
    # bf16 output (2^-8 relative) plus bf16 scale*zero and weights inside the packed ops
    assert (y.reshape(6, 48).double() - truth).abs().max() <= 2e-2 * truth.abs().max()


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_cpu_float_activations_dequantise(monkeypatch, scale_dtype):
    """torch's packed ops are scalar (very slow) for fp32/fp16 activations, so those dequantise instead."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    m, p, b = _layer(4, 32, scale_dtype=scale_dtype)
    assert m._cpu_int4 is None  # no repack (and no second copy of the weight) for non-bf16 models
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(9))
    assert dispatch.choose(m, 5, x) == "torch-dequant-matmul"
    y = m(x)
    truth = _truth(x, p, b)
    # float32 end to end: accumulation-order differences only
    assert y.dtype == torch.float32 and (y.double() - truth).abs().max() <= 1e-5 * truth.abs().max()


@pytest.mark.parametrize("kernel,rows,expected", [("reference", 3, "reference"), ("triton", 3, "triton-gemv"),
                                                  ("triton", 7, "triton-gemm"),
                                                  ("torch", 3, "torch-dequant-matmul")])
def test_forced_kernels_agree(monkeypatch, kernel, rows, expected):
    monkeypatch.setenv(dispatch.ENV, kernel)
    m, p, b = _layer(seed=3)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(4)).half()
    assert dispatch.choose(m, rows, x) == expected
    y = m(x)
    assert y.dtype == torch.float16
    truth = _truth(x, p, b)
    # fp16 activations and output: 2^-11 rounding of the output plus fp16 weights inside the kernels
    assert (y.double() - truth).abs().max() <= 3e-3 * truth.abs().max()


def test_cpu_tensors_never_take_cuda_kernels(monkeypatch):
    """True on any machine: a CPU activation runs on the CPU whether or not a GPU and the extension exist."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    m, _, _ = _layer(seed=5)
    for rows in (1, 4, 64, 512):
        assert not dispatch.choose(m, rows, torch.zeros(rows, 128)).startswith("cuda")
    monkeypatch.setenv(dispatch.ENV, "cuda")
    with pytest.raises(UserError, match="QUANTKIT_KERNEL=cuda"):
        m(torch.randn(1, 128))


def test_cuda_not_ready_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    dispatch.cuda_ready.cache_clear()
    try:
        assert not dispatch.cuda_ready()
    finally:
        dispatch.cuda_ready.cache_clear()  # the real answer again for later tests


def _cpu_prepared_layer(bits=4, group_size=32):
    """A bf16 layer with torch's CPU packed weights built, as if it had been prepared on the CPU."""
    m, _, _ = _layer(bits, group_size, scale_dtype=torch.bfloat16, seed=21)
    m.cpu_bf16_activations = True
    assert (m._cpu_int4 if bits == 4 else m._cpu_int8) is not None
    return m


# (device, rows, dtype, cuda ops built, triton usable) -> path; decided by name, no device touched
@pytest.mark.parametrize("device,rows,dtype,cuda_ok,triton_ok,expected", [
    ("cpu", 1, torch.bfloat16, False, False, "cpu-int4pack"),
    ("cpu", 1, torch.float32, False, False, "cpu-int4pack"),  # the runtime's opt-in: bf16 inside
    ("cuda", 1, torch.bfloat16, True, True, "cuda-gemv"),
    ("cuda", 4, torch.float16, True, True, "cuda-gemv"),
    ("cuda", 1, torch.float32, True, True, "triton-gemv"),  # the CUDA GEMV is fp16/bf16 only
    ("cuda", 5, torch.float16, True, True, "triton-gemm"),
    ("cuda", 64, torch.bfloat16, True, True, "triton-gemm"),
    ("cuda", 65, torch.bfloat16, True, True, "triton-dequant-matmul"),
    ("cuda", 2, torch.float16, False, True, "triton-gemv"),
    ("cuda", 200, torch.float16, True, False, "cuda-dequant-matmul"),
    ("cuda", 1, torch.bfloat16, False, False, "torch-dequant-matmul"),
])
def test_decision_by_device(monkeypatch, device, rows, dtype, cuda_ok, triton_ok, expected):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    m = _cpu_prepared_layer()
    got = dispatch.decide(device, rows, dtype, m, None, cuda_ok=cuda_ok, triton_ok=triton_ok)
    assert got == expected
    if device == "cuda":  # FBGEMM / oneDNN layouts are host-only: never on a GPU, whatever else is missing
        assert not got.startswith("cpu-")


@pytest.mark.parametrize("forced", [None, "torch", "triton", "cuda", "reference"])
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_never_gets_cpu_layouts(forced, bits):
    m = _cpu_prepared_layer(bits, 32 if bits == 4 else -1)
    for rows in (1, 3, 16, 300):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            assert not dispatch.decide("cuda", rows, dtype, m, forced, cuda_ok=True, triton_ok=True).startswith("cpu-")


def test_forced_cuda_needs_the_ops_on_a_cuda_device():
    m = _cpu_prepared_layer()
    for device, ok in (("cpu", True), ("cuda", False)):
        with pytest.raises(UserError, match="QUANTKIT_KERNEL=cuda"):
            dispatch.decide(device, 1, torch.float16, m, "cuda", cuda_ok=ok, triton_ok=True)
    assert dispatch.decide("cuda", 9, torch.float16, m, "cuda", cuda_ok=True, triton_ok=True) == "cuda-tc"
    assert dispatch.decide("cuda", 65, torch.float16, m, "cuda", cuda_ok=True, triton_ok=True) == "cuda-dequant-matmul"
    m.weight_g_idx = torch.zeros(128, dtype=torch.int32)  # act-order: the tensor-core GEMM does not take it
    assert dispatch.decide("cuda", 9, torch.float16, m, "cuda", cuda_ok=True, triton_ok=True) == "cuda-dequant-matmul"
    # unforced, the unmeasured tensor-core GEMM is never chosen
    assert dispatch.decide("cuda", 9, torch.float16, m, None, cuda_ok=True, triton_ok=True) == "triton-gemm"


def test_bad_env_and_inputs(monkeypatch):
    m, _, _ = _layer(seed=6)
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(UserError, match="QUANTKIT_KERNEL"):
        m(torch.randn(1, 128))
    monkeypatch.delenv(dispatch.ENV)
    with pytest.raises(UserError, match="128 input features"):
        m(torch.randn(1, 64))
    with pytest.raises(UserError, match="float64"):
        m(torch.randn(1, 128, dtype=torch.float64))


def test_choice_logged_once_per_shape(monkeypatch, caplog):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    m, _, _ = _layer(n=64, k=256, seed=7)
    dispatch._logged.clear()
    with caplog.at_level(logging.INFO, logger="quantkit.kernels"):
        for rows in (1, 2, 5):
            m(torch.randn(rows, 256))
    lines = [r.getMessage() for r in caplog.records if r.name == "quantkit.kernels"]
    assert len(lines) == 1 and "torch-dequant-matmul" in lines[0] and "64x256" in lines[0]


def test_prepare_runs_lazily(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    p = make_packed(32, 64, 8, -1, True, seed=8, scale_dtype=torch.bfloat16)
    m = FakeQuantLinear(p)
    y = m(torch.randn(2, 64).bfloat16())
    assert m._cpu_int8 is not None and y.shape == (2, 32)
