"""The static FP8 input scale search (solvers/fp8_input_scale.py) against a brute-force float64 reference.

The reference rounds every calibration input through e4m3 by value (test_fp8_format.e4m3_round_ref, built from
the format's bit fields) at every candidate scale and scores the per-token relative, column-weighted squared
error exactly; the solver only keeps a histogram. The histogram's bins are at most 0.4% wide, so its
estimate of each candidate's error is off by a few percent at most on a few thousand values (stated below), and
the scale it picks must be within 1% of the reference optimum.
"""
from __future__ import annotations

import pytest
import torch

from quantkit.errors import UserError
from quantkit.schemes import get_scheme
from quantkit.solvers.base import SolveOptions
from quantkit.solvers.fp8 import FP8Solver
from quantkit.solvers.fp8_input_scale import INPUT_MARGIN, InputScale, candidate_scales
from test_fp8_format import e4m3_round_ref


def exact_objective(x: torch.Tensor, w: torch.Tensor, scale: float) -> float:
    """Σ over tokens of Σ_j c_j (q(x_tj) - x_tj)² / Σ_j c_j x_tj², c_j = |W[:, j]|², q = e4m3 round at `scale`."""
    x = x.double()
    c = w.double().pow(2).sum(0)
    err = (e4m3_round_ref(x / scale) * scale - x).pow(2) * c
    energy = (x * x * c).sum(1)
    keep = energy > 0
    return float((err.sum(1)[keep] / energy[keep]).sum())


def activations(g: torch.Generator, tokens: int = 96, width: int = 48) -> torch.Tensor:
    """RMSNorm-like inputs: heavy-tailed per-channel gains, two outlier channels of near-constant size (where the
    rounding phase matters most) and one sink token 40x larger than the rest."""
    gain = torch.exp(torch.randn(width, generator=g) * 0.7)
    x = torch.randn(tokens, width, generator=g) * gain
    x[:, 5] = 9.0 + 0.3 * torch.randn(tokens, generator=g)
    x[:, 17] = -6.5 + 0.2 * torch.randn(tokens, generator=g)
    x[0] *= 40
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_candidates_cover_one_octave_in_the_storage_dtype(dtype):
    base = float(torch.tensor(0.0123).to(dtype))
    c = candidate_scales(base, dtype)
    assert c[0] == base and (c[1:] > c[:-1]).all() and float(c[-1]) < 2 * base
    assert torch.equal(c.to(dtype).float(), c)  # stored as-is, no re-rounding when written
    per_octave = {torch.bfloat16: 128, torch.float16: 1024, torch.float32: 256}[dtype]
    assert len(c) == per_octave
    # the next value up is 2*base (the octave closes): the candidates are every value in between for 16-bit
    if dtype != torch.float32:
        nxt = torch.nextafter(c[-1:].to(dtype), torch.tensor([float("inf")], dtype=dtype)).float()
        assert float(nxt) == 2 * base


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chosen_scale_is_within_one_percent_of_the_brute_force_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    x = activations(g)
    w = torch.randn(32, x.shape[1], generator=g) * torch.exp(torch.randn(x.shape[1], generator=g) * 0.5)
    obs = InputScale("model.layers.0.self_attn.q_proj", w)
    for part in x.split(40):  # in batches, as the pipeline feeds it
        obs.add(part)
    scale, stats = obs.scale(torch.float32)
    cands = candidate_scales(float(scale.new_tensor(float(x.abs().amax()) * INPUT_MARGIN / 448)), torch.float32)
    exact = torch.tensor([exact_objective(x, w, float(s)) for s in cands])
    est = obs.errors(cands)
    # the histogram's estimate follows the exact score candidate by candidate (normalised to remove its scale)
    est_n, exact_n = est / est.mean(), exact / exact.mean()
    assert float((est_n - exact_n).abs().max()) < 0.05
    assert float(scale) in set(cands.tolist())
    chosen = exact_objective(x, w, float(scale))
    assert chosen <= float(exact.min()) * 1.01
    # and it is a real gain over the plain absmax-with-margin scale on these inputs
    assert chosen < exact_objective(x, w, float(cands[0])) * 0.97
    assert stats["input_scale_gain"] > 0.03 and stats["calib_tokens"] == x.shape[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scale_keeps_the_margin_and_is_representable(dtype):
    g = torch.Generator().manual_seed(7)
    x = activations(g)
    obs = InputScale("l", torch.randn(16, x.shape[1], generator=g))
    obs.add(x)
    scale, stats = obs.scale(dtype)
    amax = float(x.abs().amax())
    low = float(torch.tensor(amax * INPUT_MARGIN / 448).to(dtype))
    assert low <= float(scale) < 2 * low  # headroom of at least the margin, at most one octave more
    assert torch.equal(scale.to(dtype).float(), scale)
    assert stats["input_amax"] == pytest.approx(amax) and stats["input_margin"] == INPUT_MARGIN


def test_the_sink_token_does_not_decide_the_roundings():
    """Scores are relative per token: scaling one token up by 1000 (a sink) must not change the choice, where an
    absolute score would be ruled by that token's few large values."""
    g = torch.Generator().manual_seed(3)
    x = activations(g)
    w = torch.randn(16, x.shape[1], generator=g)
    picks = []
    for sink in (40.0, 4e4):
        y = x.clone()
        y[0] = y[0] / 40 * sink
        obs = InputScale("l", w)
        obs.add(y)
        cands = candidate_scales(1.0, torch.float32)  # fixed candidates: the amax moves with the sink
        picks.append(int(torch.argmin(obs.errors(cands))))
    assert abs(picks[0] - picks[1]) <= 1


def test_zero_inputs_and_padding_rows_are_handled():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    obs = InputScale("l", w)
    obs.add(torch.zeros(5, 16))
    scale, _ = obs.scale(torch.float16)
    assert float(scale) > 0 and torch.isfinite(scale).all()  # nothing seen: the floor scale, never zero
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    obs.add(torch.cat([x, torch.zeros(3, 16)]))  # padding rows add nothing and produce no NaN
    ref = InputScale("l", w)
    ref.add(x)
    assert torch.equal(obs.hist, ref.hist)
    assert torch.equal(obs.scale(torch.float16)[0], ref.scale(torch.float16)[0])


def test_errors_name_the_layer():
    obs = InputScale("model.layers.2.mlp.down_proj", torch.randn(4, 4))
    with pytest.raises(UserError, match="layers.2.mlp.down_proj.*fp8-dynamic"):
        obs.scale(torch.float16)
    with pytest.raises(UserError, match="layers.2.mlp.down_proj"):
        obs.add(torch.tensor([[1.0, float("nan"), 0.0, 2.0]]))


def test_static_solver_writes_the_searched_scale():
    g = torch.Generator().manual_seed(5)
    x = activations(g)
    w = torch.randn(24, x.shape[1], generator=g)
    solver = FP8Solver("model.layers.0.mlp.up_proj", w, get_scheme("fp8"), SolveOptions(scale_dtype=torch.bfloat16))
    obs = InputScale("model.layers.0.mlp.up_proj", w)
    for part in x.split(30):
        solver.add_batch(part)
        obs.add(part)
    qw = solver.solve()
    assert torch.equal(qw.input_scale, obs.scale(torch.bfloat16)[0])
    assert qw.stats["input_scale_gain"] >= 0


def test_merged_statistics_choose_the_scale_best_for_the_group():
    """q/k/v (gate/up) read one tensor and share one scale: the merged choice is within 1% of the brute-force
    optimum of the summed objective, and never worse on that sum than any member's own choice."""
    g = torch.Generator().manual_seed(11)
    x = activations(g)
    ws = [torch.randn(24, x.shape[1], generator=g) * torch.exp(torch.randn(x.shape[1], generator=g)) for _ in range(3)]
    parts = [InputScale(f"l{i}", w) for i, w in enumerate(ws)]
    for p in parts:
        for b in x.split(32):
            p.add(b)
    merged = parts[0].merged(parts[1:])
    assert torch.allclose(merged.hist, sum(p.hist for p in parts)) and merged.tokens == x.shape[0]
    assert parts[0].hist.sum() < merged.hist.sum()  # the parts are left as they were
    scale, _ = merged.scale(torch.float32)
    cands = candidate_scales(float(torch.tensor(float(x.abs().amax()) * INPUT_MARGIN / 448)), torch.float32)
    total = lambda s: sum(exact_objective(x, w, s) for w in ws)  # noqa: E731
    exact = torch.tensor([total(float(s)) for s in cands])
    assert total(float(scale)) <= float(exact.min()) * 1.01
    for p in parts:
        assert total(float(scale)) <= total(float(p.scale(torch.float32)[0])) * 1.01
    other = InputScale("l9", ws[0])
    other.add(x[:10])
    with pytest.raises(ValueError, match="same inputs"):
        parts[0].merged([other])


def test_float32_candidates_span_the_octave_evenly():
    base = 0.0123
    c = candidate_scales(base, torch.float32).double()
    steps = c[1:] / c[:-1]
    # 256 steps of 2^(1/256) from base: the last one is 2^(255/256) x base, the whole octave less one step
    assert float(c[0]) == pytest.approx(base, rel=1e-7)
    assert float(c[-1]) == pytest.approx(base * 2 ** (255 / 256), rel=1e-6)
    assert torch.allclose(steps, torch.full_like(steps, 2 ** (1 / 256)), rtol=1e-6)


def test_float16_scales_near_the_top_of_the_range_stay_finite():
    """A float32 model writes float16 scales; inputs of ~8e6 put the octave across float16's largest value."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 1e6
    x[0, 0] = 8e6
    obs = InputScale("model.layers.3.mlp.down_proj", torch.randn(4, 8))
    obs.add(x)
    scale, _ = obs.scale(torch.float16)
    assert torch.isfinite(scale).all() and float(scale) >= 8e6 * INPUT_MARGIN / 448 * (1 - 2 ** -10)
    obs.add(torch.full((1, 8), 3e7))  # beyond any float16 scale with the margin: a clear error, not inf
    with pytest.raises(UserError, match="layers.3.mlp.down_proj.*--dtype bfloat16"):
        obs.scale(torch.float16)


def test_large_batches_are_scored_in_chunks_with_the_same_result(monkeypatch):
    import quantkit.solvers.fp8_input_scale as fis

    g = torch.Generator().manual_seed(8)
    x = activations(g)
    w = torch.randn(16, x.shape[1], generator=g)
    whole = InputScale("l", w)
    whole.add(x)
    monkeypatch.setattr(fis, "_CHUNK_ELEMENTS", 5 * x.shape[1])  # 5 rows at a time
    chunked = InputScale("l", w)
    chunked.add(x)
    # each chunk's counts are summed in float32 before joining the float64 histogram: equal to float32 rounding
    assert torch.allclose(whole.hist, chunked.hist, rtol=1e-6, atol=0) and whole.tokens == chunked.tokens
    assert torch.equal(whole.hist > 0, chunked.hist > 0)
    assert float(whole.amax) == float(chunked.amax)


def test_share_inputs_touches_only_static_fp8_solvers():
    """A group may mix schemes (per-module targets): only the static FP8 members share statistics."""
    from quantkit.solvers.base import share_inputs
    from quantkit.solvers.fp8_gptq import FP8GPTQSolver
    from quantkit.solvers.rtn import RTNSolver

    g = torch.Generator().manual_seed(9)
    x = activations(g)
    w = [torch.randn(16, x.shape[1], generator=g) for _ in range(4)]
    q = FP8Solver("q", w[0], get_scheme("fp8"))
    k = FP8GPTQSolver("k", w[1], get_scheme("fp8"))
    v = FP8Solver("v", w[2], get_scheme("fp8-dynamic"))
    o = RTNSolver("o", w[3], get_scheme("w4a16"))
    for s in (q, k, v, o):
        s.add_batch(x)
    own_q = q.inputs
    share_inputs([q, k, v, o])
    assert q.inputs is k.inputs and q.inputs is not own_q and v.inputs is None
    assert torch.allclose(q.inputs.hist, own_q.hist + _stats(x, w[1]))  # q's and k's own, summed
    assert q.solve().input_scale.equal(k.solve().input_scale) and v.solve().input_scale is None


def _stats(x, w):
    s = InputScale("k", w)
    s.add(x)
    return s.hist


def test_a_bin_is_scored_at_its_midpoint():
    """One input per row, placed exactly at its bin's midpoint: the estimate is then exact, for any scale, against
    the float64 reference (so the bins are read off where add() puts them)."""
    g = torch.Generator().manual_seed(12)
    bins = torch.randint(110 << 8, 142 << 8, (40,), generator=g, dtype=torch.int32)  # exponents: |x| 2^-17 .. 2^15
    x = ((bins << 15) | (1 << 14)).view(torch.float32)
    obs = InputScale("l", torch.ones(1, 1))
    obs.add(x.reshape(-1, 1))
    scales = torch.tensor([0.37, 1.0, 3.3, 71.0])
    want = torch.tensor([float(((e4m3_round_ref(x.double() / s) * s - x.double()) / x.double()).pow(2).sum())
                         for s in scales.tolist()], dtype=torch.float64)
    assert torch.allclose(obs.errors(scales), want, rtol=1e-5)
