"""FP4 numerics against float64 references: the E2M1 grid and its ties, saturation and non-finite inputs, nibble
packing, E8M0 codes, NVFP4's two-level scales, the per-group scale search, and GPTQ onto the FP4 grid."""
from __future__ import annotations

import math

import pytest
import torch

from quantkit import fp4
from quantkit.schemes import get_scheme
from quantkit.solvers.fp4_grid import SHRINKS, fp4_quantize, search_scales
from quantkit.solvers.gptq import gptq_quantize
from test_fp8_format import e4m3_round_ref

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e2m1_round_ref(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value in float64, ties to the even mantissa (even index in GRID), saturating at ±6."""
    a = x.double().abs().clamp(max=6.0).reshape(-1, 1)
    d = (a - GRID.reshape(1, -1)).abs()
    tied = d == d.min(dim=1, keepdim=True).values
    idx = torch.arange(8)
    pref = torch.where(tied & (idx % 2 == 0), 0, torch.where(tied, 1, 2))
    return (GRID[pref.argmin(dim=1)] * x.double().sign().reshape(-1)).reshape(x.shape)


def test_round_matches_float64_reference_on_every_tie_and_random_values():
    g = torch.Generator().manual_seed(0)
    mids = (GRID[1:] + GRID[:-1]) / 2  # every exact tie
    x = torch.cat([GRID, mids, mids.nextafter(torch.tensor(10.0, dtype=torch.float64)),
                   mids.nextafter(torch.tensor(-1.0, dtype=torch.float64)),
                   torch.randn(5000, generator=g, dtype=torch.float64) * 3]).float()
    x = torch.cat([x, -x])
    assert torch.equal(fp4.round_e2m1(x).double(), e2m1_round_ref(x))
    # the ties by name: to the even mantissa, never away from zero
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert fp4.round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert fp4.round_e2m1(-ties).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]


def test_saturation_infinities_and_nan():
    x = torch.tensor([6.0, 6.5, 7.0, 100.0, 3e38, float("inf"), -7.0, float("-inf")])
    assert fp4.round_e2m1(x).tolist() == [6.0, 6.0, 6.0, 6.0, 6.0, 6.0, -6.0, -6.0]
    with pytest.raises(ValueError, match="NaN"):
        fp4.round_e2m1(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="finite"):
        fp4_quantize(torch.tensor([[1.0] * 15 + [float("inf")]]), get_scheme("nvfp4"))


def test_codes_and_packing_roundtrip_with_the_compressed_tensors_nibble_order():
    g = torch.Generator().manual_seed(1)
    vals = torch.cat([GRID, -GRID]).float()
    v = vals[torch.randint(0, 16, (6, 32), generator=g)]
    packed = fp4.pack(v)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 16)
    assert torch.equal(fp4.unpack(packed), v)
    # code = magnitude index | sign << 3; column 0 in the low nibble: [0.5, -6] -> 0x1 | 0xF << 4
    assert fp4.pack(torch.tensor([[0.5, -6.0]])).item() == 0xF1
    assert torch.signbit(fp4.unpack(fp4.pack(torch.tensor([[-0.0, 0.0]])))).tolist() == [[True, False]]
    with pytest.raises(ValueError, match="even"):
        fp4.pack(torch.zeros(2, 3))


def test_e8m0_codes_decode_to_powers_of_two_and_clamp():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    dec = fp4.e8m0_decode(codes)
    assert all(dec[c].item() == 2.0 ** (c - 127) for c in range(255))  # 2^-127 is a float32 subnormal, exact
    assert math.isnan(dec[255].item())
    exps = torch.tensor([-300, -127, -1, 0, 5, 127, 300])
    assert fp4.e8m0_encode(exps).tolist() == [0, 0, 126, 127, 132, 254, 254]


def test_mx_exponent_is_floor_log2_minus_two():
    g = torch.Generator().manual_seed(2)
    amax = torch.cat([torch.exp(torch.randn(2000, generator=g) * 5), torch.tensor([1.0, 4.0, 6.0, 8.0, 0.75])])
    ref = torch.floor(torch.log2(amax.double())) - 2
    assert torch.equal(fp4.mx_exponent(amax).double(), ref)
    assert fp4.mx_exponent(torch.tensor([0.0])).item() == -127  # all-zero group: the smallest scale


def test_nvfp4_two_level_scales_against_float64():
    g = torch.Generator().manual_seed(3)
    for amax in [1e-6, 0.003, 0.05, 0.7, 3.0, 1e3, 1e6]:
        gs = fp4.nvfp4_global_scale(torch.tensor(amax)).item()
        exp = math.floor(math.log2(448 * 6 / amax))
        assert gs == 2.0 ** max(-14, min(14, exp))
        # every group scale is amax_group * gs / 6 rounded to E4M3 (ties to even), in E4M3's range
        group_amax = torch.rand(500, generator=g, dtype=torch.float64) * amax
        got = fp4.nvfp4_group_scale(group_amax.float(), torch.tensor([gs]))
        ref = e4m3_round_ref((group_amax * gs / 6).float()).clamp(min=2.0 ** -9)
        assert torch.equal(got.double(), ref)
        assert got.max().item() <= 448
    assert fp4.nvfp4_global_scale(torch.tensor(0.0)).item() == 1.0


def _grouped_ref_error(w, scale, div, gs):
    """float64 squared error of each group of w when rounded to E2M1 under scale / div."""
    eff = (scale.double() / div).repeat_interleave(gs, dim=1)
    return ((e2m1_round_ref(w.double() / eff) * eff - w.double()) ** 2).reshape(w.shape[0], -1, gs).sum(-1)


def test_mxfp4_rounding_puts_each_groups_largest_value_in_3_5_to_7():
    w = torch.randn(16, 4 * 32, generator=torch.Generator().manual_seed(8)) * 0.05
    w[0, :32] = 0.0
    qw = fp4_quantize(w, get_scheme("mxfp4"))
    amax = w.reshape(16, 4, 32).abs().amax(-1).double()
    ratio = amax / qw.scale.double()
    live = amax > 0
    assert bool(((ratio >= 3.5) & (ratio < 7))[live].all())
    assert bool(torch.log2(qw.scale.double()).eq(torch.log2(qw.scale.double()).round()).all())  # powers of two
    # both branches occur: largest values in [3.5, 4) (one power up from the OCP rule) and in [4, 7)
    assert bool((ratio[live] < 4).any()) and bool((ratio[live] >= 4).any())
    assert torch.equal(qw.dequantize()[0, :32], torch.zeros(32))


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_rtn_search_picks_each_groups_best_candidate_and_dequantises_exactly(name):
    """nvfp4's rounding searches; mxfp4's search is GPTQ's (search_scales), checked here on the same weights."""
    scheme = get_scheme(name)
    gs = scheme.group_size
    w = torch.randn(24, 4 * gs, generator=torch.Generator().manual_seed(4)) * 0.05
    w[0, :gs] = 0.0  # an all-zero group stays zero
    qw = fp4_quantize(w, scheme)
    if name == "mxfp4":
        qw.scale = search_scales(w.reshape(24, 4, gs), scheme, None)
        qw.q = fp4.round_e2m1(w / qw.scale.repeat_interleave(gs, dim=1))
    div = 1.0 if qw.global_scale is None else qw.global_scale.double().item()
    assert (qw.global_scale is not None) == (name == "nvfp4")
    assert torch.equal(qw.q.double(), e2m1_round_ref(qw.q))  # on the grid
    deq_ref = qw.q.double() * (qw.scale.double() / div).repeat_interleave(gs, dim=1)
    assert torch.equal(qw.dequantize().double(), deq_ref)
    assert torch.equal(qw.dequantize()[0, :gs], torch.zeros(gs))
    amax = w.reshape(24, 4, gs).abs().amax(-1)
    if name == "nvfp4":
        cands = [fp4.nvfp4_group_scale(amax * r, qw.global_scale) for r in SHRINKS]
    else:
        e = torch.floor(torch.log2(amax.double().clamp_min(2.0 ** -200))) - 2
        cands = [torch.exp2(e).float(), torch.exp2(e + 1).float()]
    errs = torch.stack([_grouped_ref_error(w, c, div, gs) for c in cands])
    chosen = _grouped_ref_error(w, qw.scale, div, gs)
    assert torch.allclose(chosen, errs.min(0).values, rtol=1e-9, atol=0)
    # the search is not vacuous: it beats the first candidate (absmax / the OCP rule) on many groups
    assert int((chosen < errs[0] * (1 - 1e-9)).sum()) >= 10
    assert torch.equal(search_scales(w.reshape(24, 4, gs), scheme, qw.global_scale), qw.scale)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_gptq_on_the_fp4_grid_lowers_the_output_error(name):
    scheme = get_scheme(name)
    g = torch.Generator().manual_seed(5)
    n, out = 128, 48
    mix = torch.randn(n, n, generator=g) * 0.3 + torch.eye(n)  # correlated inputs, as real activations are
    x = torch.randn(2048, n, generator=g) @ mix
    H = 2 * x.t() @ x / x.shape[0]
    w = torch.randn(out, n, generator=g) * 0.05
    rtn = fp4_quantize(w, scheme)
    qw = gptq_quantize(w, H, scheme, block_size=32)
    assert torch.equal(qw.q.double(), e2m1_round_ref(qw.q))
    assert qw.scale.shape == (out, n // scheme.group_size)

    def out_err(d):
        return float(((d.double() - w.double()) @ x.double().t()).norm() / (w.double() @ x.double().t()).norm())

    assert out_err(qw.dequantize()) < 0.9 * out_err(rtn.dequantize())


def test_estimate_counts_fp4_codes_and_every_scale():
    from pathlib import Path

    from quantkit.evaluate.estimate import estimate, load_config, param_counts, shape_from_config

    cfg = load_config(str(Path(__file__).parent / "data" / "llama3_70b_config.json"))
    n = param_counts(shape_from_config(cfg))
    linears = 80 * 7  # 80 layers x q, k, v, o, gate, up, down
    r = estimate(cfg, "h100", ["nvfp4", "mxfp4"], context=8192)["precisions"]
    # half a byte per weight; nvfp4: an E4M3 byte per 16 and a float32 global scale per Linear, mxfp4: a byte per 32
    assert r["nvfp4"]["weight_bytes"] == n["linear"] // 2 + n["linear"] // 16 + 4 * linears + 2 * n["other"]
    assert r["mxfp4"]["weight_bytes"] == n["linear"] // 2 + n["linear"] // 32 + 2 * n["other"]


def test_nvfp4_activation_rounding_against_float64():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 64, generator=g) * torch.exp(torch.randn(5, 1, generator=g))
    x[0, :16] = 0.0  # an all-zero group
    gs = fp4.nvfp4_global_scale(x.abs().amax())
    got = fp4.nvfp4_fake_quantize(x, gs)
    xg = x.double().reshape(5, 4, 16)
    local = e4m3_round_ref((xg.abs().amax(-1, keepdim=True) / 6 * gs.double()).float()).clamp(min=2.0 ** -9)
    eff = local / gs.double()
    ref = (e2m1_round_ref(xg / eff) * eff).reshape(5, 64)
    assert torch.equal(got.double(), ref)
    assert torch.equal(got[0, :16], torch.zeros(16)) and not torch.equal(got, x)
