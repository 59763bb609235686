"""Layer-by-layer (lazy) loading: the same checkpoint as a whole-model load, with at most one decoder layer's
float Linear weights in memory at a time, and a clean fall-back when the checkpoint cannot be streamed."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_model, tiny_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_data_support import SAMPLE, tiny_tokenizer

from quantkit.errors import UserError
from quantkit.models import lazy
from quantkit.models.lazy import LazyWeights, open_lazy
from quantkit.job import quantize_to_checkpoint
from quantkit.recipe import Recipe


def _source(tmp_path, arch="llama", tied=False, shard=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(arch, layers=3)
    cfg.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    with torch.no_grad():  # default init is tiny; spread weights so codes differ between layers and solvers
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    folder = tmp_path / f"src-{arch}-{tied}-{shard}"
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _recipe(src, out, method, spec=SAMPLE):
    return Recipe.model_validate({
        "model": str(src), "output": str(out), "quant": {"method": method, "group_size": 32},
        "calibration": {"spec": str(spec), "num_samples": 3, "seq_len": 24}})


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("arch,tied,shard,method", [
    ("llama", False, None, "rtn"), ("llama", False, None, "gptq"), ("qwen2", False, None, "rtn"),
    ("qwen2", False, None, "gptq"), ("llama", True, None, "gptq"), ("llama", False, "100KB", "rtn"),
    ("llama", False, None, "awq")])
def test_lazy_checkpoint_is_byte_identical_to_full_load(tmp_path, arch, tied, shard, method):
    src = _source(tmp_path, arch, tied, shard)
    if shard:
        assert (src / "model.safetensors.index.json").is_file()
    runs = {}
    for streamed in (False, True):
        out = tmp_path / f"out-{streamed}"
        summary = quantize_to_checkpoint(_recipe(src, out, method), lazy=streamed)
        assert summary["loading"] == ("layer by layer" if streamed else "whole model")
        runs[streamed] = out
    full, streamed = _tensors(runs[False]), _tensors(runs[True])
    assert full.keys() == streamed.keys()
    for k in full:
        assert full[k].dtype == streamed[k].dtype and torch.equal(full[k], streamed[k]), k
    for name in ("config.json", "generation_config.json"):
        assert (runs[False] / name).read_text() == (runs[True] / name).read_text()
    if method == "awq":  # the folded scales reached the norms the writer saved: they are no longer the source's
        # (any norm: AWQ's held-out guard may keep a group's RTN scales, leaving that norm as it was)
        with safe_open(src / "model.safetensors", framework="pt") as f:
            norms = [k for k in f.keys() if k.endswith("layernorm.weight")]
            assert norms and any(not torch.equal(streamed[k], f.get_tensor(k)) for k in norms)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_at_most_one_layer_of_float_linears_is_in_memory(tmp_path, monkeypatch, method):
    src = _source(tmp_path)
    seen = []
    original = LazyWeights.load_layer

    def real_linears(weights):
        return sorted(n for n, m in weights.layers.named_modules()
                      if isinstance(m, torch.nn.Linear) and not m.weight.is_meta)

    def load_layer(self, i):
        assert real_linears(self) == [], f"linears of an earlier layer still in memory when layer {i} loads"
        original(self, i)
        seen.append((i, real_linears(self)))

    monkeypatch.setattr(LazyWeights, "load_layer", load_layer)
    quantize_to_checkpoint(_recipe(src, tmp_path / "out", method))
    per_layer = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
                 "self_attn.q_proj", "self_attn.v_proj"]
    assert seen == [(i, [f"{i}.{n}" for n in per_layer]) for i in range(3)]


def test_skeleton_reads_only_what_lies_outside_the_layers(tmp_path):
    src = _source(tmp_path, tied=True)
    model, tok, _, weights = open_lazy(str(src), "float16")
    assert tok is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after being read
    real = {k for k, v in model.state_dict().items() if not v.is_meta}
    assert real == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    weights.load_layer(1)
    with safe_open(src / "model.safetensors", framework="pt") as f:
        want = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, want)
    assert model.model.layers[0].mlp.up_proj.weight.is_meta
    weights.release(["model.layers.1.mlp.up_proj"])
    assert model.model.layers[1].mlp.up_proj.weight.is_meta
    assert not model.model.layers[1].post_attention_layernorm.weight.is_meta  # AWQ folds into it: it stays


def test_renamed_keys_fall_back_to_a_full_load(tmp_path):
    src = _source(tmp_path)
    tensors = load_file(src / "model.safetensors")
    # what a fused-experts or legacy checkpoint looks like to the model: a key it does not have
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = tensors.pop("model.layers.0.mlp.gate_proj.weight")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert open_lazy(str(src), "float16") is None


def test_missing_key_or_other_format_falls_back(tmp_path):
    src = _source(tmp_path)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.2.self_attn.q_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    # a weight the model needs and the files lack is an error, not a fallback: a full load would leave it random
    with pytest.raises(UserError, match="model.layers.2.self_attn.q_proj.weight"):
        open_lazy(str(src), "float16")
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    assert lazy.checkpoint_files(src) is None


def test_self_generated_calibration_loads_the_whole_model(tmp_path):
    src = _source(tmp_path)
    recipe = Recipe.model_validate({
        "model": str(src), "output": str(tmp_path / "out"), "quant": {"method": "gptq", "group_size": 32},
        "calibration": {"spec": "self", "num_samples": 2, "seq_len": 12}})
    assert quantize_to_checkpoint(recipe)["loading"] == "whole model"
    meta = json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert meta["calibration"]["spec"] == "self"


def test_tiny_model_default_is_streamed(tmp_path):
    src = make_tiny_model(tmp_path / "t", "llama")  # no tokenizer: RTN needs none
    r = Recipe.model_validate({"model": str(src), "output": str(tmp_path / "o"),
                              "quant": {"method": "rtn", "group_size": 32}})
    assert quantize_to_checkpoint(r)["loading"] == "layer by layer"
