"""`quantkit recipe validate|show|list`, `quantkit run`, resolved recipes in quantkit.json, mixed schemes."""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import yaml

import quantkit
import quantkit.cli.recipe_cmd  # noqa: F401  (registers `recipe` and `run` until cli/__init__ imports it)
from helpers import make_tiny_model, rel_err
from quantkit.linear.quant import QuantLinear
from quantkit.recipe import Recipe, load_recipe, parse_recipe, preset_names, recipes_dir


def _write(tmp_path, text: str, name: str = "r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ---- recipe validate / show / list --------------------------------------------------------------------------

def test_validate_accepts_every_shipped_recipe(cli):
    files = sorted(recipes_dir().glob("*.yaml"))
    code, out, err = cli("recipe", "validate", *files)
    assert code == 0, err
    assert out.splitlines() == [f"ok {f}" for f in files]


def test_validate_lists_every_problem_of_every_file_and_exits_2(cli, tmp_path):
    bad = _write(tmp_path, "quant:\n  sheme: w4a16\n  method: gtpq\n")
    good = _write(tmp_path, "quant:\n  scheme: w8a16\n", "good.yaml")
    code, out, err = cli("recipe", "validate", bad, good, tmp_path / "missing.yaml")
    assert code == 2
    assert out.splitlines() == [f"ok {good}"]
    lines = err.splitlines()
    assert lines[0].startswith(f"error: {bad}:2: quant.sheme: unknown field") and "did you mean 'scheme'?" in lines[0]
    assert lines[1].startswith(f"error: {bad}:3: quant.method: expected one of") and "did you mean 'gptq'?" in lines[1]
    assert "missing.yaml' does not exist" in lines[2] and len(lines) == 3


def test_show_prints_the_preset_file_as_written(cli):
    code, out, _ = cli("recipe", "show", "w4a16-gptq")
    assert code == 0 and out == (recipes_dir() / "w4a16-gptq.yaml").read_text()


def test_show_resolved_fills_defaults_and_round_trips(cli):
    code, out, _ = cli("recipe", "show", "mixed-attn8-mlp4", "--resolved")
    assert code == 0
    data = yaml.safe_load(out)
    assert data["calibration"]["cut"] == "chunk" and data["quant"]["gptq"]["block_size"] == 128  # defaults shown
    assert parse_recipe(out) == load_recipe(recipes_dir() / "mixed-attn8-mlp4.yaml")


def test_show_unknown_preset_suggests_and_exits_2(cli):
    code, _, err = cli("recipe", "show", "w8a61")
    assert code == 2 and "did you mean the preset 'w8a16'?" in err


def test_list_json_names_every_preset_with_its_description(cli):
    code, out, _ = cli("recipe", "list", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["name"] for r in rows] == preset_names() and all(r["description"] for r in rows)


# ---- resolved recipe in quantkit.json, overrides -----------------------------------------------------------

def test_run_flags_override_the_file_and_quantkit_json_records_the_resolved_recipe(cli, tmp_path):
    src = make_tiny_model(tmp_path / "src", "llama")
    recipe = _write(tmp_path, "description: test\noutput: never-used\nquant:\n  scheme: w4a16\n  method: rtn\n  group_size: 64\n"
                              "  symmetric: true\n  gptq:\n    damp: 0.02\n")
    out = tmp_path / "out"
    code, _, err = cli("run", recipe, "--model", src, "-o", out, "-q",
                       "--set", "quant.group_size=32", "--set", "quant.symmetric=false",
                       "--set", "quant.ignore=[lm_head, 're:.*down_proj']")
    assert code == 0, err
    meta = json.loads((out / "quantkit.json").read_text())
    expected = Recipe.model_validate({"description": "test", "model": str(src), "output": str(out), "quant": {
        "scheme": "w4a16", "method": "rtn", "group_size": 32, "symmetric": False, "ignore": ["lm_head", "re:.*down_proj"],
        "gptq": {"damp": 0.02}}})
    assert Recipe.model_validate(meta["recipe"]) == expected
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["group_size"], w["symmetric"]) == (32, False)
    assert "model.layers.0.mlp.down_proj" in qc["ignore"]


def test_quantkit_json_fills_in_the_group_size_the_run_chose(cli, tmp_path):
    # hidden 192 divides by 64 but not 128, so an unset group size must resolve to 64 and be recorded as such
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=384, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    recipe = _write(tmp_path, "quant:\n  scheme: w4a16\n  group_size:\n")
    code, _, err = cli("quantize", tmp_path / "src", "--recipe", recipe, "-o", tmp_path / "out", "--quiet",
                       "--method", "rtn")
    assert code == 0, err
    meta = json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert meta["recipe"]["quant"]["group_size"] == 64
    # and a flag wins over the file's value
    recipe.write_text("quant:\n  scheme: w4a16\n  group_size: 64\n  symmetric: true\n")
    code, _, err = cli("quantize", tmp_path / "src", "--recipe", recipe, "-o", tmp_path / "out2", "--quiet", "--method", "rtn",
                       "--group-size", "32", "--set", "quant.symmetric=false")
    assert code == 0, err
    q = json.loads((tmp_path / "out2" / "quantkit.json").read_text())["recipe"]["quant"]
    assert (q["group_size"], q["symmetric"]) == (32, False)


def test_run_rejects_a_misspelt_set_field_before_doing_anything(cli, tmp_path):
    code, _, err = cli("run", "w8a16", "-o", tmp_path / "out", "--set", "quant.grup_size=64")
    assert code == 2 and "option quant.grup_size: unknown field" in err and "did you mean 'group_size'?" in err
    code, _, err = cli("run", "w8a16", "-o", tmp_path / "out", "--set", "quant.group_size")
    assert code == 2 and "expected FIELD=VALUE" in err
    assert not (tmp_path / "out").exists()


# ---- mixed per-module schemes -------------------------------------------------------------------------------

def test_mixed_preset_writes_two_config_groups_that_quantkit_and_transformers_load(cli, tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "out"
    # RTN instead of the preset's GPTQ: the tiny model has no tokenizer to calibrate with; the targets are the point
    code, _, err = cli("run", "mixed-attn8-mlp4", "--model", src, "-o", out, "-q", "--set", "quant.method=rtn")
    assert code == 0, err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = {g["weights"]["num_bits"]: g for g in qc["config_groups"].values()}
    assert sorted(groups) == [4, 8] and qc["ignore"] == ["lm_head"]
    assert groups[8]["weights"]["strategy"] == "channel" and groups[4]["weights"]["group_size"] == 128

    float_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    q = quantkit.load(out, dtype=torch.float32, exact=True)
    fmods = dict(float_model.named_modules())
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)
    rmods = dict(ref.named_modules())
    for name, mod in q.named_modules():
        if name.endswith("_proj"):
            assert isinstance(mod, QuantLinear), name
            assert mod.bits == (8 if ".self_attn." in name else 4), name
            w = mod.dequantized_weight().double()
            # 8-bit per-channel keeps ~1/16 of the 4-bit step: the relative weight error tells the two apart
            err_bound = 0.01 if mod.bits == 8 else 0.15
            assert rel_err(w, fmods[name].weight) < err_bound, name
            rmods[name].weight.data = w
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = q(ids).logits
        reference = ref(ids).logits  # float64 model holding exactly the dequantised weights
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    # float32 against float64 on the same weights: rounding only (~1e-6 relative); 1e-5 is the foundation's bound
    assert rel_err(ours, reference) < 1e-5
    # compressed-tensors decompresses our files with its own code; same weights, so again only float32 rounding
    assert rel_err(theirs, ours) < 1e-4


# ---- run: quantise, then eval, then gates -------------------------------------------------------------------

@pytest.fixture
def fake_eval(monkeypatch):
    """quantkit.evaluate stand-in recording calls, so the run's order and arguments are checked exactly."""
    calls = []
    verdict = {"failures": []}

    def run_eval(base, variants, **kw):
        from pathlib import Path

        written = Path(variants[0], "config.json").is_file()
        calls.append({"base": base, "variants": variants, "checkpoint_written": written, **kw})
        return {"variants": [{"label": "base", "is_base": True}, {"label": "q", "is_base": False}]}

    def check_gates(report, gates):
        calls.append({"gates": dict(gates), "report": report})
        return list(verdict["failures"])

    pkg = types.ModuleType("quantkit.evaluate")
    pkg.run_eval, pkg.check_gates = run_eval, check_gates
    gates_mod = types.ModuleType("quantkit.evaluate.gates")
    gates_mod.check_gates = check_gates
    gates_mod.GATES = {"max_ppl_increase": "", "max_kl_p99": "", "min_agreement": ""}
    pkg.gates = gates_mod
    monkeypatch.setitem(sys.modules, "quantkit.evaluate", pkg)
    monkeypatch.setitem(sys.modules, "quantkit.evaluate.gates", gates_mod)
    return calls, verdict


def _eval_recipe(tmp_path, src):
    (tmp_path / "text.txt").write_text("some held-out text\n")
    return _write(tmp_path, f"model: {src}\noutput: {tmp_path / 'out'}\nquant:\n  scheme: w8a16\n"
                            f"eval:\n  data: {tmp_path / 'text.txt'}\n  seq_len: 64\n  max_windows: 3\n"
                            f"  gates:\n    max_ppl_increase: 0.05\n    max_kl_p99: 0.5\n")


def test_run_quantises_then_evaluates_then_checks_gates(cli, tmp_path, fake_eval):
    calls, _ = fake_eval
    src = make_tiny_model(tmp_path / "src", "llama")
    code, _, err = cli("run", _eval_recipe(tmp_path, src), "-q")
    assert code == 0, err
    ev, gates = calls
    assert ev["checkpoint_written"] and ev["base"] == str(src) and ev["variants"] == [str(tmp_path / "out")]
    assert ev["data"] == str(tmp_path / "text.txt") and ev["seq_len"] == 64 and ev["max_windows"] == 3
    assert ev["out_dir"] == str(tmp_path / "out") + "-eval"
    assert gates["gates"] == {"max_ppl_increase": 0.05, "max_kl_p99": 0.5}


def test_run_exits_1_when_a_gate_fails(cli, tmp_path, fake_eval):
    _, verdict = fake_eval
    verdict["failures"] = ["q: max_kl_p99 = 0.9 violates 0.5"]
    src = make_tiny_model(tmp_path / "src", "llama")
    code, out, err = cli("run", _eval_recipe(tmp_path, src), "--json")
    assert code == 1
    assert json.loads(out)["gates"] == {"thresholds": {"max_ppl_increase": 0.05, "max_kl_p99": 0.5},
                                        "failures": verdict["failures"], "passed": False}


def test_skip_eval_quantises_only(cli, tmp_path, fake_eval):
    calls, _ = fake_eval
    src = make_tiny_model(tmp_path / "src", "llama")
    code, _, err = cli("run", _eval_recipe(tmp_path, src), "-q", "--skip-eval")
    assert code == 0, err
    assert calls == [] and (tmp_path / "out" / "config.json").is_file()


def test_run_without_evaluation_available_fails_before_quantising(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "quantkit.evaluate", None)  # makes `import quantkit.evaluate` fail
    src = make_tiny_model(tmp_path / "src", "llama")
    code, _, err = cli("run", _eval_recipe(tmp_path, src), "-q")
    assert code == 2 and "evaluation is not available" in err and "--skip-eval" in err
    assert not (tmp_path / "out").exists()


def test_run_with_a_missing_eval_file_fails_before_quantising(cli, tmp_path, fake_eval):
    src = make_tiny_model(tmp_path / "src", "llama")
    recipe = _eval_recipe(tmp_path, src)
    (tmp_path / "text.txt").unlink()
    code, _, err = cli("run", recipe, "-q")
    assert code == 2 and "eval.data:" in err and "does not exist" in err
    assert not (tmp_path / "out").exists()
