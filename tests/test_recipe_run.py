"""`quantkit run` with the real evaluation: a tiny model with a real tokenizer, and ci-smoke end to end (slow)."""
from __future__ import annotations

import json

import pytest
import torch

import quantkit
import quantkit.cli.recipe_cmd  # noqa: F401  (registers `recipe` and `run` until cli/__init__ imports it)
from helpers import make_tiny_model
from quantkit.recipe import load_recipe, recipes_dir
from test_data_support import SAMPLE, tiny_tokenizer


@pytest.fixture
def tiny_with_tokenizer(tmp_path):
    tok = tiny_tokenizer()
    src = make_tiny_model(tmp_path / "src", "llama", vocab_size=len(tok))
    tok.save_pretrained(src)
    return src


def _recipe(tmp_path, src, gates: str):
    p = tmp_path / "r.yaml"
    p.write_text(f"model: {src}\noutput: {tmp_path / 'out'}\nquant:\n  scheme: w4a16\n  method: rtn\n  group_size: 32\n"
                 f"eval:\n  data: {SAMPLE}\n  seq_len: 64\n  max_windows: 4\n  output: {tmp_path / 'report'}\n"
                 f"  gates:\n{gates}")
    return p


def test_run_evaluates_the_written_checkpoint_and_passes_loose_gates(cli, tmp_path, tiny_with_tokenizer):
    # a KL p99 of 50 nats only fails for a broken pipeline (e.g. base compared with an unrelated model)
    recipe = _recipe(tmp_path, tiny_with_tokenizer, "    max_kl_p99: 50\n    max_ppl_increase: 1.0\n")
    code, out, err = cli("run", recipe, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["gates"] == {"thresholds": {"max_kl_p99": 50.0, "max_ppl_increase": 1.0}, "failures": [],
                               "passed": True}
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    base, variant = report["variants"]
    assert base["is_base"] and not variant["is_base"]
    assert report["settings"]["windows"] == 4 and report["settings"]["seq_len"] == 64
    # 4-bit weights change the distribution: a KL of exactly 0 would mean the base was compared with itself
    assert variant["kl"]["mean"] > 0 and variant["ppl"] != base["ppl"]


def test_run_exits_1_on_a_real_gate_failure(cli, tmp_path, tiny_with_tokenizer):
    # no 4-bit model agrees with its base on more than every token: this gate cannot pass
    recipe = _recipe(tmp_path, tiny_with_tokenizer, "    min_token_agreement: 1.01\n")
    code, _, err = cli("run", recipe)
    assert code == 1
    assert "gate failed" in err and "min_token_agreement" in err


@pytest.mark.slow
def test_ci_smoke_recipe_end_to_end(cli, tmp_path, embedded_dir):
    """What CI runs: the shipped ci-smoke recipe on the embedded SmolLM2, quantise + load + eval + gates."""
    out = tmp_path / "ci-smoke"
    code, stdout, err = cli("run", recipes_dir() / "ci-smoke.yaml", "-o", out, "--json")
    assert code == 0, err
    result = json.loads(stdout)
    assert result["gates"]["passed"] and not result["gates"]["failures"]
    recipe = load_recipe(recipes_dir() / "ci-smoke.yaml")
    assert result["gates"]["thresholds"] == recipe.eval.gates
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["recipe"]["quant"]["group_size"] == 64 and meta["recipe"]["output"] == str(out)
    assert (tmp_path / "ci-smoke-eval" / "report.md").is_file()
    model = quantkit.load(out, exact=True)
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
