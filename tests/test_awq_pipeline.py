"""AWQ through the whole job: the CLI records alpha per layer in quantkit.json, and an awq+gptq checkpoint loads
with quantkit.load and computes what the in-memory quantised (folded, clipped, dequantised) model computes."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_model, make_tiny_unmapped_model
from test_data_support import SAMPLE, tiny_tokenizer

import quantkit
from quantkit.data import load_calibration
from quantkit.models.hf import load_float_model
from quantkit.job import quantize_to_checkpoint
from quantkit.pipeline import quantize_model
from quantkit.plan import build_plan
from quantkit.recipe import Recipe


def _model_dir(tmp_path, arch="llama"):
    folder = make_tiny_model(tmp_path / f"tiny-{arch}", arch)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_cli_awq_records_alpha_and_clip_per_layer(tmp_path, cli):
    src = _model_dir(tmp_path)
    out = tmp_path / "out"
    code, _, err = cli("quantize", src, "-o", out, "--method", "awq", "--group-size", "32", "--calib", SAMPLE,
                       "--num-samples", "4", "--seq-len", "32", "--set", "quant.awq.clip_prior_tokens=96", "-q")
    assert code == 0, err
    meta = json.loads((out / "quantkit.json").read_text())
    layers = meta["layers"]
    assert meta["recipe"]["quant"]["method"] == "awq" and len(layers) == 14
    for name, s in layers.items():
        assert "awq_alpha" in s, name
        if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")):
            assert "awq_guard" in s, name  # the held-out verdict is recorded either way
            if s["awq_alpha"] is None:  # dropped by the guard, which says why
                assert s["awq_guard"].startswith("rtn scales: held-out error"), name
            else:
                assert 0.0 <= s["awq_alpha"] <= 1.0, name
            assert s["awq_block_error"] <= s["rtn_block_error"], name
        if not name.endswith(("q_proj", "k_proj")):  # q/k keep their full range
            assert 0.5 <= s["awq_clip_min"] <= s["awq_clip_mean"] <= 1.0, name
            # the clip's Gram was measured on the 3 samples the guard does not hold out: 96 tokens, as many as
            # the prior's, so half its off-diagonal part is dropped
            assert s["awq_clip_decorrelate"] == 0.5, name
    # the tiny llama uses grouped-query attention: v_proj's rows are not o_proj's columns
    assert layers["model.layers.0.self_attn.o_proj"]["awq_alpha"] is None


def test_cli_unmapped_architecture_exit_code_and_fallback(tmp_path, cli):
    src = make_tiny_unmapped_model(tmp_path / "neox")
    tiny_tokenizer().save_pretrained(src)
    args = ["quantize", src, "--method", "awq", "--group-size", "32", "--calib", SAMPLE, "--num-samples", "2",
            "--seq-len", "16", "-q"]
    code, out, err = cli(*args, "-o", tmp_path / "a")
    assert code == 2 and "gpt_neox" in out + err and "--set quant.awq.fallback=rtn" in out + err
    code, _, err = cli(*args, "-o", tmp_path / "b", "--set", "quant.awq.fallback=rtn")
    assert code == 0, err
    layers = json.loads((tmp_path / "b" / "quantkit.json").read_text())["layers"]
    assert all(s["awq_alpha"] is None for s in layers.values())


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_awq_gptq_checkpoint_loads_and_matches_the_quantised_model(tmp_path, arch):
    src = _model_dir(tmp_path, arch)
    recipe = Recipe.model_validate({
        "model": str(src), "output": str(tmp_path / "out"), "dtype": "float32",
        "quant": {"method": "awq+gptq", "group_size": 32},
        "calibration": {"spec": str(SAMPLE), "num_samples": 4, "seq_len": 32}})
    summary = quantize_to_checkpoint(recipe)
    meta = json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert all("awq_alpha" in s for s in meta["layers"].values())

    # the same job in memory: same calibration tokens, so the same scales, clips and GPTQ codes
    model, tok, _ = load_float_model(str(src), "float32")
    c = recipe.calibration
    calib = load_calibration(spec=c.spec, tokenizer=tok, num_samples=c.num_samples, seq_len=c.seq_len, seed=c.seed)
    ids = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        float_logits = model(ids).logits
    quantize_model(model, build_plan(model, recipe), calib.samples)
    loaded = quantkit.load(summary["output"], exact=True)
    with torch.no_grad():
        want = model(ids).logits
        got = loaded(ids).logits
    # both dequantise the same codes in float32; only summation order differs
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    # and it is a quantised model, not the float one
    assert ((got - float_logits).norm() / float_logits.norm()).item() > 1e-3


def test_awq_searches_with_the_scales_the_checkpoint_stores(tmp_path):
    """On a CPU the model computes in float32, but a bfloat16 model's checkpoint stores bfloat16 scales: AWQ's
    alpha and clip searches must score those, not the float16 ones the float32 weights would suggest."""
    import torch

    from helpers import tiny_model
    from quantkit.pipeline.sequential import transforms_for

    model = tiny_model("llama")
    recipe = Recipe.model_validate({"quant": {"method": "awq", "group_size": 32}})
    for storage, want in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                          (torch.float32, torch.float16)):
        awq = transforms_for(model, build_plan(model, recipe, storage))[0]
        assert awq._scale_dtype(torch.float32) == want
