"""GPTQ onto the FP8 (E4M3) grid: against a float64 column-by-column reference, against absmax rounding, and
through the pipeline into a checkpoint (--scheme fp8|fp8-dynamic --method gptq)."""
from __future__ import annotations

import pytest
import torch

import quantkit
from quantkit.linear.fp8 import FP8Linear
from quantkit.plan import build_plan, solver_for
from quantkit.recipe import Recipe
from quantkit.schemes import get_scheme
from quantkit.solvers.fp8 import fp8_quantize
from quantkit.solvers.fp8_gptq import FP8GPTQSolver
from quantkit.solvers.gptq import gptq_quantize
from test_fp8_checkpoint import IDS, _model, _quantize
from test_fp8_format import e4m3_round_ref, e4m3_table
from test_gptq import correlated_inputs, hessian, out_err


def _tie_margin(a: torch.Tensor) -> float:
    """Smallest distance of |a| from a rounding boundary of the e4m3 grid, in units of the local grid spacing."""
    vals, _ = e4m3_table()
    a = a.double().abs().clamp(max=448.0).reshape(-1)
    mids = (vals[1:] + vals[:-1]) / 2
    gap = vals[1:] - vals[:-1]
    j = torch.searchsorted(mids, a).clamp(1, len(mids) - 1)
    near = torch.minimum((a - mids[j]).abs() / gap[j], (a - mids[j - 1]).abs() / gap[j - 1])
    return float(near.min())


def fp8_obq_reference(w, H, per_channel: bool, damp=0.01):
    """GPTQ as the paper states it, in float64: the absmax scale (per tensor or per row) is fixed from the
    original weights; each column is rounded to e4m3 (the float64 reference), its error is spread over the
    remaining columns through the inverse Hessian, and the column is removed by a rank-1 downdate."""
    W, H = w.double().clone(), H.double().clone()
    n = W.shape[1]
    amax = W.abs().amax(1, keepdim=True) if per_channel else W.abs().amax().reshape(1, 1)
    s = (amax / 448).float().double()  # the scale is stored in float32 here (scale_dtype float32)
    Hinv = torch.linalg.inv(H + damp * H.diagonal().mean() * torch.eye(n, dtype=torch.float64))
    deq = torch.zeros_like(W)
    margin = float("inf")
    for c in range(n):
        x = W[:, c:c + 1] / s
        margin = min(margin, _tie_margin(x))
        deq[:, c:c + 1] = e4m3_round_ref(x) * s
        err = (W[:, c] - deq[:, c]) / Hinv[c, c]
        W[:, c + 1:] -= torch.outer(err, Hinv[c, c + 1:])
        Hinv = Hinv - torch.outer(Hinv[:, c], Hinv[c, :]) / Hinv[c, c]
    return deq, s, margin


@pytest.mark.parametrize("name", ["fp8", "fp8-dynamic"])
@pytest.mark.parametrize("block", [3, 16])
def test_matches_float64_reference(name, block):
    sch = get_scheme(name)
    # as in test_gptq: skip seeds whose float64 run passes within 1e-4 grid steps of a rounding boundary,
    # where float32 noise (~1e-6 of a step after 16 columns of updates) may round the other way
    for seed in range(20):
        g = torch.Generator().manual_seed(500 + seed)
        x = correlated_inputs(g, 64, 16)
        w = torch.randn(8, 16, generator=g) * torch.exp(torch.randn(8, 1, generator=g))  # rows of unequal size
        H = hessian(x)
        deq, s, margin = fp8_obq_reference(w, H, per_channel=name == "fp8-dynamic")
        if margin > 1e-4:
            break
    else:
        pytest.fail("no tie-free seed found")
    qw = gptq_quantize(w, H, sch, block_size=block, scale_dtype=torch.float32)
    assert qw.q.dtype == torch.float8_e4m3fn
    assert tuple(qw.scale.shape) == ((8, 1) if name == "fp8-dynamic" else (1,))
    torch.testing.assert_close(qw.scale.double().reshape(-1, 1).expand(8, 1), s.expand(8, 1), rtol=0, atol=0)
    # same e4m3 values, same scales: the dequantised weights agree to float32 rounding of their products
    torch.testing.assert_close(qw.dequantize().double(), deq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["fp8", "fp8-dynamic"])
def test_output_error_below_absmax_rounding_in_95_percent_of_trials(name):
    sch = get_scheme(name)
    wins, trials = 0, 40
    for seed in range(trials):
        g = torch.Generator().manual_seed(seed)
        x = correlated_inputs(g, 256, 64)
        w = torch.randn(24, 64, generator=g)
        qw = gptq_quantize(w, hessian(x), sch, block_size=16)
        rtn = fp8_quantize(w, sch)
        assert torch.equal(qw.scale, rtn.scale)  # the same grid: only the rounding decisions differ
        wins += out_err(w, qw.dequantize(), x) < out_err(w, rtn.dequantize(), x)
    assert wins >= 38, f"GPTQ beat absmax rounding in only {wins}/{trials} trials"


def test_static_solver_keeps_the_input_scale_and_dynamic_one_needs_data():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 32, generator=g)
    assert solver_for("gptq", get_scheme("fp8")) is FP8GPTQSolver
    assert solver_for("gptq", get_scheme("fp8-dynamic")) is FP8GPTQSolver
    assert solver_for("awq+gptq", get_scheme("fp8")) is FP8GPTQSolver
    static = FP8GPTQSolver("l", w, get_scheme("fp8"))
    dyn = FP8GPTQSolver("l", w, get_scheme("fp8-dynamic"))
    x = correlated_inputs(g, 40, 32)
    big = float(x.abs().max()) * 3
    x[27, 3] = -big  # the largest input, in the second batch: the static scale must cover it
    for s in (static, dyn):
        s.add_batch(x[:20])
        s.add_batch(x[20:])
    qs, qd = static.solve(), dyn.solve()
    assert qs.input_scale is not None and big * 2 / 448 * 0.999 <= qs.input_scale.item() < big * 4 / 448  # margin 2
    assert qs.stats["calib_tokens"] == 40 and qs.stats["damp"] == 0.01
    assert qd.input_scale is None
    # dynamic with gptq reads calibration data, which rounding alone does not
    model = _model()
    for method, want in (("rtn", False), ("gptq", True)):
        recipe = Recipe.model_validate({"quant": {"scheme": "fp8-dynamic", "method": method}})
        assert build_plan(model, recipe).needs_data is want


def test_solver_without_tokens_falls_back_to_absmax_rounding():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    qw = FP8GPTQSolver("l", w, get_scheme("fp8-dynamic")).solve()
    assert torch.equal(qw.q.float(), fp8_quantize(w, get_scheme("fp8-dynamic")).q.float())
    assert qw.stats["fallback"] == "rtn"


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic"])
def test_checkpoint_round_trip_with_gptq(tmp_path, scheme):
    model = _model(seed=2)
    ref_rtn = _quantize(tmp_path / "rtn", _model(seed=2), {"scheme": scheme})
    # no held-out guard: on this tiny random model it may keep RTN's codes, and GPTQ's are what is tested here
    res = _quantize(tmp_path / "out", model, {"scheme": scheme, "method": "gptq"}, {"holdout": 0})
    ours = quantkit.load(tmp_path / "out", dtype=torch.float32, exact=True)
    assert sum(isinstance(m, FP8Linear) for m in ours.modules()) == 14
    name = "model.layers.0.mlp.down_proj"
    loaded = dict(ours.named_modules())[name]
    qw = res.qweights[name]
    assert torch.equal(loaded.weight.float(), qw.q.float())
    assert torch.equal(loaded.dequantized_weight(), qw.dequantize())
    # GPTQ moved some roundings away from nearest, so the codes differ from absmax rounding's
    assert not torch.equal(qw.q.float(), ref_rtn.qweights[name].q.float())
    assert (scheme == "fp8") == (loaded.input_scale is not None)
    with torch.no_grad():
        assert torch.isfinite(ours(IDS).logits).all()


@pytest.mark.parametrize("scheme", ["w4a16", "fp8-dynamic", "fp8"])
def test_gptq_on_a_head_outside_the_decoder_layers_rounds_on_the_schemes_grid(scheme):
    """An un-ignored lm_head sees no captured activations: it is rounded to nearest on its own grid, and a static
    fp8 head, which would need its inputs for an input scale, is refused naming it."""
    from quantkit.errors import UserError
    from quantkit.pipeline import quantize_model
    from quantkit.solvers.rtn import rtn_quantize
    from test_fp8_checkpoint import _samples

    model = _model(seed=4)
    head = model.lm_head.weight.detach().float().clone()
    recipe = Recipe.model_validate({"quant": {"scheme": scheme, "method": "gptq", "ignore": [],
                                              **({"group_size": 32} if scheme == "w4a16" else {})}})
    if scheme == "fp8":
        with pytest.raises(UserError, match="lm_head"):
            quantize_model(model, build_plan(model, recipe), _samples())
        return
    plan = build_plan(model, recipe)
    qw = quantize_model(model, plan, _samples()).qweights["lm_head"]
    # the head's own grid: the plan's scheme for it (a full-range 4-bit grid by default)
    assert plan.schemes["lm_head"].full_range == (scheme == "w4a16")
    want = fp8_quantize(head, get_scheme(scheme)) if scheme == "fp8-dynamic" else \
        rtn_quantize(head, get_scheme(scheme).with_options(group_size=32, full_range=True))
    assert torch.equal(qw.q.float(), want.q.float()) and torch.equal(qw.scale, want.scale)
