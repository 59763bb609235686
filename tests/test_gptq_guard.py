"""GPTQ's held-out guard (issue 23.2): act-order and GPTQ itself are checked on calibration samples kept out of
the Hessian, and a Linear keeps GPTQ-as-asked, GPTQ without act-order or RTN, whichever does best there."""
import pytest
import torch

from test_awq import tiny_model
from quantkit.pipeline import quantize_model
from quantkit.plan import build_plan
from quantkit.recipe import Recipe
from quantkit.schemes import Scheme
from quantkit.solvers.base import SolveOptions
from quantkit.solvers.gptq import gptq_quantize
from quantkit.solvers.gptq_solver import GPTQSolver
from quantkit.solvers.gptq_options import GPTQOptions
from quantkit.solvers.gptq_guard import choose
from quantkit.solvers.rtn import rtn_quantize

W4 = Scheme("w4a16", 4, "int", True, 32)
OPTS = SolveOptions(scale_dtype=torch.float32)
# the guard judged on the Hessian as measured; with the decorrelation prior: test_a_gptq_winner_is_refitted_...
GPTQ = GPTQOptions(actorder="weight", prior_tokens=0)


def _err64(w, deq, H):
    """tr(D H Dᵀ) / tr(W H Wᵀ) in float64: the reference the guard's choice is checked against."""
    w, d, H = w.double(), (w - deq).double(), H.double()
    return float(((d @ H) * d).sum() / ((w @ H) * w).sum())


def _balanced(x):
    """Each token scaled to unit RMS, as integer GPTQ's Hessian takes it."""
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def _mixing(seed):
    """Correlated channels (as real activations have), the correlation GPTQ's compensation exploits."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(64, 64, generator=gen) / 8 + torch.eye(64)


def _solve(search_mix, hold_mix, seed=0, prior=0):
    """GPTQSolver fed four search batches and two held-out batches; returns w, its result and the batches."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 64, generator=gen)
    s = GPTQSolver("lin", w, W4, OPTS, GPTQOptions(actorder="weight", prior_tokens=prior))
    search = [torch.randn(64, 64, generator=gen) @ search_mix for _ in range(4)]
    hold = [torch.randn(64, 64, generator=gen) @ hold_mix for _ in range(2)]
    for x in search:
        s.add_batch(x)
    for x in hold:
        s.add_holdout(x)
    return w, s.solve(), search, hold


def _hessian64(xs, prior=0):
    """The balanced tokens' Hessian, its off-diagonal part scaled by tokens / (prior + tokens)."""
    x = _balanced(torch.cat(xs).double())
    H = 2 * x.t() @ x / x.shape[0]
    H[~torch.eye(H.shape[0], dtype=torch.bool)] *= x.shape[0] / (prior + x.shape[0])
    return H


def _expected(w, search, hold, prior=0):
    """The guard's rule recomputed here: the three candidates from the search tokens' Hessian, each one's output
    error on the held-out tokens (as measured) in float64, the lowest kept (act-order weight, what was asked, on a
    tie); a GPTQ winner solved again from every token in its own order. PRIOR: the solves' decorrelation prior.
    Returns (label, errors, dequantised weights)."""
    H = _hessian64(search, prior).float()
    cands = {"act-order weight": gptq_quantize(w, H, W4, actorder="weight", scale_dtype=torch.float32),
             "act-order off": gptq_quantize(w, H, W4, scale_dtype=torch.float32),
             "rtn": rtn_quantize(w, W4, scale_dtype=torch.float32)}
    errors = {k: _err64(w, q.dequantize(), _hessian64(hold)) for k, q in cands.items()}
    label = min(errors, key=errors.get)
    runner_up = min(v for k, v in errors.items() if k != label)
    assert runner_up > errors[label] * (1 + 1e-3), errors  # a clear winner: float32 noise cannot swap it
    if label == "rtn":
        return label, errors, cands["rtn"].dequantize()
    refit = gptq_quantize(w, _hessian64(search + hold, prior).float(), W4, scale_dtype=torch.float32,
                          actorder="weight" if label == "act-order weight" else None)
    return label, errors, refit.dequantize()


def test_choose_keeps_the_lowest_held_out_error_measured_in_float64():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=gen)
    x = torch.randn(256, 64, generator=gen) @ _mixing(1)
    H, H_hold = 2 * x[:192].t() @ x[:192] / 192, x[192:].double().t() @ x[192:].double()
    cands = {"act-order weight": gptq_quantize(w, H, W4, actorder="weight", scale_dtype=torch.float32),
             "act-order off": gptq_quantize(w, H, W4, scale_dtype=torch.float32),
             "rtn": rtn_quantize(w, W4, scale_dtype=torch.float32)}
    label, qw = choose(w, H_hold.float(), ("act-order weight", cands["act-order weight"]),
                       [(k, lambda k=k: cands[k]) for k in ("act-order off", "rtn")])
    ref = {k: _err64(w, q.dequantize(), H_hold) for k, q in cands.items()}
    assert label == min(ref, key=ref.get) and qw is cands[label]
    assert all(abs(qw.stats["held_out_error"][k] - v) <= 1e-4 * v for k, v in ref.items())
    assert (qw.stats["gptq_guard"] is None) == (label == "act-order weight")


@pytest.mark.parametrize("prior", [0, 256])
def test_a_gptq_winner_is_refitted_on_every_token(prior):
    """With a decorrelation prior, the candidates are solved with the share 256 search tokens give and the refit
    with the share of all 384."""
    w, qw, search, hold = _solve(_mixing(1), _mixing(1), prior=prior)  # held-out like calibration: GPTQ wins
    label, _errors, want = _expected(w, search, hold, prior)
    assert label != "rtn" and qw.stats["holdout_tokens"] == 128 and qw.stats["tokens"] == 384
    assert qw.stats["hessian_decorrelate"] == round(prior / (prior + 384), 4)
    torch.testing.assert_close(qw.dequantize(), want, rtol=0, atol=1e-5)
    # and it is not the fit from the 256 calibration tokens alone
    alone = gptq_quantize(w, _hessian64(search, prior).float(), W4, scale_dtype=torch.float32,
                          actorder="weight" if label == "act-order weight" else None)
    assert not torch.equal(qw.dequantize(), alone.dequantize())


def test_rtn_wins_when_the_held_out_text_weighs_other_channels():
    """GPTQ pushes every column's error onto the columns the calibration Hessian says matter least; when the
    held-out inputs live exactly there, plain rounding is better, and the guard must see it."""
    a, b = torch.ones(64), torch.ones(64)
    a[32:], b[:32] = 0.01, 0.01  # calibration text uses the first half of the channels, held-out text the rest
    w, qw, search, hold = _solve(torch.diag(a) @ _mixing(1), torch.diag(b) @ _mixing(1))
    label, errors, want = _expected(w, search, hold)
    assert label == "rtn", errors  # the float64 errors say so: the setting is what the test claims
    assert torch.equal(qw.dequantize(), want) and qw.stats["gptq_guard"].startswith("rtn")
    assert qw.stats["tokens"] == 256  # RTN's result: the held-out tokens were never folded in


def test_gptq_is_kept_when_held_out_text_is_like_the_calibration_text():
    for seed in range(3):
        w, qw, search, hold = _solve(_mixing(1), _mixing(1), seed=seed)
        label, errors, want = _expected(w, search, hold)
        assert label != "rtn", errors
        torch.testing.assert_close(qw.dequantize(), want, rtol=0, atol=1e-5)
        assert (qw.stats["gptq_guard"] is None) == (label == "act-order weight")


def test_pipeline_sends_the_last_samples_to_the_guard():
    samples = [torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(5)]

    def stats(holdout):
        recipe = Recipe.model_validate({"quant": {"method": "gptq", "group_size": 32},
                                        "calibration": {"holdout": holdout}})
        m = tiny_model("llama", layers=1)
        return quantize_model(m, build_plan(m, recipe), samples).stats["model.layers.0.mlp.down_proj"]

    guarded, plain = stats(0.2), stats(0.0)
    assert guarded["holdout_tokens"] == 16  # one of five samples held out (which one wins: the tests above)
    assert set(guarded["held_out_error"]) == {"act-order weight", "act-order off", "rtn"}
    assert plain["tokens"] == 80 and "held_out_error" not in plain and "holdout_tokens" not in plain
