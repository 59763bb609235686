"""The float16 output head of the runtime's CPU fast path (quantkit/linear/half_head.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import quantkit
from helpers import make_tiny_model
from quantkit.linear import half_weight as half
from quantkit.linear.half_head import SAFE_ABSMAX, HalfHead, use_half_head
from quantkit.testing.models import tiny_llama

# FBGEMM's float16-weight product where torch has it (x86), else torch's own float16 product
COPY = half.HalfWeightLinear if half.available() else HalfHead


NO_FBGEMM = pytest.mark.skipif(not half.available(), reason="this torch build has no FBGEMM (x86 only)")


@pytest.mark.parametrize("kind", [pytest.param("fbgemm", marks=NO_FBGEMM), "torch"])
def test_half_head_matches_float64_within_float16_rounding(kind):
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(96, 500, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(500, 96, generator=g) * 0.1)
        head.bias.copy_(torch.randn(500, generator=g))
    x = torch.randn(7, 96, generator=g) * 3
    ref = x.double() @ head.weight.double().t() + head.bias.double()
    y = half.HalfWeightLinear(head.weight, head.bias, lossless=False)(x) if kind == "fbgemm" else HalfHead(head)(x)
    assert y.dtype == torch.float32
    rel = float((y.double() - ref).norm() / ref.norm())
    # float16 keeps 11 significant bits: each weight (and, for torch's product, input and output) is rounded by
    # at most 2^-11 relative, which averages out over the 96-term sums to well under 1e-3; a float32 result is
    # 1000x closer, and a wrong layout or a bf16 copy (8 bits, ~3e-3) would be far off
    assert 1e-6 < rel < 1e-3


def test_tied_head_gets_a_copy_and_the_embedding_table_stays_float32():
    model = tiny_llama(vocab_size=256, hidden=64, layers=1, seed=0)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    emb = model.get_input_embeddings().weight
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        before = model(ids).logits
        assert use_half_head(model)
        after = model(ids).logits
    assert isinstance(model.get_output_embeddings(), COPY)
    assert model.get_input_embeddings().weight is emb and emb.dtype == torch.float32
    assert after.dtype == torch.float32
    assert 0 < float((after - before).abs().max()) < 1e-3 * float(before.abs().max())


def test_heads_it_cannot_copy_safely_are_left_alone():
    model = tiny_llama(vocab_size=256, hidden=64, layers=1, seed=0)
    with torch.no_grad():
        model.lm_head.weight[3, 4] = SAFE_ABSMAX * 2  # would not survive float16's range with margin
    assert not use_half_head(model)
    assert type(model.get_output_embeddings()) is nn.Linear
    half = tiny_llama(vocab_size=256, hidden=64, layers=1, seed=0).to(torch.bfloat16)
    assert not use_half_head(half)  # already 16-bit: nothing to gain


def test_runtime_load_of_a_quantised_checkpoint_uses_it_and_exact_load_does_not(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "out"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "32")[0] == 0
    assert isinstance(quantkit.load(out, dtype=torch.float32).lm_head, COPY)
    assert type(quantkit.load(out, dtype=torch.float32, exact=True).lm_head) is nn.Linear
