"""AWQ's held-out guard: a scale or clip that loses to plain RTN on calibration samples the search never saw
is dropped (issue 23: AWQ must never do worse than RTN because it fitted its calibration text)."""
import torch

from test_awq import tiny_model
from quantkit.models.hf import decoder_layers
from quantkit.capture import layer as capture
from quantkit.schemes import Scheme
from quantkit.solvers.awq_clip import clip_error
from quantkit.solvers.awq_guard import guard_clip, scale_guard
from quantkit.solvers.awq_maps import map_for

W4 = Scheme("w4a16", 4, "int", True, 32)


def test_guard_clip_undoes_exactly_the_clips_that_hurt_on_held_out_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    ratio = torch.full((16, 2), 0.7)
    # held-out inputs only on each row-group's largest-|w| column: clipping that weight can only add error
    # there, while at ratio 1 the absmax weight is exactly on the grid (symmetric RTN)
    gram = torch.zeros(2, 32, 32)
    for gi in range(2):
        k = int(w[:, gi * 32:(gi + 1) * 32].abs().amax(0).argmax())
        gram[gi, k, k] = 1.0
    out, reverted = guard_clip(w, ratio, gram, W4, torch.float32)
    hurt = clip_error(w, gram, W4, ratio, torch.float32) > clip_error(w, gram, W4, 1.0, torch.float32)
    assert hurt.any() and reverted == int(hurt.sum())
    assert torch.equal(out, torch.where(hurt, torch.ones_like(ratio), ratio))
    # inputs spread evenly over every column: the searched-for case, where a mild clip usually helps
    even = torch.eye(32).expand(2, 32, 32).clone()
    out2, _ = guard_clip(w, torch.full((16, 2), 0.9), even, W4, torch.float32)
    kept = clip_error(w, even, W4, out2, torch.float32) <= clip_error(w, even, W4, 1.0, torch.float32)
    assert kept.all()  # whatever the guard keeps never raises the held-out error


def test_scale_guard_drops_a_scale_that_loses_on_held_out_samples():
    model = tiny_model("llama")
    layer = decoder_layers(model)[1][0]
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(4))
    hold = capture.first_layer_inputs(model, decoder_layers(model)[1], list(ids), "cpu")
    group = map_for(model.config).groups[2]  # post-attention norm -> gate/up, measured on the MLP
    linears = {n: layer.get_submodule(n) for n in group.linears}
    quantised = {n: W4 for n in linears}
    block = layer.get_submodule(group.block)
    assert scale_guard(layer, block, group, linears, quantised, hold, torch.ones(64), torch.float32) is None
    wild = torch.exp(torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3)  # scales spanning ~1e5
    why = scale_guard(layer, block, group, linears, quantised, hold, wild, torch.float32)
    assert why is not None and why.startswith("rtn scales: held-out error")


def test_min_gain_keeps_the_mildest_alpha_near_the_best():
    from quantkit.solvers.awq import pick_alpha

    errors = {0.0: 1.0, 0.25: 0.8, 0.5: 0.62, 0.75: 0.6, 1.0: 0.7}
    cands = [(a, torch.full((4,), 2.0 + a)) for a in errors]  # no candidate is s = 1 itself
    err = lambda s: 1.1 if bool((s == 1).all()) else errors[round(float(s[0]) - 2.0, 2)]  # noqa: E731
    assert pick_alpha(err, cands)[0] == 0.75
    assert pick_alpha(err, cands, min_gain=0.05)[0] == 0.5  # 0.62 <= 0.6 * 1.05
    alpha, s, e, base = pick_alpha(err, cands, min_gain=0.5)
    assert (alpha, e, base) == (0.25, 0.8, 1.1) and torch.equal(s, cands[1][1])  # 0.8 <= 0.9, 1.0 is not
    worse = {a: 1.2 for a in errors}  # nothing beats s = 1: no alpha, whatever the min_gain
    assert pick_alpha(lambda s: 1.1 if bool((s == 1).all()) else worse[round(float(s[0]) - 2.0, 2)], cands,
                      min_gain=0.5)[0] is None
