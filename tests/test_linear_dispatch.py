"""quantkit/linear/dispatch.py picks each Linear's module, and the runtime builds its decode plan as it loads a
model: on the model before any forward, not in a module-level cache."""
from __future__ import annotations

import copy
import io
import weakref

import pytest
import quantkit
import torch
from helpers import make_tiny_model
from torch import nn

from quantkit.linear import dispatch
from quantkit.linear import half_weight as half
from quantkit.linear.fp8 import FP8Linear
from quantkit.linear.half_head import HalfHead
from quantkit.linear.packed import PackedLinear, available as onednn_available
from quantkit.linear.quant import QuantLinear
from quantkit.runtime import build, llama_step
from quantkit.runtime.forward import forward
from quantkit.runtime.kv_cache import new_decode_cache
from quantkit.testing.packed import make_packed

INT_GROUP = {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True}}
FP8_GROUP = {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}, "input_activations": None}


def _quant_linear(n: int = 64, k: int = 64) -> QuantLinear:
    p = make_packed(n, k, 4, 32, symmetric=True, seed=1)
    m = QuantLinear(k, n, 4, 32, dtype=torch.float32)
    m.weight_packed, m.weight_scale = p.weight_packed, p.weight_scale.float()
    return m


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin.requires_grad_(False)


def test_stored_module_follows_the_config_groups_weight_type():
    lin = nn.Linear(64, 32)
    q = dispatch.stored(lin, INT_GROUP, has_g_idx=False, has_input_scale=False, dtype=torch.float16)
    assert type(q) is QuantLinear and (q.bits, q.group_size, q.bias is not None) == (4, 32, True)
    f = dispatch.stored(lin, FP8_GROUP, has_g_idx=False, has_input_scale=False, dtype=torch.float16)
    assert type(f) is FP8Linear and f.weight_scale.shape == (32, 1)


@pytest.mark.parametrize("cpu_fast", [False, True])
def test_a_quantised_linear_stays_itself_prepared_for_its_kernels(cpu_fast):
    m = _quant_linear()
    assert dispatch.choose(m, {dispatch.INT}, cpu_fast=cpu_fast, relayout=True) is m
    assert m._qk_prepared and m.cpu_bf16_activations is cpu_fast


def test_an_fp8_linear_and_the_float_layers_of_a_quantised_model_stay_as_loaded():
    f = FP8Linear(64, 32, per_channel=True, has_input_scale=False)
    assert dispatch.choose(f, {dispatch.FLOAT}, cpu_fast=True, relayout=True) is f
    lin = _linear(torch.randn(32, 64))
    for kinds in ({dispatch.INT}, {dispatch.FLOAT}):
        assert dispatch.choose(lin, kinds, cpu_fast=True, relayout=True) is lin


def test_the_head_of_an_int_checkpoint_gets_a_float16_copy_with_cpu_fast_only():
    head = _linear(torch.randn(96, 64))
    got = dispatch.choose(head, {dispatch.INT}, cpu_fast=True, head=True)
    assert type(got) is (half.HalfWeightLinear if half.available() else HalfHead)
    assert dispatch.choose(head, {dispatch.INT}, cpu_fast=False, head=True) is head
    assert dispatch.choose(head, {dispatch.FLOAT}, cpu_fast=True, head=True) is head  # FP8: no copy


def test_a_float_models_linears_take_relayouts_choice_only_when_asked():
    exact16 = _linear(torch.randn(32, 64).half().float())
    other = _linear(torch.randn(32, 64))
    assert dispatch.choose(exact16, set()) is exact16  # relayout not asked: nn.Linear as it is
    got16, got = dispatch.choose(exact16, set(), relayout=True), dispatch.choose(other, set(), relayout=True)
    if half.available():
        assert type(got16) is half.HalfWeightLinear and torch.equal(got16.weight, exact16.weight)
    if onednn_available(torch.float32):
        assert type(got) is PackedLinear and torch.equal(got.weight, other.weight)


def _step_once(model):
    cache = new_decode_cache(model)
    forward(model, torch.tensor([1, 2, 3]), cache, last_only=True)
    cache.release()


def test_the_runtime_builds_the_plan_as_it_loads_and_keeps_it_on_the_model(tmp_path, monkeypatch):
    model = quantkit.load(str(make_tiny_model(tmp_path / "f16", dtype=torch.float16, seed=1)))
    plan = model.__dict__.get(llama_step.PLAN_ATTR)
    assert isinstance(plan, llama_step.StepPlan) and len(plan.qkv) == len(model.model.layers)
    # the steps read that plan and build none of their own
    monkeypatch.setattr(llama_step.StepPlan, "__init__", lambda self, m: pytest.fail("a plan built in a step"))
    _step_once(model)
    assert model.__dict__[llama_step.PLAN_ATTR] is plan


def test_no_module_level_cache_holds_plans(tmp_path):
    assert not hasattr(llama_step, "_PLANS")
    model = quantkit.load(str(make_tiny_model(tmp_path / "f32", seed=2)))
    _step_once(model)
    plan = model.__dict__[llama_step.PLAN_ATTR]
    maps = [v for v in vars(llama_step).values()
            if isinstance(v, (dict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary))]
    assert all(plan not in list(m.values()) for m in maps)


def test_a_copy_of_a_loaded_model_makes_its_own_plan(tmp_path):
    """The plan's fused calls hold the original's modules: a copy (a self-W4 draft is one) must not reuse them."""
    model = quantkit.load(str(make_tiny_model(tmp_path / "f32", seed=3)))
    twin = copy.deepcopy(model)
    assert twin.__dict__.get(llama_step.PLAN_ATTR) is None
    _step_once(twin)
    assert isinstance(twin.__dict__[llama_step.PLAN_ATTR], llama_step.StepPlan)
    assert twin.__dict__[llama_step.PLAN_ATTR] is not model.__dict__[llama_step.PLAN_ATTR]
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).__dict__.get(llama_step.PLAN_ATTR) is None


def test_a_quantised_checkpoint_loads_with_its_plan_and_its_kernels_prepared(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "out"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "32")[0] == 0
    model = quantkit.load(str(out))
    assert isinstance(model.__dict__.get(llama_step.PLAN_ATTR), llama_step.StepPlan)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert quant and all(m._qk_prepared and m.cpu_bf16_activations for m in quant)
    assert type(model.get_output_embeddings()) is (half.HalfWeightLinear if half.available() else HalfHead)
