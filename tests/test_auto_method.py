"""`--method auto`, the default: AWQ+GPTQ (AWQ alone on little calibration text) for integer weights of 4 bits or
fewer on a mapped architecture, RTN elsewhere (docs/benchmarks.md, "The default method"), settled once and
recorded in quantkit.json."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_model, make_tiny_unmapped_model
from test_data_support import SAMPLE, tiny_tokenizer

from quantkit.auto_method import choose_method, resolve
from quantkit.recipe import Recipe, apply_overrides

CALIB = ("--calib", SAMPLE, "--num-samples", "4", "--seq-len", "32")


def _config(model_type):
    from types import SimpleNamespace

    from helpers import tiny_config
    from transformers import GPTNeoXConfig, OPTConfig

    if model_type == "gpt_neox":
        return GPTNeoXConfig()
    if model_type == "opt-post-norm":  # opt-350m's layout: a mapped model type whose config has no map
        return OPTConfig(do_layer_norm_before=False)
    return tiny_config(model_type) if model_type else SimpleNamespace(model_type=None)


@pytest.mark.parametrize("model_type, scheme, targets, bits, expected", [
    ("llama", "w4a16", [], None, "awq+gptq"),
    ("qwen2", "w3a16", [], None, "awq+gptq"),
    ("opt", "w2a16", [], None, "awq+gptq"),
    ("llama", "w8a16", ["w4a16"], None, "awq+gptq"),  # a 4-bit part is what AWQ and GPTQ are for
    ("llama", "w8a16", [], 4.5, "awq+gptq"),  # a budget under 8 bits hands out 3 and 4-bit widths
    ("llama", "w8a16", [], None, "rtn"),
    ("llama", "fp8", [], None, "rtn"),
    ("llama", "fp8-dynamic", [], None, "rtn"),
    ("llama", "w8a8", [], None, "rtn"),
    ("llama", "nvfp4", [], None, "rtn"),
    ("llama", "mxfp4", ["w4a16"], None, "rtn"),  # AWQ refuses FP4 schemes, so one FP4 part rules it out
    ("gpt_neox", "w4a16", [], None, "rtn"),  # no AWQ map
    ("opt-post-norm", "w4a16", [], None, "rtn"),
    (None, "w4a16", [], None, "rtn"),
])
def test_choice_per_scheme_and_architecture(model_type, scheme, targets, bits, expected):
    method, why = choose_method(_config(model_type), scheme, targets, bits)
    assert method == expected
    assert why.startswith(f"auto: {expected} (")


def test_every_calibration_size_gets_awq_then_gptq():
    """GPTQ with its decorrelation prior beat AWQ alone in-domain and across domains at 2,048 tokens, and AWQ+GPTQ
    was already the best from 32,768 (docs/benchmarks.md, "GPTQ at every calibration size"): the recipe's
    samples x length no longer moves the choice."""
    cfg = _config("llama")
    for samples, length in ((8, 256), (16, 256), (128, 512)):
        small = apply_overrides(Recipe(), {"calibration.num_samples": samples, "calibration.seq_len": length})
        assert resolve(small, cfg)[0].quant.method == "awq+gptq"


def test_build_plan_settles_auto_itself():
    """Callers of build_plan without the job (bench scripts, tests) get the same choice, and no solver ever
    sees 'auto'."""
    from helpers import tiny_model

    from quantkit.plan import build_plan, solver_for
    from quantkit.schemes import get_scheme

    model = tiny_model("llama")
    plan = build_plan(model, Recipe())
    assert plan.method == "awq+gptq" and plan.awq is not None and plan.needs_data
    assert plan.method_reason.startswith("auto: awq+gptq")
    assert {s.actorder for s in plan.schemes.values()} == {"weight"}  # GPTQ's own default comes with it
    plan = build_plan(model, apply_overrides(Recipe(), {"quant.scheme": "w8a16"}))
    assert plan.method == "rtn" and plan.awq is None and not plan.needs_data
    with pytest.raises(ValueError, match="concrete method"):
        solver_for("auto", get_scheme("w4a16"))


def test_default_is_auto_and_a_given_method_is_kept():
    assert Recipe().quant.method == "auto"
    given = apply_overrides(Recipe(), {"quant.method": "gptq"})
    same, why = resolve(given, _config("llama"))
    assert same is given and why is None
    chosen, why = resolve(Recipe(), _config("llama"))
    assert chosen.quant.method == "awq+gptq" and why.startswith("auto: awq+gptq")
    assert Recipe().quant.method == "auto"  # resolve copies; the caller's recipe is not changed


def test_cli_default_runs_awq_then_gptq_and_records_why(tmp_path, cli):
    src = make_tiny_model(tmp_path / "tiny", "llama")
    tiny_tokenizer().save_pretrained(src)
    out = tmp_path / "out"
    code, stdout, err = cli("quantize", src, "-o", out, "--group-size", "32", *CALIB, "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["method"] == "awq+gptq" and summary["method_reason"].startswith("auto: awq+gptq")
    meta = json.loads((out / "quantkit.json").read_text())
    # the recipe stored is the one that ran: re-running it gives the same method even if the default changes
    assert meta["recipe"]["quant"]["method"] == "awq+gptq"
    assert meta["method_reason"] == summary["method_reason"]
    assert all("awq_alpha" in s and "hessian_decorrelate" in s for s in meta["layers"].values())
    assert meta["calibration"]["spec"] == str(SAMPLE)
    code, stdout, _ = cli("inspect", out, "--json")
    assert code == 0 and json.loads(stdout)["method_reason"] == summary["method_reason"]
    code, stdout, _ = cli("inspect", out)
    assert code == 0 and "method auto: awq+gptq (" in stdout


def test_cli_default_on_an_unmapped_architecture_is_rtn_without_calibration(tmp_path, cli):
    src = make_tiny_unmapped_model(tmp_path / "neox")
    tiny_tokenizer().save_pretrained(src)
    out = tmp_path / "out"
    code, stdout, err = cli("quantize", src, "-o", out, "--group-size", "32", "--json")
    assert code == 0, err  # not AWQ's "no scaling map" error: auto never picks what cannot run
    summary = json.loads(stdout)
    assert summary["method"] == "rtn" and "no scaling map for this 'gpt_neox' model" in summary["method_reason"]
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["recipe"]["quant"]["method"] == "rtn"
    assert meta["calibration"]["spec"] is None  # RTN needs no text, so none was sampled


def test_cli_default_w8_is_rtn(tmp_path, cli):
    src = make_tiny_model(tmp_path / "tiny", "llama")
    out = tmp_path / "out"
    code, stdout, err = cli("quantize", src, "-o", out, "--scheme", "w8a16", "--json")
    assert code == 0, err
    assert json.loads(stdout)["method"] == "rtn"
    assert json.loads((out / "quantkit.json").read_text())["calibration"]["spec"] is None


def test_cli_default_with_a_bit_budget_scales_then_mixes_widths(tmp_path, cli):
    """auto + --bits: AWQ+GPTQ runs over the widths the budget chose, and transformers computes what quantkit
    does."""
    from transformers import AutoModelForCausalLM

    import quantkit

    src = make_tiny_model(tmp_path / "tiny", "llama")
    tiny_tokenizer().save_pretrained(src)
    out = tmp_path / "out"
    code, stdout, err = cli("quantize", src, "-o", out, "--bits", "4.2", "--group-size", "32", *CALIB, "--json")
    assert code == 0, err
    assert json.loads(stdout)["method"] == "awq+gptq"
    meta = json.loads((out / "quantkit.json").read_text())
    assert len({s["scheme"]["num_bits"] for s in meta["layers"].values()}) > 1
    assert any(s.get("awq_alpha") is not None for s in meta["layers"].values())
    ids = torch.tensor([[5, 9, 100, 33, 2, 250, 7]])
    ours = quantkit.load(out, dtype=torch.float32, exact=True)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits.float()
    assert (a - b).abs().max().item() < 1e-5 * a.abs().max().item()


def test_a_tokenizer_built_from_nothing_is_no_tokenizer(tmp_path, cli):
    """transformers makes a gemma tokenizer of special tokens only when the folder has none; the default (AWQ)
    then stops with the one-line fix instead of calibrating on those tokens."""
    src = make_tiny_model(tmp_path / "gemma", "gemma")
    code, _, err = cli("quantize", src, "-o", tmp_path / "out", "--group-size", "32")
    assert code == 2 and "has no tokenizer" in err and "--method rtn" in err
    assert not (tmp_path / "out").exists()
    code, _, err = cli("quantize", src, "-o", tmp_path / "out", "--group-size", "32", "--method", "rtn", "-q")
    assert code == 0, err
    assert not (tmp_path / "out" / "tokenizer_config.json").exists()
