"""float16 weights with float32 products (linear/half_weight.py, FBGEMM) and the runtime's choice of layout
per Linear (linear/relayout.py): the same products, rows independent of their batch, nothing lost where the
weights are float16 numbers, and the runtime's models decoding the same tokens through them."""
from __future__ import annotations

import copy
import io

import pytest
import quantkit
import torch
from torch import nn

from helpers import NumberTokenizer, assert_relaid_decodes_like, make_tiny_model, rel_err, repeat_prompts, \
    run_together_as_alone
from quantkit.runtime import build
from quantkit.linear import half_weight as hw
from quantkit.runtime.engine import Engine
from quantkit.linear.half_weight import HalfWeightLinear, available, exact_in_float16, fuse_modules
from quantkit.linear.packed import PackedLinear
from quantkit.linear.dispatch import relayout_model
from quantkit.linear.relayout import float_linear
from quantkit.drafts import self_w4_draft
from quantkit.testing.models import tiny_llama

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no FBGEMM (x86 only)")


def _kind_param(threads: int, kind) -> "pytest.param":
    return pytest.param((threads, kind), id=kind.__name__,
                        marks=pytest.mark.skipif(not hw._works(kind), reason=f"this torch build lacks {kind.__name__}"))


@pytest.fixture(params=[_kind_param(1, hw._Pack), _kind_param(2, hw._ThreadedPack)])
def pack_threads(request):
    """Packs made at one torch thread are _Pack (a single-threaded call), at more _ThreadedPack (split over the
    threads): every test taking this fixture runs with each kind."""
    threads, kind = request.param
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert type(hw.pack(torch.ones(2, 2))) is kind
        yield threads
    finally:
        torch.set_num_threads(n)


def _half_values(*shape: int, seed: int) -> torch.Tensor:
    """float32 values that are float16 numbers, as a float16 checkpoint loaded in float32 holds."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half().float()


def _half_model(seed: int, tied: bool = False) -> nn.Module:
    """A tiny float32 Llama whose every weight is a float16 number."""
    model = tiny_llama(vocab_size=256, hidden=64, layers=2, seed=seed, init_std=0.1, dtype=torch.float16).float()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 13, 32])
def test_product_matches_float64_reference(rows, bias, pack_threads):
    w, b = _half_values(96, 200, seed=rows), (_half_values(96, seed=50) if bias else None)
    lin = HalfWeightLinear(w, b)
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = lin(x)
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    # the weights are float16 numbers, so held in float16 they are exact; what is left is float32 summation
    # of 200 N(0,1) products (~1e-7 relative per add): 1e-5 of the output scale (~14) allows any order, while
    # a weight rounded somewhere to bf16 (~4e-3) or a wrong row or bias is far outside it
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    assert got.shape == (rows, 96) and got.dtype == torch.float32


def test_rows_do_not_depend_on_the_rest_of_the_batch(pack_threads):
    """A verify forward (k+1 rows) and a step shared by many requests must give each row the numbers it gets
    alone, or speculation and batching could change greedy output."""
    lin = HalfWeightLinear(_half_values(960, 576, seed=3), None)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = lin(x)
        for r in range(40):
            assert torch.equal(lin(x[r: r + 1]), full[r: r + 1])
        for n in (2, 3, 4, 7, 13, 16, 33):
            assert torch.equal(lin(x[:n]), full[:n])
        assert torch.equal(lin(x.view(8, 5, 576)).view(40, 960), full)  # leading dims are rows too
        assert torch.equal(lin(x.t().contiguous().t()), full)  # a non-contiguous input


def test_float16_weights_give_float16_outputs_and_other_dtypes_stay_plain(pack_threads):
    w = _half_values(48, 64, seed=4)
    lin16 = HalfWeightLinear(w.half(), None)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).half()
    with torch.no_grad():
        y = lin16(x)
    assert y.dtype == torch.float16 and lin16.packed is not None
    # a float32 product rounded once to float16: within half a float16 step of the float64 product
    ref = x.double() @ w.double().t()
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -11 + 1e-6).all()
    bf = HalfWeightLinear(w.bfloat16(), None)  # FBGEMM holds float32/float16 only: bf16 stays plain
    assert bf.packed is None and bf(x.bfloat16()).dtype == torch.bfloat16


def test_weight_state_dict_deepcopy_to_and_pickling(pack_threads):
    w, b = _half_values(64, 48, seed=5), _half_values(64, seed=6)
    lin = HalfWeightLinear(w, b)
    assert torch.equal(lin.weight, w) and lin.weight.dtype == torch.float32 and lin.nbytes == 64 * 48 * 2
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y = lin(x)
        twin = copy.deepcopy(lin)
        assert torch.equal(twin(x), y) and twin.bias is not lin.bias
        sd = lin.state_dict()
        assert sd.keys() == {"weight", "bias"} and torch.equal(sd["weight"], w)
        # new weights and a new bias: both must reach the product
        w2, b2 = _half_values(64, 48, seed=7), _half_values(64, seed=8)
        lin.load_state_dict({"weight": w2, "bias": b2})
        assert rel_err(lin(x), x @ w2.t() + b2) < 1e-6
        lin.bias.add_(1.0)  # an in-place update of the bias reaches the product
        assert rel_err(lin(x), x @ w2.t() + b2 + 1) < 1e-6
        assert torch.equal(twin(x), y)  # the copy is independent
        buf = io.BytesIO()
        torch.save(lin, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
        assert torch.equal(back(x), lin(x))
        plain = copy.deepcopy(lin).to(torch.bfloat16)  # what FBGEMM cannot hold becomes a plain weight
        assert plain.packed is None and torch.equal(plain.weight, w2.bfloat16())
        assert torch.equal(copy.deepcopy(lin).half().weight, w2.half())


def test_nothing_is_rounded_unless_asked_and_the_callers_tensor_is_untouched():
    w = _half_values(16, 8, seed=11)
    w[0, 0] = float("inf")  # FBGEMM would saturate it to 65504
    assert not exact_in_float16(w) and not exact_in_float16(w.half())
    big = _half_values(16, 8, seed=12) * 1e5  # out of float16's range
    kept = big.clone()
    lossy = HalfWeightLinear(big, None, lossless=False)  # rounds (and saturates) on purpose, in its own copy
    assert lossy.packed is not None and torch.equal(big, kept)
    lin = HalfWeightLinear(_half_values(16, 8, seed=13), None)
    assert lin.packed is not None
    other = torch.randn(16, 8, generator=torch.Generator().manual_seed(14))  # not float16 numbers
    lin.load_state_dict({"weight": other})
    assert lin.packed is None and torch.equal(lin.weight, other)  # held plain: exact, not rounded
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        assert torch.equal(lin(x), x @ other.t())
        assert rel_err(HalfWeightLinear(other, None, lossless=False)(x), x @ other.t()) > 1e-6  # rounded


def test_exactness_decides_the_layout():
    exact = _half_values(32, 16, seed=9)
    inexact = exact + 1e-6  # float32 bits below float16's precision
    assert exact_in_float16(exact) and not exact_in_float16(inexact)
    assert not exact_in_float16(torch.full((2, 2), 70000.0))  # beyond float16's range
    assert isinstance(float_linear(exact, None), HalfWeightLinear)
    assert isinstance(float_linear(inexact, None), (PackedLinear, type(None)))  # oneDNN where torch has it


@pytest.mark.parametrize("tied", [False, True])
def test_half_model_decodes_transformers_tokens(tied):
    """Every Linear of a float16-valued float32 model holds float16 weights (the head too, the tied embedding
    keeping its float32 table); greedy output, with and without prompt lookup, equals transformers' generate on
    the model as it was."""
    model = _half_model(seed=5, tied=tied)
    reference = copy.deepcopy(model)
    assert relayout_model(model) == 2 * 7 + 1
    assert sum(isinstance(m, HalfWeightLinear) for m in model.modules()) == 2 * 7 + 1
    assert isinstance(model.lm_head, HalfWeightLinear)
    emb = model.model.embed_tokens.weight
    assert emb.dtype == torch.float32 and torch.equal(emb, reference.model.embed_tokens.weight)
    assert_relaid_decodes_like(model, reference, sep=9)


def test_concurrent_requests_get_their_answers_alone():
    model = _half_model(seed=8)
    relayout_model(model)
    run_together_as_alone(Engine(model, NumberTokenizer(), max_active=8), model, repeat_prompts(6, 256, 4, sep=9), 10)


def test_runtime_loader_holds_a_float16_checkpoint_in_float16(tmp_path):
    """A float16 checkpoint loaded at the runtime's float32 default (and at --dtype float16) reads its weights
    as float16, and --compile compiles it; a float32 checkpoint of arbitrary values keeps float32 (oneDNN's
    layout) and stays eager."""
    f16 = quantkit.load(str(make_tiny_model(tmp_path / "f16", dtype=torch.float16, seed=1)))
    assert f16.dtype == torch.float32
    assert isinstance(f16.model.layers[0].mlp.up_proj, HalfWeightLinear)
    assert isinstance(f16.get_output_embeddings(), HalfWeightLinear)
    assert build.compile_decode(f16)
    half = quantkit.load(str(make_tiny_model(tmp_path / "f16b", dtype=torch.float16, seed=1)), dtype=torch.float16)
    assert isinstance(half.model.layers[0].self_attn.q_proj, HalfWeightLinear)
    with torch.no_grad():
        assert half(torch.tensor([[3, 4, 5]])).logits.dtype == torch.float16
    f32 = quantkit.load(str(make_tiny_model(tmp_path / "f32", seed=1)))
    assert not any(isinstance(m, HalfWeightLinear) for m in f32.modules())
    assert not build.compile_decode(f32)


def test_self_w4_draft_of_a_half_model_equals_the_unpacked_one():
    model = _half_model(seed=6)
    half_model = copy.deepcopy(model)
    relayout_model(half_model)
    ids = torch.tensor([repeat_prompts(1, 256, seed=3, sep=9)[0]])
    for packed in (False, True):
        a = self_w4_draft(model, group_size=32, packed=packed)
        b = self_w4_draft(half_model, group_size=32, packed=packed)
        with torch.no_grad():
            # the same W4 codes, read the same: only summation order differs
            assert rel_err(b(ids).logits, a(ids).logits) < 1e-4
        if not packed:  # the dequantised values are not all float16 numbers: none may be rounded to one
            mods = dict(a.named_modules())
            for name, m in b.named_modules():
                if name.endswith("_proj"):
                    assert torch.equal(m.weight, mods[name].weight), name


def _distinct_packs(modules) -> set[int]:
    """The FBGEMM packs the modules' products read (a module fused with others reads a shared one)."""
    return {id(getattr(m.packed, "whole", m.packed)) for m in modules}


@pytest.mark.parametrize("bias", [False, True])
def test_fused_modules_share_one_pack_and_give_their_own_outputs(bias, pack_threads):
    """q/k/v (and gate/up) packed together: one product whose columns are bit for bit the modules' own, the
    weights held once (each module keeps its rows), and each module still a working Linear on its own."""
    shapes = [(96, 64), (32, 64), (32, 64)]
    ws = [_half_values(*s, seed=20 + i) for i, s in enumerate(shapes)]
    bs = [_half_values(s[0], seed=30 + i) if bias else None for i, s in enumerate(shapes)]
    mods = [HalfWeightLinear(w, b) for w, b in zip(ws, bs)]
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        alone = [m(x) for m in mods]
        fn = fuse_modules(mods)
        assert fn is not None and len(_distinct_packs(mods)) == 1
        assert torch.equal(fn(x), torch.cat(alone, dim=-1))
        for m, y, w in zip(mods, alone, ws):  # each module alone: same output, same weight, same bytes
            assert torch.equal(m(x), y) and torch.equal(m.weight, w) and m.nbytes == w.numel() * 2
            assert torch.equal(copy.deepcopy(m)(x), y)
            buf = io.BytesIO()
            torch.save(m, buf)
            buf.seek(0)
            assert torch.equal(torch.load(buf, weights_only=False)(x), y)
        # a module given new weights leaves the shared pack, and the fused call follows it
        w_new = _half_values(32, 64, seed=40)
        mods[1].load_state_dict({"weight": w_new, **({"bias": bs[1]} if bias else {})})
        want = x @ w_new.t() + (bs[1] if bias else 0)
        assert rel_err(fn(x)[..., 96:128], want) < 1e-6 and torch.equal(fn(x)[..., :96], alone[0])


def test_modules_that_cannot_share_a_pack_are_left_alone():
    a = HalfWeightLinear(_half_values(16, 8, seed=1), None)
    assert fuse_modules([a, HalfWeightLinear(_half_values(16, 12, seed=2), None)]) is None  # other inputs
    assert fuse_modules([a, HalfWeightLinear(_half_values(16, 8, seed=3), _half_values(16, seed=4))]) is None
    assert fuse_modules([a, HalfWeightLinear(torch.randn(16, 8), None)]) is None  # held plain (not float16)
    assert fuse_modules([a, nn.Linear(8, 16)]) is None
    assert a.packed is not None and not hasattr(a.packed, "whole")


def test_compiled_half_model_decodes_the_eager_tokens_with_shared_packs():
    """`--compile` on float16-held weights: FBGEMM's products stay in the compiled graph as quantkit::half_linear,
    q/k/v and gate/up each run as one product over one shared pack, and greedy decoding (plain steps and
    prompt lookup's verify steps, which run compiled) gives the eager model's tokens."""
    from quantkit.runtime import compiled as steps
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams
    from quantkit.testing.models import single_thread

    from helpers import greedy_with_and_without_lookup

    eager = _half_model(seed=12)
    relayout_model(eager)
    model = copy.deepcopy(eager)
    assert build.compile_decode(model)
    step, calls = steps.step(model, "slot"), []
    steps.set_step(model, "slot", lambda m, h, *a: calls.append(h.shape[1]) or step(m, h, *a))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with single_thread(), torch.inference_mode():
        spec_steps = greedy_with_and_without_lookup(model, repeat_prompts(4, 256, seed=5, sep=9), params,
                                                    want=lambda p: generate(eager, p, params).output_ids())
    assert spec_steps > 0 and 1 in calls and max(calls) > 1
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert len(_distinct_packs([attn.q_proj, attn.k_proj, attn.v_proj])) == 1
        assert len(_distinct_packs([mlp.gate_proj, mlp.up_proj])) == 1
    # weights loaded after compiling reach the compiled step (which skips guards on modules): fused and unfused
    # Linears alike decode as a fresh eager model with those weights
    other = _half_model(seed=13)
    model.load_state_dict(other.state_dict())
    relayout_model(other)
    prompt = repeat_prompts(1, 256, seed=6, sep=9)[0]
    with single_thread(), torch.inference_mode():
        want = generate(other, prompt, params).output_ids()
        assert want != generate(eager, prompt, params).output_ids()
        assert generate(model, prompt, params).output_ids() == want


def test_copies_of_a_module_are_their_own_to_the_compiled_op():
    """The compiled step names each module by a key; a deepcopy or a pickled-and-loaded module must be named by
    its own key, or a compiled graph would compute with the original's weights."""
    import torch.nn.functional as F

    lin = HalfWeightLinear(_half_values(24, 16, seed=21), None)
    buf = io.BytesIO()
    torch.save(lin, buf)
    buf.seek(0)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(22))
    for twin in (copy.deepcopy(lin), torch.load(buf, weights_only=False)):
        assert twin.key != lin.key and hw._OWNERS[twin.key] is twin
        twin.load_state_dict({"weight": _half_values(24, 16, seed=23)})
        with torch.no_grad():
            via_op = torch.ops.quantkit.half_linear(x, twin.key, 24)
            assert torch.equal(via_op, twin(x)) and not torch.equal(via_op, lin(x))
            assert rel_err(via_op, F.linear(x, twin.weight)) < 1e-6
