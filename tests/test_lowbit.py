"""W3/W2 checkpoints and mixed precision under a bit budget: the dense 3-bit packing is compressed-tensors'
own bit for bit, transformers + compressed-tensors and quantkit.load give the same logits, and --bits spends
its budget on the Linears whose rounding error is largest."""
from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from safetensors import safe_open
from typer.testing import CliRunner

import quantkit
import quantkit.cli.inspect_cmd  # noqa: F401  (registers the commands for CliRunner)
import quantkit.cli.quantize_cmd  # noqa: F401
from quantkit.cli import app
from quantkit.errors import UserError
from quantkit.formats.pack import pack_int32, unpack_int32
from quantkit.inspect_ckpt import inspect_checkpoint
from quantkit.plan import build_plan
from quantkit.recipe import Recipe
from quantkit.schemes import get_scheme
from quantkit.solvers.bit_budget import Option, choose_widths, stored_bits
from test_fp8_checkpoint import IDS, _model, _quantize

P = "model.layers.1.mlp.down_proj"  # in_features 128 in the tiny model


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("cols", [1, 37, 96, 576])
def test_packing_is_compressed_tensors_bit_for_bit(bits, cols):
    g = torch.Generator().manual_seed(bits * 1000 + cols)
    q = torch.randint(-(1 << bits - 1), 1 << bits - 1, (7, cols), generator=g).to(torch.int8)
    ours, theirs = pack_int32(q, bits), pack_to_int32(q, bits)
    assert ours.dtype == torch.int32 and ours.shape == (7, -(-cols * bits // 32))
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_from_int32(ours, bits, q.shape), q)
    assert torch.equal(unpack_int32(theirs, bits, cols), q)
    # zero points are packed along dim 0
    qt = q.t().contiguous()
    assert torch.equal(pack_int32(qt, bits, dim=0), pack_to_int32(qt, bits, packed_dim=0))
    assert torch.equal(unpack_int32(pack_int32(qt, bits, dim=0), bits, cols, dim=0), qt)


@pytest.mark.parametrize("quant,default_path", [
    ({"scheme": "w3a16", "group_size": 32, "method": "gptq"}, True),
    ({"scheme": "w2a16", "method": "rtn"}, True),
    # asymmetric: transformers 5.24's default compressed path refuses packed zero points at any width (W4 too)
    ({"scheme": "w3a16", "symmetric": False, "method": "rtn"}, False),
])
def test_low_bit_checkpoint_logits_match_transformers(tmp_path, quant, default_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = _model()
    float_logits = model(IDS).logits.detach()
    res = _quantize(tmp_path / "out", model, quant)
    scheme = res.qweights[P].scheme
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    w = cfg["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], cfg["format"]) == (scheme.num_bits, scheme.group_size, "pack-quantized")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        packed = f.get_tensor(f"{P}.weight_packed")
    assert packed.shape == (64, 128 * scheme.num_bits // 32)  # 12 words of 3-bit codes, 8 of 2-bit ones
    assert torch.equal(unpack_from_int32(packed, scheme.num_bits, (64, 128)), res.qweights[P].q)
    ours = quantkit.load(tmp_path / "out", dtype=torch.float32, exact=True)
    assert torch.equal(ours.get_submodule(P).dequantized_weight(), res.qweights[P].dequantize())
    with torch.no_grad():
        got, ref = ours(IDS).logits, model(IDS).logits
    size = ref.abs().max().item()
    assert (got - ref).abs().max().item() < 1e-5 * size
    assert (float_logits - ref).abs().max().item() > 1e-2 * size
    configs = [CompressedTensorsConfig(dequantize=True)] + ([None] if default_path else [])
    for qc in configs:
        kw = {} if qc is None else {"quantization_config": qc}
        ext = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, **kw)
        with torch.no_grad():
            theirs = ext(IDS).logits.float()
        assert (theirs - got).abs().max().item() < 1e-5 * size
    row = next(r for r in inspect_checkpoint(tmp_path / "out")["layers"] if r["layer"] == P)
    assert row["shape"] == [64, 128] and row["bits"] == scheme.num_bits


def _options(errors: dict[str, tuple[float, float, float]]) -> dict[str, list[Option]]:
    schemes = [get_scheme("w3a16"), get_scheme("w4a16").with_options(group_size=64), get_scheme("w8a16")]
    return {n: [Option(s, stored_bits(s, 10, 128), e, 1280) for s, e in zip(schemes, errs)]
            for n, errs in errors.items()}


def test_budget_goes_to_the_most_sensitive_layers_and_stays_under_target():
    # 10 x 128 Linears: 3.25, 4.25 and 8.125 bits per weight; "hot" loses 25-100x more by rounding at 3/4 bits
    opts = _options({"hot": (100.0, 30.0, 0.1), "mid": (4.0, 1.0, 0.01), "cold": (1.0, 0.3, 0.01),
                     "cold2": (1.0, 0.3, 0.01)})
    for target, want in [(3.25, {"hot": 3, "mid": 3, "cold": 3, "cold2": 3}),
                         (3.6, {"hot": 4, "mid": 3, "cold": 3, "cold2": 3}),
                         (4.6, {"hot": 8, "mid": 3, "cold": 3, "cold2": 3}),  # 672 bits left: no upgrade fits
                         (4.85, {"hot": 8, "mid": 4, "cold": 3, "cold2": 3})]:
        chosen = choose_widths(opts, target)
        assert {n: o.scheme.num_bits for n, o in chosen.items()} == want
        assert sum(o.bits for o in chosen.values()) <= target * 4 * 1280
    with pytest.raises(ValueError, match="3.250"):
        choose_widths(opts, 3.2)


def test_plan_upgrades_the_heavy_tailed_layer_and_records_it():
    model = _model()
    with torch.no_grad():  # heavy tails at the same norm: each group's largest weights stretch its scale
        w = model.get_submodule(P).weight
        heavy = w.sign() * w.abs().pow(3)
        w.copy_(heavy * (w.norm() / heavy.norm()))
    recipe = Recipe.model_validate({"quant": {"scheme": "w4a16", "method": "rtn", "bits": 3.8}})
    plan = build_plan(model, recipe)
    bits = {n: s.num_bits for n, s in plan.schemes.items()}
    assert bits[P] == max(bits.values()) and bits[P] > min(bits.values())
    b = plan.bit_budget
    assert b["average_bits"] <= 3.8 and b["layers"][P]["bits"] == bits[P]
    sens = b["layers"][P]["sensitivity"]
    assert set(sens) == {"3g64", "3g32", "4g64", "4g32", "8"}  # the tiny model's default group is 64
    assert sens["3g64"] > sens["3g32"] > sens["4g64"] > sens["4g32"] > sens["8"] > 0
    with pytest.raises(UserError, match="below the cheapest mix"):
        r = Recipe.model_validate({"quant": {"bits": 2.5}})
        build_plan(model, r)
    with pytest.raises(UserError, match="--scheme w4a16"):
        r = Recipe.model_validate({"quant": {"scheme": "fp8", "bits": 4.5}})
        build_plan(model, r)


def test_cli_bits_writes_groups_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    _model().save_pretrained(tmp_path / "src")
    r = CliRunner().invoke(app, ["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "q"), "--bits", "4.2", "--method", "rtn",
                                 "--quiet"])
    assert r.exit_code == 0, r.output
    info = json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path / "q"), "--json"]).output)
    assert info["average_bits_per_weight"] <= 4.2 and info["bit_budget"]["target"] == 4.2
    assert len({row["bits"] for row in info["layers"]}) > 1  # float32 scales: 3-bit g64 is 3.5, 4-bit 4.5
    groups = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert len(groups) > 1
    ours = quantkit.load(tmp_path / "q", dtype=torch.float32, exact=True)
    # the default (compressed) path: transformers 5.24's dequantize=True decodes every dense Linear with the
    # first config group's scheme, so it cannot read a checkpoint mixing widths (docs/lowbit.md)
    ext = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    with torch.no_grad():
        got, theirs = ours(IDS).logits, ext(IDS).logits.float()
    assert (theirs - got).abs().max().item() < 1e-5 * got.abs().max().item()
    bad = CliRunner().invoke(app, ["quantize", str(tmp_path / "src"), "-o", str(tmp_path / "b"), "--bits", "3", "--method", "rtn",
                                   "--quiet"])
    # main() prints a UserError as one line and exits with its code (2); CliRunner hands back the exception
    assert isinstance(bad.exception, UserError) and bad.exception.exit_code == 2
    assert "raise --bits" in str(bad.exception)
