"""SmoothQuant: the fold keeps the float model on every architecture AWQ maps, the search lowers the W8A8 block
error, the alpha lands in the stats, and an unmapped architecture is a user error."""
from __future__ import annotations

import pytest
import torch

from quantkit.errors import UserError
from quantkit.models.hf import decoder_layers
from quantkit.capture import layer as capture
from quantkit.pipeline import quantize_model
from quantkit.plan import build_plan
from quantkit.recipe import Recipe
from quantkit.solvers.smoothquant import SmoothQuantTransform, fake_quantize_input, smooth_scales
from test_awq import ARCH_CONFIGS, rel, tiny_model

W8A8 = Recipe.model_validate({"quant": {"scheme": "w8a8", "smooth": True, "smoothquant": {"alpha": 0.5}}})


def _calib(n=2, length=16):
    return [torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(i)) for i in range(n)]


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_smoothing_fold_keeps_logits(arch):
    """A fixed alpha is always applied: every mapped group is folded, and the float model does not move."""
    model = tiny_model(arch)
    model.get_input_embeddings().weight.data[:, :3] *= 20  # outlier channels: scales far from 1
    ids = torch.stack(_calib())
    with torch.no_grad():
        before = model(ids).logits
    plan = build_plan(model, W8A8)
    t = SmoothQuantTransform(model, plan.smooth, torch.float32)
    names = {m: n for n, m in model.named_modules()}
    layers_name, layers = decoder_layers(model)
    inputs = capture.first_layer_inputs(model, layers, _calib(), "cpu")
    stats = {}
    for layer in layers:
        targets = {m: (names[m], plan.schemes[names[m]]) for m in layer.modules() if names.get(m) in plan.schemes}
        with torch.no_grad():
            stats.update(t.apply(0, layer, inputs, targets)["stats"])
            inputs = capture.LayerInputs(capture.run_layer(layer, inputs), inputs.kwargs)
    with torch.no_grad():
        after = model(ids).logits
    folded = [n for n, s in stats.items() if s.get("smooth_alpha") == 0.5]
    assert folded, stats
    assert rel(after, before) < 1e-5, arch
    first = decoder_layers(tiny_model(arch))[1][0]
    moved = max(rel(p, q) for p, q in zip(layers[0].parameters(), first.parameters()))
    assert moved > 0.05  # the weights really changed: the check above compares two different models


def test_scales_follow_the_definition():
    x, w = torch.tensor([4.0, 0.25, 1.0]), torch.tensor([0.5, 2.0, 1.0])
    s = smooth_scales(x, w, 0.75)
    assert torch.allclose(s.double(), x.double() ** 0.75 / w.double() ** 0.25)
    assert torch.equal(smooth_scales(x, w, 1.0), x)


def test_fake_quantised_input_per_token_and_per_tensor():
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    tok = fake_quantize_input(x, per_token=True)
    s = x.abs().amax(-1, keepdim=True).double() / 127
    assert torch.allclose(tok.double(), torch.round(x.double() / s) * s, atol=1e-6)
    ten = fake_quantize_input(x, per_token=False)
    assert len(torch.unique(torch.round(ten / (x.abs().max() / 127)))) <= 255


def test_search_lowers_the_w8a8_block_error_and_records_alpha():
    model = tiny_model("llama")
    model.get_input_embeddings().weight.data[:, :2] *= 30
    r = Recipe.model_validate({"quant": {"scheme": "w8a8", "smooth": True}})
    res = quantize_model(model, build_plan(model, r), _calib(4, 24))
    stats = {n: s for n, s in res.stats.items() if "smooth_block_error" in s}
    assert len(stats) >= 8
    for n, s in stats.items():
        assert s["smooth_block_error"] <= s["unsmoothed_block_error"], n
        assert s["smooth_alpha"] is None or 0 <= s["smooth_alpha"] <= 1
    qkv = stats["model.layers.0.self_attn.q_proj"]
    assert qkv["smooth_alpha"] and qkv["smooth_block_error"] < 0.5 * qkv["unsmoothed_block_error"]


def test_unmapped_architecture_is_a_user_error():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt_neox", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_hidden_layers=1, vocab_size=128)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(UserError, match="SmoothQuant has no scaling map for model type 'gpt_neox'"):
        SmoothQuantTransform(model)


def test_the_old_smooth_alpha_spelling_reaches_the_transform(tmp_path):
    """quant.smooth_alpha (YAML and --set) is now quant.smoothquant.alpha: same value in the plan's
    SmoothQuantOptions and the transform, with a warning naming the new key; without quant.smooth no options."""
    from quantkit.cli.quantize_cmd import _recipe
    from quantkit.recipe import load_recipe
    from quantkit.solvers.smoothquant_options import SmoothQuantOptions

    model = tiny_model("llama")
    path = tmp_path / "old.yaml"
    path.write_text("quant:\n  scheme: w8a8\n  smooth: true\n  smooth_alpha: 0.3\n", encoding="utf-8")
    with pytest.warns(FutureWarning, match="quant.smoothquant.alpha"):
        from_yaml = load_recipe(path)
    with pytest.warns(FutureWarning, match="quant.smoothquant.alpha"):
        from_set = _recipe(None, ["quant.smooth=true", "quant.smooth_alpha=0.3"], {"scheme": "w8a8"})
    for r in (from_yaml, from_set):
        plan = build_plan(model, r)
        assert plan.smooth == SmoothQuantOptions(alpha=0.3)
        assert SmoothQuantTransform(model, plan.smooth).alpha == 0.3
    assert build_plan(model, _recipe(None, ["quant.smoothquant.alpha=0.3"], {"scheme": "w8a8"})).smooth is None
    assert SmoothQuantTransform(model).alpha is None  # the options model's default: searched
