"""Fused q/k/v and gate/up projections: same numbers as the separate modules, weights held once."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from quantkit.testing.packed import make_packed
from quantkit.linear.quant import QuantLinear
from quantkit.linear.fused import fuse


def _quant_linear(n: int, k: int, seed: int, g_idx=None, bias=False) -> QuantLinear:
    p = make_packed(n, k, 4, 32, symmetric=seed % 2 == 0, g_idx=g_idx, seed=seed)
    m = QuantLinear(k, n, 4, 32, symmetric=seed % 2 == 0, has_g_idx=g_idx is not None, bias=bias,
                    dtype=torch.float32)
    m.weight_packed, m.weight_scale = p.weight_packed, p.weight_scale.float()
    m.weight_zero_point, m.weight_g_idx = p.weight_zero_point, p.g_idx
    if bias:
        m.bias = nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(seed)), requires_grad=False)
    m.cpu_bf16_activations = True  # as the runtime loader sets it
    return m


@pytest.mark.parametrize("bias", [False, True])
def test_fused_int4_equals_separate_modules_bit_for_bit(bias):
    mods = [_quant_linear(n, 64, seed, bias=bias) for seed, n in enumerate((128, 64, 64))]
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        want = [m(x) for m in mods]
        fused = fuse(mods, relayout=True)
        got = fused(x)
        after = [m(x) for m in mods]
    assert fused.sizes == [128, 64, 64]  # one packed call, not the fallback
    for g, w, a in zip(got, want, after):
        # torch's int4 layout keeps output rows independent, so stacking the packs changes no number
        assert torch.equal(g, w) and torch.equal(a, w)
    stacked = mods[0]._cpu_int4.packed
    # each module now reads its rows of one stacked pack: the weights are held once
    assert mods[1]._cpu_int4.packed.data_ptr() == stacked.data_ptr() + stacked.stride(0) * 128
    assert not torch.equal(got[1], got[2])  # different weights really went into each part


def test_packs_whose_rows_do_not_stack_are_not_fused():
    """torch's int4 layout interleaves rows in blocks; a 32-row module does not stack on this CPU (64-row
    blocks), and the probe must catch it rather than return wrong numbers."""
    mods = [_quant_linear(n, 64, seed) for seed, n in enumerate((64, 32, 32))]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = [m(x) for m in mods]
        got = fuse(mods, relayout=True)(x)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_act_order_modules_are_not_fused_but_still_right():
    mods = [_quant_linear(64, 64, 0, g_idx="actorder"), _quant_linear(32, 64, 2)]
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = [m(x) for m in mods]
        fused = fuse(mods, relayout=True)
        got = fused(x)
    assert fused.sizes is None  # separate calls: the permuted pack cannot share one call
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("n_out,dtype", [((96, 32, 32), torch.float32), ((16, 8), torch.float32),
                                         ((96, 32, 32), torch.bfloat16)])
def test_fused_float_matches_and_shares_storage(n_out, dtype):
    torch.manual_seed(0)
    mods = [nn.Linear(64, n, bias=True).to(dtype) for n in n_out]
    x = torch.randn(4, 64, dtype=dtype)
    with torch.no_grad():
        want = [m(x) for m in mods]
        fused = fuse(mods, relayout=True)
        got = fused(x)
        after = [m(x) for m in mods]
    # float32 keeps ~7 significant digits; a different MKL kernel may sum in another order: 1e-5 relative
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for g, w, a in zip(got, want, after):
        assert torch.allclose(g.float(), w.float(), rtol=tol, atol=tol)
        assert torch.allclose(a.float(), w.float(), rtol=tol, atol=tol)
    base = mods[0].weight.data_ptr()
    ends = [m.weight.data_ptr() for m in mods]
    span = sum(n_out) * 64 * mods[0].weight.element_size()
    assert all(base <= p < base + span for p in ends)  # one storage, no copy kept beside it


def test_float_weights_stay_as_they_are_without_relayout():
    """A model the runtime did not load keeps its weights: float projections are then called one by one."""
    torch.manual_seed(1)
    mods = [nn.Linear(64, n) for n in (96, 32)]
    before = [m.weight for m in mods]
    x = torch.randn(2, 64)
    with torch.no_grad():
        fused = fuse(mods, relayout=False)
        got = fused(x)
        assert fused.sizes is None and all(torch.equal(g, m(x)) for g, m in zip(got, mods))
    assert all(m.weight is w and w.is_contiguous() for m, w in zip(mods, before))
