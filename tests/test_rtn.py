"""RTN against a float64 brute-force reference on small random matrices."""
import itertools

import pytest
import torch

from quantkit.schemes import PRESETS
from quantkit.solvers.rtn import rtn_quantize


def _reference(w: torch.Tensor, bits: int, sym: bool, gs: int, ratio: float = 1.0, full: bool = False):
    """Per group in float64: scale (and zero) from the range, then the code nearest each weight by enumeration.
    full: the symmetric full-range grid, the larger-magnitude end of the range (signed) on qmin."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    w = w.double()
    out = torch.empty_like(w)
    gs = w.shape[1] if gs == -1 else gs
    codes = torch.arange(qmin, qmax + 1, dtype=torch.float64)
    for r, g in itertools.product(range(w.shape[0]), range(w.shape[1] // gs)):
        x = w[r, g * gs:(g + 1) * gs]
        lo, hi = min(x.min().item(), 0.0) * ratio, max(x.max().item(), 0.0) * ratio
        if sym and full:
            scale = (hi if abs(hi) > abs(lo) else lo) / qmin
            zero = 0.0
        elif sym:
            scale = max(abs(lo), abs(hi)) / qmax
            zero = 0.0
        else:
            scale = (hi - lo) / (qmax - qmin)
            zero = min(max(round(qmin - lo / scale), qmin), qmax)
        scale = float(torch.tensor(scale).half())  # the writer stores fp16 scales; codes are solved against them
        grid = (codes - zero) * scale
        out[r, g * gs:(g + 1) * gs] = grid[(x[:, None] - grid[None, :]).abs().argmin(1)]
    return out


@pytest.mark.parametrize("bits,sym,gs", [(4, True, 16), (4, False, 16), (4, True, -1), (8, True, -1),
                                         (8, False, 32), (4, False, 32)])
def test_rtn_matches_bruteforce(bits, sym, gs):
    torch.manual_seed(bits * 100 + gs)
    w = torch.randn(6, 64) * torch.rand(6, 1) * 3  # rows with different ranges
    scheme = PRESETS["w4a16" if bits == 4 else "w8a16"].with_options(symmetric=sym, group_size=gs)
    qw = rtn_quantize(w, scheme)
    ref = _reference(w, bits, sym, gs)
    # float32 vs float64: the dequantised values are products of an fp16 scale and a small integer, exact in
    # both; only a weight lying within float32 rounding (~1e-7 relative) of a midpoint could pick a different
    # code, which random normal data does not hit. So the match is exact up to float32 representation.
    assert torch.allclose(qw.dequantize().double(), ref, rtol=1e-6, atol=1e-7)
    assert qw.q.min() >= scheme.qmin and qw.q.max() <= scheme.qmax


@pytest.mark.parametrize("name,gs", [("w4a16", 16), ("w4a16", -1), ("w3a16", 32), ("w2a16", 32)])
def test_full_range_matches_bruteforce_and_beats_the_plain_grid(name, gs):
    torch.manual_seed(7 + gs)
    w = torch.randn(8, 64) * torch.rand(8, 1) * 3
    w[0, :16] = w[0, :16].abs()  # a group with no negative weight: its positive maximum still lands on qmin
    scheme = PRESETS[name].with_options(group_size=gs, full_range=True)
    qw = rtn_quantize(w, scheme)
    ref = _reference(w, scheme.num_bits, True, gs, full=True)
    assert torch.allclose(qw.dequantize().double(), ref, rtol=1e-6, atol=1e-7)
    assert qw.q.min() == scheme.qmin and qw.q.max() <= scheme.qmax
    assert (qw.scale < 0).any() and (qw.scale > 0).any()  # the sign says which side the extreme was on
    # every group's largest-magnitude weight is on code qmin, so the grid's step is absmax / 2^(b-1)
    g = w.shape[1] if gs == -1 else gs
    wg, qg = w.reshape(8, -1, g), qw.q.reshape(8, -1, g)
    at = wg.abs().argmax(-1, keepdim=True)
    assert (torch.gather(qg, -1, at) == scheme.qmin).all()
    plain = rtn_quantize(w, scheme.with_options(full_range=False))
    mse = lambda q: float((q.dequantize() - w).pow(2).mean())  # noqa: E731
    # a finer step on the same codes: about (2^(b-1) - 1)^2 / 2^(2b-2) of the plain grid's squared error
    assert mse(qw) < 0.92 * mse(plain)


def test_full_range_clip_search_matches_best_ratio():
    torch.manual_seed(4)
    w = torch.randn(4, 64)
    w[:, 5] *= 8
    scheme = PRESETS["w4a16"].with_options(group_size=32, full_range=True)
    clipped = rtn_quantize(w, scheme, clip_search=True, clip_grid=20, clip_max_shrink=0.5)
    err = (clipped.dequantize() - w).pow(2).reshape(4, 2, 32).sum(-1).double()
    best = None
    for i in range(20):
        e = (_reference(w, 4, True, 32, 1.0 - 0.5 * i / 20, full=True) - w.double()).pow(2).reshape(4, 2, 32).sum(-1)
        best = e if best is None else torch.minimum(best, e)
    assert torch.allclose(err, best, rtol=1e-4, atol=1e-6)


def test_clip_search_never_worse_and_matches_best_ratio():
    torch.manual_seed(3)
    w = torch.randn(4, 64)
    w[:, 5] *= 8  # an outlier per row makes clipping worthwhile
    scheme = PRESETS["w4a16"].with_options(group_size=32)
    plain = rtn_quantize(w, scheme)
    clipped = rtn_quantize(w, scheme, clip_search=True, clip_grid=20, clip_max_shrink=0.5)
    err = lambda qw: (qw.dequantize() - w).pow(2).reshape(4, 2, 32).sum(-1)  # noqa: E731
    assert (err(clipped) <= err(plain) + 1e-6).all()
    assert err(clipped).sum() < err(plain).sum()
    # the search picks, per group, the best of the 20 ratios: check against brute force over the same ratios
    best = None
    for i in range(20):
        e = (_reference(w, 4, True, 32, 1.0 - 0.5 * i / 20) - w.double()).pow(2).reshape(4, 2, 32).sum(-1)
        best = e if best is None else torch.minimum(best, e)
    assert torch.allclose(err(clipped).double(), best, rtol=1e-4, atol=1e-6)


def test_zero_is_exact_asymmetric():
    torch.manual_seed(1)
    w = torch.rand(3, 32) + 0.5  # all positive: the range is extended to include 0
    w[0, 0] = 0.0
    qw = rtn_quantize(w, PRESETS["w4a16"].with_options(symmetric=False, group_size=32))
    assert qw.dequantize()[0, 0].item() == 0.0
