"""The checkpoint layout, quantkit.load, and loading through transformers + compressed-tensors."""
import json

import pytest
import torch
from safetensors import safe_open

import quantkit
from helpers import make_tiny_model, rel_err, tree_hash
from quantkit.linear.quant import QuantLinear

IDS = torch.tensor([[3, 17, 250, 99, 4, 410, 12, 77, 301, 5]])


def _dequantized_float_model(src, ckpt):
    """The source architecture with every quantised Linear's weight replaced by its dequantised value."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    q = quantkit.load(ckpt, dtype=torch.float32, exact=True)
    qmods = dict(q.named_modules())
    for name, mod in ref.named_modules():
        if isinstance(qmods.get(name), QuantLinear):
            mod.weight.data = qmods[name].dequantized_weight()
    return ref, q


@pytest.mark.parametrize("args", [
    ["--scheme", "w4a16", "--group-size", "32"],
    ["--scheme", "w4a16", "--group-size", "64", "--set", "quant.symmetric=false"],
    ["--scheme", "w4a16", "--group-size", "-1", "--set", "quant.clip_search=true"],
    ["--scheme", "w8a16", "--group-size", "-1"],
    ["--scheme", "w8a16", "--group-size", "128", "--set", "quant.symmetric=false"],
])
def test_layout_and_logits(tmp_path, cli, args):
    src = make_tiny_model(tmp_path / "src", "llama")
    before = tree_hash(src)
    out = tmp_path / "out"
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", *args)
    assert code == 0, err
    assert tree_hash(src) == before  # the source model is never modified
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    bits = 4 if "w4a16" in args else 8
    gs = int(args[args.index("--group-size") + 1])
    assert w["num_bits"] == bits and w["type"] == "int"
    assert w["symmetric"] == ("quant.symmetric=false" not in args)
    assert w["strategy"] == ("channel" if gs == -1 else "group") and w["group_size"] == (None if gs == -1 else gs)
    assert qc["ignore"] == ["lm_head"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        p = "model.layers.0.mlp.down_proj"
        packed = f.get_tensor(f"{p}.weight_packed")
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (128, 256 * bits // 32)
        assert f.get_tensor(f"{p}.weight_scale").shape == (128, 1 if gs == -1 else 256 // gs)
        assert f.get_tensor(f"{p}.weight_scale").dtype == torch.float32  # the model dtype (float32 here)
        assert f.get_tensor(f"{p}.weight_shape").tolist() == [128, 256]
        assert (f"{p}.weight_zero_point" in keys) == ("quant.symmetric=false" in args)
        if "quant.symmetric=false" in args:
            groups = 1 if gs == -1 else 256 // gs
            assert tuple(f.get_tensor(f"{p}.weight_zero_point").shape) == (128 * bits // 32, groups)
        assert f"{p}.weight" not in keys and "lm_head.weight" in keys  # lm_head stays float (not tied here)
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["recipe"]["quant"]["scheme"] == ("w4a16" if bits == 4 else "w8a16")
    assert set(meta["versions"]) >= {"torch", "transformers"}
    assert all(0 < v["weight_rel_error"] < 0.3 for v in meta["layers"].values())
    ref, q = _dequantized_float_model(src, out)
    assert isinstance(q.model.layers[1].self_attn.q_proj, QuantLinear)
    with torch.no_grad():
        # both compute in float32 from identical weights; only summation order may differ
        assert rel_err(q(IDS).logits, ref(IDS).logits) < 1e-5


def test_no_full_float_copy(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "out"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "32")[0] == 0
    q = quantkit.load(out, exact=True)
    for name, mod in q.named_modules():
        if isinstance(mod, QuantLinear):
            assert not hasattr(mod, "weight")  # only the packed tensors live in memory
    params = {n for n, _ in q.named_parameters()}
    assert not any(n.endswith("proj.weight") for n in params)


@pytest.mark.parametrize("asym", [False, True])
def test_loads_through_transformers_and_compressed_tensors(tmp_path, cli, asym):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = make_tiny_model(tmp_path / "src", "qwen2", dtype=torch.float16)
    out = tmp_path / "out"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "32", *(["--set", "quant.symmetric=false"] if asym else []))[0] == 0
    # transformers 5.24's compressed (default) path registers zero points unpacked and re-initialises the
    # packed ones it reads, so asymmetric checkpoints are loaded with its dequantize=True path, which applies
    # compressed-tensors' own decompress (packed zero points along dim 0, as we write them).
    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if asym else {}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        scales = [f.get_tensor(k) for k in f.keys() if k.endswith("weight_scale")]
    # symmetric 4-bit: full-range scales, signed; both loaders must multiply codes by them as stored
    assert any((s < 0).any() for s in scales) != asym
    ext = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **kw)
    ours = quantkit.load(out, dtype=torch.float32, exact=True)
    with torch.no_grad():
        assert rel_err(ours(IDS).logits, ext(IDS).logits) < 1e-3


def test_tied_embeddings_round_trip(tmp_path, cli):
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path / "src", "qwen2")
    m = AutoModelForCausalLM.from_pretrained(src)
    m.config.tie_word_embeddings = True
    m.tie_weights()
    m.save_pretrained(src)
    out = tmp_path / "out"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "64")[0] == 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    q = quantkit.load(out, dtype=torch.float32, exact=True)
    assert q.lm_head.weight.data_ptr() == q.model.embed_tokens.weight.data_ptr()


def test_cpu_fast_path_uses_packed_ops_and_stays_close(tmp_path, cli):
    from quantkit.kernels import dispatch

    src = make_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "out"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "32")[0] == 0
    exact = quantkit.load(out, dtype=torch.float32, exact=True)
    fast = quantkit.load(out, dtype=torch.float32)
    layer = fast.model.layers[0].mlp.down_proj
    x = torch.randn(1, 256)
    assert dispatch.choose(layer, 1, x) == "cpu-int4pack"
    assert dispatch.choose(exact.model.layers[0].mlp.down_proj, 1, x) == "torch-dequant-matmul"
    with torch.no_grad():
        a, b = fast(IDS).logits, exact(IDS).logits
    # the packed op takes bf16 activations (8 mantissa bits, ~4e-3 relative per value); through two layers the
    # logits move by well under 3e-2 relative, while a wrong weight layout would move them by order 1
    assert 0 < rel_err(a, b) < 3e-2
    assert a.dtype == torch.float32


def test_float16_source_computes_in_float32_on_cpu_and_is_stored_in_float16(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama", dtype=torch.float16)
    out = tmp_path / "out"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "32")[0] == 0
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["dtypes"] == {"compute": "torch.float32", "storage": "torch.float16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight_scale").dtype == torch.float16
        assert f.get_tensor("model.norm.weight").dtype == torch.float16
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16
    ref, q = _dequantized_float_model(src, out)
    with torch.no_grad():
        # both float32 from the same fp16-stored weights: only summation order differs
        assert rel_err(q(IDS).logits, ref(IDS).logits) < 1e-5
