"""FP8 checkpoints: layout and config, quantkit.load round trip, transformers + compressed-tensors, KV scales."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache

import quantkit
from quantkit.formats.writer import write_checkpoint
from quantkit.linear.fp8 import FP8Linear
from quantkit.pipeline import quantize_model
from quantkit.plan import build_plan
from quantkit.recipe import Recipe
from quantkit.solvers.fp8_input_scale import InputScale
from quantkit.testing.models import tiny_llama
from test_fp8_format import e4m3_round_ref

# quantize_to_checkpoint's kv_cache_scheme for --kv-cache fp8
KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False,
             "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
             "observer_kwargs": {}}


def _model(seed=0):
    # weights wider than the default 0.02 init, so the logits depend visibly on every quantisation step
    return tiny_llama(vocab_size=256, hidden=64, layers=2, seed=seed, init_std=0.08)


def _samples(n=4, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g) for _ in range(n)]


def _quantize(out, model, quant: dict, calibration: dict | None = None):
    """The pipeline of quantize_to_checkpoint minus model/tokenizer loading (the tiny model has no tokenizer)."""
    recipe = Recipe.model_validate({"quant": quant, "calibration": calibration or {}})
    res = quantize_model(model, build_plan(model, recipe), _samples())
    kv = KV_SCHEME if quant.get("kv_cache") == "fp8" else None
    write_checkpoint(out, model, res.qweights, build_plan(model, recipe).schemes, None, {}, res.tensors, kv)
    return res


def _act_quant_reference(model, res):
    """model (weights already dequantised by quantize_model) with each quantised Linear's input rounded through
    e4m3 by the float64 reference: per token, or with the solver's static input scale."""
    handles = []
    for name, mod in model.named_modules():
        qw = res.qweights.get(name)
        if qw is None:
            continue

        def hook(_m, args, qw=qw):
            x = args[0].float()
            s = qw.input_scale if qw.input_scale is not None else x.abs().amax(-1, keepdim=True) / 448
            return (e4m3_round_ref(x / s) * s.double()).to(args[0].dtype)

        handles.append(mod.register_forward_pre_hook(hook))
    return handles


IDS = torch.tensor([[5, 17, 250, 99, 4, 41, 12, 77, 201, 3, 64, 128]])


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic"])
def test_round_trip_logits_match_dequantised_model_with_same_activation_quantisation(tmp_path, scheme):
    model = _model()
    float_logits = model(IDS).logits.detach()
    res = _quantize(tmp_path / "out", model, {"scheme": scheme})
    ours = quantkit.load(tmp_path / "out", dtype=torch.float32, exact=True)
    assert sum(isinstance(m, FP8Linear) for m in ours.modules()) == 14  # 7 per layer, lm_head ignored
    with torch.no_grad():
        weight_only = model(IDS).logits
        handles = _act_quant_reference(model, res)
        ref = model(IDS).logits
        for h in handles:
            h.remove()
        got = ours(IDS).logits
    # Same codes, same scales, float32 throughout: only summation order differs (about 1e-6 of the logits'
    # size); the activation rounding's own effect is orders of magnitude larger, so the check is not vacuous.
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() < 1e-5 * scale
    assert (weight_only - ref).abs().max().item() > 1e-3 * scale
    assert (float_logits - ref).abs().max().item() > 1e-3 * scale


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic"])
def test_layout_and_config_follow_compressed_tensors_float_quantized(tmp_path, scheme):
    model = _model()
    _quantize(tmp_path / "out", model, {"scheme": scheme, "kv_cache": "fp8"})
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    (group,) = qc["config_groups"].values()
    w, a = group["weights"], group["input_activations"]
    assert (w["type"], w["num_bits"], w["symmetric"]) == ("float", 8, True)
    assert w["strategy"] == ("tensor" if scheme == "fp8" else "channel")
    assert (a["type"], a["num_bits"]) == ("float", 8)
    assert (a["strategy"], a["dynamic"]) == (("tensor", False) if scheme == "fp8" else ("token", True))
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["strategy"] == "tensor"
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        p = "model.layers.1.mlp.down_proj"
        assert f.get_tensor(f"{p}.weight").dtype == torch.float8_e4m3fn
        assert tuple(f.get_tensor(f"{p}.weight_scale").shape) == ((1,) if scheme == "fp8" else (64, 1))
        assert (f"{p}.input_scale" in keys) == (scheme == "fp8")
        for i in range(2):
            for kv in ("k_scale", "v_scale"):
                t = f.get_tensor(f"model.layers.{i}.self_attn.{kv}")
                assert t.shape == (1,) and t.item() > 0


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic"])
def test_loads_through_transformers_and_compressed_tensors_with_matching_logits(tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    model = _model(seed=1)
    _quantize(tmp_path / "out", model, {"scheme": scheme, "kv_cache": "fp8"})
    ext = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ours = quantkit.load(tmp_path / "out", dtype=torch.float32, exact=True)
    ext_q = ext.model.layers[0].self_attn.q_proj
    assert torch.equal(ext_q.weight.float(), ours.model.layers[0].self_attn.q_proj.weight.float())
    # compressed-tensors 0.20 dequantises the weights on CPU and fake-quantises the activations (dynamic per
    # token or with input_scale) in float32, the same arithmetic as our emulation: equal up to float32
    # summation order. (Its KV-cache hook does not attach on transformers 5.24, whose attention takes `cache`,
    # not `past_key_values`, so the plain forward is compared, which uses no KV quantisation on either side.)
    with torch.no_grad():
        a, b = ours(IDS).logits, ext(IDS).logits
    assert (a - b).abs().max().item() < 1e-5 * a.abs().max().item()


def _cached_stats(model, samples):
    """Per layer, InputScale statistics (absmax, histogram) of the keys and values a DynamicCache stores (after
    RoPE) over the samples."""
    k, v = [None] * 2, [None] * 2
    with torch.no_grad():
        for ids in samples:
            cache = DynamicCache(config=model.config)
            model(ids.reshape(1, -1), cache=cache, use_cache=True)
            for i, layer in enumerate(cache.layers):
                if k[i] is None:
                    k[i] = InputScale("k", torch.ones(1, layer.keys.shape[-1]))
                    v[i] = InputScale("v", torch.ones(1, layer.values.shape[-1]))
                k[i].add(layer.keys)
                v[i].add(layer.values)
    return k, v


@pytest.mark.parametrize("quant", [{"scheme": "w4a16", "method": "rtn", "group_size": 32},
                                   {"scheme": "fp8-dynamic"}])
def test_kv_scales_come_from_the_cached_keys_with_margin_for_any_weight_scheme(tmp_path, quant):
    float_model = _model(seed=2)
    model = copy.deepcopy(float_model)
    res = _quantize(tmp_path / "out", model, {**quant, "kv_cache": "fp8"})
    # The observer sees layer i in float, fed by the already quantised layers before it (true sequential):
    # rebuild exactly that model for each layer and read its keys from a plain DynamicCache.
    for i in range(2):
        hybrid = copy.deepcopy(float_model)
        for j in range(i):
            hybrid.model.layers[j] = copy.deepcopy(model.model.layers[j])
        k, v = _cached_stats(hybrid, _samples())
        for name, stats in (("k_scale", k[i]), ("v_scale", v[i])):
            got = res.tensors[f"model.layers.{i}.self_attn.{name}"].float()
            # the scale searched over the cached values (tests/test_fp8_input_scale.py checks the search itself),
            # so at least absmax x 1.5 / 448 and at most twice that
            assert torch.equal(got, stats.scale(torch.float32, 1.5)[0]), (i, name)
            low = float(stats.amax) * 1.5 / 448
            assert low * (1 - 1e-6) <= float(got) < 2 * low, (i, name)
    # RoPE rotates pairs of channels, so the cached keys differ from k_proj's output: the scale must come
    # from the cache, and it does (checked above); loading puts the scales on the attention modules
    loaded = quantkit.load(tmp_path / "out", dtype=torch.float32, exact=True)
    for i in range(2):
        attn = loaded.model.layers[i].self_attn
        assert attn.k_scale.item() == res.tensors[f"model.layers.{i}.self_attn.k_scale"].item()


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_linears_reading_one_input_share_one_static_input_scale(tmp_path, method):
    """q/k/v read one tensor, gate/up another: an engine that fuses them quantises that tensor once (vLLM keeps
    the largest scale), so each group gets one scale, chosen on the group's summed error; o and down keep theirs."""
    float_model = _model(seed=8)  # a model whose members, on their own, would choose different scales
    res = _quantize(tmp_path / "out", copy.deepcopy(float_model), {"scheme": "fp8", "method": method})
    # the reference: each Linear's own statistics over its calibration inputs, merged per group. Layer 0 sees the
    # embeddings; its MLP sees the attention output with q/k/v/o already quantised (the pipeline solves in order)
    mods = dict(float_model.named_modules())
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        mods[f"model.layers.0.self_attn.{p}"].weight.data = res.qweights[f"model.layers.0.self_attn.{p}"].dequantize()
    groups = [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]
    names = [f"model.layers.0.{'self_attn' if g[0] == 'q_proj' else 'mlp'}.{p}" for g in groups for p in g]
    stats = {n: InputScale(n, mods[n].weight) for n in names}
    hooks = [mods[n].register_forward_pre_hook(lambda _m, a, n=n: stats[n].add(a[0])) for n in names]
    with torch.no_grad():
        for ids in _samples():
            float_model(ids.reshape(1, -1))
    for h in hooks:
        h.remove()
    disagree = 0
    for prefix, members in (("model.layers.0.self_attn.", groups[0]), ("model.layers.0.mlp.", groups[1])):
        scales = [res.qweights[prefix + p].input_scale for p in members]
        assert all(torch.equal(s, scales[0]) for s in scales[1:]), prefix
        parts = [stats[prefix + p] for p in members]
        want = parts[0].merged(parts[1:]).scale(torch.float16)[0]
        assert torch.equal(scales[0], want), prefix
        disagree += len({float(p.scale(torch.float16)[0]) for p in parts}) > 1
    assert disagree  # on their own, the members would have chosen different scales: the sharing is exercised
    for i in range(2):  # o_proj and down_proj read tensors of their own
        assert res.qweights[f"model.layers.{i}.self_attn.o_proj"].input_scale is not None
        assert res.qweights[f"model.layers.{i}.mlp.down_proj"].input_scale is not None
