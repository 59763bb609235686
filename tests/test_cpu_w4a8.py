"""The AVX2 W4A8 op (kernels/cpu_w4a8.py, cpu_w4a8.cpp): against float64 products it must match exactly where
the activations are already int8 on its grid, and stay within its documented error otherwise; wired into the
runtime it runs decode-sized products only, fuses exactly, and a CPU treated as without AVX2 never offers it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.kernels import cpu_w4a8, dispatch as kd
from quantkit.kernels.path_choice import relative_error
from quantkit.linear.fused import fuse
from quantkit.linear.path_candidates import W4A8_TOL
from quantkit.linear.quant import QuantLinear
from quantkit.testing.packed import make_packed

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not cpu_w4a8.available(), reason="needs an x86 CPU with AVX2 and g++")


def _module(n: int, k: int, group: int, symmetric: bool, seed: int = 0, bias: bool = False) -> tuple:
    p = make_packed(n, k, 4, group, symmetric, None, seed=seed, scale_dtype=torch.float32)
    m = QuantLinear(k, n, 4, group, symmetric=symmetric, bias=bias, dtype=torch.float32)
    m.weight_packed, m.weight_scale, m.weight_zero_point = p.args[:3]
    if bias:
        m.bias = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(seed)), requires_grad=False)
    kd.prepare(m)
    return m, p.w64


def _on_grid(rows: int, k: int, span: int, seed: int = 0) -> torch.Tensor:
    """Activations the op quantises without error: per block of SPAN inputs, int8 codes with one code at 127,
    times a power-of-two scale (so amax / 127 recovers it exactly)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, k), generator=g)
    q.view(rows, k // span, span)[..., 0] = 127
    scale = 2.0 ** torch.randint(-6, 2, (rows, k // span, 1), generator=g).float()
    return (q.view(rows, k // span, span).float() * scale).view(rows, k)


@pytest.mark.parametrize("n, k, group, symmetric", [(36, 256, 64, True), (33, 256, 32, False), (20, 512, 128, True),
                                                     (18, 256, -1, False)])
def test_activations_on_its_grid_give_the_float64_product(n, k, group, symmetric):
    """Every product of codes is an integer and every scale multiplication one float32 rounding: the result is the
    float64 product up to float32 accumulation (N not a multiple of 4 covers the remainder rows)."""
    m, w64 = _module(n, k, group, symmetric)
    pack = kd.w4a8_pack(m)
    x = _on_grid(3, k, 32)
    y = cpu_w4a8.matmul(pack, x)
    truth = x.double() @ w64.t()
    assert y.dtype == torch.float32 and relative_error(y, truth) < 2e-6


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("group, symmetric", [(64, True), (32, False), (128, False), (256, True)])
def test_any_activations_stay_within_the_rounding_bound(rows, group, symmetric):
    """Rounding moves each activation by at most half a step, amax(block) / 254, so |y - truth| is at most
    sum over blocks of 32 of amax / 254 * sum |w| in the block."""
    m, w64 = _module(96, 512, group, symmetric, seed=rows)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(7))
    x[:, 5] *= 20  # an outlier channel, as real activations have: its block's other inputs lose precision
    y = cpu_w4a8.matmul(kd.w4a8_pack(m), x)
    truth = x.double() @ w64.t()
    span = 32
    amax = x.double().abs().view(rows, -1, span).amax(-1)  # [rows, blocks]
    w_abs = w64.abs().view(96, -1, span).sum(-1)  # [n, blocks]
    bound = (amax / 254) @ w_abs.t() + 1e-5 * truth.abs().max()  # and float32 accumulation
    assert ((y.double() - truth).abs() <= bound).all()
    assert relative_error(y, truth) <= W4A8_TOL  # the path's tolerance in the runtime's float64 check


def test_the_runtime_runs_it_for_decode_rows_and_a_float_gemm_for_many():
    m, w64 = _module(64, 256, 64, False, bias=True)
    kd.use_cpu_path(m, "cpu-w4a8")
    assert m._cpu_int4 is None and m._cpu_w4a8 is not None
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y = m(x)
    want = torch.ops.quantkit_cpu.w4a8_matmul(x.reshape(3, 256), *(getattr(m._cpu_w4a8, f) for f in
                                                                    ("codes", "scale", "zero", "group")))
    assert torch.equal(y.reshape(3, 64), want + m.bias)
    # past MAX_ROWS: the weight dequantised in C++ (exact codes and scales) and a float32 product
    big = torch.randn(cpu_w4a8.MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert relative_error(m(big), big.double() @ w64.t() + m.bias.double()) < 1e-5
    out = torch.empty(64, 256)
    torch.ops.quantkit_cpu.w4a8_dequant_out(m._cpu_w4a8.codes, m._cpu_w4a8.scale, m._cpu_w4a8.zero, 64, out)
    assert torch.equal(out.double(), w64.float().double())


def test_fused_projections_give_each_modules_own_output():
    mods = [_module(n, 192, 64, False, seed=i)[0] for i, n in enumerate((64, 32, 32))]
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(3))
    for m in mods:
        kd.use_cpu_path(m, "cpu-w4a8")
    with torch.inference_mode():
        alone = [m(x) for m in mods]
        fused = fuse(mods, relayout=False)
        assert fused.sizes == [64, 32, 32]
        for a, b in zip(alone, fused(x)):
            assert torch.equal(a, b)
        for a, m in zip(alone, mods):  # each module now reads its rows of the stack
            assert torch.equal(a, m(x))
        prefill = torch.randn(cpu_w4a8.MAX_ROWS + 2, 192, generator=torch.Generator().manual_seed(4))
        for a, b in zip([m(prefill) for m in mods], fused(prefill)):
            assert torch.equal(a, b)


def test_a_cpu_without_avx2_does_not_offer_it():
    code = ("from quantkit.kernels import cpu_w4a8; import torch; "
            "print(torch.backends.cpu.get_cpu_capability(), cpu_w4a8.cpu_supported(), cpu_w4a8.available())")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["DEFAULT", "False", "False"]


def test_compiled_code_calls_the_op_and_gets_its_result():
    """`--compile` traces the op through its fake (shape and dtype only) and then runs the real one."""
    from quantkit.runtime import build

    # as compile_decode does: inductor's own cache mixes kernels built under other ISA caps (capped to AVX2
    # after an uncapped run, this product's elementwise tail came back with only its first 8 lanes doubled)
    build._inductor_cache_per_capability()
    m, _ = _module(64, 256, 64, True)
    kd.use_cpu_path(m, "cpu-w4a8")
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(lambda x: cpu_w4a8.matmul(m._cpu_w4a8, x) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), cpu_w4a8.matmul(m._cpu_w4a8, x) * 2)
