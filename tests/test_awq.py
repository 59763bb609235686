"""AWQ: exact folding on every mapped architecture, lower block error than RTN on layers with outlier channels,
and the unmapped-architecture paths (the clip search: test_awq_clip.py)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from quantkit.capture import layer as capture
from quantkit.errors import UserError
from quantkit.models.hf import decoder_layers
from quantkit.pipeline import quantize_model
from quantkit.plan import build_plan
from quantkit.recipe import Recipe
from quantkit.formats.moe_names import is_router
from quantkit.models.moe import unfuse_experts
from quantkit.schemes import Scheme
from quantkit.solvers.awq import AWQTransform, normalised_scales, weight_profile
from quantkit.solvers.awq_options import AWQOptions
from quantkit.solvers.awq_block import _GroupData, block_error, fake_quantize, measured_copy
from quantkit.solvers.awq_fold import fold_scales, prev_width
from quantkit.solvers.awq_maps import ScaleGroup, map_for, mapped_architectures


# kv heads == heads so that v -> o is folded too (grouped-query attention skips it; tested separately)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=4)
ARCH_CONFIGS = {
    "llama": dict(hidden_size=64, intermediate_size=128, **_ATTN),
    "mistral": dict(hidden_size=64, intermediate_size=128, **_ATTN),
    "qwen2": dict(hidden_size=64, intermediate_size=128, **_ATTN),
    "qwen3": dict(hidden_size=64, intermediate_size=128, head_dim=16, **_ATTN),
    "gemma": dict(hidden_size=64, intermediate_size=128, head_dim=16, **_ATTN),
    "gemma2": dict(hidden_size=64, intermediate_size=128, head_dim=16, **_ATTN),
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, head_dim=16, sliding_window=8, **_ATTN),
    "phi3": dict(hidden_size=64, intermediate_size=128, pad_token_id=0, **_ATTN),
    "opt": dict(hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64),
    # mixture-of-experts: 4 experts, top-2, split into Linears (models/moe.py); the router takes the scale too
    "qwen3_moe": dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16,
                      mlp_only_layers=[], experts_implementation="eager", **_ATTN),
    "olmoe": dict(hidden_size=64, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                  experts_implementation="eager", **_ATTN),
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                    experts_implementation="eager", **_ATTN),
    "qwen2_moe": dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=64, mlp_only_layers=[], experts_implementation="eager",
                      **_ATTN),
}


def tiny_model(arch: str, seed: int = 0, layers: int = 2, **over):
    """A random float32 model whose norms and biases are random too, so folding into them is exercised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**ARCH_CONFIGS[arch], **over}
    cfg = AutoConfig.for_model(arch, vocab_size=128, num_hidden_layers=layers, max_position_embeddings=128, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
            else:  # norm gains and biases: away from 0 and from 1, different per channel
                p.uniform_(0.5, 1.5)
    unfuse_experts(model)
    return model


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_every_requested_architecture_is_mapped():
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "opt"):
        assert arch in mapped_architectures()
    assert set(ARCH_CONFIGS) == set(mapped_architectures()), "every mapped architecture needs a fold test"


# ---------------------------------------------------------------------------------------------------------------
# Requirement 3: folding keeps the float model's function


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_folding_random_scales_keeps_logits(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    arch_map = map_for(model.config)
    g = torch.Generator().manual_seed(2)
    folded = 0
    for layer in decoder_layers(model)[1]:
        for group in arch_map.groups:
            width = layer.get_submodule(group.linears[0]).weight.shape[-1]  # routers are not Linears
            assert prev_width(layer, group) == width, f"{arch}: {group.prev} does not feed {group.linears}"
            # scales spanning ~20x, like real AWQ scales, so a wrong fold cannot hide in rounding
            s = torch.exp(torch.randn(width, generator=g) * 0.75)
            fold_scales(layer, group, s, arch_map.norm_offset)
            folded += 1
    with torch.no_grad():
        after = model(ids).logits
    assert folded == 2 * len(arch_map.groups) and len(arch_map.groups) >= 4
    # float32 rounding of one multiply and one divide per weight, through two layers: ~1e-6 relative
    assert rel(after, before) < 1e-5, arch
    # and the weights really moved: the check above is not comparing a model with itself
    q_like = decoder_layers(model)[1][0].get_submodule(arch_map.groups[0].linears[0]).weight
    fresh = decoder_layers(tiny_model(arch))[1][0].get_submodule(arch_map.groups[0].linears[0]).weight
    assert rel(q_like, fresh) > 0.1


@pytest.mark.parametrize("arch", ["gemma", "gemma2"])
def test_gemma_fold_needs_the_one_plus_weight_gain(arch):
    """Negative control: folding Gemma's norms as if they were plain RMSNorm gains changes the model."""
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    layer = decoder_layers(model)[1][0]
    group = map_for(model.config).groups[0]
    s = torch.exp(torch.randn(64, generator=torch.Generator().manual_seed(3)) * 0.75)
    fold_scales(layer, group, s, norm_offset=0.0)
    with torch.no_grad():
        assert rel(model(ids).logits, before) > 1e-2


def test_gqa_skips_v_to_o_and_still_folds_exactly():
    model = tiny_model("llama", num_key_value_heads=2)
    model.model.embed_tokens.weight.data[:, :3] *= 25  # outlier channels, so the search picks alpha > 0
    samples = [torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    ids = torch.stack(samples[:2])
    with torch.no_grad():
        before = model(ids).logits
    t = AWQTransform(model, AWQOptions(grid=6, clip=False))
    _, layers = decoder_layers(model)
    names = {m: n for n, m in model.named_modules()}
    sch = Scheme("t", 4, "int", True, 32)
    inputs = capture.first_layer_inputs(model, layers, samples, "cpu")
    stats = {}
    for i, layer in enumerate(layers):
        targets = {m: (names[m], sch) for m in layer.modules() if isinstance(m, torch.nn.Linear)}
        stats.update(t.apply(i, layer, inputs, targets)["stats"])
        inputs = capture.LayerInputs(capture.run_layer(layer, inputs), inputs.kwargs)
    with torch.no_grad():
        assert rel(model(ids).logits, before) < 1e-5
    o = stats["model.layers.0.self_attn.o_proj"]
    assert o["awq_alpha"] is None and "not scaled" in o["awq_note"]
    alphas = [stats[f"model.layers.{i}.{n}"]["awq_alpha"] for i in range(2)
              for n in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")]
    assert all(0 <= a <= 1 for a in alphas) and max(alphas) > 0


def _rtn64(w: torch.Tensor, sch: Scheme, scale_dtype) -> torch.Tensor:
    """w fake-quantised on sch's grid in float64, group by group, on the grid written in test_gptq (not rtn.py)."""
    from test_gptq import _grid64

    gs = w.shape[1] if sch.group_size == -1 else sch.group_size
    out = torch.empty_like(w)
    for c in range(0, w.shape[1], gs):
        cols = w[:, c:c + gs]
        s, z, _ = _grid64(cols, sch.num_bits, sch.symmetric, scale_dtype, sch.full_range)
        q = torch.clamp(torch.round(cols / s[:, None]) + z[:, None], sch.qmin, sch.qmax)
        out[:, c:c + gs] = (q - z[:, None]) * s[:, None]
    return out


# None: AWQOptions' default, what the CLI runs; 0.2 here keeps a milder alpha than the best
@pytest.mark.parametrize("min_gain", [None, 0.0, 0.2])
def test_alpha_search_against_a_float64_brute_force(min_gain):
    """The down_proj group (its block is the Linear itself) recomputed in float64 for every alpha on the grid:
    s = mean|x|^a normalised to a geometric midpoint of 1, the weights scaled by s, fake-quantised on the plan's
    scheme (float64 grid written here), unscaled, and the block error taken as the mean over tokens of each
    token's squared output error over its output power. The transform must choose what the written rule says
    for those errors (the best, or with min_gain the mildest alpha within min_gain of the best), record the
    errors it measured, and fold exactly that alpha's s into the weights."""
    model = tiny_model("llama", layers=1)
    with torch.no_grad():  # a few intermediate channels 15x larger: down_proj's input has outlier channels
        model.model.layers[0].mlp.up_proj.weight[[5, 40, 99]] *= 15
    plan = build_plan(model, Recipe.model_validate({"quant": {"method": "awq"}}))
    opts = plan.awq.model_copy(update={"clip": False,
                                       **({} if min_gain is None else {"min_gain": min_gain})})
    layer = decoder_layers(model)[1][0]
    down = layer.mlp.down_proj
    name = "model.layers.0.mlp.down_proj"
    sch, sd = plan.schemes[name], plan.options.scale_dtype
    samples = [torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    inputs = capture.first_layer_inputs(model, decoder_layers(model)[1], samples, "cpu")
    xs = []
    hook = down.register_forward_pre_hook(lambda _m, a: xs.append(a[0].detach().reshape(-1, a[0].shape[-1])))
    capture.run_layer(layer, inputs)
    hook.remove()
    x, w = torch.cat(xs).double(), down.weight.detach().double().clone()
    ref_out = x @ w.t()

    def scales(alpha):
        raw = x.abs().mean(0).clamp_min(1e-4) ** alpha
        return raw / (raw.max() * raw.min()).sqrt()

    def error(s):
        wq = _rtn64(w * s, sch, sd) / s
        return float(((x @ wq.t() - ref_out).pow(2).sum(-1) / ref_out.pow(2).sum(-1)).mean())

    grid = torch.linspace(0, 1, opts.grid).tolist()
    errs = [error(scales(a)) for a in grid]
    best, gain, tol = min(errs), opts.min_gain, 1e-3
    names = {m: n for n, m in model.named_modules()}
    targets = {m: (names[m], plan.schemes[names[m]]) for m in layer.modules() if isinstance(m, nn.Linear)}
    stats = AWQTransform(model, opts, sd, holdout=0.0).apply(0, layer, inputs, targets)["stats"][name]
    k = min(range(len(grid)), key=lambda i: abs(grid[i] - stats["awq_alpha"]))
    assert errs[k] <= best * (1 + gain) * (1 + tol), (stats["awq_alpha"], errs)
    assert all(e > best * (1 + gain) * (1 - tol) for e in errs[:k]), (stats["awq_alpha"], errs)
    assert stats["awq_block_error"] == pytest.approx(errs[k], rel=tol)
    assert stats["rtn_block_error"] == pytest.approx(error(torch.ones_like(x[0])), rel=tol)
    # the scale folded into down_proj's columns is that alpha's
    torch.testing.assert_close(down.weight.detach().double() / w, scales(grid[k]).expand_as(w), rtol=1e-5, atol=0)
    assert grid[k] > 0 and errs[k] < 0.9 * errs[0]  # the outliers make scaling worth it: not a vacuous check


# ---------------------------------------------------------------------------------------------------------------
# Requirement 5: AWQ beats RTN on layers with outlier input channels


def _layer_output_error(model, ref_model, ids) -> float:
    outs = {}

    def grab(key):
        def hook(_m, _a, out):
            outs[key] = out[0] if isinstance(out, tuple) else out
        return hook

    hs = [model.model.layers[0].register_forward_hook(grab("q")),
          ref_model.model.layers[0].register_forward_hook(grab("f"))]
    with torch.no_grad():
        model(ids)
        ref_model(ids)
    for h in hs:
        h.remove()
    return float((outs["q"].double() - outs["f"].double()).pow(2).sum())


def test_awq_block_error_below_rtn_in_95_percent_of_trials():
    wins, trials = 0, 20
    for seed in range(trials):
        model = tiny_model("llama", seed=seed, layers=1)
        g = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():  # a few input channels 10-40x larger than the rest, as in real LLM activations
            cols = torch.randperm(64, generator=g)[:3]
            model.model.embed_tokens.weight[:, cols] *= 10 + 30 * torch.rand(3, generator=g)
        calib = [torch.randint(0, 128, (48,), generator=g) for _ in range(6)]
        held_out = torch.randint(0, 128, (4, 48), generator=g)
        # the claim must hold across grids, not for one lucky setting
        gs, sym = [32, 64, -1][seed % 3], seed % 2 == 0
        errs = {}
        for method in ("rtn", "awq"):
            m = copy.deepcopy(model)
            r = Recipe.model_validate({"quant": {"method": method, "group_size": gs, "symmetric": sym}})
            quantize_model(m, build_plan(m, r), calib)
            errs[method] = _layer_output_error(m, model, held_out)
        wins += errs["awq"] < errs["rtn"]
    assert wins >= 19, f"AWQ beat RTN in only {wins}/{trials} trials"


# ---------------------------------------------------------------------------------------------------------------
# Scale search and clip search pieces against direct float64 computations


def test_normalised_scales_follow_the_definition():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(32, generator=g) * 5 + 0.01
    w = torch.rand(32, generator=g) + 0.1
    for alpha in (0.0, 0.3, 1.0):
        s = normalised_scales(x, None, alpha).double()
        raw = x.double() ** alpha
        ref = raw / (raw.max() * raw.min()).sqrt()
        assert torch.allclose(s, ref, rtol=1e-5)  # float32 pow vs float64
        duo = normalised_scales(x, w, alpha).double()
        raw = x.double() ** alpha / w.double() ** (1 - alpha)
        assert torch.allclose(duo, raw / (raw.max() * raw.min()).sqrt(), rtol=1e-5)
        assert abs(float(duo.max() * duo.min()) - 1) < 1e-5


def test_duo_weight_profile_is_the_mean_group_relative_magnitude():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 32, generator=g), torch.randn(4, 32, generator=g)
    got = weight_profile([a, b], 8).double()
    w = torch.cat([a, b]).double().abs()
    ref = torch.zeros(32, dtype=torch.float64)
    for c in range(32):
        grp = slice(c // 8 * 8, c // 8 * 8 + 8)
        ref[c] = sum(w[r, c] / w[r, grp].max() for r in range(10)) / 10
    assert torch.allclose(got, ref, rtol=1e-6)  # float32 division and mean vs float64


def test_block_error_weighs_every_token_the_same():
    """For a Linear block the per-token relative error does not change when one token's input is scaled by
    1000 (its error and its output grow together); the power-weighted error is dominated by that token."""
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(16, 32, generator=g))
    sch = Scheme("t", 4, "int", True, 16)
    group = ScaleGroup(prev="x", linears=("l",), block="l")
    x = torch.randn(1, 40, 32, generator=g)
    s = torch.rand(32, generator=g) + 0.5

    def errors(inp, per_token):
        data = _GroupData()
        data.calls = [((inp,), {})]
        work, copies, originals, refs, weights = measured_copy(lin, group, {"l": lin}, data, per_token)
        copies["l"].weight.data = fake_quantize(originals["l"] * s, sch, torch.float32) / s
        return block_error(work, data, refs, weights)

    loud = x.clone()
    loud[0, 7] *= 1000
    assert errors(loud, True) == pytest.approx(errors(x, True), rel=1e-6)
    # float64 reference: the mean over tokens of |error_t|^2 / |output_t|^2
    wq = fake_quantize(lin.weight.detach().float() * s, sch, torch.float32).double() / s.double()
    ref_out, q_out = x[0].double() @ lin.weight.double().t(), x[0].double() @ wq.t()
    ref = float(((q_out - ref_out).pow(2).sum(-1) / ref_out.pow(2).sum(-1)).mean())
    assert errors(x, True) == pytest.approx(ref, rel=1e-5)
    assert errors(loud, False) != pytest.approx(errors(x, False), rel=0.05)


# ---------------------------------------------------------------------------------------------------------------
# Requirement 1: unmapped architectures


def _gpt_neox():
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    cfg = GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_unmapped_architecture_is_a_user_error_naming_mapped_ones():
    model = _gpt_neox()
    r = Recipe.model_validate({"quant": {"method": "awq", "group_size": 32}})
    with pytest.raises(UserError) as e:
        quantize_model(model, build_plan(model, r), [torch.randint(0, 128, (16,))])
    msg = str(e.value)
    assert "gpt_neox" in msg and "llama" in msg and "qwen3" in msg and "--set quant.awq.fallback=rtn" in msg


def test_unmapped_architecture_falls_back_to_rtn_when_asked():
    model = _gpt_neox()
    plain = copy.deepcopy(model)
    calib = [torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    r = Recipe.model_validate({"quant": {"method": "awq", "group_size": 32, "awq": {"fallback": "rtn"}}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = quantize_model(model, build_plan(model, r), calib)
    assert any("no scaling map" in str(w.message) for w in caught)
    quantize_model(plain, build_plan(plain, Recipe.model_validate({"quant": {"method": "rtn", "group_size": 32}})))
    for (n, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), n  # exactly RTN: nothing scaled, nothing clipped
    name = "gpt_neox.layers.0.attention.query_key_value"
    assert res.stats[name]["awq_alpha"] is None and "no AWQ map" in res.stats[name]["awq_note"]


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_awq_search_runs_on_every_mapped_architecture(arch):
    """The search drives each architecture's real attention/MLP modules with the kwargs the layer passed."""
    model = tiny_model(arch)
    model.get_input_embeddings().weight.data[:, :2] *= 20
    calib = [torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    # no hold-out: this checks the search itself (the guard may drop its choices; tested on its own)
    r = Recipe.model_validate({"quant": {"method": "awq", "group_size": 32, }, "calibration": {"holdout": 0}})
    res = quantize_model(model, build_plan(model, r), calib)
    arch_map = map_for(model.config)
    scaled = [f"{p}.{n}" for p in (decoder_layers(model)[0] + ".0", decoder_layers(model)[0] + ".1")
              for g in arch_map.groups for n in g.linears if not is_router(n)]  # routers stay float
    # an expert routing sent no calibration token is left unscaled, and says so
    starved = [n for n in scaled if res.stats[n].get("awq_note") == "no calibration tokens"]
    assert all(".experts." in n for n in starved) and len(starved) < len(scaled) / 4
    for name in (n for n in scaled if n not in starved):
        s = res.stats[name]
        assert s["awq_alpha"] is not None and 0 <= s["awq_alpha"] <= 1, name
    assert any(res.stats[n]["awq_alpha"] > 0 for n in scaled)
    ids = torch.stack(calib)
    assert torch.isfinite(model(ids).logits).all()
