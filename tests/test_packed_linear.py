"""float32 Linears in oneDNN's layout (linear/packed.py): the same products, rows independent of their
batch, and the runtime's models decoding the same tokens through them."""
from __future__ import annotations

import copy

import pytest
import quantkit
import torch
from torch import nn

from helpers import assert_relaid_decodes_like, greedy_with_and_without_lookup, make_tiny_model, rel_err, \
    repeat_prompts
from quantkit.runtime import build
from quantkit.runtime.generate import generate
from quantkit.linear.packed import PackedLinear, available
from quantkit.linear.dispatch import relayout_model as pack_model
from quantkit.runtime.sampling import SamplingParams
from quantkit.drafts import self_w4_draft
from quantkit.testing.models import single_thread, tiny_llama

pytestmark = pytest.mark.skipif(not available(), reason="this torch build has no oneDNN")


def _linear(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 1)
        if bias:
            lin.bias.normal_(0, 1)
    return lin


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 32])
def test_product_matches_float64_reference(rows, bias):
    lin = _linear(96, 200, bias, seed=rows)
    packed = PackedLinear(lin.weight, lin.bias)
    x = torch.randn(rows, 200, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = packed(x)
    want = x.double() @ lin.weight.double().t() + (lin.bias.double() if bias else 0)
    # float32 sums of 200 products of N(0,1) values: rounding ~1e-7 relative per add; 1e-5 of the output
    # scale (~14) leaves room for any summation order while a wrong row, column or bias is order 1
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    assert got.shape == (rows, 96) and got.dtype == torch.float32


def test_rows_do_not_depend_on_the_rest_of_the_batch():
    """A verify forward (k+1 rows) must give row 0 exactly the numbers a one-row step gives it, or speculation
    could change greedy output; the padding below 4 rows must not change a number either."""
    lin = _linear(960, 576, False, seed=3)
    packed = PackedLinear(lin.weight, None)
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = packed(x)
        for r in range(13):
            assert torch.equal(packed(x[r: r + 1]), full[r: r + 1])
        assert torch.equal(packed(x[2:5]), full[2:5])
        assert torch.equal(packed(x.view(13, 1, 576)).view(13, 960), full)  # leading dims are rows too


def test_weight_is_the_original_and_a_deepcopy_is_independent():
    lin = _linear(64, 48, True, seed=4)
    packed = PackedLinear(lin.weight, lin.bias)
    assert torch.equal(packed.weight, lin.weight) and packed.weight.shape == (64, 48)
    twin = copy.deepcopy(packed)
    assert twin.packed is not packed.packed and twin.bias is not packed.bias
    x = torch.randn(3, 48)
    with torch.no_grad():
        assert torch.equal(twin(x), packed(x))
    assert packed.nbytes == 64 * 48 * 4


@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_decodes_transformers_tokens(tied):
    """Every float32 Linear swapped (the head too, the tied embedding keeping its table); greedy output, with
    and without prompt lookup, equals transformers' generate on the model as it was."""
    model = tiny_llama(vocab_size=256, hidden=64, layers=2, seed=5, init_std=0.1)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    reference = copy.deepcopy(model)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_model(model) == n_linear == 2 * 7 + 1
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    if tied:  # one plain table: the embedding's rows are the head's transposed copy, read by one-row products
        assert model.model.embed_tokens.weight.data_ptr() == model.lm_head.transposed.data_ptr()
    else:
        assert model.lm_head.transposed is None
    assert_relaid_decodes_like(model, reference)


def test_state_dict_holds_the_plain_weights():
    """A packed model's state_dict (what save_pretrained writes) has every Linear's weight, as before packing."""
    model = tiny_llama(vocab_size=128, hidden=64, layers=1, seed=2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    pack_model(model)
    got = model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_runtime_loader_packs_float32_and_bf16_where_the_cpu_has_it(tmp_path):
    f32 = quantkit.load(str(make_tiny_model(tmp_path / "f32", seed=1)))
    assert isinstance(f32.model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(f32.get_output_embeddings(), PackedLinear)
    bf16 = quantkit.load(str(make_tiny_model(tmp_path / "bf16", dtype=torch.bfloat16, seed=1)), dtype=torch.bfloat16)
    n_bf16 = sum(isinstance(m, PackedLinear) for m in bf16.modules())
    assert n_bf16 == (2 * 7 + 1 if available(torch.bfloat16) else 0)
    # float16 checkpoints hold float16 weights instead: tests/test_half_weight_linear.py


def test_self_w4_draft_of_a_packed_model_equals_the_unpacked_one():
    model = tiny_llama(vocab_size=256, hidden=64, layers=2, seed=6, init_std=0.1)
    packed_model = copy.deepcopy(model)
    pack_model(packed_model)
    for packed in (False, True):
        a = self_w4_draft(model, group_size=32, packed=packed)
        b = self_w4_draft(packed_model, group_size=32, packed=packed)
        ids = torch.tensor([repeat_prompts(1, 256, seed=3)[0]])
        with torch.no_grad():
            # the same W4 codes: only summation order differs (float32 products, or int4 ones read the same)
            assert rel_err(b(ids).logits, a(ids).logits) < 1e-4
    assert all(type(m) is not PackedLinear for n, m in b.named_modules() if n != "lm_head")


def test_compile_leaves_a_packed_model_eager():
    """`--compile` on a packed float32 model: each product would go through a custom op that calls back into
    Python (slower than eager, docs/benchmarks.md), so nothing is compiled and the tokens are the eager ones."""
    from quantkit.runtime import compiled as steps

    eager = tiny_llama(vocab_size=128, hidden=64, layers=2, seed=8, init_std=0.2)
    pack_model(eager)
    model = copy.deepcopy(eager)
    assert build.compile_decode(model) is False
    assert steps.step(model, "slot") is None and steps.step(model, "decode") is None
    assert build.compile_decode(tiny_llama(vocab_size=128, hidden=64, layers=2, seed=8)) is True
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with single_thread(), torch.inference_mode():
        for prompt in repeat_prompts(2, 128, seed=4):
            assert generate(model, prompt, params).output_ids() == generate(eager, prompt, params).output_ids()


def test_custom_op_gives_the_module_product_under_torch_compile():
    """The op is what a compiled graph would call; it must trace (fake shapes) and compute the same product."""
    lin = _linear(96, 64, True, seed=9)
    packed = PackedLinear(lin.weight, lin.bias)
    fn = torch.compile(lambda x: packed(x).relu(), dynamic=True)
    with torch.no_grad():
        for rows in (1, 6):
            x = torch.randn(2, rows, 64, generator=torch.Generator().manual_seed(rows))
            assert torch.allclose(fn(x), packed(x).relu(), rtol=1e-6, atol=1e-6)


def test_to_save_and_load_keep_working():
    """What callers do with an nn.Module: cast it (it then computes as a plain Linear), pickle it whole, and
    load a state_dict into it; each keeps the products right."""
    import io

    model = tiny_llama(vocab_size=128, hidden=64, layers=1, seed=3, init_std=0.1)
    model.lm_head.weight = model.model.embed_tokens.weight
    reference = copy.deepcopy(model)
    pack_model(model)
    ids = torch.tensor([[5, 9, 77, 3, 41]])
    with torch.no_grad():
        want = reference(ids).logits
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert isinstance(loaded.lm_head, PackedLinear) and loaded.lm_head.packed is not None
        assert rel_err(loaded(ids).logits, want) < 1e-5
        other = tiny_llama(vocab_size=128, hidden=64, layers=1, seed=4)
        other.lm_head.weight = other.model.embed_tokens.weight
        pack_model(other)
        other.load_state_dict(reference.state_dict())
        assert rel_err(other(ids).logits, want) < 1e-5
        half = copy.deepcopy(model).half()  # float16 has no oneDNN layout here: a plain weight
        assert half.model.layers[0].mlp.up_proj.plain.dtype == torch.float16
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        up = bf16.model.layers[0].mlp.up_proj
        assert up.weight.dtype == torch.bfloat16 and (up.packed is not None) == available(torch.bfloat16)
        # 16-bit weights and activations through one layer: ~1e-2 relative; a wrong weight would be order 1
        assert rel_err(bf16(ids).logits.float(), want) < 5e-2
        assert rel_err(half(ids).logits.float(), want) < 5e-2
        back = half.float()
        assert back.model.layers[0].mlp.up_proj.packed is not None  # float32 on a CPU again: re-laid out


def test_quantised_checkpoints_are_not_packed(tmp_path, cli):
    """A W4 checkpoint keeps its float head (and any ignored layer) as it was: packing those few would cost the
    model --compile and pad each of its steps to 4 rows."""
    src = make_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "w4"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "32",
               "--ignore", "lm_head", "--ignore", "model.layers.0.mlp.down_proj")[0] == 0
    model = quantkit.load(str(out))
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear  # left in float32, as the checkpoint has it
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert build.compile_decode(model) is True


@pytest.mark.skipif(not available(torch.bfloat16), reason="this CPU has no bf16 instructions for oneDNN")
def test_bf16_model_packs_and_decodes_its_own_greedy_tokens():
    """`--dtype bfloat16`: products in bf16 (8 significant bits) from oneDNN's layout; rows independent of their
    batch, logits near the unpacked model's, and speculation leaves greedy output unchanged. (Token equality
    with transformers' generate is a float32 property: in bf16 our forward and transformers' round differently,
    packed or not, and near-ties of a tiny random model flip.)"""
    model = tiny_llama(vocab_size=256, hidden=64, layers=2, seed=5, init_std=0.1, dtype=torch.bfloat16)
    reference = copy.deepcopy(model)
    assert pack_model(model) == 2 * 7 + 1
    assert model.lm_head.transposed is None  # bf16 keeps no plain copy: MKL's bf16 row is slower
    lin = model.model.layers[0].mlp.up_proj
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids = torch.tensor([repeat_prompts(1, 256, seed=1)[0]])
    with torch.no_grad():
        full = lin(x)
        assert all(torch.equal(lin(x[r: r + 1]), full[r: r + 1]) for r in range(13))
        # bf16 rounding of every product through two layers: ~1e-2 relative; a wrong weight is order 1
        assert rel_err(model(ids).logits.float(), reference(ids).logits.float()) < 3e-2
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with single_thread():
        assert greedy_with_and_without_lookup(model, repeat_prompts(8, 256, seed=2), params) > 0
