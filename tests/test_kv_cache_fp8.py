"""FP8KVCache: half the bytes of a bf16 cache, attention output close to the float cache and equal to a float64
fake-quant reference, and it works with model.generate, a plain forward loop and speculative rollback (crop)."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from quantkit.errors import UserError
from quantkit.runtime.fp8_kv_cache import FP8KVCache
from quantkit.runtime.loader import attach_kv_scales
from quantkit.testing.models import tiny_llama
from quantkit.solvers.kv_scales import calibrate_kv_scales
from test_fp8_format import e4m3_round_ref

IDS = torch.tensor([[5, 17, 250, 99, 4, 41, 12, 77, 201, 3, 64, 128, 7, 90, 33, 2]])


def _model(dtype=torch.float32, seed=0):
    m = tiny_llama(vocab_size=256, hidden=64, layers=2, seed=seed, init_std=0.08, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 100)
    calib = [torch.randint(0, 256, (32,), generator=g) for _ in range(4)]
    attach_kv_scales(m, {k: t.float() for k, t in calibrate_kv_scales(m, calib).items()})
    return m


class _FakeQuantLayer(DynamicLayer):
    """Float cache whose stored keys/values are rounded through e4m3 by the float64 reference."""

    def __init__(self, ks, vs):
        super().__init__()
        self.ks, self.vs = ks, vs

    def update(self, k, v, *args, **kwargs):
        k = (e4m3_round_ref(k.float() / self.ks) * self.ks).to(k.dtype)
        v = (e4m3_round_ref(v.float() / self.vs) * self.vs).to(v.dtype)
        return super().update(k, v)


def _attn_outputs(model, cache):
    outs = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o: outs.append(o[0].detach().double()))
             for layer in model.model.layers]
    with torch.no_grad():
        logits = model(IDS, cache=cache, use_cache=True).logits
    for h in hooks:
        h.remove()
    return outs, logits


def test_stores_half_the_bytes_of_a_bf16_cache():
    model = _model(torch.bfloat16)
    fp8, ref = FP8KVCache.from_model(model), DynamicCache(config=model.config)
    with torch.no_grad():
        model(IDS, cache=fp8, use_cache=True)
        model(IDS, cache=ref, use_cache=True)
    fp8_bytes = sum(t.numel() * t.element_size() for layer in fp8.layers for t in (layer.keys, layer.values))
    bf16_bytes = sum(t.numel() * t.element_size() for layer in ref.layers for t in (layer.keys, layer.values))
    assert fp8.layers[0].keys.dtype == torch.float8_e4m3fn and ref.layers[0].keys.dtype == torch.bfloat16
    assert fp8_bytes * 2 == bf16_bytes == 2 * fp8.nbytes()
    # 2 layers x (K + V) x 2 kv heads x 16 head dims x 16 tokens, one byte each
    assert fp8_bytes == 2 * 2 * 2 * 16 * IDS.shape[1]


def test_attention_output_matches_reference_and_float_cache():
    model = _model()
    fp8 = FP8KVCache.from_model(model)
    out_fp8, _ = _attn_outputs(model, fp8)
    ref_cache = DynamicCache(config=model.config)
    ref_cache.layers = [_FakeQuantLayer(l.k_scale.item(), l.v_scale.item()) for l in fp8.layers]
    out_ref, _ = _attn_outputs(model, ref_cache)
    out_float, _ = _attn_outputs(model, DynamicCache(config=model.config))
    for a, r, f in zip(out_fp8, out_ref, out_float):
        # Same e4m3 codes as the float64 reference: only float32 arithmetic order differs.
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-6 * r.abs().max().item())
        # Against the unquantised cache: each cached value carries at most 2^-4 relative error (3 mantissa
        # bits, half a step) in the normal range, and the output mixes many of them, so its relative error
        # must stay below 2^-4; it must not be zero either, or nothing was quantised.
        err = ((a - f).norm() / f.norm()).item()
        assert 1e-4 < err < 2 ** -4


def test_plain_decode_loop_equals_one_forward_over_the_whole_sequence():
    """Fixed scales: a token's codes do not depend on when it was cached, so prefill + one-token steps give
    the logits of a single forward over the whole sequence, both through the FP8 cache."""
    model = _model()
    with torch.no_grad():
        full = model(IDS, cache=FP8KVCache.from_model(model), use_cache=True).logits[0]
        cache = FP8KVCache.from_model(model)
        steps = [model(IDS[:, :10], cache=cache, use_cache=True).logits[0, -1]]
        for t in range(10, IDS.shape[1]):
            steps.append(model(IDS[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1])
    assert cache.get_seq_length() == IDS.shape[1]
    assert torch.allclose(torch.stack(steps), full[9:], atol=1e-5 * full.abs().max().item())


def test_generate_with_fp8_cache_equals_our_greedy_loop():
    model = _model()
    prompt = IDS[:, :8]
    with torch.no_grad():
        cache = FP8KVCache.from_model(model)
        out = model.generate(prompt, cache=cache, max_new_tokens=8, do_sample=False)
        mine, loop_cache = prompt, FP8KVCache.from_model(model)
        logits = model(prompt, cache=loop_cache, use_cache=True).logits[:, -1]
        for _ in range(8):
            nxt = logits.argmax(-1, keepdim=True)
            mine = torch.cat([mine, nxt], dim=1)
            logits = model(nxt, cache=loop_cache, use_cache=True).logits[:, -1]
    assert torch.equal(out, mine)
    assert isinstance(cache, FP8KVCache) and cache.get_seq_length() == 15  # the last token is never cached


def test_crop_rolls_back_exactly():
    model = _model()
    with torch.no_grad():
        cache = FP8KVCache.from_model(model)
        model(IDS[:, :10], cache=cache, use_cache=True)
        model(torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)  # a rejected speculation
        cache.crop(-3)
        after = model(IDS[:, 10:12], cache=cache, use_cache=True).logits
        clean = FP8KVCache.from_model(model)
        model(IDS[:, :10], cache=clean, use_cache=True)
        ref = model(IDS[:, 10:12], cache=clean, use_cache=True).logits
    assert torch.equal(after, ref)


def test_values_beyond_the_calibrated_range_saturate_instead_of_nan():
    model = _model()
    tiny = [torch.tensor(1e-4)] * 2  # far too small: nearly every key and value saturates
    with torch.no_grad():
        logits = model(IDS, cache=FP8KVCache(tiny, tiny), use_cache=True).logits
    assert torch.isfinite(logits).all()


def test_missing_or_bad_scales_are_user_errors():
    plain = tiny_llama(vocab_size=256, hidden=64, layers=2)
    with pytest.raises(UserError, match="--set quant.kv_cache=fp8"):
        FP8KVCache.from_model(plain)
    with pytest.raises(UserError, match="positive"):
        FP8KVCache([torch.tensor(0.0)], [torch.tensor(1.0)])
