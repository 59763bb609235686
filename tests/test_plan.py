"""The plan is complete when build_plan returns: `auto` settled with its reason, the bit budget's widths chosen,
each method's own options attached, and nothing changes it afterwards. Checked against what a `quantkit
quantize` run records in quantkit.json and against the checkpoint's own tensors (`quantkit inspect`)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import make_tiny_model
from test_data_support import SAMPLE, tiny_tokenizer

from quantkit.auto_method import choose_method
from quantkit.cli.quantize_cmd import _recipe
from quantkit.plan import build_plan

FLAGS = {"bits": 4.2, "group_size": 32, "calib": str(SAMPLE), "num_samples": 4, "seq_len": 32}


def test_build_plan_alone_gives_what_a_quantize_run_records(tmp_path, cli):
    """auto + --bits: build_plan on the float model, with no job around it, holds the method, its reason, every
    Linear's width and the budget record that the CLI run wrote; the widths are the checkpoint's."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path / "tiny", "llama")
    tiny_tokenizer().save_pretrained(src)
    out = tmp_path / "out"
    args = [a for k, v in FLAGS.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    code, _, err = cli("quantize", src, "-o", out, *args, "--json")
    assert code == 0, err
    meta = json.loads((out / "quantkit.json").read_text())

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    plan = build_plan(model, _recipe(None, [], {**FLAGS, "model": str(src)}))
    # the rule itself, asked directly
    method, why = choose_method(model.config, "w4a16", [], 4.2)
    assert (plan.method, plan.method_reason) == (method, why) == ("awq+gptq", why)
    assert plan.recipe.quant.method == meta["recipe"]["quant"]["method"] == "awq+gptq"
    assert meta["method_reason"] == plan.method_reason
    assert plan.awq is not None and plan.gptq is not None and plan.signround is None and plan.smooth is None
    assert {n: s.to_dict() for n, s in plan.schemes.items()} == {n: r["scheme"] for n, r in meta["layers"].items()}
    assert len({s.num_bits for s in plan.schemes.values()}) > 1  # the budget really mixed widths
    assert plan.bit_budget == meta["bit_budget"]
    # the average the plan promises is what the written tensors hold (inspect counts codes, scales, zeros)
    code, stdout, _ = cli("inspect", out, "--json")
    assert code == 0
    assert plan.bit_budget["average_bits"] == pytest.approx(json.loads(stdout)["average_bits_per_weight"], abs=1e-3)
    assert plan.bit_budget["average_bits"] <= 4.2


def test_the_plan_is_frozen_and_holds_only_the_options_its_methods_use():
    from helpers import tiny_model

    model = tiny_model("llama")
    plan = build_plan(model, _recipe(None, [], {"method": "gptq"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.schemes = {}
    assert plan.gptq is not None and plan.awq is None and plan.signround is None and plan.smooth is None
    solver = plan.make_solver("model.layers.0.mlp.up_proj", model.model.layers[0].mlp.up_proj.weight.detach())
    assert solver.gptq is plan.gptq
    plan = build_plan(model, _recipe(None, ["quant.gptq.damp=0.05"], {"method": "awq+gptq"}))
    assert plan.gptq.damp == 0.05 and plan.awq is not None
    plan = build_plan(model, _recipe(None, ["quant.smooth=true"], {"scheme": "w8a8", "method": "rtn"}))
    assert plan.gptq is None and plan.smooth is not None and plan.smooth.alpha is None
