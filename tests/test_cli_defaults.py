"""Every solver with exactly the defaults `quantkit quantize` gives it: the recipe the CLI builds from its flags
(cli/quantize_cmd.py, `--method X` / `--scheme Y` / `--set`), through the plan, on a tiny model, checked against an
independent reference: a float64 grid written in the tests, or plain RTN's output error (at the CLI's defaults
too) on held-out tokens the calibration never saw. GPTQ's: tests/test_gptq.py
(test_default_gptq_a_user_gets_matches_the_float64_reference)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quantkit.cli.quantize_cmd import _recipe
from quantkit.pipeline import quantize_model
from quantkit.plan import build_plan
from test_awq import _layer_output_error, _rtn64, tiny_model
from test_fp8_format import e4m3_round_ref


def cli_plan(model, *sets: str, **flags):
    """The plan `quantkit quantize MODEL --FLAG VALUE ... --set FIELD=VALUE ...` builds for MODEL."""
    return build_plan(model, _recipe(None, list(sets), flags))


def _outlier_model(seed: int, layers: int = 1):
    """A random llama whose residual stream has three input channels 10-40x larger than the rest, as real LLM
    activations do; with calibration and held-out token ids drawn apart."""
    model = tiny_model("llama", seed=seed, layers=layers)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        cols = torch.randperm(64, generator=g)[:3]
        model.model.embed_tokens.weight[:, cols] *= 10 + 30 * torch.rand(3, generator=g)
    calib = [torch.randint(0, 128, (48,), generator=g) for _ in range(8)]
    held_out = torch.randint(0, 128, (4, 48), generator=g)
    return model, calib, held_out


def _quantised(model, calib, *sets, **flags):
    m = copy.deepcopy(model)
    plan = cli_plan(m, *sets, **flags)
    return m, plan, quantize_model(m, plan, calib)


def test_rtn_defaults_equal_the_float64_full_range_grid():
    """--method rtn: w4a16, the full-range grid, the group size the plan resolves, scales in the stored dtype;
    every Linear's dequantised weights equal the float64 grid written in test_gptq, but where w/scale is within
    float32 noise of a rounding tie."""
    model, _, _ = _outlier_model(0)
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    m, plan, res = _quantised(model, None, method="rtn")
    assert plan.method == "rtn" and set(res.qweights) == set(originals) - {"lm_head"}
    for name, qw in res.qweights.items():
        sch = plan.schemes[name]
        assert sch.full_range and sch.num_bits == 4
        ref = _rtn64(originals[name].double(), sch, plan.options.scale_dtype)
        scale = qw.scale.double().repeat_interleave(sch.group_size, 1)
        x = originals[name].double() / scale
        near_tie = ((x - torch.floor(x)) - 0.5).abs() < 1e-5
        got = qw.dequantize().double()
        assert near_tie.float().mean() < 1e-3
        torch.testing.assert_close(got[~near_tie], ref[~near_tie], rtol=1e-6, atol=1e-9)
        assert torch.equal(m.get_submodule(name).weight.detach().double(), got)  # the model holds what is written


@pytest.mark.parametrize("flags", [{"method": "awq"}, {"method": "signround"}, {}], ids=["awq", "signround", "auto"])
def test_calibrated_defaults_beat_rtn_defaults_on_held_out_tokens(flags):
    """--method awq, --method signround and no flag at all (auto) against --method rtn: the first layer's output
    error against the float model, on tokens the calibration never saw, in float64."""
    for seed in range(3):
        model, calib, held_out = _outlier_model(seed)
        err = {}
        for name, f in (("rtn", {"method": "rtn"}), ("solver", flags)):
            m, plan, _ = _quantised(model, calib, **f)
            err[name] = _layer_output_error(m, model, held_out)
        assert plan.method == flags.get("method", plan.method) and plan.method != "rtn"
        assert err["solver"] < 0.8 * err["rtn"], (seed, plan.method, err)


def _int8_per_token_inputs(model):
    """Forward pre-hooks that round every quantised Linear's input to INT8 with one scale per token (absmax / 127),
    as the W8A8 runtime does; written here, in float64, from the scheme's definition."""
    def hook(_m, args):
        x = args[0].double()
        s = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
        return (torch.clamp(torch.round(x / s), -128, 127) * s).to(args[0].dtype),

    return [m.register_forward_pre_hook(hook) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n != "lm_head"]


def test_smoothquant_defaults_beat_plain_w8a8_with_int8_activations():
    """--scheme w8a8 --set quant.smooth=true against --scheme w8a8: with the activations rounded per token to INT8
    (hooks written here), the first layer's output error on held-out tokens is lower with smoothing."""
    for seed in range(3):
        model, calib, held_out = _outlier_model(seed)
        with torch.no_grad():  # outliers large enough that per-token INT8 loses the other channels
            model.model.embed_tokens.weight[:, :2] *= 30
        err = {}
        for name, sets in (("plain", ()), ("smooth", ("quant.smooth=true",))):
            m, plan, _ = _quantised(model, calib, *sets, scheme="w8a8")
            assert (plan.smooth is not None) == (name == "smooth")
            hooks = _int8_per_token_inputs(m)
            err[name] = _layer_output_error(m, model, held_out)
            for h in hooks:
                h.remove()
        assert err["smooth"] < 0.8 * err["plain"], (seed, err)


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic"])
def test_fp8_defaults_equal_e4m3_rounding_of_the_absmax_scale(scheme):
    """--scheme fp8 (one weight scale per tensor, static input scale) and fp8-dynamic (per output channel): the
    scale is the absmax over 448 in the stored dtype, every code is the float64 E4M3 rounding of w / scale
    (test_fp8_format's table), and the static scheme gets an input scale."""
    model, calib, _ = _outlier_model(1)
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    _m, plan, res = _quantised(model, calib, scheme=scheme)
    assert len(res.qweights) == len(originals) - 1
    for name, qw in res.qweights.items():
        w = originals[name]
        amax = w.abs().amax().reshape(1) if scheme == "fp8" else w.abs().amax(1, keepdim=True)
        want = (amax.double() / 448).to(plan.options.scale_dtype).double()
        assert torch.equal(qw.scale.double().reshape(want.shape), want), name
        assert torch.equal(qw.q.double(), e4m3_round_ref(w / qw.scale.reshape(want.shape))), name
        if scheme == "fp8":
            assert qw.input_scale is not None and float(qw.input_scale) > 0
