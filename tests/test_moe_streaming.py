"""Mixture-of-experts models stream layer by layer: the meta skeleton's fused experts are split into per-expert
Linears up front, each expert weight is read when its layer is processed (from the checkpoint's per-expert key,
or as its rows of a fused tensor) and dropped after the layer is solved.

The reference is the whole-model load (`lazy=False`), which reads the model through transformers'
from_pretrained and splits the experts of the loaded model: the streamed checkpoint must equal it byte for byte.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_data_support import SAMPLE, tiny_tokenizer

from test_distributed import _alone, _args, _same_checkpoint, _torchrun

from quantkit.errors import UserError
from quantkit.job import quantize_to_checkpoint
from quantkit.models.lazy import open_lazy
from quantkit.recipe import Recipe
from quantkit.testing.moe import save_tiny_moe, tiny_moe


def _source(folder, arch="qwen3_moe", fused_on_disk=False):
    """A tiny MoE as save_pretrained writes it (one key per expert projection), or with the experts stored fused,
    as the module tree holds them (`experts.gate_up_proj` [experts, 2*inter, hidden], `experts.down_proj`)."""
    save_tiny_moe(folder, arch)
    tiny_tokenizer().save_pretrained(folder)
    if fused_on_disk:
        state = {k: v.contiguous() for k, v in tiny_moe(arch).state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _recipe(src, out, method):
    return Recipe.model_validate({
        "model": str(src), "output": str(out), "quant": {"method": method, "group_size": 32},
        "calibration": {"spec": str(SAMPLE), "num_samples": 4, "seq_len": 32}})


def _layers_meta(out):
    layers = json.loads((out / "quantkit.json").read_text())["layers"]
    return {n: {k: v for k, v in s.items() if k != "seconds"} for n, s in layers.items()}


@pytest.mark.parametrize("arch,fused_on_disk,method", [
    ("qwen3_moe", False, "rtn"), ("qwen3_moe", False, "gptq"), ("mixtral", False, "gptq"), ("qwen3_moe", True, "gptq")])
def test_streamed_moe_checkpoint_is_byte_identical_to_the_whole_model_load(tmp_path, arch, fused_on_disk, method):
    src = _source(tmp_path / "src", arch, fused_on_disk)
    runs = {}
    for streamed in (False, True):
        out = tmp_path / f"out-{streamed}"
        summary = quantize_to_checkpoint(_recipe(src, out, method), lazy=streamed)
        assert summary["loading"] == ("layer by layer" if streamed else "whole model")
        runs[streamed] = out
    whole, streamed = load_file(runs[False] / "model.safetensors"), load_file(runs[True] / "model.safetensors")
    assert whole.keys() == streamed.keys()
    assert all(whole[k].dtype == streamed[k].dtype and torch.equal(whole[k], streamed[k]) for k in whole), \
        [k for k in whole if not torch.equal(whole[k], streamed[k])][:5]
    # the same experts were fed the same routed tokens (GPTQ's Hessians and the counts in quantkit.json)
    assert _layers_meta(runs[False]) == _layers_meta(runs[True])
    assert (runs[False] / "config.json").read_text() == (runs[True] / "config.json").read_text()
    # every expert under the per-expert name vLLM and transformers read (Mixtral: block_sparse_moe.experts.{e}.w1)
    block, gate = ("block_sparse_moe", "w1") if arch == "mixtral" else ("mlp", "gate_proj")
    experts = {k for k in streamed if ".experts." in k and k.endswith(".weight_packed")}
    n_experts = 4 if arch == "mixtral" else 8
    assert {f"model.layers.{i}.{block}.experts.{e}.{gate}.weight_packed" for i in range(2)
            for e in range(n_experts)} <= experts and len(experts) == 2 * n_experts * 3


@pytest.mark.parametrize("fused_on_disk", [False, True])
def test_a_layer_reads_its_experts_when_loaded_and_drops_them_when_released(tmp_path, fused_on_disk):
    src = _source(tmp_path / "src", "qwen3_moe", fused_on_disk)
    model, _, _, weights = open_lazy(str(src), "float32")
    experts = model.model.layers[1].mlp.experts
    assert len(experts) == 8 and all(p.is_meta for p in experts.parameters())
    weights.load_layer(1)
    assert model.model.layers[0].mlp.experts[0].gate_proj.weight.is_meta
    fused = tiny_moe("qwen3_moe").model.layers[1].mlp.experts  # the float model's own fused tensors
    inter = fused.gate_up_proj.shape[1] // 2
    for e, ex in enumerate(experts):
        assert torch.equal(ex.gate_proj.weight, fused.gate_up_proj[e, :inter])
        assert torch.equal(ex.up_proj.weight, fused.gate_up_proj[e, inter:])
        assert torch.equal(ex.down_proj.weight, fused.down_proj[e])
    names = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")]
    weights.release(names)
    assert all(p.is_meta for p in experts.parameters())
    assert not model.model.layers[1].mlp.gate.weight.is_meta  # the router stays: it is never quantised


def test_an_expert_whose_shape_disagrees_with_config_is_one_line(tmp_path):
    src = _source(tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    tensors[key] = tensors[key][:, :32].contiguous()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"{key} is \\[128, 32\\].*config makes it \\[128, 64\\]"):
        open_lazy(str(src), "float32")


_PEAK = """
import json, sys
from quantkit.formats import writer
from quantkit.job import quantize_to_checkpoint
from quantkit.recipe import Recipe

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

def run(src, out, group_size):
    r = Recipe.model_validate({"model": src, "output": out, "quant": {"method": "rtn", "group_size": group_size}})
    return quantize_to_checkpoint(r)

write, peak = writer.write_checkpoint, {}

def measured(*a, **k):  # the peak while quantising; the writer's own buffers come after
    peak.setdefault("quantising", rss("VmHWM"))
    return write(*a, **k)

warm, big, out = sys.argv[1:4]
run(warm, out + "-warm", 32)  # imports and first-call caches are not the job's memory
writer.write_checkpoint = measured
base = rss("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from here
    f.write("5")
summary = run(big, out, 128)  # codes and scales: 1.03 bytes a weight
print(json.dumps({"quantising": peak["quantising"] - base, "end": rss("VmHWM") - base,
                  "loading": summary["loading"]}))
"""


def _big_moe(folder):
    """4 experts of 256 x 512 in 8 layers: 58 MB of float32 weights, 87% of them in the experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=64, moe_intermediate_size=512, intermediate_size=512, num_experts=4,
                               num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=512,
                               num_hidden_layers=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()) * 4


def test_peak_memory_of_a_streamed_moe_is_a_fraction_of_the_float_model(tmp_path):
    """RSS growth while quantising (VmHWM after a reset, in a fresh process warmed up on a tiny MoE, up to the
    writer): about one layer (an eighth of the weights) read and solved, plus the codes of the layers before and
    a fixed ~15 MB; measured 0.76x the float size. A whole-model load holds every float weight, more than this
    bound allows (measured to the end of its run: 3.2x the float size)."""
    float_bytes = _big_moe(tmp_path / "big")
    warm = save_tiny_moe(tmp_path / "warm", "qwen3_moe")
    p = subprocess.run([sys.executable, "-c", _PEAK, str(warm), str(tmp_path / "big"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["loading"] == "layer by layer"
    assert r["quantising"] < 0.9 * float_bytes, (r, float_bytes)


def test_two_processes_stream_a_moe_as_one_does(tmp_path):
    """Experts dealt to two ranks by cost, each rank streaming every layer from a fused-expert checkpoint: the
    codes one process writes (up to GPTQ's float32 Hessian summation order, as tests/test_distributed.py), and the
    tokens routed to each expert counted over both ranks' samples."""
    src = _source(tmp_path / "src", "qwen3_moe", fused_on_disk=True)
    one, two = tmp_path / "one", tmp_path / "two"
    p = _alone(_args(src, one, "w4a16", "gptq"))
    assert p.returncode == 0, p.stderr[-2000:]
    p = _torchrun([*_args(src, two, "w4a16", "gptq"), "--json"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout[p.stdout.index("{"):])["loading"] == "layer by layer"
    _same_checkpoint(one, two)
    moe = [json.loads((d / "quantkit.json").read_text())["moe"] for d in (one, two)]
    assert moe[0]["routed_tokens"] == moe[1]["routed_tokens"]
    assert sum(moe[1]["routed_tokens"]["model.layers.0.mlp.experts"]) == 8 * 32 * 2  # every token, top-2
