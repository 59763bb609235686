"""Mixture-of-experts models: no expert left in float, every expert calibrated on its own tokens, loadable.

Tiny random Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE (shared expert) models built in-process (quantkit.testing.moe).
"""
import json

import pytest
import torch
from safetensors import safe_open

import quantkit
from helpers import rel_err
from quantkit.errors import UserError
from quantkit.formats.moe_names import expert_names
from quantkit.linear.quant import QuantLinear
from quantkit.models.moe import UnfusedExperts, split, unfuse_experts
from quantkit.testing.moe import MOE_ARCHS, save_tiny_moe, tiny_moe
from test_data_support import SAMPLE, tiny_tokenizer

IDS = torch.tensor([[5, 9, 100, 33, 2, 250, 7, 300, 401, 12, 64, 77]])
ARCHS = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"]


def _keys(folder):
    with safe_open(folder / "model.safetensors", "pt") as f:
        return set(f.keys())


def _fused_experts(model):
    return {n: m for n, m in model.named_modules() if getattr(m, "gate_up_proj", None) is not None
            and m.gate_up_proj.dim() == 3}


def _dequantised_reference(src, quant, arch):
    """The float source model with every quantised weight (fused experts included) replaced by its
    dequantised value, computed by transformers' own fused forward."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ql = {n: m for n, m in quant.named_modules() if isinstance(m, QuantLinear)}
    names = expert_names(arch)
    for n, m in _fused_experts(ref).items():
        inter = m.gate_up_proj.shape[1] // 2
        for e in range(m.gate_up_proj.shape[0]):
            m.gate_up_proj.data[e, :inter] = ql.pop(f"{n}.{e}.{names.gate}").dequantized_weight()
            m.gate_up_proj.data[e, inter:] = ql.pop(f"{n}.{e}.{names.up}").dequantized_weight()
            m.down_proj.data[e] = ql.pop(f"{n}.{e}.{names.down}").dequantized_weight()
    for n, m in ref.named_modules():
        if n in ql:
            m.weight.data = ql.pop(n).dequantized_weight()
    assert not ql, f"quantised modules the float model lacks: {list(ql)[:3]}"
    return ref


@pytest.mark.parametrize("arch", ARCHS)
def test_unfused_forward_equals_fused(arch):
    """UnfusedExperts computes exactly what the fused module does (float64, same routing)."""
    model = tiny_moe(arch, dtype=torch.float64)
    fused = next(iter(_fused_experts(model).values()))
    x = torch.randn(20, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    k = model.config.num_experts_per_tok
    n_exp = fused.gate_up_proj.shape[0]
    idx = torch.stack([torch.randperm(n_exp, generator=torch.Generator().manual_seed(i))[:k] for i in range(20)])
    w = torch.rand(20, k, dtype=torch.float64)
    unfused = split(fused, expert_names(arch))
    torch.testing.assert_close(unfused(x, idx, w), fused(x, idx, w), rtol=1e-12, atol=1e-12)
    unfused.calibrate_all = True  # every expert runs on every token; the routed output is unchanged
    torch.testing.assert_close(unfused(x, idx, w), fused(x, idx, w), rtol=1e-12, atol=1e-12)


def test_routed_tokens_on_a_hand_built_router():
    """Token t is built to route to experts a_t and b_t (logit 10 and 5, the rest 0): the counts must be exact."""
    model = tiny_moe("qwen3_moe", dtype=torch.float64)
    unfuse_experts(model)
    block = model.model.layers[0].mlp
    n_exp, hidden = block.gate.weight.shape
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, :n_exp] = torch.eye(n_exp)
    g = torch.Generator().manual_seed(3)
    pairs = [torch.randperm(n_exp, generator=g)[:2].tolist() for _ in range(50)]
    x = torch.zeros(1, 50, hidden, dtype=torch.float64)
    for t, (a, b) in enumerate(pairs):
        x[0, t, a], x[0, t, b] = 10.0, 5.0
    block.experts.routed.zero_()
    block(x)
    want = torch.bincount(torch.tensor(pairs).reshape(-1), minlength=n_exp)
    assert block.experts.routed.tolist() == want.tolist()


def _quantize(cli, tmp_path, arch, *extra):
    src = save_tiny_moe(tmp_path / f"src-{arch}", arch)
    tiny_tokenizer().save_pretrained(src)
    out = tmp_path / f"out-{arch}"
    method = [] if "--method" in extra else ["--method", "rtn"]
    code, _, err = cli("quantize", src, "-o", out, "--quiet", "--group-size", "32", *method, *extra)
    assert code == 0, err
    return src, out


@pytest.mark.parametrize("arch", ARCHS)
def test_w4_checkpoint_has_no_expert_in_float_and_loads(tmp_path, cli, arch):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src, out = _quantize(cli, tmp_path, arch)
    keys, src_keys = _keys(out), _keys(src)
    # every matrix of the source checkpoint (names as transformers saves them) is quantised, except the
    # embeddings, the head and the routers
    floats = {k[: -len(".weight")] for k in src_keys if k.endswith(".weight")} & {
        k[: -len(".weight")] for k in keys if k.endswith(".weight")}
    experts = [k for k in src_keys if ".experts." in k]
    assert experts and all(k.replace(".weight", ".weight_packed") in keys for k in experts)
    assert all(n.endswith(("embed_tokens", "norm", "layernorm", "lm_head", ".gate", "shared_expert_gate"))
               for n in floats), sorted(floats)[:5]
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    routers = [i for i in cfg["ignore"] if i.endswith(".gate")]
    assert len(routers) == 2  # one per layer, by its checkpoint name
    quant = quantkit.load(out, dtype=torch.float32, exact=True)
    ref = _dequantised_reference(src, quant, arch)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                              quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    with torch.no_grad():
        ours = quant(IDS).logits
        assert rel_err(ours, ref(IDS).logits) < 1e-5
        assert rel_err(hf(IDS).logits, ours) < 1e-5


def test_gptq_experts_get_their_own_tokens_and_decode_to_the_solver(tmp_path, cli):
    from quantkit.data import load_calibration
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe

    calib = ["--method", "gptq", "--calib", SAMPLE, "--num-samples", "8", "--seq-len", "32", "--set", "quant.moe.min_tokens=0"]
    src, out = _quantize(cli, tmp_path, "qwen3_moe", *calib)
    code, stdout, err = cli("quantize", src, "-o", tmp_path / "again", "--group-size", "32", *calib, "--json")
    assert code == 0, err
    summary = json.loads(stdout)["moe"]
    assert summary["experts"] == 16 and summary["rtn_fallback"] == 0 and summary["fewest_routed_tokens"] >= 0
    meta = json.loads((out / "quantkit.json").read_text())
    routed = meta["moe"]["routed_tokens"]["model.layers.0.mlp.experts"]
    assert sum(routed) == 8 * 32 * 2  # every token goes to top-2 experts
    layers = meta["layers"]
    for e, n in enumerate(routed):
        s = layers[f"model.layers.0.mlp.experts.{e}.gate_proj"]
        assert s["routed_tokens"] == n and s["calibration_tokens"] == n
    # the same job in memory: the checkpoint's codes are exactly the solver's
    recipe = Recipe.model_validate({"model": str(src), "quant": {"method": "gptq", "group_size": 32,
                                                                 "moe": {"min_tokens": 0}},
                                    "calibration": {"spec": str(SAMPLE), "num_samples": 8, "seq_len": 32}})
    model = tiny_moe("qwen3_moe")
    unfuse_experts(model)
    c = recipe.calibration
    samples = load_calibration(spec=c.spec, tokenizer=tiny_tokenizer(), num_samples=c.num_samples,
                               seq_len=c.seq_len, seed=c.seed).samples
    result = quantize_model(model, build_plan(model, recipe), samples)
    quant = {n: m for n, m in quantkit.load(out, dtype=torch.float32, exact=True).named_modules() if isinstance(m, QuantLinear)}
    experts = [n for n in result.qweights if ".experts." in n]
    assert len(experts) == 2 * 8 * 3
    for n in experts:
        torch.testing.assert_close(quant[n].dequantized_weight(), result.qweights[n].dequantize().float(),
                                   rtol=0, atol=1e-6)


def test_calibrate_all_and_the_rtn_fallback(tmp_path, cli):
    calib = ["--method", "gptq", "--calib", SAMPLE, "--num-samples", "2", "--seq-len", "16"]
    _, out = _quantize(cli, tmp_path, "qwen3_moe", *calib, "--set", "quant.moe.calibrate_all_experts=true")
    layers = json.loads((out / "quantkit.json").read_text())["layers"]
    fed = {s["calibration_tokens"] for n, s in layers.items() if ".experts." in n}
    assert fed == {2 * 16}  # every expert saw every token
    _, out2 = _quantize(cli, tmp_path / "b", "qwen3_moe", *calib, "--set", "quant.moe.min_tokens=1000")
    meta = json.loads((out2 / "quantkit.json").read_text())
    fallback = meta["moe"]["rtn_fallback"]
    assert len(fallback) == 2 * 8 * 3 and all("rtn" in v for v in fallback.values())
    assert not any(s.get("fallback") for n, s in meta["layers"].items() if ".experts." not in n)


def test_an_uncovered_fused_module_stops_the_run_unless_ignored(tmp_path, cli):
    src = tmp_path / "src"
    model = tiny_moe("qwen3_moe")
    model.save_pretrained(src)
    # a layout quantkit cannot split (interleaved gate/up) must not be silently left in float
    cls = type(model.model.layers[0].mlp.experts)
    orig = cls.__init__

    def interleaved(self, *a, **k):
        orig(self, *a, **k)
        self.is_concatenated = False

    cls.__init__ = interleaved
    try:
        code, _, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--quiet", "--group-size", "32")
        assert code == 2
        assert "would stay in float" in err and "experts.gate_up_proj" in err and "--ignore" in err
        code, _, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--quiet", "--group-size", "32",
                           "--ignore", "experts", "--ignore", "lm_head")
        assert code == 0, err
    finally:
        cls.__init__ = orig
    meta = json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert meta.get("float_weights") == []  # ignored on purpose: not listed as a surprise


def test_inspect_reports_the_float_share(tmp_path, cli):
    _, out = _quantize(cli, tmp_path, "olmoe")
    code, stdout, err = cli("inspect", out, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert 0 < info["float_share"] < 0.5  # embeddings, head, routers, norms
    assert info["moe"]["experts"] == 2 * 8


def test_tiny_configs_cover_the_named_architectures():
    assert {"qwen3_moe", "mixtral", "olmoe"} <= set(MOE_ARCHS)
    for arch in MOE_ARCHS:
        m = tiny_moe(arch, layers=1)
        assert unfuse_experts(m) and isinstance(m.model.layers[0].mlp.experts, UnfusedExperts)


def test_unknown_fused_parameter_is_counted(tmp_path):
    from quantkit.models.coverage import check_coverage

    model = tiny_moe("qwen3_moe", layers=1)
    with pytest.raises(UserError, match="gate_up_proj"):
        check_coverage(model, set(), ["lm_head"])


@pytest.mark.parametrize("method,scheme", [("awq", "w4a16"), ("awq+gptq", "w4a16"), ("gptq", "fp8-dynamic")])
def test_every_method_quantises_every_expert(tmp_path, cli, method, scheme):
    """AWQ scales the shared expert and each expert's down (the router takes the norm's scale in float)."""
    calib = ["--calib", SAMPLE, "--num-samples", "4", "--seq-len", "32", "--set", "quant.awq.grid=5"]
    src, out = _quantize(cli, tmp_path, "qwen2_moe", "--method", method, "--scheme", scheme, *calib)
    keys = _keys(out)
    stored = ".weight_packed" if scheme == "w4a16" else ".weight_scale"
    experts = [k for k in _keys(src) if ".experts." in k or ".shared_expert." in k]
    assert experts and all(k.replace(".weight", stored) in keys for k in experts)
    quant = quantkit.load(out, dtype=torch.float32, exact=True)
    with torch.no_grad():
        ours = quant(IDS).logits
    assert torch.isfinite(ours).all()
    layers = json.loads((out / "quantkit.json").read_text())["layers"]
    if method.startswith("awq"):
        downs = [s for n, s in layers.items() if n.endswith("down_proj") and ".experts." in n]
        scaled = [s for s in downs if s.get("awq_alpha") is not None]
        # each expert's down was searched: scaled, or its choice dropped by the held-out guard (which says why),
        # or no calibration token reached it
        searched = scaled + [s for s in downs if (s.get("awq_guard") or "").startswith("rtn scales")]
        assert scaled and len(searched) + sum(s.get("awq_note") == "no calibration tokens" for s in downs) == len(downs)
        # the search keeps s = 1 unless a scale lowers the measured block's error on the calibration tokens
        assert all(s["awq_block_error"] <= s["rtn_block_error"] for s in scaled)
        gate_up = [s for n, s in layers.items() if n.endswith(("gate_proj", "up_proj"))]
        assert all("awq_alpha" in s for s in gate_up)  # one shared scale for all experts and the shared expert


def test_runtime_decodes_moe_checkpoints_like_transformers(tmp_path, cli):
    """quantkit's runtime (serve/generate/eval load through quantkit.load): its incremental decoding
    equals transformers' generate on the same loaded model, alone, with prompt lookup drafting, and batched;
    and the loaded model's logits match transformers' own load of the checkpoint."""
    from helpers import NumberTokenizer, greedy_with_and_without_lookup, hf_greedy, run_together_as_alone
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.engine import Engine
    from quantkit.runtime.sampling import SamplingParams

    _, out = _quantize(cli, tmp_path, "mixtral")
    model = quantkit.load(str(out))
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in (5, 9, 14)]
    prompts += [[7, 8, 9, 7, 8, 9, 7, 8]]  # a repeat, so prompt lookup drafts
    drafted = greedy_with_and_without_lookup(model, prompts, SamplingParams(max_tokens=12, ignore_eos=True),
                                             want=lambda p: hf_greedy(model, p, 12))
    assert drafted > 0
    run_together_as_alone(Engine(model, NumberTokenizer(), max_active=4), model, prompts, 10)
    with torch.no_grad():  # the runtime computes quantised layers in bfloat16 on a CPU: ~1e-3 relative
        assert rel_err(model(IDS).logits, ref(IDS).logits) < 1e-2
