"""Linears that read one tensor (q/k/v, gate/up) need its Hessian once: the pipeline feeds the first solver of
such a group and the others adopt its sums (LinearSolver.shared_statistics / adopt). This must change nothing
but the work: every code and scale equals what each solver gathering its own statistics writes."""
from __future__ import annotations

import collections

import pytest
import torch

from test_awq import tiny_model
from quantkit.pipeline import quantize_model
from quantkit.plan import build_plan
from quantkit.recipe import Recipe
from quantkit.solvers.gptq_solver import GPTQSolver


def _samples(n=5, length=24):
    return [torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _run(arch: str, quant: dict, monkeypatch, share: bool):
    fed = collections.Counter()
    accumulate = GPTQSolver._accumulate

    def counting(self, S, seen, x):
        fed[self.name.rsplit(".", 1)[-1]] += 1
        return accumulate(self, S, seen, x)

    with monkeypatch.context() as mp:
        mp.setattr(GPTQSolver, "_accumulate", counting)
        if not share:
            mp.setattr(GPTQSolver, "shared_statistics", lambda self: None)
        m = tiny_model(arch, layers=2)
        recipe = Recipe.model_validate({"quant": quant, "calibration": {"holdout": 0.2}})
        return quantize_model(m, build_plan(m, recipe), _samples()), fed


@pytest.mark.parametrize("arch,quant,shares", [
    ("llama", {"method": "gptq", "group_size": 32}, True),
    ("llama", {"method": "gptq", "group_size": 32, "symmetric": False}, True),
    ("qwen2", {"method": "gptq", "scheme": "w8a16", "group_size": -1}, True),
    ("llama", {"method": "gptq", "scheme": "fp8-dynamic"}, True),
    # a static input scale is gathered beside the Hessian, per Linear: nothing is shared
    ("llama", {"method": "gptq", "scheme": "w8a8-static"}, False),
])
def test_sharing_writes_what_each_solver_gathering_its_own_writes(arch, quant, shares, monkeypatch):
    shared, fed = _run(arch, quant, monkeypatch, share=True)
    alone, fed_alone = _run(arch, quant, monkeypatch, share=False)
    assert set(shared.qweights) == set(alone.qweights)
    for name, qw in shared.qweights.items():
        ref = alone.qweights[name]
        assert torch.equal(qw.q, ref.q) and torch.equal(qw.scale, ref.scale), name
        assert qw.stats["tokens"] == ref.stats["tokens"] and qw.stats.get("held_out_error") == ref.stats.get(
            "held_out_error"), name
    # each input group's Hessian was summed once, through its first Linear: 5 samples x 2 layers
    assert fed_alone["k_proj"] == fed_alone["up_proj"] == 10
    assert fed["q_proj"] == fed["gate_proj"] == fed["o_proj"] == fed["down_proj"] == 10
    assert fed["k_proj"] == fed["v_proj"] == fed["up_proj"] == (0 if shares else 10)
