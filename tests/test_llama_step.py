"""Our batched Llama-family forward over the slot cache, against transformers' own forward on each sequence."""
from __future__ import annotations

import gc

import pytest
import torch
from helpers import rel_err, tiny_config, tiny_model

from quantkit.runtime import llama_step
from quantkit.runtime.forward import forward, forward_many
from quantkit.runtime.kv_cache import crop_to, new_decode_cache
from quantkit.runtime.slot_cache import SlotHandle


def _model(arch: str, seed: int = 0):
    return tiny_model(arch, seed=seed, vocab_size=128, std=0.08)  # logits far from uniform


def _ref(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0]


# float32 through 2 layers: summation order alone moves logits by ~1e-6 relative; a wrong position, mask or
# cache row moves them by order 1
TOL = 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_ragged_batch_equals_each_sequence_alone(arch):
    model = _model(arch)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in (11, 6, 9, 14)]
    refs = [_ref(model, s) for s in seqs]
    caches = [new_decode_cache(model) for _ in seqs]
    assert all(isinstance(c, SlotHandle) for c in caches)
    fed = [3, 1, 5, 2]  # each sequence's prefill length, all different
    for c, s, n in zip(caches, seqs, fed):
        forward(model, s[:n], c, last_only=True)
    # one batched forward, rows of 1 to 4 new tokens (padded to 4) over caches of 1 to 5 positions
    chunks = [s[n: n + m] for s, n, m in zip(seqs, fed, (4, 1, 3, 2))]
    outs = [r.all() for r in forward_many(model, list(zip(caches, chunks)))]
    for out, ref, n, ch in zip(outs, refs, fed, chunks):
        assert out.shape[0] == ch.shape[0]
        assert rel_err(out, ref[n: n + ch.shape[0]]) < TOL
    assert [c.get_seq_length() for c in caches] == [7, 2, 8, 4]


def test_rollback_release_and_compaction_keep_every_sequence_right():
    model = _model("llama", seed=3)
    pool = llama_step.pool_for(model)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (12,), generator=g) for _ in range(5)]
    refs = [_ref(model, s) for s in seqs]
    caches = [new_decode_cache(model) for _ in seqs]
    forward_many(model, [(c, s[:6]) for c, s in zip(caches, seqs)])
    assert pool.n_live() == 5
    # a rejected speculation: the cache rolls back by its length, and the next feed overwrites what was there
    crop_to(caches[0], 4)
    caches[1].release()  # a finished sequence gives its slot back ...
    del caches[3]  # ... and so does one dropped without finishing (the pool holds weak references)
    gc.collect()
    rest = [(caches[0], seqs[0], 4), (caches[2], seqs[2], 6), (caches[3], seqs[4], 6)]
    assert pool.n_live() == 3  # the last slot moved into a freed one
    assert sorted(h.slot for h, _, _ in rest) == [0, 1, 2]
    outs = [r.all() for r in forward_many(model, [(c, s[n:]) for c, s, n in rest])]
    for out, (c, s, n), ref in zip(outs, rest, [refs[0], refs[2], refs[4]]):
        assert rel_err(out, ref[n:]) < TOL
    with pytest.raises(RuntimeError, match="released"):
        forward(model, seqs[1][6:7], caches[1], last_only=True)


def test_storage_grows_past_its_first_capacity():
    model = _model("llama", seed=5)
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(3))
    ref = _ref(model, ids)
    cache = new_decode_cache(model)
    out = [forward(model, ids[:50], cache, last_only=False)]
    out += [forward(model, ids[i: i + 1], cache, last_only=False) for i in range(50, 200)]
    assert llama_step.pool_for(model).capacity >= 200  # started at 64 positions, doubled on the way
    assert rel_err(torch.cat(out), ref) < TOL


def test_verify_rows_compute_the_head_only_as_far_as_asked():
    """A verify forward's head runs for row 0 first and for the rest only when asked: the rows are the same."""
    model = _model("llama", seed=8)
    ids = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(6))
    ref = _ref(model, ids)
    calls, head = [], model.get_output_embeddings()
    cache = new_decode_cache(model)
    forward(model, ids[:4], cache, last_only=True)
    handle = head.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    try:
        (rows,) = forward_many(model, [(cache, ids[4:])])
        assert calls == []  # nothing yet
        first = rows.upto(1)
        assert calls == [1]  # row 0 alone: a draft rejected at its first token costs one head row
        rest = rows.all()
        assert calls == [1, 5]  # then every remaining row at once
    finally:
        handle.remove()
    assert rel_err(first, ref[4:5]) < TOL and rel_err(rest, ref[4:]) < TOL


def test_other_models_and_kinds_keep_transformers_caches():
    from transformers import DynamicCache

    assert not llama_step.supports(_model("gemma"))  # scaled embeddings, other norms: not our layer
    assert not llama_step.supports(_model("opt"))
    cfg = tiny_config("mistral", vocab_size=128, layers=2)
    cfg.sliding_window = 16
    from transformers import AutoModelForCausalLM

    assert not llama_step.supports(AutoModelForCausalLM.from_config(cfg))  # a window we would not honour
    llama = _model("llama")
    assert isinstance(new_decode_cache(llama, slots=False), DynamicCache)
    assert isinstance(new_decode_cache(llama), SlotHandle)


def test_an_empty_pool_drops_what_a_long_request_needed():
    model = _model("llama", seed=9)
    pool = llama_step.pool_for(model)
    long = new_decode_cache(model)
    forward(model, torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(1)), long, True)
    assert pool.capacity >= 150
    long.release()
    short = new_decode_cache(model)
    ids = torch.randint(0, 128, (5,), generator=torch.Generator().manual_seed(2))
    out = forward(model, ids, short, last_only=False)
    assert pool.capacity == 64 and pool.n_live() == 1
    assert rel_err(out, _ref(model, ids)) < TOL


def test_length_dependent_rope_stays_with_transformers():
    """Dynamic NTK scaling rescales RoPE from the longest position in a call: in a batch that is another
    request's, so such models are not batched by our forward."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama", vocab_size=128, layers=2)
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    assert not llama_step.supports(AutoModelForCausalLM.from_config(cfg))


def test_decoding_leaves_a_callers_model_as_it_was(tmp_path):
    """A model the caller built (not one the runtime loaded) keeps ordinary, contiguous weights: it can still be
    saved, trained and changed in place after decoding, in a bf16 model outside inference mode too."""
    from quantkit.runtime.sequence import Sequence
    from quantkit.runtime.sampling import SamplingParams
    from quantkit.drafts.prompt_lookup import PromptLookupDrafter

    model = _model("llama", seed=10).to(torch.bfloat16)
    ids = torch.randint(0, 128, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    seq = Sequence(model, ids * 2, SamplingParams(max_tokens=8, ignore_eos=True),
                   drafter=PromptLookupDrafter(2, min_ngram=1))
    with torch.no_grad():  # not inference mode: the lazy verify rows must still work
        while not seq.done:
            seq.step()
    assert seq.metrics.spec_steps > 0
    w = model.model.layers[0].self_attn.q_proj.weight
    assert not w.is_inference() and w.is_contiguous()
    with torch.no_grad():
        w.mul_(1.0)
    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "config.json").exists()


def test_storage_shrinks_when_the_long_request_leaves():
    """Every slot is as long as the longest live sequence; once that one leaves, the storage fits the rest again
    (at four times what is needed, so that growing and shrinking do not alternate)."""
    model = _model("llama", seed=12)
    pool = llama_step.pool_for(model)
    g = torch.Generator().manual_seed(4)
    short_ids = torch.randint(0, 128, (12,), generator=g)
    short, long = new_decode_cache(model), new_decode_cache(model)
    forward(model, short_ids[:5], short, True)
    forward(model, torch.randint(0, 128, (300,), generator=g), long, True)
    assert pool.capacity >= 300
    long.release()
    out = forward(model, short_ids[5:], short, last_only=False)
    assert pool.capacity == 64 and pool.n_live() == 1
    assert rel_err(out, _ref(model, short_ids)[5:]) < TOL
