"""NVFP4/MXFP4 checkpoints: the compressed-tensors layout and config, quantkit.load's round trip, transformers +
compressed-tensors decompressing them on CPU with the same logits, and the plan's refusals."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import quantkit
from quantkit.errors import UserError
from quantkit.inspect_ckpt import inspect_checkpoint
from quantkit.linear.fp4 import FP4Linear
from quantkit.plan import build_plan
from quantkit.recipe import Recipe
from test_fp8_checkpoint import IDS, _model, _quantize

P = "model.layers.1.mlp.down_proj"  # in_features 128 in the tiny model: 8 nvfp4 groups, 4 mxfp4 ones


@pytest.mark.parametrize("scheme,method", [("nvfp4", "rtn"), ("mxfp4", "gptq")])
def test_round_trip_layout_and_transformers_logits(tmp_path, scheme, method):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = _model(seed=2)
    with torch.no_grad():  # fused Linears of different ranges: nvfp4 global scales that must be shared
        model.model.layers[0].self_attn.k_proj.weight.mul_(3.0)
        model.model.layers[0].mlp.up_proj.weight.mul_(0.3)
        float_logits = model(IDS).logits
    res = _quantize(tmp_path / "out", model, {"scheme": scheme, "method": method})
    with torch.no_grad():
        ref = model(IDS).logits  # the pipeline left every quantised weight at its dequantised value
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == f"{scheme}-pack-quantized"
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert (w["type"], w["num_bits"], w["symmetric"], group["input_activations"]) == ("float", 4, True, None)
    assert (w["strategy"], w["group_size"]) == (("tensor_group", 16) if scheme == "nvfp4" else ("group", 32))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = {k for k in f.keys() if k.startswith(P + ".")}
        packed, scale = f.get_tensor(f"{P}.weight_packed"), f.get_tensor(f"{P}.weight_scale")
        assert packed.dtype == torch.uint8 and packed.shape == (64, 64)
        if scheme == "nvfp4":
            assert keys == {f"{P}.{k}" for k in ("weight_packed", "weight_scale", "weight_global_scale")}
            assert scale.dtype == torch.float8_e4m3fn and scale.shape == (64, 8)
            gscale = f.get_tensor(f"{P}.weight_global_scale")
            assert gscale.dtype == torch.float32 and torch.equal(gscale, res.qweights[P].global_scale)
        else:
            assert keys == {f"{P}.weight_packed", f"{P}.weight_scale"}
            assert scale.dtype == torch.uint8 and scale.shape == (64, 4)
    # inspect counts codes and every scale: 4 bits + 8 per 16 (+ 32 per tensor) or + 8 per 32
    rows = {r["layer"]: r for r in inspect_checkpoint(tmp_path / "out")["layers"]}
    assert rows[P]["shape"] == [64, 128]
    assert rows[P]["bits_per_weight"] == round(4 + 8 / 16 + 32 / (64 * 128) if scheme == "nvfp4" else 4 + 8 / 32, 3)
    ours = quantkit.load(tmp_path / "out", dtype=torch.float32, exact=True)
    assert sum(isinstance(m, FP4Linear) for m in ours.modules()) == 14
    for name, qw in res.qweights.items():  # q/k/v and gate/up moved onto one global scale without a change
        assert torch.equal(ours.get_submodule(name).dequantized_weight(), qw.dequantize())
    if scheme == "nvfp4":
        layer = ours.model.layers[0]
        for part, fused in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            stored = {float(layer.get_submodule(f"{part}.{f}").weight_global_scale) for f in fused}
            own = {float(res.qweights[f"model.layers.0.{part}.{f}"].global_scale) for f in fused}
            assert stored == {min(own)} and len(own) > 1
    # transformers 5.24's default compressed path decompresses these Linears to bfloat16 on the fly, which a
    # float32 model then refuses (dtype mismatch); its dequantize=True path decompresses once at load
    ext = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True))
    assert torch.equal(ext.get_submodule(P).weight.float(), res.qweights[P].dequantize())
    with torch.no_grad():
        got, theirs = ours(IDS).logits, ext(IDS).logits
    size = ref.abs().max().item()
    assert (got - ref).abs().max().item() < 1e-5 * size
    assert (theirs - got).abs().max().item() < 1e-5 * size
    assert (float_logits - ref).abs().max().item() > 1e-2 * size  # 4-bit weights visibly move the logits


@pytest.mark.parametrize("quant,message", [
    ({"scheme": "nvfp4", "group_size": 32}, "groups of 16"),
    ({"scheme": "mxfp4", "symmetric": False}, "symmetric groups of 32"),
    ({"scheme": "nvfp4", "method": "awq"}, "does not support the FP4 schemes"),
])
def test_plan_refuses_what_the_formats_cannot_hold(quant, message):
    model = _model()
    with pytest.raises(UserError, match=message):
        build_plan(model, Recipe.model_validate({"quant": quant}))


def test_nvfp4_with_activations_matches_transformers_compressed_path_in_bfloat16(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _model(seed=3)
    res = _quantize(tmp_path / "out", model, {"scheme": "nvfp4-a4", "method": "gptq"})
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    a = group["input_activations"]
    assert (a["num_bits"], a["type"], a["strategy"], a["group_size"], a["dynamic"]) == (4, "float", "tensor_group",
                                                                                       16, "local")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        g = {n: float(f.get_tensor(f"model.layers.0.self_attn.{n}.input_global_scale")) for n in ("q_proj", "k_proj")}
    assert g["q_proj"] == g["k_proj"] == float(res.qweights["model.layers.0.self_attn.q_proj"].input_scale)
    # transformers 5.24 runs the activation quantisation only on its compressed path, which computes in bfloat16
    # (its dequantize=True path drops input_global_scale and runs the weights alone)
    ext = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    ours = quantkit.load(tmp_path / "out", dtype=torch.bfloat16, exact=True)
    with torch.no_grad():
        got, theirs = ours(IDS).logits.float(), ext(IDS).logits.float()
        for m in ours.modules():
            if isinstance(m, FP4Linear):
                m.input_global_scale = None
        weights_only = ours(IDS).logits.float()
    size = got.abs().max().item()
    assert (theirs - got).abs().max().item() < 1e-2 * size  # bfloat16 logits: about 3 significant digits
    assert (weights_only - got).abs().max().item() > 5e-2 * size  # the activations' rounding is in both
